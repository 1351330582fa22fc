"""``overdrive sparsify``: prune a trained model to 2:4 and write a compressed checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from overdrive.cli.common import (check_distinct, check_json_target, check_output, console, json_option, spec_file,
                                  write_json)


@click.command("sparsify")
@click.option("--model", "model_spec", required=True,
              help="'pkg.module:Factory', 'file.py:Factory', or an alias: digits, docstrings.")
@click.option("--checkpoint", default=None, help="Trained weights: a state_dict (a pruned one with its masks too) or an overdrive Trainer checkpoint.")
@click.option("--allow-untrained", is_flag=True,
              help="Prune the model's initial (random) weights when no --checkpoint is given: for trying the format "
                   "and the report only, the accuracy of such a model means nothing.")
@click.option("--out", required=True, help="Where to write the compressed 2:4 checkpoint.")
@click.option("--mask-calculator", default="m4n2_1d", show_default=True,
              type=click.Choice(["m4n2_1d", "m4n2_2d_greedy", "m4n2_2d_best"]))
@click.option("--permute/--no-permute", default=False, show_default=True, help="Channel permutation search first.")
@click.option("--exclude", "exclude", multiple=True, help="Module name to keep dense (repeatable).")
@click.option("--input-shape", default=None, metavar="SHAPE|NAME:AxB,...",
              help="Example input shape in any rank, e.g. 1,1,8,8 or 1,16, or inputs by name as build --shapes "
                   "takes them, e.g. input_ids:1x128,attention_mask:1x128 (token ids drawn below the vocabulary "
                   "size), to report FLOPs pruned.")
@json_option("the report")
def command(model_spec: str, checkpoint: str | None, allow_untrained: bool, out: str, mask_calculator: str, permute: bool,
            exclude: tuple[str, ...], input_shape: str | None, json_path: str | None) -> None:
    """Prune a model to 2:4 structured sparsity and save it compressed (values + 2-bit indices).

    \b
    Examples:
      overdrive sparsify --model digits --allow-untrained --out digits.sparse24.pt --input-shape 1,1,8,8
      overdrive sparsify --model mypkg.models:build --checkpoint trained.pt --out model.sparse24.pt
      overdrive sparsify --model mypkg.models:tagger --allow-untrained --out tagger.sparse24.pt \\
          --input-shape input_ids:1x32,attention_mask:1x32
    """
    check_json_target(json_path)
    if out.lower().endswith((".onnx", ".engine")):  # a torch.save file under a name other tools read as theirs
        from overdrive._utils.errors import UsageError

        kind = "an ONNX" if out.lower().endswith(".onnx") else "an engine"
        raise UsageError(f"--out {out} names {kind} file, but sparsify writes a compressed "
                         f"2:4 PyTorch checkpoint (a torch.save file, e.g. {Path(out).stem}.sparse24.pt); build an "
                         f"engine from it with overdrive build --model ... --checkpoint {Path(out).stem}.sparse24.pt")
    check_output("--out", out)
    check_distinct([("--out", out), ("--json", json_path)], [("--model", spec_file(model_spec)),
                                                            ("--checkpoint", checkpoint)])
    from overdrive.recipes.input_shapes import parse_input_shapes
    from overdrive.recipes.sparsify import sparsify_checkpoint
    from overdrive.sparsity import SparsityConfig as Config

    shape = parse_input_shapes(input_shape)  # refused before the model is built
    cfg = Config(mask_calculator=mask_calculator, permutation=permute, disallowed_layer_names=exclude)
    report, stats = sparsify_checkpoint(model_spec, checkpoint, out, cfg, shape, allow_untrained=allow_untrained)
    if json_path is not None:
        write_json({"report": report.to_dict(), "storage": stats, "out": out}, json_path)
        if json_path == "-":
            return
    con = console()
    for t in report.tables():
        t.notes.append(f"pruned weights stored in {stats['compressed_weight_bytes']:,} bytes instead of "
                       f"{stats['dense_weight_bytes']:,} ({stats['compressed_weight_bytes'] / stats['dense_weight_bytes']:.2f}x); "
                       f"wrote {out} ({stats['file_bytes']:,} bytes)")
        con.print(t.render())
