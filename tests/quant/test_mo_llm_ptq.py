"""ModelOpt's LLM PTQ workflow (hf_ptq.py) on tiny Hugging Face decoders with only the import changed: a
weight-only model made real keeps the fake-quant outputs in int8 storage, and ``save_pretrained`` under
``mto.enable_huggingface_checkpointing()`` writes a weights file whose keys are the float model's."""

from __future__ import annotations

import copy

import pytest
import torch

import overdrive.quant.modelopt as mtq
import overdrive.quant.modelopt.opt as mto
from overdrive import quant
from overdrive.quant.weight_only import WeightOnlyLinear

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)  # GQA: 2 key/value heads for 4 query heads
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)  # Conv1D projections, weights (in, out)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"llama": _llama, "gpt2": _gpt2}
_G = torch.Generator().manual_seed(1)
BATCHES = [{"input_ids": torch.randint(0, 128, (2, 12), generator=_G),
            "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(3)]


def _forward_loop(model: torch.nn.Module) -> None:
    for batch in BATCHES:
        model(**batch)


def _quantize(make, preset: str) -> torch.nn.Module:  # noqa: ANN001
    cfg = copy.deepcopy(getattr(mtq, preset))
    cfg["quant_cfg"]["*lm_head*"] = {"enable": False}  # hf_ptq.py's edit
    return mtq.quantize(make(), cfg, _forward_loop)


def _nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("arch", list(MODELS))
def test_to_real_stores_weight_only_int8_and_keeps_the_fake_quant_outputs(arch: str) -> None:
    """Before: ``quant.to_real`` (what ``mtq.compress`` points to) of an ``INT8_WEIGHT_ONLY_CFG`` model put every
    layer back to float ("quantizers disabled"): float outputs (max diff 0.01 to the fake-quant logits) and no
    memory saved. Now each becomes an int8 ``WeightOnlyLinear`` with the fake quantization's codes and scales."""
    model = _quantize(MODELS[arch], "INT8_WEIGHT_ONLY_CFG")
    before = _nbytes(model)
    with torch.no_grad():
        fake = model(**BATCHES[0]).logits
        fake_tokens = model.generate(BATCHES[1]["input_ids"][:1, :6], max_new_tokens=8, do_sample=False)
    # independent: each layer's weight fake-quantized by hand, per output channel, amax = max |w| over the row
    layer = model.model.layers[0].mlp.down_proj if arch == "llama" else model.transformer.h[0].mlp.c_proj
    w = layer.weight.detach() if arch == "llama" else layer.weight.detach().t()  # (N, K)
    s = w.abs().amax(dim=1, keepdim=True) / 127
    by_hand = torch.clamp(torch.round(w / s), -128, 127) * s

    real = quant.to_real(model)
    converted = [n for n, why in real._overdrive_real.items() if why == "int8 weight-only"]
    assert len(converted) == (14 if arch == "llama" else 8)
    new = real.model.layers[0].mlp.down_proj if arch == "llama" else real.transformer.h[0].mlp.c_proj
    assert isinstance(new, WeightOnlyLinear) and new.q.dtype == torch.int8
    torch.testing.assert_close(new.weight, by_hand, rtol=0, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(real(**BATCHES[0]).logits, fake, rtol=0, atol=1e-5)
        assert torch.equal(real.generate(BATCHES[1]["input_ids"][:1, :6], max_new_tokens=8, do_sample=False),
                           fake_tokens)
    assert _nbytes(real) < 0.5 * before  # fp32 projections -> int8 codes + one fp32 scale per row


@pytest.mark.parametrize("preset", ["INT8_SMOOTHQUANT_CFG", "INT8_WEIGHT_ONLY_CFG"])
def test_save_pretrained_writes_the_float_keys_and_loads_back_quantized(preset: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Before: the quantizers' amax / pre_quant_scale went into model.safetensors as well as modelopt_state.pth, so
    every ``from_pretrained`` of the folder reported them all as UNEXPECTED keys ("not ok if you expect identical
    arch"). Now the weights file holds exactly the float model's keys and the round trip is exact."""
    from safetensors import safe_open

    base = transformers.PreTrainedModel
    for attr in ("save_pretrained", "from_pretrained"):  # put transformers back as it was after this test
        monkeypatch.setattr(base, attr, base.__dict__[attr])
    monkeypatch.setattr(base, "_overdrive_modelopt_checkpointing", False, raising=False)
    mto.enable_huggingface_checkpointing()

    float_keys = set(_llama().state_dict())
    model = _quantize(_llama, preset)
    model.save_pretrained(tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert saved <= float_keys and not any("quantizer" in k for k in saved)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert mtq.utils.is_quantized(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits, rtol=0, atol=0)
