"""weight_only and to_real on Hugging Face layouts: GPT-2's Conv1D (weight stored (in, out)) gets weight-only int8 /
int4 like nn.Linear, and the converted layers keep a ``weight`` (T5's feed-forward reads ``wo.weight.dtype``).

References: a hand-written group-wise round-to-nearest of the transposed Conv1D weight (exact to 1e-6), the fp32
model (weight-only: last-hidden-state cosine >= 0.999 int8, >= 0.98 int4; 0.99997 / 0.997 seen on GPT-2) and the
fake-quant model for to_real (max error <= 1% of the output range; 0 seen on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError

tf = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2Model(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)).eval()


def _t5() -> nn.Module:
    torch.manual_seed(0)
    return tf.T5EncoderModel(tf.T5Config(num_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                                         vocab_size=128)).eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("bits, bound", [(8, 0.999), (4, 0.98)])
def test_weight_only_converts_gpt2_conv1d(bits: int, bound: float) -> None:
    model = _gpt2()
    ids = _ids(0)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    conv = model.h[0].mlp.c_fc
    w = conv.weight.detach().t().reshape(conv.nf, -1, 16)  # (out, in / 16, 16)
    qmax = 127 if bits == 8 else 7
    s = w.abs().amax(-1, keepdim=True) / qmax
    ref_w = (torch.clamp(torch.round(w / s), -qmax - (bits == 4), qmax) * s).reshape(conv.nf, conv.nx)
    q = quant.weight_only(model, bits=bits, group_size=16, min_features=0)
    layers = [m for m in q.modules() if isinstance(m, quant.WeightOnlyLinear)]
    assert len(layers) == 8 and not any(isinstance(m, Conv1D) for m in q.modules())  # 4 Conv1D per block
    torch.testing.assert_close(q.h[0].mlp.c_fc.dequantized_weight(torch.float32), ref_w, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert _cosine(q(input_ids=ids).last_hidden_state, ref) >= bound


def test_weight_only_with_nothing_to_convert_says_why() -> None:
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 8))
    with pytest.raises(UsageError, match=r"no layer.*0: 20x64 < min_features=256"):
        quant.weight_only(model)
    with pytest.raises(UsageError, match="in_features=20 not divisible by group_size=16"):
        quant.weight_only(nn.Sequential(nn.Linear(20, 64)), group_size=16, min_features=0)


def test_t5_runs_after_to_real_and_weight_only() -> None:
    ids = _ids(1)
    fq = quant.quantize(_t5(), quant.INT8_DEFAULT, forward_loop=lambda m: m(input_ids=_ids(2)))
    with torch.no_grad():
        fake = fq(input_ids=ids).last_hidden_state
        real = quant.to_real(fq)
        out = real(input_ids=ids).last_hidden_state
    wo = real.encoder.block[0].layer[1].DenseReluDense.wo
    assert isinstance(wo, quant.Int8Linear) and wo.weight.dtype == torch.float32
    assert wo.weight.shape == (64, 128)
    assert float((out - fake).abs().max() / (fake.max() - fake.min())) <= 0.01
    float_model = _t5()
    with torch.no_grad():
        ref = float_model(input_ids=ids).last_hidden_state
        wq = quant.weight_only(float_model, bits=8, group_size=16, min_features=0)
        assert _cosine(wq(input_ids=ids).last_hidden_state, ref) >= 0.999
    assert wq.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
