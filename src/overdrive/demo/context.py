"""What the demo's stages share: the device, the workload and its data, and the fp32 model trained at O0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from overdrive.recipes.data import Digits
from overdrive.demo.workloads import Workload, choose_workload, resize


class StageSkipped(Exception):
    """Raised by a stage that cannot run on this machine (a missing optional package, no GPU for it);
    the message says why, and the demo goes on with the next stage."""


@dataclass
class DemoContext:
    device: torch.device
    dtype: torch.dtype
    digits: Digits  # the 8x8 digits (the quick workload and the distributed stage train on these)
    epochs: int = 8
    batch_size: int = 64
    seed: int = 0
    opt_levels: tuple[str, ...] = ("O0", "O1", "O2", "O3")
    progress: bool = True
    workload: Workload | None = None  # None: the quick digits CNN
    fp32_model: torch.nn.Module | None = None  # the O0-trained model, for the stages after amp
    fp32_accuracy: float | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)  # stages hand files/objects on here
    _data: Digits | None = None

    def __post_init__(self) -> None:
        if self.workload is None:
            self.workload = choose_workload(self.device, quick=True, batch_size=self.batch_size, epochs=self.epochs)

    @property
    def data(self) -> Digits:
        """The digits at the workload's image size (upscaled once, kept on the CPU)."""
        if self._data is None:
            size = self.workload.image_size  # type: ignore[union-attr]
            d = self.digits
            self._data = d if size == d.x_train.shape[-1] else Digits(resize(d.x_train, size), d.y_train,
                                                                      resize(d.x_test, size), d.y_test)
        return self._data

    def example(self, batch: int = 1) -> torch.Tensor:
        """A random input batch of the workload's shape on the demo device."""
        return torch.randn(batch, *self.workload.input_shape, device=self.device)  # type: ignore[union-attr]
