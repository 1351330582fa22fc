"""Engine edge cases, each against a stated reference: uint8 inputs, profiles an ONNX model's
fixed dims cannot run, min = opt = 1 dynamic profiles on Inductor, compare on infinities and dict outputs, and
nearest-rank percentiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, ShapeProfile, compare
from overdrive.engine.benchmark import _stats

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402


def _onnx(nodes: list, x_type: int, x_shape: list, y_shape: list) -> bytes:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_uint8_image_input_builds_and_runs() -> None:
    """A uint8 image input (Cast to float inside the model): the build feeds uint8, the binding takes uint8,
    and the output equals ONNX Runtime's (it fell back to float32 and failed)."""
    model = _onnx([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], TensorProto.UINT8, [1, 3, 4, 4],
                  [1, 3, 4, 4])
    eng = Builder(device="cpu").build(model)
    assert eng.header["inputs"][0]["dtype"] == "uint8"
    x = torch.randint(0, 256, (1, 3, 4, 4), dtype=torch.uint8)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_array_equal(eng(x).numpy(), ref)


def test_profile_beyond_a_fixed_onnx_dim_is_refused_at_build() -> None:
    model = _onnx([helper.make_node("Relu", ["x"], ["y"])], TensorProto.FLOAT, [1, 3], [1, 3])
    with pytest.raises(UsageError, match="dim 0 is fixed to 1 in the ONNX model, but the profile asks for 1..8"):
        Builder(device="cpu", profiles=[ShapeProfile("x", (1, 3), (1, 3), (8, 3))]).build(model)


def test_inductor_dynamic_profile_with_opt_one() -> None:
    """min = opt = 1: torch.export specialized the size-1 dim and the build failed; batch 5 must run."""
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2).eval()
    eng = Builder(device="cpu", backend="inductor", profiles=[ShapeProfile("x", (1, 3), (1, 3), (8, 3))]).build(
        m, input_names=["x"])
    x = torch.randn(5, 3)
    with torch.no_grad():
        assert (eng(x) - m(x)).abs().max().item() <= 1e-5


def test_compare_equal_infinities_pass_and_nan_fails() -> None:
    model = _onnx([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Log", ["r"], ["y"])], TensorProto.FLOAT,
                  [2, 4], [2, 4])
    eng = Builder(device="cpu").build(model)
    x = torch.tensor([[1.0, -1.0, 2.0, 3.0], [0.5, 4.0, -2.0, 1.0]])  # Log(0) = -inf on both sides
    r = compare(eng, model, inputs=(x,))
    assert r["passed"] and r["outputs"][0]["max_abs"] == 0.0

    class NaNs(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.relu(x)) * 0  # -inf * 0 = NaN where x <= 0

    assert not compare(eng, NaNs(), inputs=(x,))["passed"]


def test_compare_against_a_module_returning_a_dict() -> None:
    """Hugging Face models return a ModelOutput (a dict): its tensors, in key order, are the outputs."""

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.lin(x), "hidden": x * 2}

    m = M().eval()
    eng = Builder(device="cpu").build(m, (torch.randn(2, 3),))
    r = compare(eng, m)
    assert r["passed"] and len(r["outputs"]) == 2


@pytest.mark.parametrize("n, p, expected", [(10, 50, 5), (100, 99, 99), (20, 95, 19), (8, 50, 4), (1, 99, 1)])
def test_percentiles_are_nearest_rank(n: int, p: float, expected: int) -> None:
    """Nearest rank: the smallest sample with at least p% of the samples at or below it (rounding half to
    even put some one rank high)."""
    assert _stats([float(i) for i in range(1, n + 1)], (p,))[f"p{p:g}"] == expected


def test_exec_shapes_with_an_unknown_input_name_is_refused(tmp_path) -> None:
    """`exec --shapes y:...` on an engine whose input is 'x' names the bad input and the real ones (it ran silently
    at the opt shapes)."""
    from overdrive.cli.main import main

    model = _onnx([helper.make_node("Relu", ["x"], ["y"])], TensorProto.FLOAT, [2, 3], [2, 3])
    eng = Builder(backend="onnxruntime", device="cpu", profiles=[ShapeProfile.fixed("x", (2, 3))]).build(model)
    with pytest.raises(UsageError, match=r"'y', which this engine does not have; its inputs are 'x'"):
        eng.random_inputs({"y": (2, 3)})
    eng.save(tmp_path / "m.engine")
    assert main(["exec", "--load-engine", str(tmp_path / "m.engine"), "--shapes", "y:2x3", "--duration", "0"]) == 2


