"""``overdrive quantize``: calibrate a model, report accuracy per calibrator, export ONNX with Q/DQ."""

from __future__ import annotations

import click

from overdrive.cli.common import (check_distinct, check_json_target, check_output, console, json_option, progress_option,
                                  spec_file, write_json)


@click.command("quantize")
@click.option("--model", "model_spec", default="digits", show_default=True,
              help="'digits' (the demo CNN, trained here in a few seconds), 'pkg.module:factory' (a callable "
                   "returning an nn.Module) or 'path/to/file.py:factory', with literal arguments if it takes any: "
                   "'file.py:make_model(num_classes=10)' (pickled models are refused: loading them runs code).")
@click.option("--checkpoint", default=None, metavar="FILE.pt",
              help="Weights for the --model's model, read weights-only: a state_dict, an overdrive Trainer checkpoint, "
                   "or the .sparse24.pt that overdrive sparsify writes (2:4 sparse + int8/fp8).")
@click.option("--calib-data", default="digits", show_default=True,
              help="'digits' or a calibration file (the one format of build --calib): torch.save of a tensor (N, ...), "
                   "a list of batches, [(input_ids, attention_mask), ...] or {'input_ids': ..., 'attention_mask': ...}; "
                   "or a folder of images (class subfolders or flat; --calib-batches x --batch-size of them, evenly "
                   "spaced in sorted order, resized and center-cropped to --input-shape), the .npz that overdrive "
                   "data tokenize -o writes (padded to --input-shape's length, else the longest text), or a .txt file, "
                   "one sample per line (the docstrings model only: others need their tokenizer's ids saved).")
@click.option("--input-shape", default=None, metavar="SHAPE|NAME:AxB,...",
              help="The model's input shape in any rank, e.g. 1,16 (an MLP), 1,80,3000 (audio) or 1,3,224,224, or "
                   "its inputs by name as build --shapes takes them, e.g. input_ids:1x128,attention_mask:1x128: "
                   "--calib-data must hold inputs of that shape (any batch size), and a folder of images is read "
                   "at it (C,H,W or N,C,H,W; default: a timm model's pretrained_cfg input_size).")
@click.option("--calib-normalize", default=None, metavar="imagenet|none|MEAN:STD",
              help="Normalization of --calib-data images after scaling to [0, 1]: imagenet (mean 0.485,0.456,0.406, "
                   "std 0.229,0.224,0.225; the default unless a timm model's pretrained_cfg gives its own), none, or "
                   "MEAN:STD, e.g. 0.5,0.5,0.5:0.5,0.5,0.5.")
@click.option("--config", "config_name",
              type=click.Choice(["int8", "fp8", "int8_attention", "int8_smoothquant", "int8_dynamic",
                                 "int8_dynamic_smoothquant"]), default="int8",
              show_default=True, help="int8_attention: int8 plus the attention matmuls (QK^T, PV); int8_smoothquant: "
                   "int8 after SmoothQuant (alpha 0.5); int8_dynamic: per-token activation scales at run time on "
                   "Linear layers (no calibration, no ONNX export); int8_dynamic_smoothquant: int8_dynamic after "
                   "SmoothQuant from the calibration data (the most accurate int8 for transformers).")
@click.option("--method", type=click.Choice(["max", "entropy", "percentile", "mse"]), default="max", show_default=True)
@click.option("--percentile", default=99.99, show_default=True, type=click.FloatRange(50, 100, min_open=True),
              help="The percentile calibrator's percentile of |x|, in (50, 100].")
@click.option("--calib-batches", default=8, show_default=True, type=click.IntRange(min=1), help="Batches used for calibration.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--export", "export_path", default=None, metavar="FILE.onnx", help="Write an ONNX model with Q/DQ nodes.")
@click.option("--save", "save_path", default=None, metavar="FILE.pt",
              help="Save the quantized PyTorch model (state dict with every amax, config and model spec; written "
                   "atomically); reload it with overdrive.recipes.quantize.load_quantized(FILE).")
@click.option("--opset", default=None, type=int, help="ONNX opset (default 17 for int8, 19 for fp8).")
@json_option("the summary")
@progress_option()
def command(model_spec: str, checkpoint: str | None, calib_data: str, input_shape: str | None,
            calib_normalize: str | None, config_name: str, method: str, percentile: float, calib_batches: int,
            batch_size: int, export_path: str | None, save_path: str | None, opset: int | None, json_path: str | None,
            no_progress: bool) -> None:
    """Quantize a model (PTQ), print which layers were quantized with their amax, optionally export ONNX
    (--export) and save the quantized PyTorch model (--save).

    \b
    Examples:
      overdrive quantize --config int8 --method entropy --export digits_int8.onnx --save digits_int8.pt
      overdrive quantize --model mypkg.models:build --calib-data calib.pt --config fp8 --export m.onnx
      overdrive quantize --model mypkg.models:build --calib-data imgs/ --input-shape 1,3,224,224 --calib-batches 2
      overdrive quantize --model mypkg.models:mlp --calib-data tabular.npy --input-shape 1,16 --save mlp_int8.pt
      overdrive quantize --model mypkg.models:tagger --calib-data tokens.npz --input-shape input_ids:1x32
    """
    check_json_target(json_path)
    _check_suffixes(export_path, save_path)
    check_output("--export", export_path)  # before the model is trained and calibrated
    check_output("--save", save_path)
    check_distinct([("--export", export_path), ("--save", save_path), ("--json", json_path)],
                   [("--model", spec_file(model_spec)), ("--checkpoint", checkpoint), ("--calib-data", calib_data)])
    from overdrive._utils.progress import status
    from overdrive.recipes.calib_formats import ImageOptions
    from overdrive.recipes.input_shapes import parse_input_shapes
    from overdrive.recipes.quantize import run_quantize

    shape = parse_input_shapes(input_shape)
    ImageOptions(normalize=calib_normalize)  # a bad value is refused before the model is built

    out = console()
    steps = "calibrating" + (", exporting ONNX" if export_path else "") + (", saving" if save_path else "")
    with status(f"quantize {model_spec}: {steps}", enabled=not no_progress and json_path != "-"):
        result = run_quantize(model_spec, calib_data, config_name, method, percentile, calib_batches, batch_size,
                              export_path, opset, console=None if json_path == "-" else out, save_path=save_path,
                              checkpoint=checkpoint, input_shape=shape, calib_normalize=calib_normalize)
    if json_path is not None:
        write_json(result, json_path)


def _check_suffixes(export_path: str | None, save_path: str | None) -> None:
    """Refuse the two outputs swapped, before any work: ``--save m.onnx`` wrote a torch.save file under an ONNX
    name (which ``build --onnx`` then could not read), ``--export m.pt`` an ONNX graph under a torch.save name."""
    from pathlib import Path

    from overdrive._utils.errors import UsageError

    if save_path and save_path.lower().endswith(".onnx"):
        raise UsageError(f"--save {save_path} names an ONNX file, but --save writes the quantized PyTorch model (a "
                         f"torch.save file, e.g. {Path(save_path).stem}.pt); for ONNX with Q/DQ nodes give --export {save_path}")
    if export_path and export_path.lower().endswith((".pt", ".pth")):
        raise UsageError(f"--export {export_path} names a torch.save file, but --export writes ONNX (e.g. "
                         f"{Path(export_path).stem}.onnx); to save the quantized PyTorch model give --save {export_path}")
