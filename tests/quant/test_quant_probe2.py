"""ModelOpt-style user scripts against overdrive.quant: SmoothQuant's fidelity record, hand-placed quantizers
under mtq.quantize, and ``quantizer.num_bits = ...`` as ModelOpt scripts write it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq
from overdrive import quant
from overdrive._utils.errors import UsageError
from overdrive.quant.modelopt.nn import TensorQuantizer


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("preset", ["int8", "int8_smoothquant", "int8_dynamic", "int8_dynamic_smoothquant"])
def test_fidelity_counts_each_calibration_batch_once(preset: str) -> None:
    """SmoothQuant runs the forward loop twice (statistics, then calibration): the fidelity record keeps the inputs
    of one pass, so 2 batches are reported as 2 (not 4) and measured on 2 distinct inputs."""
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    calls = []
    q = quant.quantize(_mlp(), quant.PRESETS[preset], forward_loop=lambda m: [calls.append(1) or m(x) for x in xs])
    record = quant.summary(q)["fidelity"]
    assert record["batches"] == 2
    assert len(calls) == (4 if "smoothquant" in preset and "dynamic" not in preset else 2)


def test_smoothquant_fidelity_matches_a_direct_measurement() -> None:
    """The reported cosine is that of the quantized model against itself with quantizers off on the 2 batches."""
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    q = quant.quantize(_mlp(), quant.PRESETS["int8_smoothquant"], forward_loop=lambda m: [m(x) for x in xs])
    record = quant.summary(q)["fidelity"]
    with torch.no_grad():
        outs = torch.cat([q(x) for x in xs])
        with mtq.set_quantizer_by_cfg_context(q, [{"quantizer_name": "*", "enable": False}]):
            refs = torch.cat([q(x) for x in xs])
    cos = torch.nn.functional.cosine_similarity(outs.double(), refs.double(), dim=-1).mean()
    assert record["cosine"] == pytest.approx(float(cos), abs=1e-5)


class _HandAttention(nn.Module):
    """Quantizers around the attention matmuls written into the model's own code (pytorch-quantization habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.q_bmm_quantizer = TensorQuantizer()
        self.k_bmm_quantizer = TensorQuantizer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return (self.q_bmm_quantizer(q) @ self.k_bmm_quantizer(k).transpose(-1, -2)).softmax(-1) @ v


def test_mtq_quantize_on_hand_placed_quantizers_names_the_real_cause() -> None:
    """ModelOpt refuses a model with quantizers too ('Model must not be quantized!'); the message names the
    quantizers found and does not claim an earlier mtq.quantize placed them."""
    with pytest.raises(UsageError, match="built by hand .q_bmm_quantizer, k_bmm_quantizer") as info:
        mtq.quantize(_HandAttention(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 4, 8)))
    assert "earlier" not in str(info.value) and "mtq.register" in str(info.value)
    done = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 8)))
    with pytest.raises(UsageError, match=r"quantizers \(0.input_quantizer, 0.weight_quantizer, .*\) from an earlier"):
        mtq.quantize(done, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 8)))


