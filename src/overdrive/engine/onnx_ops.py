"""Deprecated: moved to :mod:`overdrive.engine.onnx.ops` (Q/DQ to ``overdrive.engine.onnx.qdq``, the full op
table and ``SUPPORTED_OPS`` to ``overdrive.engine.onnx.importer``). This module re-exports them and warns on
import; import from ``overdrive.engine.onnx.ops`` instead.
"""

import warnings
from typing import Any

from overdrive.engine.onnx import importer as _importer
from overdrive.engine.onnx import ops as _new
from overdrive.engine.onnx.importer import SUPPORTED_OPS
from overdrive.engine.onnx.qdq import _dequantize, _quantize  # noqa: F401  (the old module imported them)

__all__ = ["SUPPORTED_OPS"]

warnings.warn("overdrive.engine.onnx_ops is deprecated; import from overdrive.engine.onnx.ops instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The rest of the old module's names (``_OPS``, the table with Q/DQ; the operator functions) from their
    new modules."""
    if name == "_OPS":
        return _importer._OPS
    if name == "_HOST_INPUTS":
        return _new.HOST_INPUTS
    from overdrive.engine.onnx import layers, select, shape

    for mod in (_new, shape, layers, select):  # the Reduce ops moved on to select, shape and layer ops to their own
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"module 'overdrive.engine.onnx_ops' has no attribute {name!r}")
