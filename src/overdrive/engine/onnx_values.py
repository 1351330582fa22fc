"""Deprecated: moved to :mod:`overdrive.engine.onnx.values`. This module re-exports it and warns on import;
import from ``overdrive.engine.onnx.values`` instead.
"""

import warnings
from typing import Any

from overdrive.engine.onnx import values as _new
from overdrive.engine.onnx.values import Value

__all__ = ["Value"]

warnings.warn("overdrive.engine.onnx_values is deprecated; import from overdrive.engine.onnx.values instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The rest of the old module's names, from their new module."""
    return getattr(_new, name)
