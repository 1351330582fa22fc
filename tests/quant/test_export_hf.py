"""export_onnx takes a Hugging Face model as it is (no wrapper): inputs by name, dynamic batch and sequence.

The int8 Q/DQ graph runs in ONNX Runtime at sequence lengths 1, 7 and 32 (the export traced 8) and batch 1
and 3, padded masks included, and matches the PyTorch fake-quant model within 1e-4 (outputs of magnitude
about 3; the two agree to ~1e-6, a rounding tie would cost one int8 step). ORT runs at
``ORT_ENABLE_BASIC``: its extended QDQ fusions miscompute 3-D int8 Linear on x86 without VNNI (README)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError
from overdrive.quant.export import qdq_counts

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
tf = pytest.importorskip("transformers")

TOL = 1e-4


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return tf.BertModel(tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=200)).eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2Model(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=200, n_positions=64)).eval()


def _tokens(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with the second row's second half padded (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 200, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1 and seq > 2:
        mask[1, seq // 2:] = 0
        ids[1, seq // 2:] = 0
    return ids, mask


def _calibrated(model: nn.Module) -> nn.Module:
    ids, mask = _tokens(4, 16, seed=1)
    return quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(input_ids=ids, attention_mask=mask))


def _dims(value_info) -> list[object]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_hf_model_exports_directly_and_matches_ort_at_every_length(arch: str, tmp_path) -> None:
    q = _calibrated(_bert() if arch == "bert" else _gpt2())
    ids, mask = _tokens(2, 8, seed=2)
    if arch == "bert":  # a dict of example inputs
        path = quant.export_onnx(q, {"input_ids": ids, "attention_mask": mask}, tmp_path / "bert_int8.onnx")
        outputs = ["last_hidden_state", "pooler_output"]
    else:  # a tuple plus input_names (GPT-2's forward takes past_key_values second: by name, not by position)
        path = quant.export_onnx(q, (ids, mask), tmp_path / "gpt2_int8.onnx", input_names=("input_ids", "attention_mask"))
        outputs = ["last_hidden_state"]  # use_cache=False: no KV cache among the outputs
    g = onnx.load(str(path)).graph
    assert [i.name for i in g.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in g.output] == outputs
    assert all(_dims(i) == ["batch", "sequence"] for i in g.input)
    assert _dims(g.output[0])[:2] == ["batch", "sequence"]
    assert qdq_counts(path).get("QuantizeLinear", 0) >= 2
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        for seq in (1, 7, 32):
            ids, mask = _tokens(batch, seq, seed=10 * batch + seq)
            with torch.no_grad():
                ref = q(input_ids=ids, attention_mask=mask)
            got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
            for name, y in zip(outputs, got):
                want = ref[name].numpy()
                assert y.shape == want.shape, (name, batch, seq)
                err = float(np.abs(y - want).max())
                assert err <= TOL, f"{arch} {name} batch {batch} seq {seq}: max error {err:.2e} (max |y| {np.abs(want).max():.2f})"


class _Tok(nn.Module):
    """A token model in Hugging Face's convention, small enough to export in a fraction of a second."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, input_ids=None, past=None, attention_mask=None):  # noqa: ANN001, ANN201 - HF-like defaults
        h = self.fc(self.emb(input_ids))  # (B, T, 8)
        return {"logits": h * attention_mask.unsqueeze(-1)}


@pytest.fixture()
def tok() -> nn.Module:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    return quant.quantize(_Tok().eval(), quant.INT8_DEFAULT,
                          forward_loop=lambda m: m(input_ids=ids, attention_mask=torch.ones_like(ids)))


def test_token_tuple_is_named_in_tokenizer_order_and_axes_are_an_option(tok, tmp_path) -> None:
    ids = torch.randint(0, 50, (2, 6))
    g = onnx.load(str(quant.export_onnx(tok, (ids, torch.ones_like(ids)), tmp_path / "a.onnx"))).graph
    assert [i.name for i in g.input] == ["input_ids", "attention_mask"]  # not forward's order (past second)
    assert [o.name for o in g.output] == ["logits"] and _dims(g.output[0]) == ["batch", "sequence", 8]
    g = onnx.load(str(quant.export_onnx(tok, (ids, torch.ones_like(ids)), tmp_path / "s.onnx", dynamic_axes=None))).graph
    assert _dims(g.input[0]) == [2, 6]
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    g = onnx.load(str(quant.export_onnx(tok, {"input_ids": ids, "attention_mask": ids * 0 + 1}, tmp_path / "d.onnx",
                                        dynamic_axes=axes))).graph
    assert _dims(g.input[0]) == [2, "seq"]
    with pytest.raises(UsageError, match="neither inputs"):
        quant.export_onnx(tok, (ids, torch.ones_like(ids)), tmp_path / "x.onnx", dynamic_axes={"mask": {0: "b"}})
    with pytest.raises(UsageError, match="one distinct name per input"):
        quant.export_onnx(tok, (ids, torch.ones_like(ids)), tmp_path / "x.onnx", input_names=("input_ids",))
