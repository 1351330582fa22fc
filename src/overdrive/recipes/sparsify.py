"""Model specs and checkpoints for ``overdrive sparsify``: build a model, load its weights, prune,
write the compressed checkpoint. The CLI only parses arguments and calls :func:`sparsify_checkpoint`."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity.api import sparsify
from overdrive.sparsity.config import SparsityConfig as Config
from overdrive.sparsity.export import save_compressed
from overdrive.sparsity.report import SparsityReport

from overdrive.recipes.model_spec import ALIASES  # noqa: E402,F401 - the names `overdrive sparsify --model` takes


def build_model(spec: str) -> nn.Module:
    """``"pkg.module:Factory"``, ``"path/to/file.py:Factory"`` or an alias (digits, docstrings) -> model.

    Example:
        >>> type(build_model("digits")).__name__
        'DigitsCNN'
    """
    from overdrive.recipes.model_spec import load_model

    return load_model(spec)


def load_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """``--checkpoint`` into ``model``: :func:`overdrive.recipes.model_spec.load_checkpoint`."""
    from overdrive.recipes.model_spec import load_checkpoint

    load_checkpoint(model, path)


def sparsify_checkpoint(model_spec: str, checkpoint: str | None, out: str, config: Config,
                        example_shape: tuple[int, ...] | Mapping[str | None, tuple[int, ...]] | None = None,
                        allow_untrained: bool = False) -> tuple[SparsityReport, dict[str, Any]]:
    """Build, load, prune to 2:4 and save compressed; returns the report and byte counts. Without a
    ``checkpoint`` the model's random initial weights are refused unless ``allow_untrained``. ``example_shape``:
    one input's shape in any rank, or ``{name: shape}`` (:mod:`overdrive.recipes.input_shapes`), for the FLOPs
    pruned; token inputs get random ids below the model's vocabulary size.

    Example:
        >>> # sparsify_checkpoint("m.py:make_bert", "bert.pt", "bert.sparse24.pt", Config(), {"input_ids": (1, 128)})
    """
    from overdrive.recipes.input_shapes import show

    shapes = (None if example_shape is None else dict(example_shape) if isinstance(example_shape, Mapping)
              else {None: tuple(example_shape)})
    text = show(shapes) if shapes else ""
    if shapes is not None and (not shapes or any(not s or min(s) < 1 for s in shapes.values())):
        raise UsageError(f"--input-shape {text} must be positive integers like 1,3,224,224 or 1,16")
    if Path(out).is_dir():
        raise UsageError(f"--out {out!r} is a directory; give a file path such as {str(Path(out) / 'model.sparse24.pt')!r}")
    model = build_model(model_spec)
    names = {n for n, _ in model.named_modules()}
    unknown = [n for n in config.disallowed_layer_names if n not in names]  # a typo would prune the layer silently
    if unknown:
        known = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
        raise UsageError(f"--exclude {unknown[0]!r} is not a module of {type(model).__name__}; "
                         f"use module names such as {known[:4]}")
    example = None
    if shapes is not None:  # inputs of that shape: refused before the weights are loaded and pruned
        from overdrive._utils.inputs import forward_parameters, positional_range
        from overdrive.recipes.input_shapes import by_position, example_inputs, positional

        lo = positional_range(model)[0]
        if lo > len(shapes):
            params = [n for n in (forward_parameters(model) or {}) if n not in ("self", "args", "kwargs")]
            raise UsageError(f"--input-shape {text} gives {'one input' if len(shapes) == 1 else f'{len(shapes)} inputs'} but "
                             f"{type(model).__name__}.forward takes {lo} ({', '.join(params[:lo])}); name each, e.g. "
                             f"{','.join(f'{p}:1x16' for p in params[:lo])}, or drop --input-shape (the report then "
                             "counts pruned weights, not FLOPs)")
        example = positional(model, example_inputs(model, by_position(model, shapes)), text)
    if not checkpoint and not allow_untrained:  # 2:4 masks of random weights: a report that means nothing
        raise UsageError(f"--model {model_spec} without --checkpoint would prune its random, untrained weights; give "
                         "trained weights with --checkpoint FILE (torch.save(model.state_dict(), FILE) after training, "
                         "or an overdrive Trainer checkpoint), or pass --allow-untrained to try the format anyway")
    if checkpoint:
        load_weights(model, checkpoint)
    model.eval()
    handle = sparsify(model, config)
    try:
        report = handle.report(example_inputs=example)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        if example is None or isinstance(exc, UsageError):
            raise
        raise UsageError(f"--input-shape {text} does not fit {type(model).__name__}: "
                         f"{str(exc).splitlines()[0]}; pass the shape of one input batch the model takes") from exc
    stats = save_compressed(handle, out)
    stats["file_bytes"] = Path(out).stat().st_size
    return report, stats