def test_hand_placed_quantizers_follow_the_messages_second_route() -> None:
    """What the message offers for hand-placed quantizers works: set_quantizer_by_cfg, then mtq.calibrate."""
    m = _HandAttention()
    mtq.set_quantizer_by_cfg(m, [{"quantizer_name": "*bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}}])
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    mtq.calibrate(m, "max", lambda mm: mm(x))
    with torch.no_grad():
        q, k, _ = m.qkv(x).chunk(3, -1)
    assert float(m.q_bmm_quantizer.amax) == pytest.approx(float(q.abs().max()))
    assert float(m.k_bmm_quantizer.amax) == pytest.approx(float(k.abs().max()))


def test_num_bits_setter_switches_format_and_keeps_amax() -> None:
    """``q.num_bits = (4, 3)`` (ModelOpt scripts' direct write): fp8 e4m3 with the same amax, the output equal to a
    quantizer built fp8 from the start; ``= 8`` back to int8."""
    m = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda mm: mm(torch.randn(32, 8)))
    ref = copy.deepcopy(m)
    mtq.set_quantizer_attribute(ref, "*", {"num_bits": (4, 3)})
    for src, dst in zip(quant.api.quantizers(m), quant.api.quantizers(ref)):
        dst[1].amax = src[1].amax.clone()  # set_quantizer_attribute dropped it (a format change recalibrates)
    amax = m[0].input_quantizer.amax.clone()
    for _, q in m.named_modules():
        if isinstance(q, TensorQuantizer):
            q.num_bits = (4, 3)
    assert m[0].input_quantizer.num_bits == (4, 3) and m[2].weight_quantizer.config.format == "fp8_e4m3"
    assert torch.equal(m[0].input_quantizer.amax, amax)
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    m[0].input_quantizer.num_bits = 8
    assert m[0].input_quantizer.num_bits == 8 and m[0].input_quantizer.maxbound == 127


@pytest.mark.parametrize("bad", [4, (5, 2), True, "int8", 8.5])
def test_num_bits_setter_refuses_other_formats(bad: object) -> None:
    q = TensorQuantizer()
    with pytest.raises(UsageError, match=r"num_bits = .* is not supported; use 8 \(int8\) or \(4, 3\)"):
        q.num_bits = bad
    assert q.num_bits == 8


class _WithPooler(nn.Module):
    """A model whose forward skips one layer (a pooler kept for another task), as Hugging Face encoders have."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def test_mtq_quantize_leaves_an_unreached_layer_uncalibrated_with_a_warning() -> None:
    """ModelOpt's calibration skips a quantizer that saw no data; mtq.quantize does too, with a warning naming it and
    the quant_cfg entry that keeps it float, and the layers reached get the amax a full calibration gives them."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match=r"never reached 1 quantizer\(s\) \(pooler.input_quantizer\).*"
                                            r"'quantizer_name': 'pooler\.\*', 'enable': False"):
        m = mtq.quantize(_WithPooler(), mtq.INT8_DEFAULT_CFG, lambda mm: mm(x))
    assert m.pooler.input_quantizer.amax is None
    assert float(m.enc.input_quantizer.amax) == pytest.approx(float(x.abs().max()))
    with torch.no_grad():  # calibration observes the float network: the head sees relu(enc(x)) of the float model
        assert float(m.head.input_quantizer.amax) == pytest.approx(float(torch.relu(_WithPooler().enc(x)).abs().max()))
    with pytest.raises(UsageError, match="pooler.input_quantizer is not calibrated"):
        m.pooler(x)
    # the remedy the warning names: no warning, the pooler in float, the same outputs
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "pooler.*", "enable": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2 = mtq.quantize(_WithPooler(), cfg, lambda mm: mm(x))
    with torch.no_grad():
        assert torch.equal(m2(x), m(x))


def test_mtq_calibrate_keeps_an_unreached_quantizers_amax() -> None:
    """Recalibrating on data that skips a layer keeps that layer's earlier amax (ModelOpt: no data, no new amax)."""
    m = mtq.quantize(_WithPooler(), mtq.INT8_DEFAULT_CFG, lambda mm: [mm(torch.randn(4, 8)), mm.pooler(torch.ones(2, 8))])
    assert float(m.pooler.input_quantizer.amax) == 1.0
    with pytest.warns(RuntimeWarning, match="never reached 1 quantizer"):
        mtq.calibrate(m, "max", lambda mm: mm(torch.randn(4, 8)))
    assert float(m.pooler.input_quantizer.amax) == 1.0


def test_a_forward_loop_that_reaches_nothing_still_raises() -> None:
    with pytest.raises(UsageError, match="forward_loop never reached quantizer"):
        mtq.quantize(_WithPooler(), mtq.INT8_DEFAULT_CFG, lambda mm: None)
    with pytest.raises(UsageError, match=r"never reached quantizer\(s\) \['1.input_quantizer'\]"):
        quant.quantize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), quant.INT8_DEFAULT, lambda mm: mm[0](torch.ones(1, 8)))
