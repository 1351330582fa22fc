"""What ``overdrive quantize`` does, as a library function (the CLI only parses arguments)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.api import print_summary, quantize, summary
from overdrive.quant.config import get_preset


def load_model(spec: str) -> tuple[nn.Module, Any]:
    """'digits' (trains the demo CNN briefly; returns it and the dataset), or any spec
    :func:`overdrive.recipes.model_spec.load_model` takes ('pkg.mod:factory', 'file.py:factory', an alias)."""
    if spec == "digits":
        from overdrive.recipes.data import load_digits
        from overdrive.recipes.models import DigitsCNN

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
    from overdrive.recipes.model_spec import load_model as _load

    return _load(spec).eval(), None


def load_calib(spec: str, digits: Any, n: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """'digits' (the dataset's training images), or a file :func:`overdrive.recipes.model_spec.load_calibration`
    reads (weights_only: a data file never runs code) -> up to ``n`` batches of input tuples."""
    if spec == "digits":
        if digits is None:
            from overdrive.recipes.data import load_digits

            digits = load_digits()
        return [(b,) for b in digits.calibration_batches(n=n, batch_size=batch_size)]
    from overdrive.recipes.model_spec import load_calibration

    return load_calibration(spec, "--calib-data", batch_size=batch_size, max_batches=n)


def _n_inputs(model: nn.Module) -> int | None:
    """How many positional inputs ``model.forward`` takes (None when it takes *args)."""
    import inspect

    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


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
    n_in = _n_inputs(model)
    wrong = next((b for b in batches if n_in is not None and len(b) != n_in), None)
    if wrong is not None:
        raise UsageError(f"--calib-data {calib_data!r}: a batch holds {len(wrong)} tensors but the model's forward takes "
                         f"{n_in} input(s); save the inputs only (no labels), e.g. torch.save([x for x, _ in loader], path)")
    result: dict[str, Any] = {"model": model_spec, "config": cfg.to_dict()}
    if digits is not None:
        with torch.no_grad():
            result["fp32_accuracy"] = float((model(digits.x_test).argmax(1) == digits.y_test).float().mean())
    qmodel = quantize(model, cfg, forward_loop=lambda m: [m(*b) for b in batches])
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

        path = export_onnx(qmodel, tuple(t[:1] for t in batches[0]), export_path, opset=opset)
        result["onnx"] = {"path": str(path), "ops": qdq_counts(path)}
        if console is not None:
            console.print(f"wrote {path} ({result['onnx']['ops'].get('QuantizeLinear', 0)} QuantizeLinear nodes)")
    return result
