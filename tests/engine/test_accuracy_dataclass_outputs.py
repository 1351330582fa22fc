"""The float reference of an engine's accuracy check reads a module that returns a user's ``@dataclass`` (a model
whose dataclass the user registered for export, or a wrapper around one), as it reads a tuple or a dict: its
tensors in field order. torch's pytree handed the dataclass over whole, so the reference gave no output and the
check was skipped ("the reference gives 0 output(s)"). Reference: the module's own fields; exact."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from overdrive.engine import accuracy


@dataclasses.dataclass(frozen=True)
class Detections:
    scores: torch.Tensor  # (B, 4) float
    labels: torch.Tensor  # (B,) long
    extra: dict[str, torch.Tensor]  # {"boxes": (B, 4)}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> Detections:
        s = self.drop(self.fc(x))
        return Detections(s, s.argmax(-1), {"boxes": s.sigmoid()})


def test_module_reference_reads_every_tensor_of_a_dataclass_output() -> None:
    head = Head().train()
    x = torch.randn(3, 8)
    got = accuracy.module_reference(head)((x,))
    assert head.training  # put back after the reference's eval-mode run
    with torch.no_grad():
        s = head.fc(x)
    assert [tuple(t.shape) for t in got] == [(3, 4), (3,), (3, 4)]
    torch.testing.assert_close(got[0], s, rtol=0, atol=0)  # eval mode: no dropout
    torch.testing.assert_close(got[1], s.argmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(got[2], s.sigmoid(), rtol=0, atol=0)
