"""An engine served as a web server serves it: one Engine called from many threads, kept outputs, calls at every
shape of its profile, copies and pickles of it, its benchmark summary. Reference: the digits CNN in eval mode,
fp32, atol 1e-5."""

from __future__ import annotations

import copy
import json
import math
import pickle
import sys
import threading

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine
from overdrive.engine.backends.inductor import Runner
from overdrive.engine.fp32_flags import _SLOTS, _get_fp32, fp32_flags

from .conftest import DYN

ATOL = 1e-5


@pytest.fixture(scope="module")
def engine(digits_onnx: bytes) -> Engine:
    return Builder(backend="onnxruntime", device="cpu", profiles=DYN).build(digits_onnx)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, 1, 8, 8, generator=g) for b in range(1, 33)]  # every batch size of the profile


def test_threads_match_single_threaded_calls(engine: Engine, digits: torch.nn.Module) -> None:
    xs = _batches()
    single = [engine(x) for x in xs]
    with torch.no_grad():
        for x, y in zip(xs, single):
            torch.testing.assert_close(y, digits(x), atol=ATOL, rtol=ATOL)
    n = 4
    barrier, got = threading.Barrier(n), {}

    def serve(t: int) -> None:
        barrier.wait()
        for k in range(len(xs)):
            j = (k + 8 * t) % len(xs)  # each thread walks the shapes from another start
            got[t, j] = engine(xs[j])

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == n * len(xs)
    for (_, j), y in got.items():
        assert torch.equal(y, single[j])


def test_kept_output_survives_the_next_call(engine: Engine) -> None:
    x1, x2 = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    y1 = engine(x1)
    kept = y1.clone()
    engine(x2)
    assert torch.equal(y1, kept)


def test_inductor_runner_threads_keep_the_callers_flags() -> None:
    # a call sets the engine's fp32 flags and puts the caller's back; threads doing so at once must not leave the
    # engine's flags behind, nor run a call under the caller's (TF32 here)
    seen: list[str] = []
    w = torch.randn(256, 256)

    def program(x: torch.Tensor) -> torch.Tensor:
        seen.append(_get_fp32("mkldnn", "matmul"))
        y = x @ w  # releases the GIL: another thread's call runs meanwhile
        seen.append(_get_fp32("mkldnn", "matmul"))
        return y

    runner = Runner(program, fp32_flags("fp32"), "default", "test")
    was_precision, was_switch = torch.get_float32_matmul_precision(), sys.getswitchinterval()
    torch.set_float32_matmul_precision("high")
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so an unguarded interleaving shows
    try:
        caller = {s: _get_fp32(*s) for s in _SLOTS}
        n = 4
        barrier = threading.Barrier(n)

        def serve() -> None:
            barrier.wait()
            for _ in range(30):
                runner(torch.randn(128, 256))

        threads = [threading.Thread(target=serve) for _ in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        after = {s: _get_fp32(*s) for s in _SLOTS}
    finally:
        sys.setswitchinterval(was_switch)
        torch.set_float32_matmul_precision(was_precision)
    assert after == caller
    assert seen == ["ieee"] * len(seen) and len(seen) == 2 * n * 30


@pytest.mark.parametrize("batch", [1, 4, 17, 32])
def test_calls_across_the_profile(engine: Engine, digits: torch.nn.Module, batch: int) -> None:
    x = torch.randn(batch, 1, 8, 8)
    with torch.no_grad():
        ref = digits(x)
    torch.testing.assert_close(engine(x), ref, atol=ATOL, rtol=ATOL)
    with torch.inference_mode():
        torch.testing.assert_close(engine(x), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(engine(x.clone().requires_grad_()), ref, atol=ATOL, rtol=ATOL)
    wide = torch.randn(batch, 1, 8, 16)[..., ::2]  # a non-contiguous view
    with torch.no_grad():
        torch.testing.assert_close(engine(wide), digits(wide), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("shape", [(33, 1, 8, 8), (0, 1, 8, 8), (4, 1, 9, 8)])
def test_one_past_the_profile_names_input_shape_and_profile(engine: Engine, shape: tuple[int, ...]) -> None:
    with pytest.raises(UsageError, match=r"input 'x' has shape \(.*outside the engine's profile min \(1, 1, 8, 8\) "
                                          r"max \(32, 1, 8, 8\)"):
        engine(torch.randn(*shape))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_pickles_run_on_their_own(engine: Engine, how: str) -> None:
    twin = copy.deepcopy(engine) if how == "deepcopy" else pickle.loads(pickle.dumps(engine))
    assert twin.runner is not engine.runner
    assert twin.trust == engine.trust and twin.info["inputs"] == engine.info["inputs"]
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(twin(x), engine(x))


def test_benchmark_numbers_and_info(engine: Engine) -> None:
    s = engine.benchmark(iterations=20, duration_s=0.0, warmup_ms=0.0, percentiles=(50, 90, 99))
    for k in ("latency_ms", "compute_ms"):
        st = s[k]
        assert st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
        assert st["min"] <= st["median"] <= st["max"] and st["min"] <= st["mean"] <= st["max"]
    assert s["iterations"] >= 20 and s["batch"] == DYN[0].opt[0]
    assert math.isclose(s["throughput_samples_s"], s["throughput_qps"] * s["batch"])
    assert math.isclose(s["throughput_qps"], s["iterations"] / s["total_host_walltime_s"])
    # the wall time holds every timed call: throughput is at most batch / mean latency
    assert s["throughput_samples_s"] <= s["batch"] / (s["latency_ms"]["mean"] / 1e3) * (1 + 1e-9)
    json.dumps(engine.info)
    json.dumps(s)
