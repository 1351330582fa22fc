"""TrainConfig: Trainer's settings as one frozen config. Dict / JSON round trips (a Policy or Strategy as its
dict, a string as a string), validation with errors that name the value, an unknown Trainer keyword as a
UsageError (was a TypeError), and a Trainer built from a config training bit for bit like one built from
keywords."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from overdrive import UsageError
from overdrive.amp import Policy
from overdrive.distributed import Strategy
from overdrive.train import TrainConfig, Trainer
from tests._config_checks import assert_frozen

EXAMPLES: dict[str, TrainConfig] = {
    "defaults": TrainConfig(),
    "opt-level string": TrainConfig(policy="O2", accumulate=4, grad_clip=1.0, progress=False),
    "Policy": TrainConfig(policy=Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale=128), compile=True,
                          channels_last=True),
    "resolved Policy": TrainConfig(policy=Policy(opt_level="O2", dtype=torch.bfloat16).resolve(torch.device("cpu"))),
    "strategy string": TrainConfig(strategy="fsdp", device="cuda:1"),
    "Strategy": TrainConfig(strategy=Strategy(kind="fsdp", fsdp_blocks=("Block",), reshard_after_forward=False)),
    "torch.device": TrainConfig(device=torch.device("cpu")),
}

FIELDS = ["policy", "device", "grad_clip", "accumulate", "compile", "progress", "channels_last", "strategy"]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_dict_and_json_round_trip(name: str) -> None:
    cfg = EXAMPLES[name]
    d = cfg.to_dict()
    assert list(d) == FIELDS
    json.dumps(d, allow_nan=False)  # JSON-safe as it is
    back = TrainConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg and hash(back) == hash(cfg)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert type(back.policy) is type(cfg.policy) and type(back.strategy) is type(cfg.strategy)


def test_policy_and_strategy_json_forms() -> None:
    pol = Policy(opt_level="O1", dtype=torch.bfloat16)
    d = TrainConfig(policy=pol, strategy=Strategy(kind="ddp")).to_dict()
    assert d["policy"] == pol.to_dict() and d["strategy"] == Strategy(kind="ddp").to_dict()
    d = TrainConfig(policy="O3", strategy="ddp", device=torch.device("cpu")).to_dict()
    assert (d["policy"], d["strategy"], d["device"]) == ("O3", "ddp", "cpu")  # strings stay strings
    assert TrainConfig.from_dict({"policy": "O3"}).policy == "O3"


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_frozen(name: str) -> None:
    assert_frozen(EXAMPLES[name])


@pytest.mark.parametrize("changes, match", [
    ({"accumulate": 0}, r"accumulate=0 must be an int >= 1"),
    ({"accumulate": 2.5}, r"accumulate=2.5"),
    ({"grad_clip": 0.0}, r"grad_clip=0.0 must be a positive finite"),
    ({"grad_clip": float("inf")}, r"grad_clip=inf"),
    ({"policy": "O4"}, r"opt_level 'O4' is not one of O0, O1, O2, O3"),
    ({"policy": 2}, r"policy=2 must be an opt level"),
    ({"strategy": "horovod"}, r"strategy='horovod' is not one of"),
    ({"strategy": 3}, r"strategy=3 must be"),
    ({"device": "gpu"}, r"device='gpu' is not a torch device"),
    ({"compile": "yes"}, r"compile='yes' must be True or False"),
    ({"progress": None}, r"progress=None must be True or False"),
])
def test_validation_names_the_bad_value(changes: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        TrainConfig(**changes)
    with pytest.raises(UsageError, match=match):
        TrainConfig().replace(**changes)
    with pytest.raises(UsageError, match=match):
        TrainConfig.from_dict(changes)


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def test_unknown_trainer_keyword_is_a_usage_error_naming_it() -> None:
    model, opt = _model_and_opt()
    with pytest.raises(UsageError) as info:
        Trainer(model, opt, acumulate=2, progress=False)  # misspelt; was a TypeError
    assert str(info.value) == f"TrainConfig: unknown key(s) ['acumulate']; known keys: {FIELDS}"


def test_trainer_from_a_config_trains_like_trainer_from_keywords() -> None:
    """Same seed, same data, two optimizer steps (with bf16 O1 autocast, clipping and accumulation):
    the parameters come out identical."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    settings = {"policy": Policy(opt_level="O1", dtype=torch.bfloat16), "grad_clip": 0.1, "accumulate": 2,
                "progress": False, "device": "cpu"}

    def train(make) -> tuple[Trainer, list[torch.Tensor]]:  # noqa: ANN001
        model, opt = _model_and_opt()
        t = make(model, opt)
        for b in batches:
            t.train_step(b)
        return t, [q.detach().clone() for q in model.parameters()]

    t_kw, p_kw = train(lambda m, o: Trainer(m, o, **settings))
    t_cfg, p_cfg = train(lambda m, o: Trainer(m, o, TrainConfig(**settings)))
    t_mix, p_mix = train(lambda m, o: Trainer(m, o, TrainConfig(policy="O3", accumulate=5), **settings))
    assert t_kw.step_count == t_cfg.step_count == t_mix.step_count == 2
    p0 = [q.detach() for q in _model_and_opt()[0].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(p_kw, p0))  # it did train
    for a, b, c in zip(p_kw, p_cfg, p_mix):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert t_kw.config == t_cfg.config == t_mix.config == TrainConfig(**settings)
    for t in (t_kw, t_cfg):  # the attributes the loop, checkpoints and distributed code read
        assert (t.accumulate, t.grad_clip, t.progress, t.channels_last) == (2, 0.1, False, False)
        assert t.device == torch.device("cpu") and t.parallel is None and t.mp.policy.opt_level == "O1"


def test_keywords_replace_fields_of_the_config_and_leave_it_unchanged() -> None:
    cfg = TrainConfig(policy="O0", accumulate=3, progress=False)
    model, opt = _model_and_opt()
    t = Trainer(model, opt, cfg, accumulate=2)
    assert t.config == cfg.replace(accumulate=2) and t.accumulate == 2
    assert cfg.accumulate == 3  # frozen: the caller's config is not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.config.accumulate = 4  # type: ignore[misc]


def test_third_positional_argument_may_still_be_the_policy() -> None:
    for policy in ("O1", Policy(opt_level="O1", dtype=torch.bfloat16)):
        model, opt = _model_and_opt()
        t = Trainer(model, opt, policy, progress=False)
        assert t.config.policy == policy and t.mp.policy.opt_level == "O1"
    model, opt = _model_and_opt()
    with pytest.raises(UsageError, match="policy is given twice"):
        Trainer(model, opt, "O1", policy="O2")
    with pytest.raises(UsageError, match="must be an overdrive.train.TrainConfig"):
        Trainer(model, opt, {"policy": "O1"})
