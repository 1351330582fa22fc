"""overdrive.train: the loop converges at bf16 O1/O2 like O0 on digits, and checkpoints resume exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive import UsageError
from overdrive.amp import Policy
from overdrive.recipes.data import load_digits
from overdrive.recipes.models import DigitsCNN
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


# --- regressions -------------------------------------------------------------------------------


def test_fit_evaluates_with_the_trainers_loss_fn() -> None:
    # evaluate() was called without loss_fn: eval used cross-entropy (and crashed on float targets)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    mse = nn.functional.mse_loss
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=lambda o, y: mse(o.squeeze(-1), y),
                progress=False)
    x, y = torch.randn(24, 4), torch.randn(24)
    eval_data = [(x[:16], y[:16]), (x[16:], y[16:])]  # unequal batches: weighted by size
    result = t.fit([(x[:8], y[:8])], epochs=1, eval_data=eval_data)
    with torch.no_grad():
        expected = mse(model(x).squeeze(-1), y).item()  # plain PyTorch over all 24 samples
    assert result.history[-1].eval_loss == pytest.approx(expected, rel=1e-6)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))


@pytest.mark.parametrize(("level", "poisoned"), [("O0", None), ("O2", None), ("O2", 3)])
def test_checkpoint_mid_accumulation_resumes_bit_identically(tmp_path: Path, level: str, poisoned: int | None) -> None:
    # the pending grads (and a pending overflow skip) of a half-done accumulation were not saved
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
    if poisoned is not None:  # an inf in micro-batch 3: the step closing micro-batches 3..5 is skipped
        data[poisoned][0][0, 0] = float("inf")
    base = _small_model()

    def make() -> Trainer:
        m = copy.deepcopy(base)
        pol = Policy(opt_level=level, dtype=torch.bfloat16, loss_scale="dynamic" if level != "O0" else None)
        return Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), policy=pol, accumulate=3, progress=False)

    ref = make()  # uninterrupted
    for b in data:
        ref.train_step(b)
    a = make()
    for b in data[:4]:  # 4 = one step + one pending micro-batch
        a.train_step(b)
    path = save_checkpoint(tmp_path / "mid.pt", a)
    resumed = make()
    load_checkpoint(path, resumed)
    for b in data[4:]:
        resumed.train_step(b)
    for (k, v), w in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(v, w), k
    for p, q in zip(ref.mp.master_params(), resumed.mp.master_params()):
        assert torch.equal(p, q)
    assert resumed.skipped_steps == (1 if poisoned is not None else 0) == ref.skipped_steps
    assert resumed.mp.loss_scale == ref.mp.loss_scale


@pytest.mark.parametrize("with_eval", [True, False])
def test_reduce_lr_on_plateau_steps_once_per_epoch_on_a_metric(with_eval: bool) -> None:
    # train_step called scheduler.step() without the metric ReduceLROnPlateau needs: TypeError
    model = _small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # lr so small the loss plateaus at once
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    t = Trainer(model, opt, scheduler=sched, progress=False)
    g = torch.Generator().manual_seed(0)
    train = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    test = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))]
    lrs: list[float] = []
    result = t.fit(train, epochs=4, eval_data=test if with_eval else None,
                   on_epoch_end=lambda _s: lrs.append(opt.param_groups[0]["lr"]))
    # reference: a plain ReduceLROnPlateau stepped once per epoch on the metric fit reports
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-6)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=0)
    ref_lrs = []
    for e in result.history:
        ref.step(e.eval_loss if with_eval else e.loss)
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
    assert lrs == ref_lrs
    assert lrs[-1] < 1e-6  # the plateau was detected (4 batches per epoch, yet at most one cut per epoch)


def test_epoch_stats_count_skipped_optimizer_steps_not_overflowed_micro_batches() -> None:
    # two overflowing micro-batches in one accumulation window were reported as two skipped steps
    model = _small_model()
    ref = copy.deepcopy(model)
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if calls["n"] in (0, 1):  # finite loss, inf gradient: micro-batches 0 and 1 overflow
            out.register_hook(lambda grad: grad * float("inf"))
        calls["n"] += 1
        return nn.functional.cross_entropy(out, y)

    pol = Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic")
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=pol, loss_fn=loss_fn, accumulate=3,
                progress=False)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
    result = t.fit(data, epochs=1)
    assert t.step_count == 2 and t.mp.scaler.overflows == 2
    assert result.history[0].skipped_steps == 1
    assert t.skipped_steps == 1
    # plain-PyTorch reference: only the second window's step happened (autocast bf16, mean over 3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data[3:]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ref(x)
        (nn.functional.cross_entropy(out.float(), y) / 3).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # only the summation order may differ


# --- fixes from a review (each test failed before its fix) ----------------------------------
def _batches(n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 4, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def test_trainer_moves_the_model_to_the_device_it_is_given() -> None:
    # 'meta' stands in for an accelerator on a CPU-only machine: a model left on the CPU fails the
    # step with "Tensor on device cpu is not on the expected device meta!".
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = Trainer(model, opt, device="meta", progress=False)
    assert {q.device.type for q in model.parameters()} == {"meta"}
    # moved in place: the optimizer steps the parameters the model holds
    assert [id(q) for q in opt.param_groups[0]["params"]] == [id(q) for q in model.parameters()]
    loss = t.train_step(_batches(1)[0])
    assert loss.device.type == "meta" and t.step_count == 1


@pytest.mark.gpu
def test_trainer_moves_a_cpu_model_to_cuda_and_trains() -> None:
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cuda", progress=False)
    assert model.weight.is_cuda
    result = t.fit(_batches(4), epochs=1, eval_data=_batches(2))
    assert result.history[0].eval_loss is not None and model.weight.is_cuda


def test_fit_steps_a_partial_accumulation_at_epoch_end_on_its_mean_gradient() -> None:
    # 4 batches, accumulate=3: each epoch steps on mean(grads 0-2), then on grad 3 alone; nothing
    # carries into the next epoch (before: batch 3 joined the next epoch's first step, and the
    # last epoch's leftover gradients stayed on the parameters).
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model).double()
    data = _batches(4)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulate=3, progress=False)
    t.fit(data, epochs=2)
    assert t.step_count == 4 and t._micro == 12
    assert all(q.grad is None for q in model.parameters())
    # Reference: plain SGD in float64 on the mean loss of each window.
    for _ in range(2):
        for window in (data[:3], data[3:]):
            loss = sum(nn.functional.cross_entropy(ref(x.double()), y) for x, y in window) / len(window)
            ref.zero_grad()
            loss.backward()
            with torch.no_grad():
                for q in ref.parameters():
                    q -= 0.5 * q.grad
    for q, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(q.double(), r, atol=1e-5, rtol=0)


def test_fit_partial_accumulation_works_without_len() -> None:
    # fit looks one batch ahead, so an iterable without len (a generator, a streaming loader) works too
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulate=3, progress=False)
    t.fit((b for b in _batches(5)), epochs=1)
    assert t.step_count == 2 and all(q.grad is None for q in model.parameters())


def test_accuracy_only_where_it_means_top1_and_the_epoch_loss_is_per_sample() -> None:
    """evaluate's accuracy compared argmax with any target: one BCE logit per sample against (N, 1) targets broadcast
    to (N, N) and read 500%, per-token outputs were divided by sequences. Now None there. fit's epoch loss was the mean
    of batch means, so a last batch of 1 weighed like one of 8 (1.222 against a per-sample 1.403); now per sample,
    as evaluate's. Reference: the losses of the untrained model (lr 0) computed by hand."""
    from overdrive.train import Trainer
    from overdrive.train.loop import evaluate

    torch.manual_seed(0)
    x, yb = torch.randn(9, 16), torch.randint(0, 2, (9, 1)).float()
    binary = nn.Linear(16, 1)
    assert evaluate(binary, [(x, yb)], loss_fn=nn.BCEWithLogitsLoss())[1] is None
    tokens = nn.Linear(16, 5)  # (B, T, C) scores against (B, T) targets
    xt, yt = torch.randn(2, 3, 16), torch.randint(0, 5, (2, 3))
    assert evaluate(tokens, [(xt, yt)], loss_fn=lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))[1] is None
    clf = nn.Linear(16, 3)
    yc = torch.randint(0, 3, (9,))
    acc = evaluate(clf, [(x, yc)])[1]
    assert acc == int((clf(x).argmax(-1) == yc).sum()) / 9
    trainer = Trainer(clf, torch.optim.SGD(clf.parameters(), lr=0.0), progress=False)
    result = trainer.fit([(x[:8], yc[:8]), (x[8:], yc[8:])], epochs=1)
    want = float(nn.functional.cross_entropy(clf(x), yc))  # the mean over the 9 samples
    assert abs(result.history[-1].loss - want) < 1e-5


