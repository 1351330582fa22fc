"""Device facts and device selection. Nothing here initializes CUDA at import time."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import is_available


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Turn "auto", "cpu", "cuda" or "cuda:N" into a device, checking that it exists.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {str(device)!r} was asked for but no CUDA GPU is usable here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"device {str(device)!r} does not exist: {torch.cuda.device_count()} GPU(s) here; use cuda:0.."
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif dev.type != "cpu":
        raise UsageError(f"device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def supports_fp8(device: torch.device) -> bool:
    """fp8 (e4m3) matrix multiply needs compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def supports_bf16(device: torch.device) -> bool:
    """bf16 runs on every CPU torch supports and on CUDA GPUs of compute capability 8.0+."""
    if device.type == "cpu":
        return True
    return torch.cuda.is_bf16_supported()


def cpu_isa() -> str:
    """The CPU's vector ISA level as torch sees it (e.g. 'AVX512', 'AVX2', 'DEFAULT')."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - very old torch
        return platform.machine()


_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8",
              "amx_fp16")


def cpu_features(cpuinfo: str | None = None) -> dict[str, bool]:
    """The CPU's matrix/vector features that decide whether bf16 and int8 are native here, read from
    the ``flags`` line of ``/proc/cpuinfo`` (Linux) or from ``cpuinfo`` text; torch's ISA string
    ('AVX512') does not tell AVX512-BF16, VNNI or AMX apart. Other systems: every flag False.

    Example:
        >>> f = cpu_features("flags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_int8")
        >>> f["amx_bf16"], f["avx512_vnni"]
        (True, False)
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read(1 << 20)
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            break
    return {f: f in flags for f in _CPU_FLAGS}


def cpu_summary(features: dict[str, bool] | None = None) -> str:
    """One line: what bf16 and int8 math this CPU has natively, from :func:`cpu_features`.

    Example:
        >>> cpu_summary({"amx_bf16": True, "amx_int8": True, "avx512_bf16": True})
        'bf16: AMX-BF16, AVX512-BF16; int8: AMX-INT8'
    """
    f = features if features is not None else cpu_features()
    bf16 = [n for k, n in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if f.get(k)]
    int8 = [n for k, n in (("amx_int8", "AMX-INT8"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI")) if f.get(k)]
    return (f"bf16: {', '.join(bf16) or 'none native (emulated through fp32)'}; "
            f"int8: {', '.join(int8) or 'none native (no VNNI/AMX dot products)'}")


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()
        return out[0].strip() if out else None
    except (subprocess.SubprocessError, OSError):
        return None


def _backends(cuda: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["onnx"] = {"available": is_available("onnx")}
    ort: dict[str, Any] = {"available": is_available("onnxruntime")}
    if ort["available"]:
        import onnxruntime

        ort["version"] = onnxruntime.__version__
        ort["providers"] = list(onnxruntime.get_available_providers())
    out["onnxruntime"] = ort
    out["tensorrt"] = {"available": is_available("tensorrt")}
    tv: dict[str, Any] = {"available": False, "gpu_jpeg_decode": False}
    if is_available("torchvision"):
        try:
            import torchvision

            tv["available"] = True
            tv["version"] = torchvision.__version__
            tv["gpu_jpeg_decode"] = bool(cuda and hasattr(torchvision.io, "decode_jpeg"))
        except Exception as exc:  # a torchvision built for another torch fails at import
            tv["error"] = f"{type(exc).__name__}: {exc}"
    out["torchvision"] = tv
    out["triton"] = {"available": is_available("triton")}
    try:
        out["cusparselt"] = {"available": bool(torch.backends.cusparselt.is_available())}
    except Exception:
        out["cusparselt"] = {"available": False}
    return out


def environment_report() -> dict[str, Any]:
    """Everything `overdrive env` prints: versions, GPUs and usable optional backends.

    Example:
        >>> report = environment_report()
        >>> sorted(report)[:3]
        ['backends', 'cpu', 'cuda']
    """
    cuda_ok = torch.cuda.is_available()
    gpus = []
    if cuda_ok:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({
                "index": i,
                "name": p.name,
                "compute_capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
                "bf16": torch.cuda.is_bf16_supported(),
                "fp8": (p.major, p.minor) >= (8, 9),
            })
    return {
        "overdrive": sys.modules["overdrive"].__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu": {"isa": cpu_isa(), "features": cpu_summary(), "threads": torch.get_num_threads(), "machine": platform.machine()},
        "cuda": {
            "available": cuda_ok,
            "version": torch.version.cuda,
            "driver": _driver_version() if cuda_ok else None,
            "cudnn": torch.backends.cudnn.version() if cuda_ok else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda_ok else None,
        },
        "gpus": gpus,
        "backends": _backends(cuda_ok),
    }
