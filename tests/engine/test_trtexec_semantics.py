"""build / exec / compare against what trtexec and polygraphy users expect: shape specs with several inputs
and names holding ':' and '/', --optShapes alone, inputs the ONNX model fixes, output names, integer and empty
outputs, percentiles, --warm-up 0, and bad paths refused before the run. Each test failed before its fix.
Tiny hand-made ONNX models on the onnxruntime backend: no compile, well under a second each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile, compare, parse_shapes
from overdrive.engine.config import profiles_from_shapes

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

NAMES = ["out:0", "arg/max", "ids_plus"]
PROFILE = "input:0:{b}x4,tok/ids:{b}x{s}"


def _model(nodes: list, inputs: list, outputs: list, inits: list = ()) -> bytes:
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def _multi() -> bytes:
    """Inputs 'input:0' (B, 4) float and 'tok/ids' (B, S) int64; outputs 'out:0' float, 'arg/max' and 'ids_plus' int64."""
    w = numpy_helper.from_array(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).numpy(), "W")
    one = numpy_helper.from_array(torch.tensor(1).numpy(), "one")
    return _model([h.make_node("MatMul", ["input:0", "W"], ["mm"]), h.make_node("Relu", ["mm"], ["out:0"]),
                   h.make_node("ArgMax", ["mm"], ["arg/max"], axis=1, keepdims=0),
                   h.make_node("Add", ["tok/ids", "one"], ["ids_plus"])],
                  [h.make_tensor_value_info("input:0", T.FLOAT, ["B", 4]), h.make_tensor_value_info("tok/ids", T.INT64, ["B", "S"])],
                  [h.make_tensor_value_info("out:0", T.FLOAT, ["B", 3]), h.make_tensor_value_info("arg/max", T.INT64, ["B"]),
                   h.make_tensor_value_info("ids_plus", T.INT64, ["B", "S"])], [w, one])


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("multi")
    (d / "m.onnx").write_bytes(_multi())
    code = main(["build", "--onnx", str(d / "m.onnx"), "--save-engine", str(d / "m.engine"), "--min-shapes",
                 PROFILE.format(b=1, s=2), "--opt-shapes", PROFILE.format(b=4, s=5), "--max-shapes", PROFILE.format(b=16, s=9)])
    assert code == 0
    return d / "m.onnx", d / "m.engine"


def test_output_names_are_the_onnx_models_and_survive_save_load(multi: tuple[Path, Path]) -> None:
    """The header named the bindings output0..2 (not what the model calls them, unlike trtexec / polygraphy)."""
    onnx_path, engine_path = multi
    eng = Engine.load(engine_path)
    assert [o["name"] for o in eng.info["outputs"]] == NAMES
    assert [o["dtype"] for o in eng.info["outputs"]] == ["float32", "int64", "int64"]
    assert [(p.name, p.min, p.opt, p.max) for p in eng.profiles] == [("input:0", (1, 4), (4, 4), (16, 4)),
                                                                     ("tok/ids", (1, 2), (4, 5), (16, 9))]
    r = compare(eng, str(onnx_path))
    assert r["passed"] and [o["name"] for o in r["outputs"]] == NAMES


@pytest.mark.parametrize("b,s", [(1, 2), (16, 9)])
def test_exec_at_the_profiles_min_and_max(multi: tuple[Path, Path], tmp_path: Path, b: int, s: int,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _, engine_path = multi
    times = tmp_path / "times.json"
    code = main(["exec", "--load-engine", str(engine_path), "--shapes", PROFILE.format(b=b, s=s), "--iterations", "3",
                 "--duration", "0", "--warm-up", "0", "--percentile", "0,50,100", "--export-times", str(times),
                 "--json", "-"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)  # --json -: stdout is the JSON alone
    assert summary["batch"] == b and summary["iterations"] == 3
    assert set(summary["latency_ms"]) >= {"p0", "p50", "p100"}
    assert len(json.loads(times.read_text())) == 3


def test_percentiles_outside_0_100_are_refused(multi: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """150 and -5 were clamped to the max / min and printed as percentile(150%); nan crashed with a ValueError."""
    eng = Engine.load(multi[1])
    for p in (150.0, -5.0, math.nan, math.inf):
        with pytest.raises(UsageError, match="between 0 and 100"):
            eng.benchmark(iterations=1, duration_s=0, warmup_ms=0, percentiles=(50, p))
    assert main(["exec", "--load-engine", str(multi[1]), "--percentile", "50,150", "--duration", "0"]) == 2
    assert "--percentile 150" in capsys.readouterr().err


def test_nan_duration_and_warm_up_are_refused(multi: tuple[Path, Path]) -> None:
    eng = Engine.load(multi[1])
    for kw in ({"duration_s": math.nan}, {"warmup_ms": math.nan}):
        with pytest.raises(UsageError, match="duration >= 0"):
            eng.benchmark(iterations=1, **{"duration_s": 0, "warmup_ms": 0, **kw})


def test_warm_up_zero_makes_no_warm_up_calls(multi: tuple[Path, Path]) -> None:
    """trtexec --warmUp=0 runs no warm-up; two calls were made anyway."""
    eng = Engine.load(multi[1])
    calls, inner = [], eng.runner

    def counting(*xs: torch.Tensor) -> list[torch.Tensor]:
        calls.append(1)
        return inner(*xs)

    eng.runner = counting
    s = eng.benchmark(iterations=3, duration_s=0, warmup_ms=0)
    assert s["iterations"] == 3 and len(calls) == 3


def test_benchmark_takes_one_tensor_as_the_one_input() -> None:
    """benchmark(inputs=tensor) split the tensor along dim 0 (tuple(tensor)) and refused it."""
    eng = Builder(BuildConfig(profiles=[ShapeProfile.fixed("x", (2, 3))])).build(
        _model([h.make_node("Relu", ["x"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
               [h.make_tensor_value_info("y", T.FLOAT, [2, 3])]))
    assert eng.benchmark(inputs=torch.randn(2, 3), iterations=2, duration_s=0, warmup_ms=0)["batch"] == 2


def test_export_and_json_paths_are_checked_before_the_run(multi: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A missing folder failed with FileNotFoundError (exit 1) after the whole --duration had run."""
    eng = Engine.load(multi[1])
    bad = str(tmp_path / "no" / "such" / "f.json")
    for kw in ("export_times", "export_profile"):
        with pytest.raises(UsageError, match="does not exist"):
            eng.benchmark(iterations=1, duration_s=0, warmup_ms=0, **{kw: bad})
    assert main(["exec", "--load-engine", str(multi[1]), "--duration", "0", "--json", bad]) == 2
    assert "--json" in capsys.readouterr().err


