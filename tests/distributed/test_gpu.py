"""On one GPU: NCCL initializes under torchrun, the doctor's bandwidth test runs, a short DDP O2 bf16 run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from overdrive.distributed import LaunchConfig, doctor
from overdrive.distributed.launch import bandwidth, launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402
pytestmark = pytest.mark.gpu


def test_doctor_reports_gpu_nccl_and_topology() -> None:
    rep = doctor.diagnose()
    assert rep["versions"]["nccl"] and rep["gpus"] and rep["gpus"][0]["name"]
    assert rep["topology"] is None or "GPU0" in rep["topology"]


def test_nccl_bandwidth_one_gpu() -> None:
    bw = bandwidth(1, 1 << 20, 64 << 20, iters=10)
    assert bw["backend"] == "nccl" and bw["world_size"] == 1
    assert all(r["time_us"] > 0 and r["algbw_gbs"] > 0 for r in bw["rows"])
    assert all(r["busbw_gbs"] == 0 for r in bw["rows"])  # n = 1: nothing crosses a link


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_short_o2_bf16_run_with_restart_on_nccl(tmp_path: Path, strategy: str) -> None:
    args = ["--device", "cuda", "--strategy", strategy, "--opt-level", "O2", "--dtype", "bf16", "--steps", "6",
            "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.json")]
    rc = launch(LaunchConfig(nproc_per_node=1, max_restarts=0), str(HERE / "_resume_script.py"), args, env=worker_env(omp_threads=None))
    assert rc == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["steps"] == 6 and res["final_loss"] < 1.386 + 0.05  # starts near ln(4); must not diverge
    assert torch.isfinite(torch.tensor(res["param_sum"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_short_o2_bf16_fp8_run_with_restart_on_nccl(tmp_path: Path, strategy: str) -> None:
    """O2 bf16 + fp8 tensorwise (real fp8 GEMMs; under FSDP2 the weights all-gathered in fp8) trains, checkpoints
    and resumes on NCCL: the two 32-wide Linear layers whose dims are multiples of 16 (of 3) run in fp8; a batch of
    16 (fp8 GEMMs need a multiple of 16 tokens)."""
    from overdrive._utils.device import supports_fp8
    from overdrive.amp import fp8 as fp8_mod

    if not supports_fp8(torch.device("cuda")) or not fp8_mod.is_available():
        pytest.skip("needs compute capability 8.9+ and torchao")
    args = ["--device", "cuda", "--strategy", strategy, "--opt-level", "O2", "--dtype", "bf16", "--steps", "6",
            "--fp8", "tensorwise", "--batch", "16", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.json")]
    rc = launch(LaunchConfig(nproc_per_node=1, max_restarts=0), str(HERE / "_resume_script.py"), args,
                env=worker_env(omp_threads=None))
    assert rc == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["steps"] == 6 and res["fp8_layers"] == 2
    assert res["final_loss"] < 1.386 + 0.05  # starts near ln(4); must not diverge
