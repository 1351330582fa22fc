"""Which GPU a rank takes: torchrun's LOCAL_RANK, else an MPI or Slurm launcher's local rank; a multi-rank CUDA job
with none of them was put on cuda:0 in every rank. CUDA is faked (no GPU here): the test stops at the process group."""

from __future__ import annotations

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.distributed import parallel


class _Stop(Exception):
    pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    devices: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append(torch.device(d)))

    def stop(**kwargs: object) -> None:
        raise _Stop

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", stop)
    monkeypatch.setattr(parallel.dist, "TCPStore", lambda *a, **k: object())
    monkeypatch.setattr(parallel.dist, "PrefixStore", lambda *a, **k: object())
    for var in ("LOCAL_RANK", *parallel.LOCAL_RANK_FALLBACKS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    return devices


def test_a_multi_rank_cuda_job_without_a_local_rank_is_refused(fake_cuda: list[torch.device]) -> None:
    with pytest.raises(UsageError, match="WORLD_SIZE=4 on CUDA but LOCAL_RANK is unset.*every rank would take cuda:0"):
        parallel.init()
    assert fake_cuda == []  # refused before any device was taken


@pytest.mark.parametrize("var", ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"])
def test_the_local_rank_comes_from_the_launcher(fake_cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch,
                                                var: str) -> None:
    monkeypatch.setenv(var, "3")
    with pytest.raises(_Stop):
        parallel.init()
    assert fake_cuda == [torch.device("cuda", 3)]


def test_a_cpu_job_needs_no_local_rank(fake_cuda: list[torch.device]) -> None:
    with pytest.raises(_Stop):
        parallel.init(device="cpu")
    assert fake_cuda == []


@pytest.mark.parametrize("var", ["SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"])
def test_a_launcher_that_gives_each_process_its_own_gpu(fake_cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch,
                                                        var: str) -> None:
    # `srun --gpus-per-task=1` (or an mpirun wrapper setting CUDA_VISIBLE_DEVICES per rank): task 3 of a node sees
    # one GPU, its own, as cuda:0; it had been refused with "LOCAL_RANK=3 but only 1 GPU(s) are visible"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv(var, "3")
    with pytest.raises(_Stop):
        parallel.init()
    assert fake_cuda == [torch.device("cuda", 0)]


def test_a_pod_per_rank_with_one_gpu_needs_no_local_rank(fake_cuda: list[torch.device],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a Kubernetes PyTorchJob running `python train.py` sets MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK only; each
    # pod has its GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(_Stop):
        parallel.init()
    assert fake_cuda == [torch.device("cuda", 0)]


def test_torchrun_local_rank_past_the_visible_gpus_is_still_refused(fake_cuda: list[torch.device],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun --nproc-per-node 2 on one GPU: a mistake, not a binding
    with pytest.raises(parallel.OverdriveError, match="LOCAL_RANK=1 but only 1 GPU"):
        parallel.init()
    assert fake_cuda == []
