"""FSDP2 through ``Strategy`` on tiny Hugging Face models (random weights, no downloads), against the one-process
reference.

2 ranks (torchrun runs this file as a script): a tiny Llama with tied embedding / LM head and a GPT-2 (tied head,
Conv1D layers), each trained with AdamW for 2 steps of accumulate 2 with gradient clipping on its half of every
micro-batch. The per-block default finds the decoder layers (``model.layers[i]``, ``transformer.h[i]``) without
``fsdp_blocks``; the parameters equal the one-process full-batch reference within 1e-5 (measured 2.5e-7 Llama,
6e-6 GPT-2: Adam's normalisation magnifies rounding on the attention biases, whose gradients are near zero), the
tie survives sharding, and the full state dict gathered on rank 0 loads into a fresh model that generates the
reference's tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402

NAMES = ("llama_tied", "gpt2")
STEPS, ACCUMULATE, CLIP = 2, 2, 0.05


def build(name: str) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(0)
    if name == "llama_tied":
        cfg = hf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                             tie_word_embeddings=True)
        return hf.LlamaForCausalLM(cfg)
    cfg = hf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return hf.GPT2LMHeadModel(cfg)


def batch(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, 64, (2, 8), generator=g)  # (B, T)
    return {"input_ids": ids, "labels": ids.clone()}


def generate(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)


def worker(out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from overdrive import distributed as odist
    from overdrive.distributed.parallel import fsdp_blocks
    from overdrive.train import Trainer

    env = odist.init(device="cpu")
    results = {}
    for name in NAMES:
        m = build(name)
        blocks = [n for n, mod in m.named_modules() if any(mod is b for b in fsdp_blocks(m))]
        tr = Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), progress=False, strategy="fsdp",
                     accumulate=ACCUMULATE, grad_clip=CLIP)
        for step in range(STEPS):
            for micro in range(ACCUMULATE):
                tr.train_step(batch(env.rank, step, micro))
        inner = tr.model
        params = {n: q.full_tensor().detach().clone() for n, q in inner.named_parameters()}
        full = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[name] = {"blocks": blocks, "params": params, "tied": inner.get_output_embeddings().weight
                         is inner.get_input_embeddings().weight}
        if env.is_main:  # cpu_offload gathers the full tensors on rank 0 only
            fresh = build(name)
            fresh.load_state_dict(full)
            results[name]["tokens"] = generate(fresh)
    torch.save(results, f"{out}/rank{env.rank}.pt")
    odist.leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("fsdp_hf")
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(out)], env=worker_env(), timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def reference(name: str) -> torch.nn.Module:
    """One process, both ranks' micro-batches at once, the loss divided by ``ACCUMULATE``, the norm clipped."""
    m = build(name)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            parts = [batch(r, step, micro) for r in range(2)]
            (m(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]}).loss / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return m


@pytest.mark.parametrize("name", NAMES)
def test_fsdp_trains_hf_models_as_the_reference(ranks: list[dict], name: str) -> None:
    ref = reference(name)
    want = dict(ref.named_parameters())
    layers = "model.layers" if name == "llama_tied" else "transformer.h"
    for r in range(2):
        got = ranks[r][name]
        assert got["blocks"] == [f"{layers}.0", f"{layers}.1"]
        assert got["tied"], f"{name} rank {r}: the LM head is no longer the embedding"
        assert got["params"].keys() == want.keys()
        for k, q in want.items():
            assert torch.allclose(got["params"][k], q.detach(), atol=1e-5, rtol=0), f"{name} rank {r}: {k}"
    assert torch.equal(ranks[0][name]["tokens"], generate(ref)), f"{name}: generate differs from the reference"


if __name__ == "__main__":  # one of the 2 torchrun ranks the ``ranks`` fixture starts
    worker(sys.argv[1])
