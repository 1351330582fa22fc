"""What ``--model`` and ``--calib`` mean for every verb: model specs (with the demo's aliases) and
calibration files, read one way (``torch.load(weights_only=True)``: a data file never runs code).

Example:
    >>> type(load_model("digits")).__name__
    'DigitsCNN'
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.model_spec import load_factory

# Short names for the models that ship with overdrive (the demo's and the text task's).
ALIASES = {"digits": "overdrive.recipes.models:DigitsCNN", "docstrings": "overdrive.recipes.textdata:ByteTransformer"}


def load_model(spec: str, flag: str = "--model") -> nn.Module:
    """An alias (``digits``, ``docstrings``), ``pkg.module:factory`` or ``file.py:factory`` -> a fresh model."""
    if spec.endswith((".pt", ".pth")) and Path(spec).is_file():
        raise UsageError(f"{flag} {spec!r} is a pickled file; overdrive does not unpickle models (loading a pickle "
                         "runs code). Give 'file.py:factory' that builds the model, and its weights as a state_dict "
                         "where the verb takes --checkpoint")
    if ":" not in spec and spec not in ALIASES:
        raise UsageError(f"{flag} {spec!r} must be 'package.module:factory', 'path/to/file.py:factory' or one of "
                         f"{', '.join(sorted(ALIASES))}")
    return load_factory(ALIASES.get(spec, spec), flag)


def load_calibration(path: str, flag: str = "--calib", batch_size: int = 32,
                     max_batches: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """A tensor (N, ...) saved with ``torch.save`` (split into batches of ``batch_size``), or a list of batches
    (each a tensor or a tuple of the model's input tensors) -> batches of input tuples."""
    if not Path(path).is_file():
        raise UsageError(f"{flag} {path!r} does not exist; save calibration inputs with torch.save(tensor, path)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickle of objects weights_only refuses, or not a torch file
        raise UsageError(f"{flag} {path!r} is not a tensor file overdrive can read safely ({type(exc).__name__}); "
                         "save the inputs only: torch.save(tensor, path) or torch.save([batch, ...], path)") from exc
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or len(data) == 0:
            raise UsageError(f"{flag} {path!r} holds a tensor of shape {tuple(data.shape)}, with no samples; "
                             "save calibration inputs as a tensor (N, ...) with N >= 1")
        batches = [(b,) for b in data.split(batch_size)]
    elif isinstance(data, (list, tuple)) and data and all(
            isinstance(b, torch.Tensor) or (isinstance(b, (list, tuple)) and b and
                                            all(isinstance(t, torch.Tensor) for t in b)) for b in data):
        batches = [tuple(b) if isinstance(b, (list, tuple)) else (b,) for b in data]
    else:
        what = f"an empty {type(data).__name__}" if isinstance(data, (list, tuple)) and not data else type(data).__name__
        raise UsageError(f"{flag} {path!r} must hold a tensor (N, ...) or a list of input batches, got {what}; "
                         "save the inputs only, e.g. torch.save([x for x, _ in loader], path)")
    return batches[:max_batches] if max_batches is not None else batches
