"""``overdrive env``: versions, GPUs and which optional backends are usable here."""

from __future__ import annotations

import click

from overdrive.cli.common import check_json_target, console, json_option, write_json


@click.command("env")
@json_option("the report")
def command(json_path: str | None) -> None:
    """Show python, torch, CUDA/driver versions, GPUs and usable backends.

    \b
    Example:
      overdrive env --json > env.json
    """
    check_json_target(json_path)
    from overdrive._utils.device import environment_report

    report = environment_report()
    if json_path is not None:
        write_json(report, json_path)
        if json_path == "-":
            return
    from rich.table import Table

    t = Table(title="overdrive environment", show_header=False)
    t.add_column("what")
    t.add_column("value")
    t.add_row("overdrive", report["overdrive"])
    t.add_row("python", report["python"])
    t.add_row("torch", report["torch"])
    t.add_row("cpu", f"{report['cpu']['machine']} {report['cpu']['isa']}, {report['cpu']['threads']} threads; {report['cpu']['features']}")
    cuda = report["cuda"]
    t.add_row("cuda", f"{cuda['version']} (driver {cuda['driver']}, cudnn {cuda['cudnn']}, nccl {cuda['nccl']})" if cuda["available"] else "not available")
    for g in report["gpus"]:
        t.add_row(f"gpu {g['index']}", f"{g['name']}, sm {g['compute_capability']}, {g['memory_gib']} GiB, fp8 {'yes' if g['fp8'] else 'no'}")
    for name, b in report["backends"].items():
        extra = ""
        if name == "onnxruntime" and b["available"]:
            extra = f" {b['version']} ({', '.join(b['providers'])})"
        if name == "torchvision":
            extra = f" (GPU JPEG decode: {'yes' if b.get('gpu_jpeg_decode') else 'no'})" + (f" [{b['error']}]" if "error" in b else "")
        t.add_row(name, ("yes" if b["available"] else "no") + extra)
    console().print(t)
