"""``quant.dynamic_int8``: Linear layers as int8 GEMMs (``torch._int_mm``) with per-token activation scales computed
at run time, no calibration. Reference: the float64 Linear; error measure: SQNR per row."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive.quant.real import Int8Linear


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(M,) signal-to-quantization-noise ratio of each row, in dB."""
    err = (out.double() - ref).pow(2).sum(-1)
    return 10 * torch.log10(ref.pow(2).sum(-1) / err.clamp_min(1e-300))


def test_each_row_gets_its_own_scale() -> None:
    """A row 1000x larger than the others leaves their precision alone (one per-tensor scale would zero them)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(6, 64)
    x[2] *= 1000.0
    ref = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    out = Int8Linear.dynamic(lin)(x)
    assert out.dtype == torch.float32 and out.shape == (6, 48)
    assert (_sqnr_db(ref, out) > 30).all(), _sqnr_db(ref, out)  # int8 x int8: about 35-40 dB on every row


def test_dynamic_int8_swaps_linears_and_keeps_the_rest() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))
    x = torch.randn(3, 5, 32)  # (B, T, C): rows are tokens
    with torch.no_grad():
        ref = model.double()(x.double())
    q = quant.dynamic_int8(copy.deepcopy(model).float(), exclude=["2"])
    assert isinstance(q[0], Int8Linear) and q[0].rowwise and type(q[2]) is nn.Linear
    assert q._overdrive_real == {"0": "int8 dynamic (per-token)"}
    with torch.no_grad():
        out = q(x)
    assert (_sqnr_db(ref.reshape(-1, 16), out.reshape(-1, 16)) > 25).all()
    assert q[0].w_q.dtype == torch.int8 and q[0].w_scale.shape == (64,)  # per output channel


def test_to_real_int8_keeps_its_static_scale_when_rowwise_is_asked() -> None:
    """``rowwise`` is fp8's switch in to_real: an int8 model stays per-tensor (static), as documented."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    x = torch.randn(8, 16)
    calibrated = quant.quantize(model, quant.INT8_DEFAULT, lambda m: m(x))
    real = quant.to_real(copy.deepcopy(calibrated), rowwise=True)
    assert isinstance(real[0], Int8Linear) and not real[0].rowwise


@pytest.mark.parametrize("shape", [(1, 8), (5, 24), (2, 3, 40)])
def test_odd_shapes_run_on_cpu(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(shape[-1], 7)
    x = torch.randn(*shape)
    out = Int8Linear.dynamic(lin)(x)
    ref = lin.double()(x.double())
    assert out.shape == ref.shape and (_sqnr_db(ref.reshape(-1, 7), out.reshape(-1, 7)) > 25).all()
