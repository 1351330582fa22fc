"""What ``overdrive quantize`` does, as a library function (the CLI only parses arguments)."""

from __future__ import annotations

from collections.abc import Mapping
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
               images: ImageOptions | None = None, seq_shape: tuple[int, ...] | None = None) -> Calibration:
    """'digits' (the dataset's training images), or a calibration file (any format
    :mod:`overdrive.recipes.calibration` describes; weights_only: a data file never runs code) -> up to ``n``
    batches, named after ``model``'s inputs where it has names for them. A folder of images or a ``.txt`` file
    gives up to ``n * batch_size`` samples, read as ``images`` says (:mod:`overdrive.recipes.calib_formats`);
    the texts of ``overdrive data tokenize -o FILE.npz`` are padded to ``seq_shape`` (N, T) where given."""
    if spec == "digits":
        if digits is None:
            from overdrive.recipes.data import load_digits

            digits = load_digits()
        return Calibration("digits", None, [(b,) for b in digits.calibration_batches(n=n, batch_size=batch_size)])
    opts = images or ImageOptions()
    opts = ImageOptions(opts.input_shape, opts.normalize, n * batch_size, opts.crop_fraction)
    return load_calibration(spec, "--calib-data", batch_size=batch_size, max_batches=n, model=model, images=opts,
                            input_shape=seq_shape)


def run_quantize(model_spec: str, calib_data: str, config_name: str, method: str, percentile: float,
                 calib_batches: int, batch_size: int, export_path: str | None, opset: int | None,
                 console: Any = None, save_path: str | None = None, checkpoint: str | None = None,
                 input_shape: tuple[int, ...] | Mapping[str | None, tuple[int, ...]] | None = None,
                 calib_normalize: str | None = None) -> dict[str, Any]:
    """Load, calibrate, summarize, (for the digits model) evaluate, and optionally export ONNX
    (``export_path``) and save the quantized model (``save_path``, see :func:`save_quantized`). ``input_shape``
    (one input's shape in any rank, or ``{name: shape}``, :mod:`overdrive.recipes.input_shapes`): the shape the
    calibration inputs must have, and the size a folder of images in ``calib_data`` is read at, normalized as
    ``calib_normalize`` says (:class:`~overdrive.recipes.calib_formats.ImageOptions`).

    Example:
        >>> # run_quantize("mlp.py:make_mlp", "calib.npy", "int8", "max", 99.99, 8, 64, None, None, input_shape=(1, 16))
    """
    if calib_batches < 1 or batch_size < 1:
        raise UsageError(f"--calib-batches {calib_batches} and --batch-size {batch_size} must be >= 1")
    shapes = dict(input_shape) if isinstance(input_shape, Mapping) else ({None: tuple(input_shape)} if input_shape
                                                                          else None)
    image_shape = next(iter(shapes.values())) if shapes and len(shapes) == 1 else None
    images = ImageOptions(input_shape=image_shape, normalize=calib_normalize)  # bad values refused before loading
    cfg = get_preset(config_name).replace(method=method, percentile=percentile)
    if export_path:  # a bad --opset is refused before the model is loaded and calibrated
        from overdrive.quant.export import check_opset

        if cfg.input.dynamic:
            raise UsageError(f"--config {config_name} has dynamic per-token scales, which have no ONNX Q/DQ form "
                             "(QuantizeLinear takes a fixed scale); export with --config int8 (calibrated), or drop "
                             "--export and --save the model for quant.to_real")

        check_opset(opset, cfg.input.format)
    if checkpoint:  # before the model is built (digits trains) and calibrated
        from overdrive.recipes.model_spec import check_checkpoint_path

        check_checkpoint_path(checkpoint)
    if calib_data != "digits":  # a typo'd path, refused before the model is built (digits trains for seconds)
        from overdrive.recipes.calibration import check_calibration_path

        check_calibration_path(calib_data, "--calib-data")
    model, digits = load_model(model_spec)
    from overdrive.recipes.models import DigitsCNN

    if calib_data == "digits" and not isinstance(model, DigitsCNN):
        # refused before calibrating: the demo's (N, 1, 8, 8) images fail in the model's first layer
        raise UsageError(f"--calib-data digits (the default) is the digits demo's 8x8 images, for --model digits only; "
                         f"give {type(model).__name__}'s own inputs: --calib-data calib.npy (np.save of an array "
                         "(N, ...)), calib.npz / calib.pt (inputs by name, e.g. input_ids), or a folder of images")
    if checkpoint:  # a state_dict, a Trainer checkpoint or a .sparse24.pt from overdrive sparsify
        from overdrive.recipes.model_spec import load_checkpoint

        load_checkpoint(model, checkpoint)
        model.eval()
    seq_shape = (shapes.get("input_ids") or shapes.get(None)) if shapes else None  # a tokenized corpus's (N, T)
    calib = load_calib(calib_data, digits, calib_batches, batch_size, model, images,
                       seq_shape if seq_shape is not None and len(seq_shape) == 2 else None)
    if shapes and not Path(calib_data).is_dir():  # a folder's images are read at the shape; a file's are checked
        # before calibrating: inputs of another shape fail in some layer, far from the cause
        from overdrive.recipes.input_shapes import check_batches

        check_batches(shapes, calib.names, calib.batches[0], f"--calib-data {calib_data!r}")
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
    # the export first: it is the step that fails (an op ONNX cannot express), and a run that fails must leave an
    # existing --save file as it was, not replaced while the command exits 1
    if export_path:
        from overdrive.quant.export import export_onnx, qdq_counts

        example = calib.example(2)
        if isinstance(example, dict) and len(example) == 1 and not is_token_model(model):
            example = tuple(example.values())  # one input keeps the name 'input', as from the digits
        path = export_onnx(qmodel, example, export_path, opset=opset)  # by name; dynamic batch (and sequence)
        result["onnx"] = {"path": str(path), "ops": qdq_counts(path)}
        if console is not None:
            console.print(f"wrote {path} ({result['onnx']['ops'].get('QuantizeLinear', 0)} QuantizeLinear nodes)")
    if save_path:
        save_quantized(qmodel, cfg, model_spec, save_path)
        result["saved"] = str(save_path)
        if console is not None:
            console.print(f"wrote {save_path} (reload: overdrive.recipes.quantize.load_quantized({str(save_path)!r}))")
    return result


