"""Deprecated: moved to :mod:`overdrive.engine.onnx` (``overdrive.engine.onnx.importer``). This module
re-exports it and warns on import; import from ``overdrive.engine.onnx`` instead.
"""

import warnings
from typing import Any

from overdrive.engine.onnx import importer as _new
from overdrive.engine.onnx.importer import SUPPORTED_OPS, ONNXModule, import_onnx

__all__ = ["ONNXModule", "SUPPORTED_OPS", "import_onnx"]

warnings.warn("overdrive.engine.onnx_import is deprecated; import from overdrive.engine.onnx instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The rest of the old module's names, from their new module."""
    if name == "_HOST_INPUTS":
        return _new.HOST_INPUTS
    return getattr(_new, name)
