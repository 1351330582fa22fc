"""overdrive: make PyTorch train faster and serve faster.

The public surface, grouped by technique. Submodules are imported lazily, so ``import overdrive``
stays lean: it never imports onnx, onnxruntime, torchvision, transformers, matplotlib or tensorrt,
and never initializes CUDA.

Example:
    >>> from overdrive import amp
    >>> policy = amp.Policy.from_opt_level("O2")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from overdrive._utils.errors import OverdriveError, UsageError  # noqa: E402  (tiny, no heavy deps)

_SUBMODULES = (
    "amp",  # mixed precision: opt levels O0-O3, loss scaler, master weights
    "train",  # the training loop that composes the techniques
    "quant",  # PTQ / QAT, calibrators, ONNX Q/DQ export, int8/fp8 modules
    "engine",  # build / save / load / run / benchmark
    "sparsity",  # 2:4 structured sparsity (ASP)
    "data",  # GPU image pipeline, tokenization
    "distributed",  # DDP / FSDP2, launch, checkpoint, doctor
)

__all__ = ["__version__", "OverdriveError", "UsageError", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"overdrive.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'overdrive' has no attribute {name!r}")
