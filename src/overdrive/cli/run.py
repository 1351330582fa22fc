"""``overdrive run``: polygraphy's ``run model.onnx --trt --onnxrt``, an engine built here against ONNX Runtime."""

from __future__ import annotations

import click

from overdrive.cli.common import (Tolerance, check_distinct, check_json_target, check_output, json_option, progress_option,
                                  write_json)


@click.command("run")
@click.argument("model", metavar="MODEL.onnx")
@click.option("--trt", is_flag=True, help="Runner 1: an overdrive engine built from MODEL in memory (backend chosen as "
              "`overdrive build` chooses it; TensorRT itself is not used).")
@click.option("--onnxrt", is_flag=True, help="Runner 2, the reference: MODEL as written, in ONNX Runtime (CPU).")
@click.option("--atol", default=1e-3, show_default=True, type=Tolerance(),
              help="Absolute tolerance. An element passes when |a - b| <= atol + rtol * |b| (torch.allclose's test; "
                   "polygraphy passes it when either |a - b| <= atol or |a - b| / |b| <= rtol, so this is stricter). "
                   "A finite number >= 0.")
@click.option("--rtol", default=1e-3, show_default=True, type=Tolerance(), help="Relative tolerance, against ONNX Runtime "
              "(see --atol).")
@click.option("--fp16", "precision", flag_value="fp16", help="Build the engine in fp16.")
@click.option("--int8", "precision", flag_value="int8", help="Build the engine in int8 (no calibration data: fit for "
              "timing, not accuracy).")
@click.option("--input-shapes", "--shapes", "input_shapes", multiple=True, metavar="NAME:[A,B,C]",
              help="Input shapes, polygraphy's name:[1,3,224,224] (several, space-separated) or name:1x3x224x224; "
                   "needed for dynamic inputs.")
@click.option("--load-inputs", default=None, metavar="FILE", help="Run these inputs: an .npz of arrays by input name "
              "or a .pt (torch.save of a dict name -> tensor, or a list in input order). Polygraphy's JSON is not read.")
@click.option("--save-inputs", default=None, metavar="FILE", help="Write the inputs run to FILE (.npz or .pt), for "
              "--load-inputs or `overdrive compare --inputs`.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random inputs.")
@click.option("--device", default="auto", show_default=True, help="Device the engine is built for (auto, cpu, cuda).")
@progress_option()
@json_option("the report")
def command(model: str, trt: bool, onnxrt: bool, atol: float, rtol: float, precision: str | None,
            input_shapes: tuple[str, ...], load_inputs: str | None, save_inputs: str | None, seed: int, device: str,
            no_progress: bool, json_path: str | None) -> None:
    """Compare an engine built from MODEL against ONNX Runtime (polygraphy run); exit 1 when an output FAILED.

    \b
    Examples:
      overdrive run model.onnx --trt --onnxrt --atol 1e-3 --rtol 1e-3
      overdrive run model.onnx --trt --onnxrt --input-shapes input:[1,3,224,224] --save-inputs in.npz
      overdrive run model.onnx --trt --onnxrt --fp16 --atol 1e-2 --load-inputs in.npz

    The same comparison with the engine kept: `overdrive build --onnx model.onnx --save-engine model.engine`, then
    `overdrive compare model.engine model.onnx`.
    """
    from overdrive._utils.progress import status
    from overdrive.cli.common import check_device
    from overdrive.engine import format_compare
    from overdrive.recipes.run import polygraphy_shapes, run_runners

    check_json_target(json_path)
    check_output("--save-inputs", save_inputs)
    check_device("--device", device)
    check_distinct([("--json", json_path), ("--save-inputs", save_inputs)], [("MODEL", model), ("--load-inputs", load_inputs)])
    shapes = polygraphy_shapes(input_shapes)
    with status(f"building an engine from {model} and comparing it with ONNX Runtime",
                enabled=not no_progress and json_path != "-"):
        report = run_runners(model, trt=trt, onnxrt=onnxrt, atol=atol, rtol=rtol, seed=seed, shapes=shapes,
                             load_inputs=load_inputs, save_inputs=save_inputs, precision=precision or "fp32",
                             device=device)
    if json_path is not None:
        write_json(report, json_path)
    if json_path != "-":
        eng = report["engine"]
        click.echo(f"[I] --trt: overdrive engine (backend {eng['backend']}, {eng['precision']}) built from {model}; "
                   f"--onnxrt: ONNX Runtime CPU, the reference")
        click.echo(format_compare(report))
    if not report["passed"]:
        raise click.exceptions.Exit(1)
