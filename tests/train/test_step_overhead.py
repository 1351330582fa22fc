"""What Trainer.fit does per step beyond the step itself: host syncs of its own, and graphs under compile.

On a GPU a host read of a device value (``float(loss)``, ``.item()``) waits for every queued kernel, and each
graph of a compiled forward is one more guard check and autograd function per step; at a few milliseconds a
step (the demo's ResNet-18) both show in samples/s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive._utils.timing import count_host_reads
from overdrive.amp import Policy
from overdrive.recipes.models import ResNet
from overdrive.train import Trainer
from overdrive.train import loop


def _data(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, size, size, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def _trainer(level: str, **kw: object) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no step counters: every read counted is amp's or fit's
    return Trainer(model, opt, policy=Policy(opt_level=level, dtype=torch.bfloat16), **kw)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_one_host_read_per_step(level: str) -> None:
    t = _trainer(level, progress=False)
    data = _data(6)
    t.train_step(data[0])
    with count_host_reads() as n:
        for b in data[1:]:
            t.train_step(b)
    assert n["reads"] == len(data) - 1  # the inf/NaN check before each optimizer step, nothing more


def test_progress_bar_reads_the_loss_by_time_not_every_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # It read float(loss) every 10 steps: one more host sync each, at any step rate. With the clock
    # standing still the bar has nothing to show until the epoch ends, and reads nothing.
    data = _data(25)
    reads = {}
    for progress in (False, True):
        t = _trainer("O2", progress=progress)
        t.fit(data[:2], epochs=1)
        monkeypatch.setattr(loop.time, "perf_counter", lambda: 100.0)
        with count_host_reads() as n:
            t.fit(data, epochs=1)
        monkeypatch.undo()
        reads[progress] = n["reads"]
    assert reads[True] == reads[False], reads


def test_compiled_o2_forward_is_one_graph_without_recompiles() -> None:
    # torch.compile(model) ran O2's input and output cast hooks outside the compiled forward, each compiled
    # as a graph of its own (three graphs a step, one recompile); the whole call is one graph now, and
    # epochs with evaluation between them compile nothing more.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        torch.manual_seed(0)
        model = ResNet(width=4, depths=(1,), stem="small")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        t = Trainer(model, opt, policy=Policy(opt_level="O2", dtype=torch.bfloat16), progress=False, compile=True,
                    channels_last=True)
        data = _data(4)
        result = t.fit(data, epochs=3, eval_data=_data(2))
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert counters["frames"]["total"] == 1, dict(counters["frames"])  # no recompile after the first
        assert t.forward(data[0][0]).dtype == torch.float32  # the output cast hook ran inside the graph
        assert all(e.loss == e.loss for e in result.history)
    finally:
        torch._dynamo.reset()
        counters.clear()


def test_compiled_calls_of_many_model_classes_stay_compiled() -> None:
    """Each model class gets a code object of its own for the compiled call, as ``torch.compile(model)`` has one per
    class's forward: 10 classes compile 10 graphs with no recompile-limit fallback (one code object shared by every
    Trainer would hit the limit of 8 and run the 9th class uncompiled), and two models of one class share a graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from overdrive.train.loop import _compiled

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(2, 4)
    classes = [type(f"Net{i}", (torch.nn.Linear,), {}) for i in range(10)]
    for cls in classes:
        _compiled(cls(4, 4), whole_call=True)(x)
    _compiled(classes[0](4, 4), whole_call=True)(x)  # a second model of a class compiled already
    assert counters["stats"]["unique_graphs"] == 10, dict(counters["stats"])
    assert not any("recompile_limit" in k or "cache_limit" in k for k in counters), dict(counters)
