"""Two gloo ranks under torchrun (via overdrive.distributed.launch): numerics against a
single-process full-batch reference, checkpoint N -> M ranks, and a rank killed mid-training."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from overdrive import distributed as odist
from overdrive.amp import Policy
from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch
from overdrive.train import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402

TOL = 1e-5  # fp32, sums in a different order than the single-process reference
TOL_BF16 = 3e-2  # bf16 weights / compute after 3 SGD steps with momentum


@pytest.fixture(scope="module")
def numerics(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("numerics")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_numerics_worker.py"), [str(out)], env=worker_env(), timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return json.loads((out / "results.json").read_text()), out


@pytest.mark.parametrize("key", ["ddp", "ddp_static", "ddp_accumulate2", "fsdp", "fsdp_accumulate2", "fsdp_grad_scale"])
def test_two_ranks_match_single_process_full_batch(numerics: tuple[dict, Path], key: str) -> None:
    res, _ = numerics
    assert res["world_size"] == 2
    assert res[key] < TOL, f"{key}: max |param - reference| = {res[key]}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp8_under_ddp_and_fsdp2_matches_one_process(numerics: tuple[dict, Path], strategy: str) -> None:
    """O2 bf16 + fp8 (emulated) on 2 ranks = one process stepping the ranks' halves as 2 micro-batches (each
    half's activations get their own fp8 scales, as on the ranks), one SGD step, fp32 masters compared within 2e-3
    (bf16 gradients reduced in another order). The one-process reference for FSDP2 is amp O1 + fp8: FSDP2 at O2
    keeps fp32 shards and computes in bf16, so fp8 casts the fp32 weights, as O1 does. fp8 itself moves the weights
    > 5e-3 from bf16 (so a run that silently dropped fp8 fails here)."""
    res, _ = numerics
    if "ddp_fp8" not in res:
        pytest.skip("needs torchao (pip install -e '.[fp8]')")
    assert res["fp8_ref_layers"] == res[f"{strategy}_fp8_layers"] == 3.0  # the three 16x16 block layers
    assert res[f"{strategy}_fp8"] < 2e-3, f"max |master - one-process fp8| = {res[f'{strategy}_fp8']}"
    assert res["fp8_vs_bf16"] > 5e-3, res["fp8_vs_bf16"]
    if strategy == "fsdp":
        assert res["fsdp_fp8_all_gather"] == 1.0  # tensorwise: the weights travel in fp8
        assert res["resume_fsdp_fp8"] == 0.0  # checkpoint after 2 steps + 1 more == 3 uninterrupted, bit for bit


def test_fsdp_really_shards(numerics: tuple[dict, Path]) -> None:
    assert numerics[0]["fsdp_is_sharded"] == 1.0


@pytest.mark.parametrize("key", ["ddp_o2_bf16", "fsdp_o2_bf16"])
def test_o2_bf16_close_to_fp32_reference(numerics: tuple[dict, Path], key: str) -> None:
    assert numerics[0][key] < TOL_BF16


@pytest.mark.parametrize("key", ["resume_ddp", "resume_fsdp"])
def test_checkpoint_resume_equals_uninterrupted(numerics: tuple[dict, Path], key: str) -> None:
    assert numerics[0][key] == 0.0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_from_two_ranks_loads_on_one(numerics: tuple[dict, Path], strategy: str) -> None:
    import _numerics_worker as w

    _, out = numerics
    env = odist.init(backend="gloo", device="cpu")  # a group of one, in this process
    try:
        assert env.world_size == 1
        torch.manual_seed(0)
        model = w.Net()
        policy = Policy(opt_level="O2", dtype=torch.bfloat16) if strategy == "ddp" else "O0"
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), policy=policy, progress=False, strategy=strategy)
        pos = odist.checkpoint.load(odist.checkpoint.latest(out / f"ckpt_{strategy}"), t)
        assert pos == {"consumed": 32, "epoch": 0} and t.step_count == 2
        if strategy == "fsdp":
            saved = torch.load(out / "fsdp_step2_params.pt")
            assert w.maxdiff(w.params(t.model), saved) == 0.0
        # One more step on one rank with the full batch equals the 2-rank uninterrupted run's third step.
        t.train_step(w.data(3, 16)[2])
        whole = torch.load(out / f"whole_{strategy}.pt")
        assert w.maxdiff(w.params(t.model), whole) < (TOL if strategy == "fsdp" else 1e-2)
        del t  # the DDP reducer goes before its process group: freed after it, gloo's teardown hung now and then
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_killed_rank_resumes_under_max_restarts(tmp_path: Path) -> None:
    import _resume_script as s

    args = ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "crash.json"), "--crash-at", "5", "--steps", "8"]
    rc = launch(LaunchConfig(nproc_per_node=2, max_restarts=1), str(HERE / "_resume_script.py"), args, env=worker_env(), timeout_s=600)
    assert rc == 0
    crashed = json.loads((tmp_path / "crash.json").read_text())
    assert crashed["restart"] == 1 and crashed["steps"] == 8 and crashed["world_size"] == 2
    # Reference: the same 8 steps uninterrupted in this process, one rank with the 2-rank global batch.
    s.main(["--ckpt", str(tmp_path / "ref_ckpt"), "--out", str(tmp_path / "ref.json"), "--steps", "8", "--batch", "16", "--save-every", "100"])
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert crashed["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5, abs=1e-6)
    assert crashed["param_sum"] == pytest.approx(ref["param_sum"], rel=1e-4, abs=1e-4)


PLAIN_SCRIPT = '''import json, os, sys
import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")  # plain torchrun idiom: env:// from torchrun's variables, no overdrive
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if rank == 1 and attempt == 0:
    os._exit(3)  # the first attempt dies on one rank
t = torch.ones(1)
dist.all_reduce(t)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"sum": t.item(), "attempt": attempt, "max": os.environ["TORCHELASTIC_MAX_RESTARTS"],
                   "argv0": os.path.basename(sys.argv[0]), "name": __name__}, f)
dist.barrier()
sys.stdout.flush()
os._exit(0)
'''


def test_plain_init_process_group_script_restarts(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A script that joins with a plain ``dist.init_process_group("gloo")`` restarts under max_restarts on one
    node: each attempt is a fresh torchrun (under torchrun's own restarts gloo re-read the dead attempt's
    addresses: "Connection refused"), and the ranks see the attempt in TORCHELASTIC_RESTART_COUNT as under torchrun."""
    script, out = tmp_path / "plain.py", tmp_path / "out.json"
    script.write_text(PLAIN_SCRIPT)
    rc = launch(LaunchConfig(nproc_per_node=2, max_restarts=2), str(script), [str(out)], env=worker_env(),
                timeout_s=300)
    assert rc == 0
    got = json.loads(out.read_text())
    assert got == {"sum": 2.0, "attempt": 1, "max": "2", "argv0": "plain.py", "name": "__main__"}
    assert "attempt 0 exited with code" in capfd.readouterr().err


def test_restarts_give_up_with_the_last_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import os\nos._exit(5)\n")
    assert launch(LaunchConfig(nproc_per_node=1, max_restarts=1), str(script), env=worker_env(), check=False,
                  timeout_s=300) != 0
