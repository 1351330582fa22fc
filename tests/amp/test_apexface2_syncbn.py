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
