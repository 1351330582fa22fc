"""``overdrive compare``: run two engines / ONNX models / PyTorch models on the same inputs (polygraphy-style)."""

from __future__ import annotations

import click

from overdrive.cli.common import check_json_target, json_option, write_json


@click.command("compare")
@click.argument("a")
@click.argument("b")
@click.option("--atol", default=1e-3, show_default=True, type=float,
              help="Absolute tolerance: an element passes when |a - b| <= atol + rtol * |b| (torch.allclose's test; "
                   "polygraphy passes it when either |a - b| <= atol or |a - b| / |b| <= rtol).")
@click.option("--rtol", default=1e-3, show_default=True, type=float, help="Relative tolerance, against B (see --atol).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random inputs (at the engine's opt shapes).")
@json_option("the report")
def command(a: str, b: str, atol: float, rtol: float, seed: int, json_path: str | None) -> None:
    """Compare outputs of A against reference B; exit 1 when any output FAILED.

    \b
    Examples:
      overdrive compare model_fp16.engine model.onnx --atol 1e-2 --rtol 1e-2
      overdrive compare model.engine mypkg.models:make_model
    """
    from overdrive.engine import compare, format_compare

    check_json_target(json_path)
    report = compare(a, b, atol=atol, rtol=rtol, seed=seed)
    if json_path is not None:
        write_json(report, json_path)
    if json_path != "-":
        click.echo(format_compare(report))
    if not report["passed"]:
        raise click.exceptions.Exit(1)
