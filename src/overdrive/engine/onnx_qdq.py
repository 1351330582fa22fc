"""Deprecated: moved to :mod:`overdrive.engine.onnx.qdq`. This module re-exports it and warns on import;
import from ``overdrive.engine.onnx.qdq`` instead.
"""

import warnings
from typing import Any

from overdrive.engine.onnx import qdq as _new

__all__: list[str] = []  # the old module had private names only: _quantize, _dequantize, _qparams

warnings.warn("overdrive.engine.onnx_qdq is deprecated; import from overdrive.engine.onnx.qdq instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The rest of the old module's names, from their new module."""
    return getattr(_new, name)
