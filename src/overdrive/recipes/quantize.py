"""What ``overdrive quantize`` does, as a library function (the CLI only parses arguments)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.inputs import is_token_model
from overdrive.quant.api import print_summary, quantize, summary
from overdrive.quant.config import QuantConfig, get_preset
from overdrive.recipes.calib_formats import ImageOptions
from overdrive.recipes.calibration import Calibration, load_calibration


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


def load_calib(spec: str, digits: Any, n: int, batch_size: int, model: nn.Module | None = None,
               images: ImageOptions | None = None) -> Calibration:
    """'digits' (the dataset's training images), or a calibration file (any format
    :mod:`overdrive.recipes.calibration` describes; weights_only: a data file never runs code) -> up to ``n``
    batches, named after ``model``'s inputs where it has names for them. A folder of images or a ``.txt`` file
    gives up to ``n * batch_size`` samples, read as ``images`` says (:mod:`overdrive.recipes.calib_formats`)."""
    if spec == "digits":
        if digits is None:
            from overdrive.recipes.data import load_digits

            digits = load_digits()
        return Calibration("digits", None, [(b,) for b in digits.calibration_batches(n=n, batch_size=batch_size)])
    opts = images or ImageOptions()
    opts = ImageOptions(opts.input_shape, opts.normalize, n * batch_size, opts.crop_fraction)
    return load_calibration(spec, "--calib-data", batch_size=batch_size, max_batches=n, model=model, images=opts)


def run_quantize(model_spec: str, calib_data: str, config_name: str, method: str, percentile: float,
                 calib_batches: int, batch_size: int, export_path: str | None, opset: int | None,
                 console: Any = None, save_path: str | None = None, checkpoint: str | None = None,
                 input_shape: tuple[int, ...] | None = None, calib_normalize: str | None = None) -> dict[str, Any]:
    """Load, calibrate, summarize, (for the digits model) evaluate, and optionally export ONNX
    (``export_path``) and save the quantized model (``save_path``, see :func:`save_quantized`). ``input_shape``
    and ``calib_normalize``: how a folder of images in ``calib_data`` is sized and normalized
    (:class:`~overdrive.recipes.calib_formats.ImageOptions`)."""
    if calib_batches < 1 or batch_size < 1:
        raise UsageError(f"--calib-batches {calib_batches} and --batch-size {batch_size} must be >= 1")
    images = ImageOptions(input_shape=input_shape, normalize=calib_normalize)  # bad values refused before loading
    cfg = get_preset(config_name).replace(method=method, percentile=percentile)
    if export_path:  # a bad --opset is refused before the model is loaded and calibrated
        from overdrive.quant.export import check_opset

        if cfg.input.dynamic:
            raise UsageError(f"--config {config_name} has dynamic per-token scales, which have no ONNX Q/DQ form "
                             "(QuantizeLinear takes a fixed scale); export with --config int8 (calibrated), or drop "
                             "--export and --save the model for quant.to_real")

        check_opset(opset, cfg.input.format)
    if checkpoint and not Path(checkpoint).is_file():  # before the model is built (digits trains) and calibrated
        raise UsageError(f"--checkpoint {checkpoint!r} does not exist")
    model, digits = load_model(model_spec)
    if checkpoint:  # a state_dict, a Trainer checkpoint or a .sparse24.pt from overdrive sparsify
        from overdrive.recipes.model_spec import load_checkpoint

        load_checkpoint(model, checkpoint)
        model.eval()
    calib = load_calib(calib_data, digits, calib_batches, batch_size, model, images)
    result: dict[str, Any] = {"model": model_spec, "config": cfg.to_dict()}
    if digits is not None:
        with torch.no_grad():
            result["fp32_accuracy"] = float((model(digits.x_test).argmax(1) == digits.y_test).float().mean())
    qmodel = quantize(model, cfg, forward_loop=calib.forward_loop())
    if digits is not None:
        with torch.no_grad():
            result["quantized_accuracy"] = float((qmodel(digits.x_test).argmax(1) == digits.y_test).float().mean())
    s = summary(qmodel)
    result["layers"] = [vars(r) for r in s["layers"]]
    result["skipped"] = s["skipped"]
    result["fidelity"] = s["fidelity"]  # the outputs on the first calibration batches against the float model
    if console is not None:
        print_summary(qmodel, console)
        if "fp32_accuracy" in result:
            console.print(f"digits test accuracy: fp32 {result['fp32_accuracy']:.4f}, "
                          f"{config_name} {method} {result['quantized_accuracy']:.4f}")
    if save_path:
        save_quantized(qmodel, cfg, model_spec, save_path)
        result["saved"] = str(save_path)
        if console is not None:
            console.print(f"wrote {save_path} (reload: overdrive.recipes.quantize.load_quantized({str(save_path)!r}))")
    if export_path:
        from overdrive.quant.export import export_onnx, qdq_counts

        example = calib.example(2)
        if isinstance(example, dict) and len(example) == 1 and not is_token_model(model):
            example = tuple(example.values())  # one input keeps the name 'input', as from the digits
        path = export_onnx(qmodel, example, export_path, opset=opset)  # by name; dynamic batch (and sequence)
        result["onnx"] = {"path": str(path), "ops": qdq_counts(path)}
        if console is not None:
            console.print(f"wrote {path} ({result['onnx']['ops'].get('QuantizeLinear', 0)} QuantizeLinear nodes)")
    return result


SAVE_FORMAT = "overdrive.quantized"


def save_quantized(qmodel: nn.Module, config: QuantConfig, model_spec: str, path: str) -> None:
    """Write a quantized model as ``{'format', 'model', 'config', 'state_dict'}``, atomically. The state dict
    holds the float weights and every quantizer's amax; it loads into ``quant.quantize(float_model, config)``
    (no forward_loop), which :func:`load_quantized` does. The whole model is not pickled (its traced
    classes are made at run time, and loading a pickle runs code)."""
    from overdrive._utils.files import atomic_torch_save

    state = {k: v.detach().cpu() for k, v in qmodel.state_dict().items()}
    atomic_torch_save({"format": SAVE_FORMAT, "model": model_spec, "config": config.to_dict(), "state_dict": state},
                      path)


def load_quantized(path: str, model: nn.Module | None = None) -> nn.Module:
    """The model ``overdrive quantize --save FILE`` wrote, quantized and calibrated, in eval mode. ``model``:
    the float model to quantize again (default: built from the spec saved in FILE).

    Example:
        >>> # m = load_quantized("digits_int8.pt"); m(torch.randn(1, 1, 8, 8))
    """
    from pathlib import Path

    if not Path(path).is_file():
        raise UsageError(f"quantized model {str(path)!r} does not exist; write one with overdrive quantize --save FILE")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(payload, dict) and payload.get("format") == SAVE_FORMAT):
        raise UsageError(f"{path} is not a file written by overdrive quantize --save (no format {SAVE_FORMAT!r})")
    if model is None:
        from overdrive.recipes.model_spec import load_model as _load

        model = _load(payload["model"])
    qmodel = quantize(model.eval(), QuantConfig.from_dict(payload["config"]))
    try:
        qmodel.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise UsageError(f"{path} does not fit the model: {str(exc).splitlines()[0]}") from exc
    return qmodel.eval()
