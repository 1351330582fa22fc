"""A user's ``@dataclass`` batch or model output goes through the Trainer like a tuple or dict does: its tensors are
moved (and made channels-last) with the rest of the batch, its samples counted, its loss evaluated; so do a
tokenizer's ``BatchEncoding`` and an object with its own ``to(device)`` (a graph batch), and the evaluation loss of a
structured output is computed as the training step computes it.

torch's pytree hands an unregistered dataclass over whole, as one leaf: the Trainer never moved its tensors to the
device, counted 0 samples, and fit raised "training diverged" on finite losses (their weights summed to 0).
Reference: the same model trained on the same data as plain tensors; tolerance 1e-6."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overdrive._utils.errors import UsageError
from overdrive.train import Trainer, evaluate
from overdrive.train.batches import _split


@dataclasses.dataclass(frozen=True)
class Image:
    pixels: torch.Tensor  # (B, 3, 4, 4)


@dataclasses.dataclass
class Inputs:
    image: Image
    mask: torch.Tensor  # (B, 48) of 0/1
    source: list[str]  # metadata the model ignores: e.g. the file each sample came from


@dataclasses.dataclass
class Output:
    logits: torch.Tensor  # (B, 3)


class Net(nn.Module):
    def __init__(self, check_channels_last: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(48, 3)
        self.check = check_channels_last

    def forward(self, b: Inputs) -> Output:
        x = b.image.pixels
        if self.check:  # what Trainer(channels_last=True) promises every 4-D input
            assert x.is_contiguous(memory_format=torch.channels_last), "the dataclass's image was not moved"
        return Output(self.fc(x.flatten(1) * b.mask))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(20, 3, 4, 4, generator=g), (torch.rand(20, 48, generator=g) > 0.2).float(),
                         torch.randint(0, 3, (20,), generator=g))


def _collate(items: list[tuple[torch.Tensor, ...]]) -> tuple[Inputs, torch.Tensor]:
    x, m, y = (torch.stack(t) for t in zip(*items))
    return Inputs(Image(x), m, [f"img{i}.png" for i in range(len(items))]), y


def _loss(out: Output, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits, y)


def test_fit_moves_counts_and_trains_a_dataclass_batch_as_the_plain_tensors() -> None:
    torch.manual_seed(0)
    model = Net(check_channels_last=True)
    ref = nn.Linear(48, 3)
    ref.load_state_dict(model.fc.state_dict())
    data = DataLoader(_data(), batch_size=8, collate_fn=_collate)  # batches of 8, 8, 4
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss, channels_last=True, progress=False)
    stats = t.fit(data, epochs=1, eval_data=data).history[0]  # raised "training diverged: no finite loss"
    assert stats.samples == 20

    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    total = 0.0
    for x, m, y in DataLoader(_data(), batch_size=8):
        loss = nn.functional.cross_entropy(ref(x.flatten(1) * m), y)
        total += loss.item() * len(y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isclose(stats.loss, total / 20, rel_tol=1e-6)
    torch.testing.assert_close(model.fc.weight, ref.weight, rtol=1e-6, atol=1e-6)

    x, m, y = _data().tensors
    with torch.no_grad():
        logits = ref(x.flatten(1) * m)
    want_loss = float(nn.functional.cross_entropy(logits, y))
    want_acc = int((logits.argmax(-1) == y).sum()) / 20
    assert math.isclose(stats.eval_loss, want_loss, rel_tol=1e-6)
    assert stats.eval_accuracy == want_acc  # the Output's logits, read as a ModelOutput's


def test_the_device_move_reaches_every_tensor_of_a_dataclass_batch() -> None:
    """The move itself, with a dtype-changing stand-in for the device (this machine has one device)."""

    model = Net()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss, progress=False)
    t._move = lambda v: v.double()  # stands in for .to(device)
    x, _ = _collate(list(zip(*_data().tensors))[:2])
    moved = t._to_device((x, {"extra": [Image(torch.zeros(2, 3, 4, 4))]}))
    assert moved[0].image.pixels.dtype == torch.float64 and moved[0].mask.dtype == torch.float64
    assert moved[0].source == ["img0.png", "img1.png"] and isinstance(moved[0].image, Image)
    assert moved[1]["extra"][0].pixels.dtype == torch.float64
    assert x.image.pixels.dtype == torch.float32  # the caller's batch is left as it was


def test_evaluate_counts_the_samples_of_a_dataclass_batch() -> None:
    model = Net()
    data = DataLoader(_data(), batch_size=6, collate_fn=_collate)  # 6, 6, 6, 2: a mean over samples, not batches
    loss, acc = evaluate(model, data, loss_fn=_loss)  # raised "the evaluation data yielded no sample"
    x, m, y = _data().tensors
    with torch.no_grad():
        logits = model.fc(x.flatten(1) * m)
    assert math.isclose(loss, float(nn.functional.cross_entropy(logits, y)), rel_tol=1e-6)
    assert acc == int((logits.argmax(-1) == y).sum()) / 20


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (self.emb(input_ids) * attention_mask[..., None]).mean(1)  # (B, 3)


def _encoded(make: type) -> list[tuple[object, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(make({"input_ids": torch.randint(0, 10, (n, 5), generator=g), "attention_mask": torch.ones(n, 5)}),
             torch.randint(0, 3, (n,), generator=g)) for n in (4, 4, 2)]


def test_a_tokenizers_batch_encoding_as_the_inputs_of_a_pair_is_moved_and_counted() -> None:
    """``(tokenizer(texts, return_tensors="pt", padding=True), labels)``: the BatchEncoding (a UserDict, which pytree
    does not walk) was one opaque leaf: never moved, 0 samples, and fit raised "training diverged"."""
    transformers = pytest.importorskip("transformers")
    data = _encoded(transformers.BatchEncoding)
    model = _Emb()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), progress=False)  # lr 0: the epoch loss is evaluate's
    stats = t.fit(data, epochs=1, eval_data=data).history[0]
    assert stats.samples == 10
    with torch.no_grad():
        logits = torch.cat([model(**x) for x, _ in data])
    want = float(nn.functional.cross_entropy(logits, torch.cat([y for _, y in data])))
    assert math.isclose(stats.loss, want, rel_tol=1e-6) and math.isclose(stats.eval_loss, want, rel_tol=1e-6)
    t._move = lambda v: v.double() if v.is_floating_point() else v  # stands in for .to(device)
    moved = t._to_device(_split(data[0])[0])
    assert moved["attention_mask"].dtype == torch.float64 and moved["input_ids"].dtype == torch.long


class Graphs:
    """A batch of graphs as torch_geometric's ``Batch``: an object with its own ``to(device)``, opaque to pytree."""

    def __init__(self, x: torch.Tensor, batch: torch.Tensor, moved_to: list[str] | None = None) -> None:
        self.x, self.batch, self.moved_to = x, batch, moved_to or []

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Graphs:
        return Graphs(self.x.to(device), self.batch.to(device), [*self.moved_to, str(device)])

    @property
    def num_graphs(self) -> int:
        return int(self.batch.max()) + 1


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, g: Graphs) -> torch.Tensor:
        assert g.moved_to == ["cpu"], "the graph batch did not go through its own to(device)"
        return torch.zeros(g.num_graphs, 2).index_add_(0, g.batch, self.fc(g.x))  # (num_graphs, 2)


