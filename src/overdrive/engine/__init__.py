"""overdrive.engine: build an engine once for one device and precision, save it, load it, run and
benchmark it like trtexec, and compare it against ONNX Runtime or PyTorch.

Example:
    >>> from overdrive.engine import Builder, BuildConfig, Engine
    >>> # engine = Builder(BuildConfig(precision="fp16", device="cuda")).build(model, (x,))
    >>> # engine.save("m.engine"); Engine.load("m.engine").benchmark()
"""

from overdrive.engine.api import Builder, choose_backend
from overdrive.engine.compare import compare, format_compare
from overdrive.engine.config import (
    BF16_CUDA,
    FP16_CUDA,
    FP32_DEFAULT,
    PRESETS,
    BuildConfig,
    ShapeProfile,
    get_preset,
    parse_shapes,
    profiles_from_shapes,
)
from overdrive.engine.layers import format_layer_info, layer_info
from overdrive.engine.runtime import Engine

__all__ = ["Builder", "Engine", "BuildConfig", "ShapeProfile", "compare", "format_compare", "parse_shapes",
           "profiles_from_shapes", "choose_backend", "FP32_DEFAULT", "FP16_CUDA", "BF16_CUDA", "PRESETS", "get_preset",
           "layer_info", "format_layer_info"]
