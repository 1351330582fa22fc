"""``mpirun -np 2 python train.py`` (no torchrun: the rank and size are in OMPI_COMM_WORLD_RANK / _SIZE, or PMI_RANK /
PMI_SIZE under MPICH and Intel MPI): ``init()`` joins one group of 2. Without reading them every process joined a
group of one and trained alone, silently, each writing the same checkpoint files. Two plain processes stand in for
mpirun's (no MPI here)."""

from __future__ import annotations

import os

import pytest

from overdrive._utils.errors import UsageError
from overdrive.distributed import parallel

from ._ranks import SRC, run_ranks



_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_USE_AGENT_STORE", *[v for trio in parallel.MPI_RANK_VARS for v in trio[:2]])


@pytest.mark.parametrize("rank_var,size_var", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                               ("PMI_RANK", "PMI_SIZE")])
def test_processes_started_by_mpirun_join_one_group(rank_var: str, size_var: str) -> None:
    base = {k: v for k, v in os.environ.items() if k not in _TORCHRUN}
    base.update(PYTHONPATH=str(SRC), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(parallel.free_port()),
                **{size_var: "2"})
    outs = run_ranks([{**base, rank_var: str(r)} for r in range(2)])
    assert sorted(o["rank"] for o in outs) == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 3.0 for o in outs), outs  # 1 + 2: one group, not two of one


def test_mpirun_without_a_master_port_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _TORCHRUN:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    with pytest.raises(UsageError, match=r"mpirun \(Open MPI\) started 4 processes, but MASTER_PORT is unset"):
        parallel.init(device="cpu")


def test_torchrun_variables_win_over_mpi_ones() -> None:
    env, who = parallel.rank_env({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "3",
                                  "OMPI_COMM_WORLD_SIZE": "8"})  # torchrun started under mpirun: torchrun's ranks
    assert (env["RANK"], env["WORLD_SIZE"], who) == ("0", "1", None)
    assert parallel.rank_env({"PMI_RANK": "0", "PMI_SIZE": "1"})[1] is None  # a job of one: a group of one, as before