SAVE_FORMAT = "overdrive.quantized"


def save_quantized(qmodel: nn.Module, config: QuantConfig, model_spec: str, path: str) -> None:
    """Write a quantized model as ``{'format', 'model', 'config', 'state_dict'}``, atomically. The state dict
    holds the float weights and every quantizer's amax; it loads into ``quant.quantize(float_model, config)``
    (no forward_loop), which :func:`load_quantized` does. The whole model is not pickled (its traced
    classes are made at run time, and loading a pickle runs code)."""
    from overdrive._utils.files import atomic_torch_save
    from overdrive._utils.signing import sign, signing_key

    state = {k: v.detach().cpu() for k, v in qmodel.state_dict().items()}
    mac = sign(_spec_payload(model_spec), signing_key(create=True).key)  # load_quantized runs the spec only if it verifies
    atomic_torch_save({"format": SAVE_FORMAT, "model": model_spec, "model_signature": mac, "config": config.to_dict(),
                       "state_dict": state}, path)


def _spec_payload(model_spec: str) -> bytes:
    return f"{SAVE_FORMAT} model spec\0{model_spec}".encode()


def _untrusted_spec(payload: dict[str, Any]) -> str | None:
    """Why the model spec in ``payload`` may not run (None: an alias of overdrive's own models, or signed with
    this user's key)."""
    from overdrive._utils.signing import signing_key, verify
    from overdrive.recipes.model_spec import ALIASES

    spec, mac = payload.get("model"), payload.get("model_signature")
    if isinstance(spec, str) and spec in ALIASES:
        return None
    if not isinstance(spec, str) or mac is None:
        return "it is not signed (written by an older overdrive, by hand, or by another tool)"
    key = signing_key(create=False)
    if key is None:
        return "it is signed but there is no signing key here to check it with"
    if not verify(_spec_payload(spec), mac, key.key):
        return "its signature does not verify under your key (signed elsewhere, or changed)"
    return None


def load_quantized(path: str, model: nn.Module | None = None, trust: bool = False) -> nn.Module:
    """The model ``overdrive quantize --save FILE`` wrote, quantized and calibrated, in eval mode. ``model``:
    the float model to quantize again (default: built from the spec saved in FILE). Building it runs the code
    the spec names, so that happens only for a file signed with your key (``--save`` signs it), an alias of
    overdrive's own models, or ``trust=True``; otherwise UsageError, before anything is imported.

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

        why = None if trust else _untrusted_spec(payload)
        if why is not None:
            raise UsageError(f"{path}: building its model runs the code its spec {payload.get('model')!r} names, and "
                             f"{why}; pass the float model yourself (load_quantized(path, model=build())), save it "
                             "again here with overdrive quantize --save, or pass trust=True if you know where it came from")
        model = _load(payload["model"])
    qmodel = quantize(model.eval(), QuantConfig.from_dict(payload["config"]))
    try:
        qmodel.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise UsageError(f"{path} does not fit the model: {str(exc).splitlines()[0]}") from exc
    return qmodel.eval()
