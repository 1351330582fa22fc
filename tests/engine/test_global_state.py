"""The inductor backend leaves the process's fp32 precision flags (TF32 for cuBLAS/cuDNN, oneDNN's matmul
precision, torch.get_float32_matmul_precision) exactly as the caller had them after a build, a call, a save and
a load; while it compiles and runs, the flags its header records are in force."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive.engine.backends import inductor
from overdrive.engine.backends.inductor import Runner
from overdrive.engine.fp32_flags import fp32_flags, precision_flags

B = torch.backends
# torch's fp32_precision slots (backend, op), named by their public attribute (torch.backends.<name>.fp32_precision;
# "backends" is torch.backends.fp32_precision); a slot set to "none" inherits its parent's value
SLOTS = {"backends": ("generic", "all"), "cudnn": ("cuda", "all"), "cuda.matmul": ("cuda", "matmul"),
         "cudnn.conv": ("cuda", "conv"), "cudnn.rnn": ("cuda", "rnn"), "mkldnn": ("mkldnn", "all"),
         "mkldnn.matmul": ("mkldnn", "matmul"), "mkldnn.conv": ("mkldnn", "conv"), "mkldnn.rnn": ("mkldnn", "rnn")}
_PUBLIC = {"backends": B, "cudnn": B.cudnn, "cuda.matmul": B.cuda.matmul, "cudnn.conv": B.cudnn.conv,
           "cudnn.rnn": B.cudnn.rnn, "mkldnn": B.mkldnn, "mkldnn.matmul": B.mkldnn.matmul, "mkldnn.conv": B.mkldnn.conv,
           "mkldnn.rnn": B.mkldnn.rnn}


def flags() -> dict[str, Any]:
    """Every precision flag a user can read, the legacy ones included (they raise when the user mixes the APIs)."""
    out: dict[str, Any] = {name: obj.fp32_precision for name, obj in _PUBLIC.items()}
    for name, get in (("matmul.allow_tf32", lambda: B.cuda.matmul.allow_tf32),
                      ("cudnn.allow_tf32", lambda: B.cudnn.allow_tf32),
                      ("float32_matmul_precision", torch.get_float32_matmul_precision)):
        try:
            out[name] = get()
        except RuntimeError as exc:  # a state torch calls a mix of the legacy and new APIs
            out[name] = f"raises: {str(exc)[:60]}"
    return out


def links() -> dict[str, bool]:
    """For each slot, whether it reads through to its parent (it is "none"): each parent is set to "ieee" and then
    "tf32" through torch's (backend, op) setter (torch 2.13's torch.backends.mkldnn.fp32_precision setter writes the
    generic slot), and put back: the backend-wide slots go first, so their own "none" is known when they are."""
    get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    out: dict[str, bool] = {}
    for name in ("cudnn", "mkldnn", *(k for k in SLOTS if "." in k)):
        slot = SLOTS[name]
        parent = ("generic", "all") if slot[1] == "all" else (slot[0], "all")
        saved, seen = get(*parent), []
        for p in ("ieee", "tf32"):
            put(*parent, p)
            seen.append(get(*slot))
        inherited = slot[1] != "all" and out["cudnn" if slot[0] == "cuda" else "mkldnn"]  # the parent's own "none"
        put(*parent, "none" if inherited else saved)
        out[name] = seen == ["ieee", "tf32"]
    return out


def reset() -> None:
    """torch's defaults: 'highest' matmuls, cuDNN TF32 on, every other slot inheriting."""
    torch.set_float32_matmul_precision("highest")
    B.cudnn.allow_tf32 = True
    for name in ("backends", "cudnn", "cuda.matmul", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn"):
        torch._C._set_fp32_precision_setter(*SLOTS[name], "none")  # (torch 2.13's mkldnn setter writes "generic")


@pytest.fixture
def unusual() -> Iterator[dict[str, Any]]:
    """Flags nobody's defaults give: 'medium' matmuls (cuBLAS TF32, oneDNN bf16) and cuDNN TF32 off; reset after."""
    torch.set_float32_matmul_precision("medium")
    B.cudnn.allow_tf32 = False
    state = flags()
    assert state["float32_matmul_precision"] == "medium" and state["matmul.allow_tf32"] is True
    assert state["cudnn.allow_tf32"] is False and state["mkldnn.matmul"] == "bf16"
    yield state
    reset()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16"])
def test_scope_sets_the_engine_flags_and_puts_the_callers_back(unusual: dict[str, Any], precision: str) -> None:
    want = fp32_flags(precision)
    with precision_flags(want):
        inside = flags()
    assert flags() == unusual
    tf32 = "ieee" if precision == "fp32" else "tf32"
    assert {k: inside[k] for k in want} == want == {"cuda.matmul": tf32, "cudnn.conv": tf32, "cudnn.rnn": tf32,
                                                   "mkldnn.matmul": "ieee", "mkldnn.conv": "ieee", "mkldnn.rnn": "ieee"}
    assert inside["cudnn"] == tf32 and inside["mkldnn"] == "ieee"  # the backend-wide values Inductor reads too
    # the legacy views agree with the new slots inside (torch raises at a matmul, in Inductor and export otherwise)
    assert inside["matmul.allow_tf32"] is inside["cudnn.allow_tf32"] is (tf32 == "tf32")
    assert inside["float32_matmul_precision"] == ("medium" if tf32 == "tf32" else "highest")  # 'medium' agrees


def test_scope_restores_on_an_exception(unusual: dict[str, Any]) -> None:
    with pytest.raises(ZeroDivisionError), precision_flags(fp32_flags("fp32")):
        1 / 0
    assert flags() == unusual


def test_scope_keeps_inherited_slots_inherited() -> None:
    """A user of the new API who set only backend-wide values: the slots that inherit ("none") stay so, and a later
    change of the backend-wide value still reaches them."""
    try:
        torch._C._set_fp32_precision_setter("cuda", "all", "tf32")  # torch.backends.cudnn.fp32_precision
        torch._C._set_fp32_precision_setter("mkldnn", "all", "bf16")
        for child in ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn"):
            _PUBLIC[child].fp32_precision = "none"
        before, linked = flags(), links()
        assert before["cuda.matmul"] == before["cudnn.conv"] == "tf32" and before["mkldnn.matmul"] == "bf16"
        assert linked == {"cudnn": False, "mkldnn": False, **{k: True for k in SLOTS if "." in k}}
        for precision in ("fp32", "tf32"):
            with precision_flags(fp32_flags(precision)):
                pass
            assert flags() == before and links() == linked
    finally:
        reset()


def test_scope_keeps_torchs_untouched_cudnn_defaults() -> None:
    """In a fresh process torch 2.13 holds cuDNN conv/rnn in an internal default (TF32 unless a backend-wide value is
    set) that no setter can put back. After a TF32 scope (fp16/bf16 engines too) a backend-wide value set later acts
    as in a process that ran none; an fp32 scope must move the legacy cuDNN flag, whose setter overwrites that
    default: conv/rnn still read as before."""
    code = ("import torch\n"
            "from overdrive.engine.fp32_flags import fp32_flags, precision_flags\n"
            "B = torch.backends.cudnn\n"
            "read = lambda: (B.conv.fp32_precision, B.rnn.fp32_precision)\n"
            "before = read(), B.allow_tf32\n"
            "if SCOPE:\n"
            "    with precision_flags(fp32_flags(SCOPE)):\n"
            "        pass\n"
            "after = read(), B.allow_tf32\n"
            "B.fp32_precision = 'ieee'\n"
            "print(before == after, *read())\n")
    runs = {p: subprocess.run([sys.executable, "-c", code.replace("SCOPE", repr(p))], capture_output=True, text=True,
                              check=True).stdout.split() for p in ("", "tf32", "fp32")}
    assert runs["tf32"] == runs[""] and runs[""][0] == "True"
    assert runs["fp32"][0] == "True"


def test_runner_call_runs_under_the_header_flags(unusual: dict[str, Any]) -> None:
    seen: list[dict[str, Any]] = []
    runner = Runner(lambda x: (seen.append(flags()), x)[1], fp32_flags("tf32"), "default", "test")
    assert torch.equal(runner(torch.ones(2))[0], torch.ones(2))
    assert seen[0]["cuda.matmul"] == "tf32" and seen[0]["mkldnn.matmul"] == "ieee"
    assert flags() == unusual


_TRACED: list[str] = []


class _Probe(torch.nn.Module):
    """A tiny MLP that notes the flags in force while torch.export traces it (Python runs during the trace)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _TRACED.append(torch.backends.cuda.matmul.fp32_precision)  # a module global: the build deep-copies the model
        return self.net(x)


@pytest.mark.slow
@pytest.mark.parametrize("precision,aot", [("fp32", None), ("tf32", False)])
def test_build_call_save_load_leave_the_flags_alone(unusual: dict[str, Any], tmp_path: Path, precision: str,
                                                    aot: bool | None) -> None:
    """fp32 through the default CPU path (an AOTInductor package where it loads), tf32 through torch.compile
    (compiled at the first call, from the stored cache at load): both must leave the caller's flags as they were."""
    model = _Probe().eval()
    _TRACED.clear()
    eng = Builder(precision=precision, device="cpu", backend="inductor", aot=aot,
                  profiles=[ShapeProfile.fixed("x", (2, 8))]).build(model, (torch.randn(2, 8),))
    assert flags() == unusual, "after build"
    want = fp32_flags(precision)
    assert eng.header["backend_meta"]["fp32_precision"] == want
    # the engine's flags, not the caller's, at export; the build's accuracy check runs the model as its reference in
    # IEEE fp32 (a reference under the caller's TF32 flags is no fp32 reference)
    assert set(_TRACED) <= {want["cuda.matmul"], "ieee"} and want["cuda.matmul"] in _TRACED
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model.net.double()(x.double()).float()  # fp64: the caller's bf16 oneDNN matmuls do not reach it
    torch.testing.assert_close(eng(x), ref, atol=1e-5, rtol=1e-5)
    assert flags() == unusual, "after a call"
    path = tmp_path / "m.engine"
    eng.save(path)
    assert flags() == unusual, "after save"
    loaded = Engine.load(path)
    assert flags() == unusual, "after load"
    assert loaded.header["backend_meta"]["fp32_precision"] == want
    torch.testing.assert_close(loaded(x), ref, atol=1e-5, rtol=1e-5)
    assert flags() == unusual, "after a call of the loaded engine"


def test_load_applies_the_header_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded runner takes its flags from the header (engines from before the field: from the precision)."""
    made: list[dict[str, str]] = []
    monkeypatch.setattr(inductor, "_load_aoti", lambda package, fp32: made.append(fp32) or "runner")
    monkeypatch.setattr(inductor, "aoti_works", lambda: True)
    mine = fp32_flags("tf32")  # not what precision "fp32" gives: the header wins
    cpu = torch.device("cpu")
    inductor.load({"aoti_package": b""}, {"precision": "fp32", "backend_meta": {"fp32_precision": mine}}, cpu, trusted=True)
    inductor.load({"aoti_package": b""}, {"precision": "bf16", "backend_meta": {}}, cpu, trusted=True)
    assert made == [mine, fp32_flags("bf16")]


def test_bad_header_flags_are_refused() -> None:
    with pytest.raises(UsageError, match="cuda.matmul.*'fast'"):
        inductor.load({"aoti_package": b""}, {"precision": "fp32", "backend_meta": {
            "fp32_precision": {**fp32_flags("fp32"), "cuda.matmul": "fast"}}}, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_engines_leave_the_flags_alone(unusual: dict[str, Any], tmp_path: Path, precision: str) -> None:
    """CUDA builds (torch.compile, CUDA graphs) under the caller's 'medium' (TF32) flags: the fp32 engine still runs
    IEEE fp32 (TF32 would be off by ~1e-3 of the scale), and the flags are the caller's after every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 14 * 14, 64)).eval()
    eng = Builder(precision=precision, device="cuda", backend="inductor",
                  profiles=[ShapeProfile.fixed("x", (8, 3, 16, 16))]).build(model)
    assert flags() == unusual, "after build"
    assert eng.header["backend_meta"]["fp32_precision"] == fp32_flags(precision)
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        ref = model.double()(x.double()).float()  # fp64: no precision flag reaches it
    tol = {"fp32": 1e-4, "fp16": 2e-2}[precision] * ref.abs().max().item()
    assert (eng(x).cpu() - ref).abs().max().item() <= tol
    assert flags() == unusual, "after a call"
    eng.save(tmp_path / "e.engine")
    loaded = Engine.load(tmp_path / "e.engine")
    assert flags() == unusual, "after load"
    assert (loaded(x).cpu() - ref).abs().max().item() <= tol
    assert flags() == unusual, "after a call of the loaded engine"
