"""Fine-tuning Hugging Face models the way the HF Trainer or a plain loop does: dict batches from a DataCollator,
the model's own loss, logits with a user loss, accuracy read from a ModelOutput, accumulation with an uneven last
window, clipping, a per-step scheduler, weight-decay groups, bf16 on the CPU and a mid-epoch resume. References are
hand-written loops on copies of the same model (float64 for the metrics)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.train import Trainer, evaluate, load_checkpoint, save_checkpoint

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert(num_labels: int = 3) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=num_labels,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def _lm_batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Right-padded causal-LM batches of different lengths, padding labelled -100 (a DataCollator's output)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows, length = 2 + i % 2, 5 + i % 3
        ids = torch.randint(1, 40, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[0, -(1 + i % 3):] = 0
        ids[mask == 0] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _clf_batches(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows, length = 3 + i % 2, 4 + i % 3
        ids = torch.randint(1, 40, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[-1, -1:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (rows,), generator=g)})
    return out


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """The HF Trainer's weight-decay groups: no decay on biases and LayerNorm weights."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _reference_fit(model: nn.Module, data: list[dict[str, torch.Tensor]], accumulate: int, clip: float) -> None:
    """A plain HF-style loop: the mean of the window's micro-batch losses, clip, step, scheduler per optimizer step."""
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for start in range(0, len(data), accumulate):
        window = data[start:start + accumulate]
        for b in window:
            (model(**b).loss / len(window)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()


def test_dict_batches_train_on_the_models_own_loss_as_a_plain_loop_does() -> None:
    """A DataCollator's dict batch was refused ("takes batches (inputs, targets)"); now model(**batch) computes its
    loss from batch["labels"], as in the HF Trainer. 5 padded causal-LM batches, accumulate=2 (windows of 2, 2, 1),
    grad_clip, a per-step LambdaLR and weight-decay groups: the weights equal the plain loop's within 1e-6."""
    model, data = _gpt2(), _lm_batches(5)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    t = Trainer(model, opt, scheduler=sched, accumulate=2, grad_clip=0.5, progress=False)
    t.fit(data, epochs=1)
    _reference_fit(ref, data, accumulate=2, clip=0.5)
    assert t.step_count == 3 and sched.last_epoch == 3
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_dict_batch_with_a_loss_fn_gets_the_labels_as_targets_and_a_clear_error_without_a_loss() -> None:
    """With loss_fn, the labels leave the inputs and go to it (the HF Trainer's compute_loss_func): its loss on the
    logits equals the model's own. A model whose output holds no loss is one line naming the way out."""
    model, data = _bert(), _clf_batches(3)
    own = evaluate(model, data)[0]

    def loss_fn(out: Any, labels: torch.Tensor) -> torch.Tensor:
        assert out.loss is None  # the model was not given the labels
        return nn.functional.cross_entropy(out.logits, labels)

    assert evaluate(model, data, loss_fn=loss_fn)[0] == pytest.approx(own, abs=1e-6)
    base = transformers.BertModel(model.config)  # returns hidden states, no loss
    t = Trainer(base, torch.optim.SGD(base.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match=r"holds no 'loss'.*pass loss_fn="):
        t.train_step({"input_ids": data[0]["input_ids"], "labels": data[0]["labels"]})


def _reference_eval(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """float64 mean loss over samples and top-1 accuracy."""
    m = copy.deepcopy(model).double().eval()
    total, right, n = 0.0, 0, 0
    with torch.no_grad():
        for b in data:
            logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            total += float(nn.functional.cross_entropy(logits, b["labels"], reduction="sum"))
            right += int((logits.argmax(-1) == b["labels"]).sum())
            n += len(b["labels"])
    return total / n, right / n


def test_sequence_classification_eval_reads_the_logits_of_the_model_output() -> None:
    """eval_accuracy was None for any ModelOutput (only a tensor output counted); now top-1 over its logits. Loss and
    accuracy equal a float64 hand-written loop within 1e-6, for dict batches and for (inputs, labels) pairs."""
    model, data = _bert(), _clf_batches(4)
    want_loss, want_acc = _reference_eval(model, data)
    loss, acc = evaluate(model, data)
    assert loss == pytest.approx(want_loss, abs=1e-6) and acc == pytest.approx(want_acc, abs=1e-6)
    pairs = [({k: v for k, v in b.items() if k != "labels"}, b["labels"]) for b in data]
    loss2, acc2 = evaluate(model, pairs, loss_fn=lambda o, y: nn.functional.cross_entropy(o.logits, y))
    assert loss2 == pytest.approx(want_loss, abs=1e-6) and acc2 == pytest.approx(want_acc, abs=1e-6)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), progress=False)
    stats = t.fit(data, epochs=1, eval_data=data).history[0]
    assert stats.eval_accuracy == pytest.approx(want_acc, abs=1e-6)
    assert evaluate(_gpt2(), _lm_batches(2))[1] is None  # per-token logits: no top-1 accuracy


def test_bf16_mid_epoch_checkpoint_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """bf16 autocast on the CPU (O1), accumulate=2, a checkpoint after micro-batch 3 (mid-window): a fresh trainer
    loading it and running the rest ends with the uninterrupted run's weights, bit for bit."""
    data = _lm_batches(6)

    def trainer() -> Trainer:
        model = _gpt2()
        opt = torch.optim.AdamW(_groups(model), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return Trainer(model, opt, "O1", scheduler=sched, accumulate=2, grad_clip=1.0, progress=False)

    full = trainer()
    for i, b in enumerate(data):
        full.train_step(b, end_of_epoch=i == len(data) - 1)
    first = trainer()
    for b in data[:3]:
        first.train_step(b)
    save_checkpoint(tmp_path / "mid.pt", first)
    resumed = trainer()
    load_checkpoint(tmp_path / "mid.pt", resumed)
    for i, b in enumerate(data[3:], start=3):
        resumed.train_step(b, end_of_epoch=i == len(data) - 1)
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