def test_opt_shapes_alone_is_a_static_profile_and_stray_names_are_refused() -> None:
    """--optShapes alone was dropped (then 'give the input shapes'); an --opt-shapes name that min/max lack was
    ignored silently (opt became max); a name given twice kept the last."""
    assert profiles_from_shapes(opt_shapes="x:2x3") == [ShapeProfile.fixed("x", (2, 3))]
    p = profiles_from_shapes(min_shapes="x:1x3,y:1", opt_shapes="x:2x3,y:2", max_shapes="x:8x3,y:4")
    assert [q.opt for q in p] == [(2, 3), (2,)]
    with pytest.raises(UsageError, match=r"--opt-shapes names \['z'\]"):
        profiles_from_shapes(min_shapes="x:1x3", opt_shapes="z:2x3", max_shapes="x:8x3")
    with pytest.raises(UsageError, match="'input:0' twice"):
        parse_shapes("input:0:2x4,tok/ids:2x3,input:0:4x4")
    assert parse_shapes("'input:0':2x4,tok/ids:2x3") == {"input:0": (2, 4), "tok/ids": (2, 3)}


def test_inputs_the_onnx_model_fixes_need_no_shapes(tmp_path: Path) -> None:
    """As trtexec: only the dynamic input needs --min/--max-shapes; the model's static 'bias' was 'missing'."""
    model = _model([h.make_node("Add", ["x", "bias"], ["y"])],
                   [h.make_tensor_value_info("x", T.FLOAT, ["B", 3]), h.make_tensor_value_info("bias", T.FLOAT, [3])],
                   [h.make_tensor_value_info("y", T.FLOAT, ["B", 3])])
    (tmp_path / "m.onnx").write_bytes(model)
    assert main(["build", "--onnx", str(tmp_path / "m.onnx"), "--save-engine", str(tmp_path / "m.engine"),
                 "--min-shapes", "x:1x3", "--max-shapes", "x:8x3"]) == 0
    eng = Engine.load(tmp_path / "m.engine")
    assert [(p.name, p.min, p.max) for p in eng.profiles] == [("x", (1, 3), (8, 3)), ("bias", (3,), (3,))]
    x, b = torch.randn(8, 3), torch.randn(3)
    assert torch.equal(eng(x, b), x + b)