def test_structured_inputs_outputs_and_a_clear_error_for_dict_batches() -> None:
    """The Trainer took only (tensor, tensor) batches and a tensor output: a multi-input batch ((x1, x2), y) raised
    "'tuple' object has no attribute 'to'", a model returning a dict or a Hugging Face ModelOutput raised "no
    attribute 'float'" even with a loss_fn that indexes it, and a dict batch unpacked its keys. Now inputs may be a
    tuple (model(*x)) or a dict (model(**x)) and a structured output goes to loss_fn as it is; a batch that is no
    (inputs, targets) pair is one line. Reference: the same steps by hand, fp32 (tolerance 0)."""
    from overdrive.train import Trainer
    from overdrive.train.loop import evaluate

    class TwoIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(5, 3)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.a(x1) + self.b(x2)}

    def loss_fn(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out["logits"], y)

    torch.manual_seed(0)
    model, ref = TwoIn(), TwoIn()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(6, 4, generator=g), torch.randn(6, 5, generator=g)), torch.randint(0, 3, (6,), generator=g))
            for _ in range(3)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (x1, x2), y in data:
        loss_fn(ref(x1, x2), y).backward()
        opt.step()
        opt.zero_grad()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, progress=False)
    trainer.fit(data, epochs=1)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    kw = [({"x1": x1, "x2": x2}, y) for (x1, x2), y in data]  # keyword inputs
    loss, acc = evaluate(model, kw, loss_fn=loss_fn)
    assert loss == pytest.approx(sum(float(loss_fn(model(*x), y)) for x, y in data) / 3, rel=1e-5)
    # a dict output's "logits" are class scores: top-1 accuracy reads them, as it reads a tensor output
    assert acc == sum(int((model(*x)["logits"].argmax(-1) == y).sum()) for x, y in data) / 18
    with pytest.raises(UsageError, match=r"takes batches \(inputs, targets\); the data yielded a dict with keys"):
        trainer.fit([{"x": torch.randn(2, 4), "y": torch.zeros(2, dtype=torch.long)}], epochs=1)
    other = TwoIn()
    plain = Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match="returns a dict, not a tensor of scores: pass loss_fn"):
        plain.fit(data, epochs=1)


