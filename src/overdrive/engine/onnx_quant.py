"""Deprecated: moved to :mod:`overdrive.engine.onnx.quantize`. This module re-exports it and warns on import;
import from ``overdrive.engine.onnx.quantize`` instead.
"""

import warnings
from typing import Any

from overdrive.engine.onnx import quantize as _new
from overdrive.engine.onnx.quantize import quantizable_nodes, quantize_onnx

__all__ = ["quantizable_nodes", "quantize_onnx"]

warnings.warn("overdrive.engine.onnx_quant is deprecated; import from overdrive.engine.onnx.quantize instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The rest of the old module's names, from their new module."""
    return getattr(_new, name)
