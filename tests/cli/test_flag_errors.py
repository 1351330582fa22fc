"""Bad values are refused naming the flag the user typed (``--batch-size -1``), never the Python argument
behind it (``batch_size=-1``), in one line with exit code 2, before any work."""

from __future__ import annotations

import re

import pytest

from overdrive.cli.main import _with_flags, main

CASES = [
    (["data", "bench", ".", "--batch-size", "-1"], "--batch-size"),
    (["data", "bench", ".", "--size", "0"], "--size"),
    (["data", "bench", ".", "--workers", "-1"], "--workers"),
    (["data", "bench", ".", "--batches", "0"], "--batches"),
    (["data", "bench", ".", "--device", "gpu0"], "--device gpu0"),
    (["data", "make-dataset", "out", "-n", "0"], "'-n'"),
    (["data", "make-dataset", "out", "--quality", "0"], "--quality"),
    (["data", "make-dataset", "out", "--processes", "0"], "--processes"),
    (["doctor", "--node-rank", "-1"], "--node-rank"),
    (["doctor", "--bandwidth", "1", "--min-bytes", "0"], "--min-bytes"),
    (["exec", "--load-engine", "x.engine", "--iterations", "0"], "--iterations"),
    (["exec", "--load-engine", "x.engine", "--duration", "-1"], "--duration"),
    (["exec", "--load-engine", "x.engine", "--warm-up", "-1"], "--warm-up"),
    (["exec", "--load-engine", "x.engine", "--duration", "inf"], "--duration"),  # ran for ever
    (["exec", "--load-engine", "x.engine", "--warm-up", "inf"], "--warm-up"),
    (["exec", "--load-engine", "x.engine", "--duration", "nan"], "--duration"),
    (["exec", "--load-engine", "x.engine", "--device", "gpu0"], "--device gpu0"),
    (["build", "--onnx", "m.onnx", "--save-engine", "m.engine", "--device", "gpu0"], "--device gpu0"),
    (["demo", "--device", "gpu0"], "--device gpu0"),
    (["launch", "--nnodes", "0", "train.py"], "--nnodes"),
    (["launch", "--node-rank", "1", "train.py"], "--node-rank 1"),
    (["launch", "--max-restarts", "-1", "train.py"], "--max-restarts"),
    (["launch", "--nproc-per-node", "0", "train.py"], "--nproc-per-node 0"),
    (["launch", "--nproc-per-node", "many", "train.py"], "--nproc-per-node many"),
    (["launch", "--rdzv-endpoint", "host:abc", "train.py"], "--rdzv-endpoint 'host:abc'"),  # the library's message
    (["quantize", "--calib-batches", "0"], "--calib-batches"),
    (["quantize", "--batch-size", "0"], "--batch-size"),
    (["quantize", "--percentile", "200"], "--percentile"),
    (["quantize", "--config", "int8_dynamic", "--export", "m.onnx"], "--config int8_dynamic has dynamic per-token"),
    # values a config or the library checks: named by the flag typed, with the close choice
    (["quantize", "--export", "m.onnx", "--opset", "30"], "--opset 30 is newer"),
    (["exec", "--load-engine", "x.engine", "--precision", "fp61"], "--precision 'fp61' is not one of fp32, tf32, "
     "fp16, bf16, int8, fp8, best; did you mean 'fp16'?"),
    (["build", "--model", "torch.nn:Identity", "--shapes", "x:1x4", "--save-engine", "m.engine", "--precision", "fp61"],
     "--precision 'fp61' is not one of fp32, tf32, fp16, bf16, int8, fp8, best; did you mean 'fp16'?"),
    (["build", "--model", "torch.nn:Identity", "--shapes", "x:1x4", "--save-engine", "m.engine", "--backend", "onnxrt"],
     "--backend 'onnxrt' is not one of auto, inductor, onnxruntime, tensorrt; did you mean 'onnxruntime'?"),
    (["build", "--model", "torch.nn:Identity", "--shapes", "x:1x4", "--save-engine", "m.engine", "--fp16",
      "--int8-activations", "static"], "--int8-activations 'static' applies to int8 engines, but this build has "
     "--precision 'fp16'"),
    (["build", "--model", "torch.nn:Identity", "--shapes", "x:1x4", "--save-engine", "m.engine",
      "--inputIOFormats", "fp61:chw"], "did you mean fp16:chw?"),
    # outputs swapped: a torch.save file under an ONNX name (build --onnx could not read it), ONNX under a .pt name
    (["quantize", "--save", "q.onnx"], "--save q.onnx names an ONNX file, but --save writes the quantized PyTorch "
     "model (a torch.save file, e.g. q.pt); for ONNX with Q/DQ nodes give --export q.onnx"),
    (["quantize", "--export", "q.pt"], "--export q.pt names a torch.save file, but --export writes ONNX"),
    (["sparsify", "--model", "digits", "--allow-untrained", "--out", "s.onnx"], "--out s.onnx names an ONNX file, "
     "but sparsify writes a compressed 2:4 PyTorch checkpoint"),
    (["quantize", "--model", "torch.nn:Linnear"], "--model 'torch.nn:Linnear': 'torch.nn' has no 'Linnear'; did you "
     "mean 'Linear'?"),
]


