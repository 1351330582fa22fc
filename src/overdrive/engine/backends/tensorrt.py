"""TensorRT backend: not driven from Python here. No TensorRT was available to test a code path on
(neither on the CI machine nor on the lent H200), so overdrive exports the ONNX and prints the
equivalent ``trtexec`` command line instead of running untested TensorRT code."""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import OverdriveError
from overdrive._utils.optional import is_available
from overdrive.engine.config import BuildConfig, ShapeProfile

NAME = "tensorrt"
_FLAGS = {"fp16": "--fp16", "bf16": "--bf16", "int8": "--int8", "fp8": "--fp8", "best": "--best", "tf32": "", "fp32": "--noTF32"}


def trtexec_command(onnx_path: str, engine_path: str, cfg: BuildConfig) -> str:
    """The trtexec line that builds the same engine.

    Example:
        >>> trtexec_command("m.onnx", "m.plan", BuildConfig(precision="fp16"))
        'trtexec --onnx=m.onnx --saveEngine=m.plan --fp16'
    """
    parts = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    if _FLAGS[cfg.precision]:
        parts.append(_FLAGS[cfg.precision])

    def fmt(ps: list[ShapeProfile], which: str) -> str:
        return ",".join(f"{p.name}:" + "x".join(map(str, getattr(p, which))) for p in ps)

    if cfg.profiles and all(p.static for p in cfg.profiles):
        parts.append(f"--shapes={fmt(cfg.profiles, 'opt')}")
    elif cfg.profiles:
        parts += [f"--minShapes={fmt(cfg.profiles, 'min')}", f"--optShapes={fmt(cfg.profiles, 'opt')}",
                  f"--maxShapes={fmt(cfg.profiles, 'max')}"]
    return " ".join(parts)


def unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "TensorRT needs a CUDA GPU"
    if not is_available("tensorrt"):
        return "the tensorrt package is not installed"
    return "overdrive does not drive TensorRT from Python (no TensorRT was available to test it); use trtexec"


def refuse(onnx_path: str, engine_path: str, cfg: BuildConfig, device: torch.device) -> None:
    """Raise the clear error for --backend tensorrt, with the equivalent trtexec line."""
    raise OverdriveError(f"--backend tensorrt: {unavailable(device)}. The ONNX model is at {onnx_path}; build the "
                         f"TensorRT engine with: {trtexec_command(onnx_path, engine_path, cfg)}")


def build(*args: Any, **kwargs: Any) -> Any:
    raise OverdriveError("the tensorrt backend is handled by tensorrt.refuse (prints the trtexec line)")


def load(*args: Any, **kwargs: Any) -> Any:
    raise OverdriveError("overdrive engine files never hold TensorRT plans; load .plan files with trtexec --loadEngine")
