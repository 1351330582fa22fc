"""apex.parallel.SyncBatchNorm's arguments (``channel_last``, ``fuse_relu``, the residual ``z``) and
convert_syncbn_model, against torch's BatchNorm on one process (no process group: the local batch's statistics)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.apex.parallel import SyncBatchNorm, convert_syncbn_model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, 6, 3, generator=g), torch.randn(4, 5, 6, 3, generator=g)  # (N, H, W, C)


def test_channel_last_fuse_relu_and_z_match_batchnorm() -> None:
    x, z = _data()
    ref = nn.BatchNorm2d(3)
    bn = SyncBatchNorm(3, channel_last=True, fuse_relu=True)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        bn.weight.copy_(ref.weight)
    want = torch.relu(ref(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1) + z)
    torch.testing.assert_close(bn(x, z), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-6, atol=1e-7)
    bn.eval(); ref.eval()
    torch.testing.assert_close(bn(x), torch.relu(ref(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)), rtol=1e-5, atol=1e-6)


def test_channel_first_is_batchnorm_and_bad_z_is_named() -> None:
    x, _ = _data()
    x = x.permute(0, 3, 1, 2)
    torch.testing.assert_close(SyncBatchNorm(3)(x), nn.BatchNorm2d(3)(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(UsageError, match=r"shape \(2,\)"):
        SyncBatchNorm(3)(x, torch.zeros(2))


def test_convert_shares_parameters_and_takes_channel_last() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.BatchNorm1d(3)))
    old = net[1][0].eval()
    out = convert_syncbn_model(net, channel_last=True)
    bn = out[1][0]
    assert isinstance(bn, SyncBatchNorm) and bn.channel_last and not bn.training
    assert bn.weight is old.weight and bn.running_mean is old.running_mean
    x = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(1))  # (N, L, C): channels last
    torch.testing.assert_close(bn(x), old(x.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-6)


# --- CPU ranks of a gloo group: torch's SyncBatchNorm refused to run there, and torch's DDP refused the module ---

def _gloo_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 3, 4, 4, generator=g) * 2 + 1, torch.randn(8, 3, 4, 4, generator=g)  # (N, C, H, W), dy


def _gloo_rank(rank: int, world: int, store: str, out: str) -> None:
    """One rank: apex's DDP around a converted model, a training forward/backward on this rank's slice."""
    import torch.distributed as dist

    from overdrive.apex.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        x, dy = _gloo_data()
        n = x.shape[0] // world
        x = x[rank * n:(rank + 1) * n].clone().requires_grad_(True)
        bn = nn.BatchNorm2d(3, momentum=None)  # momentum=None: the cumulative average
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
            bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        model = DistributedDataParallel(convert_syncbn_model(nn.Sequential(bn)), delay_allreduce=True)
        y = model(x)
        (y * dy[rank * n:(rank + 1) * n]).sum().backward()
        sbn = model.module[0]
        torch.save({"y": y.detach(), "dx": x.grad, "dw": sbn.weight.grad, "db": sbn.bias.grad,
                    "mean": sbn.running_mean, "var": sbn.running_var}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_sync_batchnorm_and_ddp_on_cpu_gloo_ranks_match_the_full_batch(tmp_path, world: int) -> None:
    """A BatchNorm over the whole batch (float32) is the reference: each rank's output and input gradient are its
    slice of the reference's; DDP's averaged weight gradients are the reference's divided by the world size."""
    import torch.multiprocessing as mp

    if world == 1:
        _gloo_rank(0, 1, str(tmp_path / "store"), str(tmp_path))
    else:
        mp.start_processes(_gloo_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                           start_method="spawn")
    x, dy = _gloo_data()
    x.requires_grad_(True)
    ref = nn.BatchNorm2d(3, momentum=None)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        ref.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    y = ref(x)
    (y * dy).sum().backward()
    n = x.shape[0] // world
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        part = slice(r * n, (r + 1) * n)
        torch.testing.assert_close(got["y"], y[part].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["dx"], x.grad[part], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["dw"], ref.weight.grad / world, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["db"], ref.bias.grad / world, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["mean"], ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["var"], ref.running_var, rtol=1e-5, atol=1e-6)
