"""What ``--model`` and ``--calib`` mean for every verb: model specs (with the demo's aliases) and
calibration files, read one way (``torch.load(weights_only=True)``: a data file never runs code; the format
and its reader, :func:`load_calibration`, live in :mod:`overdrive.recipes.calibration`).

Example:
    >>> type(load_model("digits")).__name__
    'DigitsCNN'
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.model_spec import load_factory
from overdrive.recipes.calibration import Calibration, load_calibration

__all__ = ["ALIASES", "Calibration", "load_calibration", "load_model"]

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
