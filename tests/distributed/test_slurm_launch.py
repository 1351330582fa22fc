"""``srun -n 2 python train.py`` (no torchrun: the rank and size are the step's SLURM_PROCID / SLURM_STEP_NUM_TASKS):
``init()`` joins one group of 2, with the master address from the step's node list and a port both tasks derive from
the job id. Without reading them every task joined a group of one and trained alone. ``python train.py`` in the sbatch
batch script (SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step size) stays a group of one. Plain processes with
faked Slurm variables stand in for srun's tasks (no Slurm here)."""

from __future__ import annotations

import os
import socket

import pytest

from overdrive._utils.errors import UsageError
from overdrive.distributed import parallel, slurm

from ._ranks import SRC, run_ranks



_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_USE_AGENT_STORE", *[v for trio in parallel.MPI_RANK_VARS for v in trio[:2]])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("SLURM", "SLURMD"))}
    env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return env


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run(envs: list[dict[str, str]]) -> list[dict[str, float]]:
    return run_ranks(envs)


@pytest.mark.parametrize("expr,hosts", [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("node-[0009-0010].ib", ["node-0009.ib", "node-0010.ib"]),
    ("localhost", ["localhost"]),
])
def test_hostlist_expands_like_scontrol(expr: str, hosts: list[str]) -> None:
    assert slurm.expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["gpu[01-04", "gpu01]", "gpu[4-1]", "gpu[a-b]", "gpu[[1]]", ""])
def test_unreadable_hostlist_is_named(expr: str) -> None:
    with pytest.raises(UsageError, match=r"Slurm host list .* export MASTER_ADDR"):
        slurm.expand_hostlist(expr)


def _step(procid: int, ntasks: int = 2, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid),
            "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_JOB_NODELIST": "gpu[03,07-08]", **extra}


def test_srun_step_gives_rank_world_and_master() -> None:
    env, who = parallel.rank_env(_step(1, 4))
    assert (env["RANK"], env["WORLD_SIZE"], who) == ("1", "4", "srun (Slurm)")
    assert env["MASTER_ADDR"] == "gpu07"  # the step's first node, not the job's
    assert env["MASTER_PORT"] == str(15000 + 15 * 456)
    assert parallel.rank_env(_step(1, 4, SLURM_STEP_RESV_PORTS="31000-31001"))[0]["MASTER_PORT"] == "31000"
    mine = parallel.rank_env(_step(0, 4, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))[0]  # exported: kept
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.1", "29500")


@pytest.mark.parametrize("env", [
    # the sbatch batch script: the job's task count, SLURM_PROCID=0, no step size
    {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]"},
    # the batch step where a Slurm sets a step id and size for it
    {**_step(0, 2), "SLURM_STEP_ID": str(0xFFFFFFFB)},
    # `srun -n 1 python train.py`, or an `srun --pty bash` shell
    _step(0, 1),
])
def test_batch_script_and_one_task_steps_stay_a_group_of_one(env: dict[str, str]) -> None:
    assert parallel.rank_env(env) == (env, None)


def test_torchrun_and_mpirun_under_slurm_win_over_the_step() -> None:
    # srun --ntasks-per-node 1 torchrun ...: the srun step has one task per node, torchrun's ranks are the ranks
    env, who = parallel.rank_env({**_step(1, 2), "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"})
    assert (env["RANK"], env["WORLD_SIZE"], who) == ("5", "16", None)
    # mpirun in an allocation starts its daemons with srun, one per node: the processes carry that step's variables
    env, who = parallel.rank_env({**_step(1, 2), "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "16"})
    assert (env["RANK"], env["WORLD_SIZE"], who) == ("6", "16", "mpirun (Open MPI)")


def test_tasks_started_by_srun_join_one_group() -> None:
    job = next(j for j in range(100000, 101000) if _free(slurm.default_port({"SLURM_JOB_ID": str(j)})))
    base = {**_clean_env(), "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost"}
    outs = _run([{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURMD_NODENAME": "localhost"}
                 for r in range(2)])
    assert sorted(o["rank"] for o in outs) == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 3.0 and o["local"] == o["rank"] for o in outs), outs  # 1 + 2: one group


def test_batch_script_runs_alone() -> None:
    # sbatch --ntasks 2 with `python train.py` in the script: one process, a group of one (it waited for a peer)
    env = {**_clean_env(), "SLURM_JOB_ID": "424242", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}
    (out,) = _run([env])
    assert (out["rank"], out["world"], out["sum"]) == (0, 1, 1.0)


def _fake_init(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for var in list(os.environ):
        if var in _LAUNCH_VARS or var.startswith("SLURM"):
            monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)


def test_srun_without_a_job_id_names_the_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _step(1, 4)
    del env["SLURM_JOB_ID"]
    _fake_init(monkeypatch, env)
    with pytest.raises(UsageError, match=r"srun \(Slurm\) started 4 processes, but MASTER_PORT is unset.*before srun"):
        parallel.init(device="cpu")


def test_task_0_off_the_first_node_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_init(monkeypatch, {**_step(0, 2), "SLURMD_NODENAME": "gpu08"})  # --distribution=arbitrary
    with pytest.raises(UsageError, match=r"task 0 on gpu08, not on the step's first node gpu07"):
        parallel.init(device="cpu")
