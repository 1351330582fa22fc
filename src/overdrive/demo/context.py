"""What the demo's stages share: the device, the dataset, and the fp32 model trained at O0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from overdrive.demo.data import Digits


@dataclass
class DemoContext:
    device: torch.device
    dtype: torch.dtype
    digits: Digits
    epochs: int = 8
    batch_size: int = 64
    seed: int = 0
    opt_levels: tuple[str, ...] = ("O0", "O1", "O2", "O3")
    progress: bool = True
    fp32_model: torch.nn.Module | None = None  # the O0-trained model, for the stages after amp
    fp32_accuracy: float | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)  # stages hand files/objects on here
