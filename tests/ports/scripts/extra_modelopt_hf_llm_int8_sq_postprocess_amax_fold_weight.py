# source: NVIDIA ModelOpt LLM PTQ flow (examples/llm_ptq hf_ptq.py, the NeMo/Megatron quantizer, llm_eval's quantize_model): a Hugging Face causal LM, calib_dataloader of {"input_ids", "attention_mask"} batches, def calibrate_loop(model): model(**data), mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, forward_loop=calibrate_loop), mtq.postprocess_amax(model, "*input_quantizer", lambda amax: torch.clamp(amax, min=0.01 * maxbound)), mtq.print_quant_summary, mtq.set_quantizer_attribute(model, "*", {"enable": False}) / ("*input_quantizer", {"enable": True}) as in ModelOpt's plugin tests, mtq.fold_weight(model) "for faster evaluation" with the weight quantizers' is_enabled checked, isinstance over modelopt.torch.quantization.nn.TensorQuantizer, then greedy generation
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu"); a tiny LlamaForCausalLM built from a LlamaConfig (and trained a few steps here) stands in for AutoModelForCausalLM.from_pretrained
"""ModelOpt INT8 SmoothQuant PTQ of a Hugging Face Llama, amax clamped, weights folded, then generation."""
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq
# was: from modelopt.torch.quantization.nn import TensorQuantizer
from overdrive.quant.modelopt.nn import TensorQuantizer

device = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 64


def pretrained_model():
    """What from_pretrained would give: a small Llama trained on a repeating-pattern language."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        start = torch.randint(0, VOCAB, (16, 1), generator=g)
        ids = (start + torch.arange(16) * 3) % VOCAB
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def get_calib_dataloader(batch_size=4, num_samples=16):
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(num_samples):
        ids = (torch.randint(0, VOCAB, (1,), generator=g) + torch.arange(16) * 3) % VOCAB
        mask = torch.ones(16, dtype=torch.long)
        mask[: int(torch.randint(0, 4, (1,), generator=g))] = 0  # left padding
        samples.append({"input_ids": ids, "attention_mask": mask})
    return torch.utils.data.DataLoader(samples, batch_size=batch_size)


if __name__ == "__main__":
    model = pretrained_model().to(device)
    float_model = copy.deepcopy(model)
    calib_dataloader = get_calib_dataloader()

    def calibrate_loop(model):
        for data in calib_dataloader:
            data = {k: v.to(device) for k, v in data.items()}
            model(**data)

    algorithm = "int8_sq"
    quant_cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    model = mtq.quantize(model, quant_cfg, forward_loop=calibrate_loop)

    # Clamp the scaling_factor with a min threshold to avoid under-calibration.
    maxbound = 127 if algorithm == "int8_sq" else 448
    model = mtq.postprocess_amax(model, "*input_quantizer", lambda amax: torch.clamp(amax, min=0.01 * maxbound))
    mtq.print_quant_summary(model)

    test_ids = torch.stack([(torch.tensor([s]) + torch.arange(16) * 3) % VOCAB for s in range(0, VOCAB, 4)]).to(device)
    with torch.no_grad():
        ref = float_model(input_ids=test_ids).logits
        out = model(input_ids=test_ids).logits

    quantizers = {name: m for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}
    assert any(name.endswith("mlp.down_proj.input_quantizer") for name in quantizers), sorted(quantizers)[:6]
    assert not model.lm_head.weight_quantizer.is_enabled  # the preset keeps lm_head in float
    for name, q in quantizers.items():
        if name.endswith("input_quantizer") and q.is_enabled:
            assert q.amax.min() >= 0.01 * maxbound - 1e-6, (name, q.amax)
    assert not torch.equal(out, ref)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95

    # every quantizer off: the float model's logits; activations only: the weights back in float
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=test_ids).logits, ref, rtol=1e-5, atol=1e-5)
    mtq.set_quantizer_attribute(model, "*input_quantizer", {"enable": True})
    mtq.set_quantizer_attribute(model, "*weight_quantizer", {"enable": True})
    mtq.disable_quantizer(model, "*lm_head*")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=test_ids).logits, out, rtol=0, atol=0)

    # Fold weights for faster evaluation: same logits, weight quantizers off
    mtq.fold_weight(model)
    for name, module in model.named_modules():
        if name.endswith("weight_quantizer"):
            assert not module.is_enabled, f"quantizer {name} is still enabled"
    with torch.no_grad():
        folded = model(input_ids=test_ids).logits
    torch.testing.assert_close(folded, out, rtol=1e-4, atol=1e-4)

    # generation with the quantized model follows the pattern like the float one
    prompt = test_ids[:2, :8]
    with torch.no_grad():
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen = model.generate(prompt, **kwargs)
        ref_gen = float_model.generate(prompt, **kwargs)
    assert (gen[:, 8:] == ref_gen[:, 8:]).float().mean().item() >= 0.8, (gen, ref_gen)