@pytest.mark.parametrize(("args", "needle"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_errors_name_the_flag(args: list[str], needle: str, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error:") and needle in err, err
    assert not re.search(r"\b[a-z]+_[a-z_]+=", err), err  # no batch_size=..., node_rank=...


def test_library_argument_names_become_flags() -> None:
    flags = {"batch_size": "--batch-size", "nnodes": "--nnodes", "size": "--size"}
    assert _with_flags("batch_size=-1 must be >= 1", flags) == "--batch-size -1 must be >= 1"
    assert _with_flags("nnodes=2 needs --master-addr", flags) == "--nnodes 2 needs --master-addr"
    # only whole names: input_size= and x.size= are not the --size flag
    assert _with_flags("input_size=3, x.size=4", flags) == "input_size=3, x.size=4"


def test_quantize_offers_every_preset() -> None:
    from overdrive.cli.quantize import command
    from overdrive.quant import PRESETS

    opt = next(p for p in command.params if p.name == "config_name")
    assert list(opt.type.choices) == list(PRESETS)


def test_a_negative_shape_and_two_precisions_are_usage_errors(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``exec --shapes input:-2x4`` reached torch ("negative dimension", exit 1); ``build --precision bf16 --fp16``
    built fp16 without a word."""
    import contextlib
    import io

    import onnx
    from onnx import TensorProto, helper

    monkeypatch.chdir(tmp_path)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "m.onnx")
    from overdrive._utils.errors import UsageError
    from overdrive.engine.config import parse_shapes

    with pytest.raises(UsageError, match=r"shape 'x:-2x4': dims must be >= 0"):  # exec's --shapes is parsed here
        parse_shapes("x:-2x4")
    for args, want in ((["build", "--onnx", "m.onnx", "--save-engine", "m.engine", "--precision", "bf16", "--fp16"],
                        "--precision bf16 and --fp16 ask for different precisions"),):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(args)
        assert code == 2 and want in err.getvalue(), err.getvalue()


def test_a_misspelled_verb_gets_the_close_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``overdrive buld`` said "No such command 'buld'." with nothing to try: the verbs load lazily, so click had
    none to compare with (``overdrive data tokenise`` got its suggestion)."""
    assert main(["buld"]) == 2
    assert "No such command 'buld'. Did you mean 'build'?" in capsys.readouterr().err
    assert main(["zzz"]) == 2
    assert "The commands are: build, compare," in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(("flags", "needle"), [
    (["--precision", "fp61"], "--precision 'fp61' is not one of"),
    (["--backend", "tensrt"], "did you mean 'tensorrt'?"),
    (["--inputIOFormats", "fp61:chw"], "--inputIOFormats fp61:chw: I/O format 'fp61:chw'"),
    (["--outputIOFormats", "fp16:cwh"], "--outputIOFormats fp16:cwh: I/O format 'fp16:cwh'"),
])
def test_build_refuses_bad_config_values_before_reading_the_model(flags: list[str], needle: str, tmp_path,  # type: ignore[no-untyped-def]
                                                                  monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad --precision / --backend / I/O formats were refused only after the model was imported (minutes for a
    large one, or its import's own failure first); an I/O format's message did not say which of the two flags."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text("raise RuntimeError('the model was imported')\n")
    assert main(["build", "--model", "slow.py:make", "--shapes", "x:1x4", "--save-engine", "m.engine", *flags]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "imported" not in err, err
    assert "--inputIOFormats / --outputIOFormats" not in err
