"""The pipeline="auto" probe times steady state only: a pipeline with a slow start-up but a fast steady
state is measured at its steady-state rate, and both pipelines are timed over the same batches.

The pipelines here are simulated on a fake clock (no sleeps): P producers (CPU workers / GPU threads),
producer p comes up at ``startup + p * stagger`` and then delivers one batch every ``per_batch`` seconds;
batch k comes from producer k % P, as in torch's DataLoader and the GPU pipeline. Its steady-state rate
is exactly P * batch_size / per_batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader, LoaderConfig
from overdrive.data.auto import decision_text, measure, probe, steady_batches


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Sim:
    producers: int
    startup: float  # seconds before the first producer delivers anything
    stagger: float  # each later producer comes up this much later
    per_batch: float  # steady state: seconds per batch per producer
    consumed: list[int] = field(default_factory=list)  # batches delivered per run

    def run(self, clock: FakeClock, batches: list[list[int]]):
        start = clock.now
        n = 0
        try:
            for k, idx in enumerate(batches):
                p, r = k % self.producers, k // self.producers
                ready = start + self.startup + p * self.stagger + (r + 1) * self.per_batch
                clock.now = max(clock.now, ready)
                n += 1
                yield torch.zeros(len(idx), 1), torch.zeros(len(idx), dtype=torch.long)
        finally:
            self.consumed.append(n)

    def steady_rate(self, batch_size: int) -> float:
        return self.producers * batch_size / self.per_batch


class FakeLoader:
    """What measure() uses of an ImageLoader: config, device, _batches(), _iter_cpu(), _iter_gpu()."""

    def __init__(self, cpu: Sim, gpu: Sim, clock: FakeClock, n_batches: int = 10, batch_size: int = 256) -> None:
        self.config = LoaderConfig(batch_size=batch_size, num_workers=cpu.producers, gpu_threads=gpu.producers)
        self.device = torch.device("cpu")
        self.cpu, self.gpu, self.clock, self.n_batches = cpu, gpu, clock, n_batches

    def _batches(self) -> list[list[int]]:
        bs = self.config.batch_size
        return [list(range(k * bs, (k + 1) * bs)) for k in range(self.n_batches)]

    def _iter_cpu(self, batches, cfg=None):
        assert cfg is None or cfg.num_workers == self.cpu.producers
        return self.cpu.run(self.clock, batches)

    def _iter_gpu(self, batches):
        return self.gpu.run(self.clock, batches)


def test_probe_excludes_slow_worker_startup() -> None:
    # 16 workers: 5 s before the first is up, then one more every 0.2 s; steady state 0.1 s/batch/worker.
    clock = FakeClock()
    cpu = Sim(producers=16, startup=5.0, stagger=0.2, per_batch=0.1)
    loader = FakeLoader(cpu, Sim(2, 0.0, 0.0, 0.05), clock)
    rate = measure(loader, "cpu", batches=3, clock=clock)
    assert rate == pytest.approx(cpu.steady_rate(256), rel=1e-9)  # 40,960 img/s
    # 16 discarded (one per worker) + 3 rounded up to one round of 16 timed
    assert cpu.consumed == [32]


def test_probe_is_fair_to_both_pipelines() -> None:
    # The H200 case: the CPU pipeline starts slowly but is faster in steady state; the GPU one starts
    # at once but is slower. The old probe (1 warm-up batch, 3 timed) picked the GPU here.
    clock = FakeClock()
    cpu = Sim(producers=16, startup=3.0, stagger=0.3, per_batch=0.1)  # steady 40,960 img/s
    gpu = Sim(producers=2, startup=0.5, stagger=0.0, per_batch=0.064)  # steady 8,000 img/s
    loader = FakeLoader(cpu, gpu, clock, n_batches=7)  # shorter than the probe: cycled
    g, c, steady = probe(loader, batches=3, clock=clock)
    assert steady == 16 == steady_batches(loader, 3)
    assert g == pytest.approx(gpu.steady_rate(256), rel=1e-9)
    assert c == pytest.approx(cpu.steady_rate(256), rel=1e-9)
    # the same 16 steady-state batches timed on each, after each one's own warm-up (2 GPU threads, 16 workers)
    assert gpu.consumed == [2 + 16] and cpu.consumed == [16 + 16]
    text = decision_text("cpu" if c > g else "gpu", g, c, steady, 256, 2, 16, 2, 16)
    assert text.startswith("auto chose cpu: steady-state 8,000 img/s on the GPU pipeline")
    assert "40,960 img/s on the CPU pipeline (16 workers)" in text and "same 16 batches of 256" in text
    assert "discarding its first 2 (GPU) / 16 (CPU) batches" in text


def test_steady_batches_is_a_whole_round_of_both() -> None:
    clock = FakeClock()
    loader = FakeLoader(Sim(6, 0, 0, 1), Sim(4, 0, 0, 1), clock)
    assert steady_batches(loader, 3) == 12 and steady_batches(loader, 13) == 24
    loader = FakeLoader(Sim(0, 0, 0, 1), Sim(2, 0, 0, 1), clock)  # 0 workers: in-process, one producer
    assert steady_batches(loader, 3) == 4


def test_measure_real_loader_and_bad_input(folder: Path) -> None:
    loader = ImageLoader(folder, batch_size=4, size=8, num_workers=0)
    assert measure(loader, "cpu", batches=2) > 0
    with pytest.raises(UsageError, match="at least 1 timed batch"):
        measure(loader, "cpu", batches=0)