def test_compare_integer_outputs_exactly_above_2_24() -> None:
    """Integer outputs went through float32, where 2**24 + 1 == 2**24: ids off by one compared equal."""
    one = numpy_helper.from_array(torch.tensor(1).numpy(), "one")
    model = _model([h.make_node("Add", ["ids", "one"], ["y"])], [h.make_tensor_value_info("ids", T.INT64, [2])],
                   [h.make_tensor_value_info("y", T.INT64, [2])], [one])
    eng = Builder().build(model)

    class Same(torch.nn.Module):  # forgets the + 1
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids

    ids = torch.tensor([2**24, 2**24])  # the engine gives 2**24 + 1, which float32 rounds back to 2**24
    r = compare(eng, Same(), inputs=(ids,), atol=0.5, rtol=0)
    assert not r["passed"] and r["outputs"][0]["max_abs"] == 1.0
    assert compare(eng, model, inputs=(ids,), atol=0, rtol=0)["passed"]


def test_compare_empty_outputs_and_bad_tolerances() -> None:
    """NonZero of all zeros is an empty output on both sides: compare crashed in max(); a negative atol was taken."""
    model = _model([h.make_node("NonZero", ["x"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                   [h.make_tensor_value_info("y", T.INT64, [2, None])])
    eng = Builder().build(model)
    r = compare(eng, model, inputs=(torch.zeros(2, 3),))
    assert r["passed"] and r["outputs"][0]["shape"] == [2, 0] and r["outputs"][0]["max_abs"] == 0.0
    for kw in ({"atol": -1.0}, {"rtol": math.nan}, {"atol": math.inf}):  # inf: the Python API as the CLI
        with pytest.raises(UsageError, match="tolerances must be finite and >= 0"):
            compare(eng, model, **kw)


def test_build_line_describes_the_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The build line printed the header's dict: device {'type': 'cpu', 'isa': ...}."""
    (tmp_path / "m.onnx").write_bytes(_multi())
    assert main(["build", "--onnx", str(tmp_path / "m.onnx"), "--save-engine", str(tmp_path / "m.engine"),
                 "--shapes", PROFILE.format(b=2, s=3)]) == 0
    out = capsys.readouterr().out
    assert "device CPU " in out and "{'type'" not in out


def test_shape_hints_quote_names_that_hold_colons_or_spaces() -> None:
    """The hint of a missing dynamic shape pasted as `--shapes in put:0:4x16,...`, which splits in the shell and
    parses as a name `in put`; it must come quoted as the parser takes it."""
    import shlex

    from overdrive.engine.config import ShapeProfile, check_all_dynamic_shapes, parse_shapes

    ps = [ShapeProfile("in put:0", (1, 1), (8, 8), (8, 64)), ShapeProfile("m:1", (1, 1), (8, 8), (8, 64))]
    with pytest.raises(UsageError) as err:
        check_all_dynamic_shapes(ps, {"in put:0": (4, 16)})
    hint = str(err.value).split("e.g. --shapes ", 1)[1]
    (value,) = shlex.split(hint.replace("...", "4x16"))
    assert parse_shapes(value) == {"in put:0": (4, 16), "m:1": (4, 16)}
