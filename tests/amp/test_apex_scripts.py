"""apex.amp scripts with only the import changed (issue 20): each test is written as a user's script,
after apex's docs and the DeepLearningExamples BERT / ViT-pytorch / GAN training loops, and its numbers
are checked against the native ``overdrive.amp.prepare`` path at a stated tolerance. CPU, bf16."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive import amp
from tests.amp.conftest import Net, batch

BF16 = torch.bfloat16


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_save_whole_model_after_initialize(opt_level: str) -> None:
    # apex scripts end with torch.save(model, "model.pt"): the hooks on the model must pickle
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=BF16)
    x = torch.randn(4, 8)
    with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        # the same casts and autocast run in the loaded copy: bit-identical outputs (tolerance 0)
        assert torch.equal(loaded.eval()(x), model.eval()(x))
    loaded.load_state_dict(model.state_dict())  # its load hooks work, with no optimizer behind them
