"""Model specs and checkpoints for ``overdrive sparsify``: build a model, load its weights, prune,
write the compressed checkpoint. The CLI only parses arguments and calls :func:`sparsify_checkpoint`."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
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
                        example_shape: tuple[int, ...] | None = None,
                        allow_untrained: bool = False) -> tuple[SparsityReport, dict[str, Any]]:
    """Build, load, prune to 2:4 and save compressed; returns the report and byte counts. Without a
    ``checkpoint`` the model's random initial weights are refused unless ``allow_untrained``."""
    if example_shape is not None and (not example_shape or any(d < 1 for d in example_shape)):
        raise UsageError(f"--input-shape {','.join(map(str, example_shape))} must be positive integers like 1,3,224,224")
    if Path(out).is_dir():
        raise UsageError(f"--out {out!r} is a directory; give a file path such as {str(Path(out) / 'model.sparse24.pt')!r}")
    model = build_model(model_spec)
    names = {n for n, _ in model.named_modules()}
    unknown = [n for n in config.disallowed_layer_names if n not in names]  # a typo would prune the layer silently
    if unknown:
        known = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
        raise UsageError(f"--exclude {unknown[0]!r} is not a module of {type(model).__name__}; "
                         f"use module names such as {known[:4]}")
    if example_shape is not None:  # one input of that shape: refused before the weights are loaded and pruned
        from overdrive._utils.inputs import forward_parameters, positional_range

        lo = positional_range(model)[0]
        if lo > 1:
            params = [n for n in (forward_parameters(model) or {}) if n not in ("self", "args", "kwargs")]
            raise UsageError(f"--input-shape {','.join(map(str, example_shape))} gives one input but "
                             f"{type(model).__name__}.forward takes {lo} ({', '.join(params[:lo])}); drop "
                             "--input-shape (the report then counts pruned weights, not FLOPs)")
    if not checkpoint and not allow_untrained:  # 2:4 masks of random weights: a report that means nothing
        raise UsageError(f"--model {model_spec} without --checkpoint would prune its random, untrained weights; give "
                         "trained weights with --checkpoint FILE (torch.save(model.state_dict(), FILE) after training, "
                         "or an overdrive Trainer checkpoint), or pass --allow-untrained to try the format anyway")
    if checkpoint:
        load_weights(model, checkpoint)
    model.eval()
    handle = sparsify(model, config)
    example = None
    if example_shape is not None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        # token models take integer ids; others a float tensor
        example = ((torch.randint(0, emb.num_embeddings, example_shape),) if emb is not None
                   else (torch.randn(example_shape),))
    try:
        report = handle.report(example_inputs=example)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        if example is None or isinstance(exc, UsageError):
            raise
        raise UsageError(f"--input-shape {','.join(map(str, example_shape))} does not fit {type(model).__name__}: "
                         f"{str(exc).splitlines()[0]}; pass the shape of one input batch the model takes") from exc
    stats = save_compressed(handle, out)
    stats["file_bytes"] = Path(out).stat().st_size
    return report, stats
