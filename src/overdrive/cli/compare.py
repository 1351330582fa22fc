"""``overdrive compare``: run two engines / ONNX models / PyTorch models on the same inputs (polygraphy-style)."""

from __future__ import annotations

import click

from overdrive.cli.common import Tolerance, check_distinct, check_json_target, join_repeated, json_option, spec_file, write_json


@click.command("compare")
@click.argument("a")
@click.argument("b")
@click.option("--atol", default=1e-3, show_default=True, type=Tolerance(),
              help="Absolute tolerance: an element passes when |a - b| <= atol + rtol * |b| (torch.allclose's test; "
                   "polygraphy passes it when either |a - b| <= atol or |a - b| / |b| <= rtol).")
@click.option("--rtol", default=1e-3, show_default=True, type=Tolerance(), help="Relative tolerance, against B (see --atol).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random inputs.")
@click.option("--shapes", multiple=True, callback=join_repeated, metavar="NAME:AxBxC,...",
              help="Shapes of the random inputs, e.g. input:4x1x8x8 (default: an engine's opt shapes or an ONNX "
                   "model's fixed ones); needed for dynamic ONNX inputs and for two PyTorch models.")
@click.option("--inputs", "inputs_path", default=None, metavar="FILE",
              help="Run these inputs instead of random ones: a .pt (torch.save of a tensor, a list of tensors or a dict "
                   "name -> tensor; read with weights_only) or an .npz of named arrays.")
@click.option("--checkpoint", default=None, metavar="FILE.pt",
              help="Weights for A or B given as a PyTorch factory, read weights-only as build --checkpoint reads them "
                   "(a state_dict, an overdrive Trainer checkpoint or a .sparse24.pt); without it the factory's model "
                   "keeps the weights the factory gives it.")
@json_option("the report")
def command(a: str, b: str, atol: float, rtol: float, seed: int, shapes: str | None, inputs_path: str | None,
            checkpoint: str | None, json_path: str | None) -> None:
    """Compare outputs of A against reference B; exit 1 when any output FAILED (outputs of different shapes too).

    \b
    Examples:
      overdrive compare model_fp16.engine model.onnx --atol 1e-2 --rtol 1e-2
      overdrive compare model.engine mypkg.models:make_model   # at the engine's opt shapes; mypkg/ in this folder
      overdrive compare model.onnx model_int8.onnx --shapes input:4x3x224x224 --atol 1e-1
      overdrive compare a.onnx b.onnx --inputs batch.npz   # or batch.pt: a tensor, a list or a dict name -> tensor
      overdrive compare model.engine mypkg.models:make_model --checkpoint trained.pt   # the engine's own weights
    """
    from overdrive.engine import compare, format_compare, parse_shapes
    from overdrive.recipes.run import random_weights_note, with_checkpoint

    check_json_target(json_path)
    check_distinct([("--json", json_path)], [("A", a), ("B", b), ("A", spec_file(a)), ("B", spec_file(b)),
                                             ("--inputs", inputs_path), ("--checkpoint", checkpoint)])
    given = parse_shapes(shapes) or None
    ra, rb = with_checkpoint(a, b, checkpoint)
    report = compare(ra, rb, inputs=inputs_path, atol=atol, rtol=rtol, seed=seed, shapes=given)
    if json_path is not None:
        write_json(report, json_path)
    if json_path != "-":
        click.echo(format_compare(report))
    if not report["passed"]:
        note = random_weights_note(a, b, checkpoint)
        if note:
            click.echo(f"[I] {note}", err=True)
        raise click.exceptions.Exit(1)