def test_compare_against_an_onnx_model_with_another_fixed_batch_names_it() -> None:
    """An engine at opt batch 4 against an ONNX file fixed at batch 1: a one-line error naming the input and both
    shapes (it was ONNX Runtime's raw dimension error)."""
    dyn = _onnx([helper.make_node("Relu", ["x"], ["y"])], TensorProto.FLOAT, ["b", 3], ["b", 3])
    fixed = _onnx([helper.make_node("Relu", ["x"], ["y"])], TensorProto.FLOAT, [1, 3], [1, 3])
    eng = Builder(backend="onnxruntime", device="cpu",
                  profiles=[ShapeProfile("x", (1, 3), (4, 3), (8, 3))]).build(dyn)
    with pytest.raises(UsageError, match=r"input 'x' is fixed at 1x3, but the comparison runs 4x3"):
        compare(eng, fixed)
    assert compare(eng, dyn)["passed"]


def test_an_index_past_the_table_is_one_clear_error(capfd: pytest.CaptureFixture[str]) -> None:
    """ONNX Runtime's InvalidArgument (and its coloured log line on stderr) reached the user as they were."""
    pytest.importorskip("onnxruntime")
    from overdrive._utils.errors import UsageError
    from overdrive.engine import Builder

    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).sum(1)

    eng = Builder(precision="fp32", backend="onnxruntime", device="cpu").build(Lookup().eval(),
                                                                                (torch.randint(0, 50, (2, 5)),))
    capfd.readouterr()
    with pytest.raises(UsageError, match=r"could not run the engine on these inputs: .*idx=99.*check their values"):
        eng(torch.full((2, 5), 99))
    assert "[E:onnxruntime" not in capfd.readouterr().err


def test_an_example_outside_the_shape_profile_is_refused_before_the_build() -> None:
    """Before: the build traced and checked with a batch of 16 under a profile of at most 8, and the engine it made
    refused that very shape when called."""
    from overdrive._utils.errors import UsageError
    from overdrive.engine import BuildConfig, Builder
    from overdrive.engine.config import ShapeProfile

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    builder = Builder(BuildConfig(profiles=[ShapeProfile("x", (1, 8), (4, 8), (8, 8))], device="cpu"))
    with pytest.raises(UsageError, match=r"example input 'x' has shape \(16, 8\), outside its shape profile min "
                                         r"\(1, 8\) max \(8, 8\); give an example inside it \(its opt shape \(4, 8\)\)"):
        builder.build(model, torch.randn(16, 8))
    with pytest.raises(UsageError, match=r"has shape \(4, 8, 1\), outside"):  # another rank
        builder.build(model, torch.randn(4, 8, 1))
    engine = builder.build(model, torch.randn(8, 8))  # the profile's edge is inside
    assert engine(torch.randn(2, 8)).shape == (2, 4)


def test_loading_at_a_precision_that_does_not_exist_names_the_choices(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before: "built for precision fp32, not bogus ...; rebuild with --precision bogus", a fix that cannot work."""
    from overdrive.engine import BuildConfig, Builder
    from overdrive.engine.config import ShapeProfile
    from overdrive.engine.runtime import Engine

    e = Builder(BuildConfig(device="cpu", profiles=[ShapeProfile("x", (2, 4), (2, 4), (2, 4))])).build(torch.nn.Linear(4, 2))
    e.save(tmp_path / "m.engine")
    with pytest.raises(UsageError, match=r"^precision='bogus' is not one of fp32, tf32, fp16, bf16, int8, fp8, best\. It only checks the "
                                         r"engine's own precision, fixed at build \(fp32 for .*m.engine\): leave it out"):
        Engine.load(tmp_path / "m.engine", precision="bogus")