def test_bad_trainer_and_policy_values_are_one_usage_error() -> None:
    """epochs=2.5 / "2" and loss_fn="cross_entropy" raised raw TypeErrors; init_scale=0 divided by zero at the first
    step, NaN skipped 50 steps before "diverged"; growth_interval="10" raised TypeError and 2.5 was accepted;
    keep_batchnorm_fp32="yes" was accepted. sparsify(model, "2:4") raised AttributeError; a preset name now works."""
    from overdrive.sparsity import is_2to4, sparsify
    from overdrive.train import Trainer

    model = nn.Linear(8, 4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    for bad in (2.5, "2", None, True):
        with pytest.raises(UsageError, match="must be an int >= 1"):
            trainer.fit([(torch.randn(2, 8), torch.zeros(2, dtype=torch.long))], epochs=bad)
    with pytest.raises(UsageError, match="is not callable"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn="cross_entropy", progress=False)
    for kw, match in (({"init_scale": 0.0}, "init_scale=0.0 must be a positive finite"),
                      ({"init_scale": float("nan")}, "init_scale=nan"),
                      ({"growth_interval": "10"}, "growth_interval='10' must be an int"),
                      ({"growth_interval": 2.5}, "growth_interval=2.5"),
                      ({"keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32='yes' must be True, False or None")):
        with pytest.raises(UsageError, match=match):
            Policy(opt_level="O1", **kw)
    with pytest.raises(UsageError, match=r"not a preset; use one of \['default', 'permuted', 'transposable'\]"):
        sparsify(nn.Linear(32, 32), "2:4")
    lin = nn.Linear(32, 32)
    sparsify(lin, "default")
    assert is_2to4(lin.weight)


def test_trainer_refuses_a_foreign_scheduler_a_loss_class_a_vector_loss_and_non_iterable_data() -> None:
    """A scheduler built on another optimizer was accepted and this one trained at a constant rate; a loss class,
    a per-sample loss, a string scheduler and fit(5, 1) failed deep in torch."""
    from overdrive import UsageError

    m = nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(UsageError, match="scheduler .* was built on another optimizer"):
        Trainer(m, o, scheduler=torch.optim.lr_scheduler.StepLR(other, 1), progress=False)
    with pytest.raises(UsageError, match="scheduler='cosine' is not an LR scheduler"):
        Trainer(m, o, scheduler="cosine", progress=False)
    with pytest.raises(UsageError, match=r"loss_fn=CrossEntropyLoss is a class; pass an instance, e.g. CrossEntropyLoss\(\)"):
        Trainer(m, o, loss_fn=nn.CrossEntropyLoss, progress=False)
    t = Trainer(m, o, loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"), progress=False)
    with pytest.raises(UsageError, match=r"loss_fn returned a tensor of shape \(8,\), not one value"):
        t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
    m2 = nn.Linear(4, 3)
    with pytest.raises(UsageError, match="train_data=5 is not an iterable of batches"):
        Trainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), progress=False).fit(5, 1)


def test_an_o2_checkpoint_saved_after_add_param_group_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reference: the uninterrupted run. The load said "amp state holds 4 master params, this model has 2": the
    optimizer's state, loaded first, made amp take the added group for stepped parameters and make no masters."""
    from overdrive.amp import Policy
    from overdrive.train import load_checkpoint, save_checkpoint

    def make() -> Trainer:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
        opt = torch.optim.AdamW(m[1].parameters(), lr=1e-2)
        t = Trainer(m, opt, policy=Policy(opt_level="O2", dtype=torch.bfloat16), progress=False)
        opt.add_param_group({"params": list(m[0].parameters())})  # the backbone unfrozen
        return t

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    ref = make()
    for b in data:
        ref.train_step(b)
    t = make()
    for b in data[:2]:
        t.train_step(b)
    save_checkpoint(tmp_path / "ag.pt", t)
    resumed = make()
    load_checkpoint(tmp_path / "ag.pt", resumed)
    for b in data[2:]:
        resumed.train_step(b)
    assert all(torch.equal(a, b) for a, b in zip(ref.mp.master_params(), resumed.mp.master_params()))
