"""overdrive.train: the loop converges at bf16 O1/O2 like O0 on digits, and checkpoints resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive import UsageError
from overdrive.amp import Policy
from overdrive.demo.data import load_digits
from overdrive.demo.models import DigitsCNN
from overdrive.train import Trainer, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def digits():  # noqa: ANN201
    return load_digits()


def _trainer(level: str, steps_per_epoch: int, epochs: int, width: int = 8) -> Trainer:
    torch.manual_seed(0)
    model = DigitsCNN(width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps_per_epoch * epochs)
    return Trainer(model, opt, policy=Policy(opt_level=level, dtype=torch.bfloat16), scheduler=sched, progress=False)


def test_bf16_o1_o2_converge_within_2pct_of_o0(digits) -> None:  # noqa: ANN001
    final = {}
    for level in ("O0", "O1", "O2"):
        train, test = digits.loaders(batch_size=64, seed=0)
        t = _trainer(level, len(train), epochs=3, width=16)  # the demo's model and recipe
        result = t.fit(train, epochs=3, eval_data=test)
        final[level] = result.final_loss
        assert result.history[-1].eval_accuracy > 0.9
    for level in ("O1", "O2"):
        assert final[level] <= final["O0"] * 1.02, final


def test_checkpoint_resume_is_bit_identical(digits, tmp_path: Path) -> None:  # noqa: ANN001
    x, y = digits.x_train[:256], digits.y_train[:256]
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]  # 8 steps

    ref = _trainer("O2", 8, 2)
    for b in batches:
        ref.train_step(b)

    a = _trainer("O2", 8, 2)
    for b in batches[:4]:
        a.train_step(b)
    path = save_checkpoint(tmp_path / "ckpt.pt", a)
    b_ = _trainer("O2", 8, 2)
    load_checkpoint(path, b_)
    for b in batches[4:]:
        b_.train_step(b)
    for (k, v), (_, w) in zip(ref.model.state_dict().items(), b_.model.state_dict().items()):
        assert torch.equal(v, w), k
    for p, q in zip(ref.mp.master_params(), b_.mp.master_params()):
        assert torch.equal(p, q)
    assert b_.step_count == ref.step_count == 8


def test_accumulation_steps_once_per_n_micro_batches() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3, progress=False)
    w0 = model.weight.detach().clone()
    for i in range(2):
        t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
    assert torch.equal(model.weight, w0) and t.step_count == 0
    t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
    assert not torch.equal(model.weight, w0) and t.step_count == 1


def test_bad_inputs(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match="epochs=0"):
        t.fit([], epochs=0)
    with pytest.raises(UsageError, match="no batch"):
        t.fit([], epochs=1)
    with pytest.raises(UsageError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt", t)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="could not be read"):
        load_checkpoint(tmp_path / "junk.pt", t)
    with pytest.raises(UsageError, match="accumulate=0"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=0)


def test_divergence_is_reported() -> None:
    from overdrive import OverdriveError

    model = torch.nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    bad = [(torch.full((4, 4), float("nan")), torch.zeros(4, dtype=torch.long))]
    with pytest.raises(OverdriveError, match="diverged"):
        t.fit(bad, epochs=1)
