"""Hugging Face GPT-2's ``Conv1D`` (a Linear whose weight is stored (in, out)) is quantized like nn.Linear.

Reference: the fp32 model, and a hand-written fake quantization of one Conv1D (per-tensor input, weights per output
channel = axis 1 of the (in, out) weight, narrow range). A tiny GPT2Model from a config (2 layers, hidden 64,
random init, seed 0) on random token ids: after max calibration on 8 x 32 tokens its last hidden state keeps a
per-token cosine >= 0.999 to fp32 on other tokens (0.9998 seen).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from overdrive import quant

tf = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

N_LAYER = 2
COSINE_BOUND = 0.999


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2Model(tf.GPT2Config(n_embd=64, n_layer=N_LAYER, n_head=4, vocab_size=128, n_positions=64)).eval()


def _ids(seed: int, batch: int = 8, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _calibrated(model: nn.Module, config: quant.QuantConfig = quant.INT8_DEFAULT) -> nn.Module:
    calib = _ids(1)
    return quant.quantize(model, config, forward_loop=lambda m: m(input_ids=calib))


def test_every_conv1d_is_quantized_counted_and_close_to_fp32() -> None:
    fp32 = _gpt2()
    q = _calibrated(copy.deepcopy(fp32))
    conv = [n for n, m in q.named_modules() if isinstance(m, Conv1D)]
    assert len(conv) == 4 * N_LAYER  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    rows = {r.name: r for r in quant.summary(q)["layers"]}
    assert all(rows[n].kind == "QuantConv1D" and rows[n].enabled for n in conv)
    assert set(conv) <= set(quant.quantized_layers(q))
    for n in conv:
        m = q.get_submodule(n)
        assert m.weight_quantizer.axis == 1 and m.weight_quantizer.amax.shape == (m.nf,)
        torch.testing.assert_close(m.weight_quantizer.amax, m.weight.detach().abs().amax(dim=0))
    test = _ids(2)
    with torch.no_grad():
        ref, out = fp32(input_ids=test).last_hidden_state, q(input_ids=test).last_hidden_state
    cos = nn.functional.cosine_similarity(ref, out, dim=-1)  # (B, T): one per token
    assert float(cos.min()) >= COSINE_BOUND
    assert not torch.equal(ref, out)  # the projections really are fake-quantized


def test_quant_conv1d_matches_a_hand_written_fake_quantization() -> None:
    torch.manual_seed(0)
    layer = Conv1D(24, 16)  # nf=24 out, nx=16 in: weight (16, 24)
    x = torch.randn(3, 5, 16)
    q = quant.quantize(copy.deepcopy(layer), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    assert isinstance(q, Conv1D) and type(q).__name__ == "QuantConv1D"
    w = layer.weight.detach()
    w_scale = w.abs().amax(dim=0) / 127  # (24,): one per output channel
    w_q = torch.clamp(torch.round(w / w_scale), -127, 127) * w_scale
    x_scale = x.abs().max() / 127
    x_q = torch.clamp(torch.round(x / x_scale), -128, 127) * x_scale
    ref = (x_q.reshape(-1, 16) @ w_q + layer.bias.detach()).view(3, 5, 24)
    with torch.no_grad():
        torch.testing.assert_close(q(x), ref, atol=1e-6, rtol=1e-6)
    back = q.to_float()
    assert type(back) is Conv1D and back.weight is q.weight


def test_quantized_gpt2_pickles_by_reference_and_deep_copies() -> None:
    q = quant.quantize(Conv1D(8, 4), quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(2, 4)))
    again = pickle.loads(pickle.dumps(q))
    assert type(again) is type(q)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(again(x), q(x))
        torch.testing.assert_close(copy.deepcopy(q)(x), q(x))


def test_exclude_and_layer_types_apply_to_conv1d() -> None:
    # without "Conv1D" in layer_types a GPT2Model has nothing to quantize (and says so)
    q = _calibrated(_gpt2(), quant.INT8_DEFAULT.replace(exclude=("*.attn.*",), residual_add=False))
    s = quant.summary(q)
    assert [r.name for r in s["layers"]] == [f"h.{i}.mlp.{p}" for i in range(N_LAYER) for p in ("c_fc", "c_proj")]
    assert s["skipped"]["h.0.attn.c_attn"] == "excluded by pattern '*.attn.*'"
    with pytest.raises(Exception, match="no layer to quantize"):
        _calibrated(_gpt2(), quant.INT8_DEFAULT.replace(layer_types=("Linear",), residual_add=False))


def test_onnx_export_puts_per_output_channel_dq_on_the_gemm_weight(tmp_path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    q = _calibrated(_gpt2())
    ids, mask = _ids(3, batch=2, seq=8), torch.ones(2, 8, dtype=torch.long)
    path = quant.export_onnx(q, {"input_ids": ids, "attention_mask": mask}, tmp_path / "gpt2.onnx")
    g = onnx.load(str(path)).graph
    inits = {i.name for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    weight_dq = []  # DequantizeLinear feeding a Gemm / MatMul from a constant weight
    for n in g.node:
        if n.op_type in ("Gemm", "MatMul"):
            for inp in n.input:
                dq = producer.get(inp)
                if dq is not None and dq.op_type == "DequantizeLinear":
                    qn = producer.get(dq.input[0])
                    src = qn.input[0] if qn is not None else dq.input[0]
                    if src in inits or (producer.get(src) is not None and producer[src].op_type == "Constant"):
                        weight_dq.append({a.name: a.i for a in dq.attribute}.get("axis"))
    assert weight_dq == [1] * (4 * N_LAYER)  # every Conv1D weight: per channel along its output axis
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # (README: x86 without VNNI)
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    test = _ids(4, batch=3, seq=11)
    feeds = {"input_ids": test.numpy(), "attention_mask": np.ones((3, 11), dtype=np.int64)}
    got = sess.run(None, feeds)[0]
    with torch.no_grad():
        want = q(input_ids=test, attention_mask=torch.ones(3, 11, dtype=torch.long)).last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_modelopt_int8_config_quantizes_conv1d_like_the_native_preset() -> None:
    import overdrive.quant.modelopt as mtq

    calib = _ids(1)
    native = _calibrated(_gpt2(), quant.INT8_DEFAULT.replace(residual_add=False, weight=quant.QuantizerConfig(
        per_channel=True)))  # ModelOpt's weights: [-128, 127]
    ported = mtq.quantize(_gpt2(), mtq.INT8_DEFAULT_CFG, forward_loop=lambda m: m(input_ids=calib))
    a = dict(quant.quantizers(native))
    b = dict(quant.quantizers(ported))
    assert set(a) == set(b) and b["h.0.attn.c_attn.weight_quantizer"].axis == 1
    for name in a:
        torch.testing.assert_close(a[name].amax, b[name].amax)


def test_to_real_runs_conv1d_as_an_int8_gemm_on_the_cpu() -> None:
    q = _calibrated(_gpt2())
    test = _ids(2, batch=2, seq=16)
    with torch.no_grad():
        fake = q(input_ids=test).last_hidden_state
        real = quant.to_real(q)
        out = real(input_ids=test).last_hidden_state
    assert sum(v.startswith("int8") for v in real._overdrive_real.values()) == 4 * N_LAYER
    # the same int8 values; only the accumulation order differs (int32 GEMM then one fp32 rescale)
    assert float(nn.functional.cosine_similarity(fake, out, dim=-1).min()) >= 0.99999


def test_dynamic_int8_converts_conv1d_layers_like_linear() -> None:
    """quant.dynamic_int8 (the engine's per-token int8 on CPU) used to leave GPT-2's Conv1D float: it now converts
    each to an Int8Linear over the transposed weight, exactly what a Linear holding W.t() converts to, and the model
    keeps a per-token cosine >= 0.999 to fp32."""
    from overdrive.quant.real import Int8Linear, dynamic_int8

    model = _gpt2()
    ids = _ids(2)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    layer = copy.deepcopy(model.h[0].attn.c_attn)
    converted = dynamic_int8(copy.deepcopy(model))
    conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert conv and all(converted._overdrive_real.get(n) == "int8 dynamic (per-token)" for n in conv)
    assert not any(isinstance(m, Conv1D) for m in converted.modules())
    lin = nn.Linear(layer.nx, layer.nf)
    with torch.no_grad():
        lin.weight.copy_(layer.weight.t())
        lin.bias.copy_(layer.bias)
        x = torch.randn(5, layer.nx)
        torch.testing.assert_close(Int8Linear.dynamic(layer)(x), Int8Linear.dynamic(lin)(x), rtol=0, atol=0)
        out = converted(input_ids=ids).last_hidden_state
    cos = nn.functional.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    assert cos.min() >= COSINE_BOUND, cos.min()


def test_a_gpt2_body_counts_as_a_gemm_model_for_the_engines_auto_int8() -> None:
    """A GPT2Model has Conv1D projections and no nn.Linear: the engine's auto int8 mode (dynamic for GEMM-only models
    on CPU) used to take it for a model without GEMMs."""
    from overdrive.engine.int8 import gemm_model
    from overdrive.engine.sources import ModelSource

    model = _gpt2()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert gemm_model(ModelSource(module=model, input_names=["input_ids"]))
