"""Engines from PyTorch models users bring as they are: fp64 weights, a model left in training mode, a TorchScript
module (scripted or traced) with named dynamic profiles, an LSTM whose sequence length torch.export fixes. Each engine
is compared with the eager model (stated tolerances, fixed seeds)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile


class _Net(nn.Module):
    """A small CNN with BatchNorm and Dropout (what differs between train and eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.bn(self.conv(x)).relu().mean((2, 3))))


def _net() -> _Net:
    torch.manual_seed(0)
    m = _Net()
    m.bn.running_mean.uniform_(-1, 1)
    m.bn.running_var.uniform_(0.5, 2.0)
    return m


class _Lookup(nn.Module):
    """A float input and int64 token ids (an Embedding), as in a recommender or a text head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1)) + x.sum(-1, keepdim=True)


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_fp64_model_builds_in_float32(backend: str) -> None:
    # before: ONNX Runtime had no float64 Conv, and Inductor's engine fed float32 inputs to float64 weights
    if backend == "inductor":  # a small MLP, compiled without AOTInductor: seconds, not the CNN's ~40 s
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        cfg = BuildConfig(backend=backend, device="cpu", aot=False)
    else:
        model = _net().double().eval()
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        cfg = BuildConfig(backend=backend, device="cpu")
    with pytest.warns(UserWarning, match="float64"):
        engine = Builder(cfg).build(model, (x,))
    assert next(model.parameters()).dtype == torch.float64  # the user's model is not cast
    out = engine(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)  # float32 rounding of an fp64 model


def test_train_mode_model_warns_and_builds_eval() -> None:
    model = _net().train()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="training mode"):
        engine = Builder(BuildConfig(backend="onnxruntime", device="cpu")).build(model, (x,))
    assert model.training and model.drop.training  # the user's model keeps its mode
    with torch.no_grad():
        ref = model.eval()(x)
    torch.testing.assert_close(engine(x), ref, rtol=1e-5, atol=1e-5)  # the engine is the eval-mode model


def test_eval_model_does_not_warn_about_mode() -> None:
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Builder(BuildConfig(backend="onnxruntime", device="cpu")).build(_net().eval(), (x,))


@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_module_with_named_dynamic_profiles(how: str, tmp_path) -> None:
    # before: a loaded TorchScript module had no Python signature, so its one input was "input" and profiles naming
    # x and ids were refused; and the build's output hook raised on ScriptModules
    torch.manual_seed(0)
    eager = _Lookup().eval()
    ex = (torch.randn(2, 4), torch.randint(0, 20, (2, 5)))
    scripted = torch.jit.script(eager) if how == "script" else torch.jit.trace(eager, ex)
    torch.jit.save(scripted, str(tmp_path / "m.pt"))
    module = torch.jit.load(str(tmp_path / "m.pt"))
    profiles = [ShapeProfile("x", (1, 4), (2, 4), (4, 4)), ShapeProfile("ids", (1, 2), (2, 5), (4, 9))]
    engine = Builder(BuildConfig(backend="onnxruntime", device="cpu", profiles=profiles)).build(module)
    assert engine.input_names == ["x", "ids"] and engine.input_dtypes == [torch.float32, torch.int64]
    engine.save(tmp_path / "m.engine")
    loaded = Engine.load(tmp_path / "m.engine")
    g = torch.Generator().manual_seed(3)
    for b, t in ((1, 2), (2, 5), (3, 7), (4, 9)):
        x, ids = torch.randn(b, 4, generator=g), torch.randint(0, 20, (b, t), generator=g)
        with torch.no_grad():
            ref = eager(x, ids)
        torch.testing.assert_close(engine(x, ids), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(x=x, ids=ids), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="outside the engine's profile"):
        engine(torch.randn(5, 4), torch.randint(0, 20, (5, 5)))


def test_torchscript_module_on_inductor_is_refused_clearly() -> None:
    module = torch.jit.script(_Lookup().eval())
    with pytest.raises(Exception, match="TorchScript.*--backend onnxruntime"):
        Builder(BuildConfig(backend="inductor", device="cpu")).build(
            module, (torch.randn(2, 4), torch.randint(0, 20, (2, 5))))


def test_lstm_dynamic_sequence_on_inductor_names_the_dim() -> None:
    # torch.export fixes an nn.LSTM's sequence length; the error was a screen of torch's mark_dynamic advice
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 16, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    from overdrive._utils.errors import UsageError

    cfg = BuildConfig(backend="inductor", device="cpu", profiles=[ShapeProfile("x", (1, 3, 8), (2, 5, 8), (4, 9, 8))])
    with pytest.raises(UsageError, match=r"input 'x' dim 1: .*\(3\.\.9\).*fixed it at 5.*--backend onnxruntime"):
        Builder(cfg).build(Tagger().eval())


@pytest.mark.parametrize("content, says", [
    ("torch", "zip archive, as PyTorch saves"),
    (b"ODENGINE\x00\x00", "an overdrive engine already"),
])
def test_a_file_that_is_not_onnx_says_what_it_is(tmp_path: Path, content: object, says: str) -> None:
    """`build --onnx model.pt` said only "Wire format was corrupt"; the error now says what the file holds and which
    flag takes it."""
    from overdrive.engine.sources import from_onnx

    path = tmp_path / "model.onnx"
    if content == "torch":
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    else:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=says):
        from_onnx(str(path))