def test_an_object_with_its_own_to_is_moved_and_its_samples_counted_from_the_targets() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(Graphs(torch.randn(6, 4, generator=g), torch.tensor([0, 0, 1, 1, 1, 2])),
             torch.randint(0, 2, (3,), generator=g)) for _ in range(3)]
    model = _Pool()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), progress=False, device="cpu")
    stats = t.fit(data, epochs=1, eval_data=data).history[0]  # raised "training diverged: no finite loss"
    assert stats.samples == 9  # the targets' rows: one per graph
    with torch.no_grad():
        want = float(nn.functional.cross_entropy(torch.cat([model(x.to("cpu")) for x, _ in data]),
                                                 torch.cat([y for _, y in data])))
    assert math.isclose(stats.loss, want, rel_tol=1e-6) and math.isclose(stats.eval_loss, want, rel_tol=1e-6)
    loss, _ = evaluate(model, data)
    assert math.isclose(loss, want, rel_tol=1e-6)


class _Texts(nn.Module):
    """Embeds raw strings itself (its own tokenizer): the batch holds no tensor at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(256, 4)

    def forward(self, anchors: list[str], positives: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        def ids(texts: list[str]) -> torch.Tensor:
            return torch.tensor([[ord(c) for c in s[:3].ljust(3)] for s in texts])  # (B, 3)

        return self.emb(ids(anchors)), self.emb(ids(positives))  # (B, 4) each


def _contrastive(out: tuple[torch.Tensor, torch.Tensor], _: None) -> torch.Tensor:
    a, p = out
    return nn.functional.cross_entropy(a @ p.T, torch.arange(len(a)))


def test_an_epoch_of_batches_without_a_readable_size_reports_the_mean_step_loss() -> None:
    """No tensor in inputs or targets: each step weighs alike, instead of the NaN mean of zero weights that fit
    reported as "training diverged: no finite loss"."""
    data = [((["cat", "dog", "owl"], ["cats", "dogs", "owls"]), None), ((["ant", "bee"], ["ants", "bees"]), None)]
    model = _Texts()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=_contrastive, progress=False)
    stats = t.fit(data, epochs=1).history[0]
    with torch.no_grad():
        want = sum(float(_contrastive(model(*x), None)) for x, _ in data) / 2
    assert math.isclose(stats.loss, want, rel_tol=1e-6) and stats.samples == 0


def test_a_whole_dataclass_batch_is_refused_with_its_fields_and_the_pair_to_yield() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match=r"a Batch dataclass with fields \['x', 'y'\] \(yield it as \(batch, batch.y\)"):
        t.train_step(Batch(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)))


def test_eval_loss_of_a_structured_output_is_computed_as_the_training_loss_under_o1() -> None:
    """Under O1 the training step computes ``loss_fn`` inside autocast (cross-entropy in fp32); evaluate computed it
    outside, on a structured output's bf16 logits, so the loss came back rounded to bf16: 2.41796875 against the
    training loss's 2.4183376 for the same weights (lr 0). Tolerance 1e-6 relative."""
    from overdrive.amp import Policy

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = nn.Linear(16, 10)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> Output:
            return Output(self.inner(x))

    t = Trainer(Wrapped(), torch.optim.SGD(model.parameters(), lr=0.0), policy=Policy(opt_level="O1", dtype=torch.bfloat16),
                loss_fn=_loss, progress=False)
    stats = t.fit(data, epochs=1, eval_data=data).history[0]
    assert math.isclose(stats.eval_loss, stats.loss, rel_tol=1e-6)


def test_a_dataset_of_triples_is_refused_with_the_pair_to_yield() -> None:
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    batch = [torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), ("a.jpg", "b.jpg")]  # DataLoader's (x, y, path)
    with pytest.raises(UsageError, match=r"a list of 3 items \(for \(inputs, targets, extra...\) yield \(\(x, y\) for x, y, \*_"):
        t.train_step(batch)
