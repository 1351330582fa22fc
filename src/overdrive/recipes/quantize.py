"""What ``overdrive quantize`` does, as a library function (the CLI only parses arguments)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.api import print_summary, quantize, summary
from overdrive.quant.config import get_preset


def load_model(spec: str) -> tuple[nn.Module, Any]:
    """'digits' (trains the demo CNN briefly; returns it and the dataset), 'pkg.mod:factory', or a file."""
    if spec == "digits":
        from overdrive.demo.data import load_digits
        from overdrive.demo.models import DigitsCNN

        digits = load_digits()
        torch.manual_seed(0)
        model = DigitsCNN()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train, _ = digits.loaders(batch_size=64)
        for _ in range(4):
            for x, y in train:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return model.eval(), digits
    if ":" in spec and not Path(spec).exists():
        mod_name, _, fn = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"--model {spec!r}: cannot import {fn!r} from {mod_name!r} ({exc}); "
                             "use 'package.module:function' returning an nn.Module") from exc
        model = factory()
    elif Path(spec).is_file():
        model = torch.load(spec, map_location="cpu", weights_only=False)
    else:
        raise UsageError(f"--model {spec!r} is not 'digits', a 'pkg.module:factory' or an existing file")
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec!r} gave a {type(model).__name__}, not a torch.nn.Module (save the whole "
                         "module with torch.save(model, path), not its state_dict)")
    return model.eval(), None


def load_calib(spec: str, digits: Any, n: int, batch_size: int) -> list[torch.Tensor]:
    if spec == "digits":
        if digits is None:
            from overdrive.demo.data import load_digits

            digits = load_digits()
        return digits.calibration_batches(n=n, batch_size=batch_size)
    if not Path(spec).is_file():
        raise UsageError(f"--calib-data {spec!r} is not 'digits' or an existing .pt file")
    data = torch.load(spec, map_location="cpu", weights_only=False)
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or len(data) == 0:
            raise UsageError(f"--calib-data {spec!r} holds a tensor of shape {tuple(data.shape)}, with no samples; "
                             "save calibration inputs as a tensor (N, ...) with N >= 1")
        return [data[i:i + batch_size] for i in range(0, min(len(data), n * batch_size), batch_size)]
    if isinstance(data, (list, tuple)) and data and all(isinstance(b, torch.Tensor) for b in data):
        return list(data[:n])
    what = type(data).__name__
    if isinstance(data, (list, tuple)):
        what = f"an empty {what}" if not data else f"a {what} of {type(next(b for b in data if not isinstance(b, torch.Tensor))).__name__}"
    raise UsageError(f"--calib-data {spec!r} must hold a tensor (N, ...) or a list of input tensors, got {what}; "
                     "save the inputs only, e.g. torch.save([x for x, _ in loader], path)")


def run_quantize(model_spec: str, calib_data: str, config_name: str, method: str, percentile: float,
                 calib_batches: int, batch_size: int, export_path: str | None, opset: int | None,
                 console: Any = None) -> dict[str, Any]:
    """Load, calibrate, summarize, (for the digits model) evaluate, and optionally export."""
    if calib_batches < 1 or batch_size < 1:
        raise UsageError(f"--calib-batches {calib_batches} and --batch-size {batch_size} must be >= 1")
    cfg = get_preset(config_name).replace(method=method, percentile=percentile)
    if export_path:  # a bad --opset is refused before the model is loaded and calibrated
        from overdrive.quant.export import check_opset

        check_opset(opset, cfg.input.format)
    model, digits = load_model(model_spec)
    batches = load_calib(calib_data, digits, calib_batches, batch_size)
    result: dict[str, Any] = {"model": model_spec, "config": cfg.to_dict()}
    if digits is not None:
        with torch.no_grad():
            result["fp32_accuracy"] = float((model(digits.x_test).argmax(1) == digits.y_test).float().mean())
    qmodel = quantize(model, cfg, forward_loop=lambda m: [m(b) for b in batches])
    if digits is not None:
        with torch.no_grad():
            result["quantized_accuracy"] = float((qmodel(digits.x_test).argmax(1) == digits.y_test).float().mean())
    s = summary(qmodel)
    result["layers"] = [vars(r) for r in s["layers"]]
    result["skipped"] = s["skipped"]
    if console is not None:
        print_summary(qmodel, console)
        if "fp32_accuracy" in result:
            console.print(f"digits test accuracy: fp32 {result['fp32_accuracy']:.4f}, "
                          f"{config_name} {method} {result['quantized_accuracy']:.4f}")
    if export_path:
        from overdrive.quant.export import export_onnx, qdq_counts

        path = export_onnx(qmodel, (batches[0][:1],), export_path, opset=opset)
        result["onnx"] = {"path": str(path), "ops": qdq_counts(path)}
        if console is not None:
            console.print(f"wrote {path} ({result['onnx']['ops'].get('QuantizeLinear', 0)} QuantizeLinear nodes)")
    return result
