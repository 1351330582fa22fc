"""Inputs that are views (transposed, sliced, expanded): the binding reads them in its layout. An AOTInductor
engine read a non-contiguous input at the strides it was built for, so its outputs were wrong (0.003 off on a
small CNN, 1e21 on an expanded batch) with no error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.engine import Builder, BuildConfig

pytest.importorskip("onnxruntime")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()


def _views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"channels_last": torch.randn(4, 16, 16, 3, generator=g).permute(0, 3, 1, 2),
            "strided_rows": torch.randn(4, 3, 32, 16, generator=g)[:, :, ::2],
            "strided_cols": torch.randn(4, 3, 16, 32, generator=g)[..., ::2],
            "strided_batch": torch.randn(8, 3, 16, 16, generator=g)[::2],
            "expanded": torch.randn(1, 3, 16, 16, generator=g).expand(4, 3, 16, 16)}


@pytest.fixture(scope="module", params=["inductor", "onnxruntime"])
def engine_and_model(request: pytest.FixtureRequest) -> tuple:
    m = _cnn()
    return Builder(BuildConfig(device="cpu", backend=request.param)).build(m, (torch.randn(4, 3, 16, 16),)), m


@pytest.mark.parametrize("view", list(_views()))
def test_a_view_input_gives_the_contiguous_inputs_outputs(engine_and_model: tuple, view: str) -> None:
    """Reference: the fp32 module on the same values made contiguous; tolerance 1e-5 (fp32 engine)."""
    eng, m = engine_and_model
    x = _views()[view]
    assert not x.is_contiguous()
    with torch.no_grad():
        ref = m(x.contiguous())
    torch.testing.assert_close(eng(x), ref, atol=1e-5, rtol=1e-5)
