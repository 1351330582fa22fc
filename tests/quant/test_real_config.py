"""The configs of quant's real-precision verbs (RealConfig for to_real, WeightOnlyConfig for weight_only) and of
the QAT recipe (QATConfig for recipes.quant.qat): dict / JSON round trips, frozen, validation, an unknown
keyword as a UsageError naming it (was a TypeError), and a config giving the same model as the keywords."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn

from overdrive import UsageError, quant
from overdrive._utils.config import ConfigBase
from overdrive.amp import Policy
from overdrive.quant import RealConfig, WeightOnlyConfig
from overdrive.recipes.quant import QATConfig, qat
from tests._config_checks import assert_frozen

EXAMPLES: dict[str, ConfigBase] = {
    "RealConfig()": RealConfig(),
    "RealConfig(rowwise, cuda)": RealConfig(rowwise=True, device="cuda"),
    "RealConfig(torch.device)": RealConfig(device=torch.device("cpu")),
    "WeightOnlyConfig()": WeightOnlyConfig(),
    "WeightOnlyConfig(int4)": WeightOnlyConfig(bits=4, group_size=32, min_features=64, exclude=["lm_head", "*.proj"]),
    "QATConfig(string policy)": QATConfig(epochs=2, lr=1e-5, weight_decay=0.01, policy="O2", progress=True),
    "QATConfig(Policy)": QATConfig(epochs=1, lr=3e-5, policy=Policy(opt_level="O1", dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_dict_and_json_round_trip(name: str) -> None:
    cfg = EXAMPLES[name]
    d = cfg.to_dict()
    json.dumps(d, allow_nan=False)
    assert list(d) == [f.name for f in dataclasses.fields(cfg)]
    back = type(cfg).from_dict(json.loads(json.dumps(d)))
    assert back == cfg and hash(back) == hash(cfg)
    assert type(cfg).from_json(cfg.to_json()) == cfg


def test_qat_policy_json_forms() -> None:
    pol = Policy(opt_level="O1", dtype=torch.bfloat16)
    assert QATConfig(1, 1e-5, policy=pol).to_dict()["policy"] == pol.to_dict()
    assert QATConfig(1, 1e-5, policy="O2").to_dict()["policy"] == "O2"
    assert isinstance(QATConfig.from_json(QATConfig(1, 1e-5, policy=pol).to_json()).policy, Policy)
    with pytest.raises(UsageError, match=r"QATConfig: missing key\(s\) \['lr'\]"):
        QATConfig.from_dict({"epochs": 1})


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_frozen(name: str) -> None:
    assert_frozen(EXAMPLES[name])


@pytest.mark.parametrize("cls, changes, match", [
    (RealConfig, {"rowwise": "yes"}, r"rowwise='yes' must be True or False"),
    (RealConfig, {"device": "gpu"}, r"device='gpu' is not a torch device"),
    (WeightOnlyConfig, {"bits": 2}, r"bits=2 must be 4 or 8"),
    (WeightOnlyConfig, {"group_size": 0}, r"group_size=0 must be an int > 0"),
    (WeightOnlyConfig, {"min_features": -1}, r"min_features=-1 must be an int >= 0"),
    (WeightOnlyConfig, {"exclude": "lm_head"}, r"exclude='lm_head' is a string"),
    (QATConfig, {"epochs": 0, "lr": 1e-5}, r"epochs >= 1 and lr > 0, got epochs=0"),
    (QATConfig, {"epochs": 1, "lr": float("nan")}, r"lr=nan"),
    (QATConfig, {"epochs": 1, "lr": 1e-5, "weight_decay": -1.0}, r"weight_decay=-1.0 must be"),
    (QATConfig, {"epochs": 1, "lr": 1e-5, "policy": "O5"}, r"opt_level 'O5'"),
    (QATConfig, {"epochs": 1, "lr": 1e-5, "progress": 1}, r"progress=1 must be True or False"),
])
def test_validation_names_the_bad_value(cls: type, changes: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        cls(**changes)
    with pytest.raises(UsageError, match=match):
        cls.from_dict(changes)


def _calibrated() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x)), x


@pytest.mark.parametrize("call, bad", [
    (lambda m: quant.to_real(m, rowwise=False, row_wise=True), "row_wise"),
    (lambda m: quant.to_real(m, RealConfig(), dev="cpu"), "dev"),
    (lambda m: quant.weight_only(m, bitz=4), "bitz"),
    (lambda m: qat(m, [], epochs=1, lr=1e-5, weight_decy=0.1), "weight_decy"),
    (lambda m: qat(m, [], config=QATConfig(1, 1e-5), polcy="O2"), "polcy"),
    (lambda m: quant.qat(m, [], epochs=1, learning_rate=1e-5), "learning_rate"),  # the deprecated alias
])
def test_unknown_keyword_is_a_usage_error_naming_it_and_the_known_ones(call, bad: str) -> None:  # noqa: ANN001
    model, _ = _calibrated()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # quant.qat's
        with pytest.raises(UsageError, match=rf"Config: unknown key\(s\) \['{bad}'\]; known keys: \["):
            call(model)


def test_qat_without_epochs_or_lr_names_what_is_missing() -> None:
    model, _ = _calibrated()
    with pytest.raises(UsageError, match=r"qat needs lr"):
        qat(model, [], epochs=1)
    with pytest.raises(UsageError, match=r"must be an overdrive.recipes.quant.QATConfig"):
        qat(model, [], config={"epochs": 1, "lr": 1e-5})


def test_to_real_config_gives_the_same_model_as_keywords() -> None:
    model, x = _calibrated()
    with torch.no_grad():
        ref = quant.to_real(copy.deepcopy(model))(x)
        for real in (quant.to_real(copy.deepcopy(model), RealConfig(device="cpu")),
                     quant.to_real(copy.deepcopy(model), device="cpu"),
                     quant.to_real(copy.deepcopy(model), RealConfig(rowwise=True), rowwise=False),
                     quant.to_real(copy.deepcopy(model), False)):  # the old positional rowwise
            assert isinstance(real[0], quant.Int8Linear)
            assert torch.equal(real(x), ref)


def test_weight_only_config_gives_the_same_model_as_keywords() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))
    kw = quant.weight_only(copy.deepcopy(base), bits=4, group_size=32, min_features=64, exclude=("2",))
    cfg = WeightOnlyConfig(bits=4, group_size=32, min_features=64, exclude=("2",))
    for other in (quant.weight_only(copy.deepcopy(base), cfg),
                  quant.weight_only(copy.deepcopy(base), WeightOnlyConfig(bits=8), bits=4, group_size=32,
                                    min_features=64, exclude=("2",)),
                  quant.weight_only(copy.deepcopy(base), 4, group_size=32, min_features=64, exclude=("2",))):
        assert isinstance(other[0], quant.WeightOnlyLinear) and type(other[2]) is nn.Linear  # "2" excluded
        assert other[0].bits == 4 and other[0].group_size == 32
        assert torch.equal(other[0].q, kw[0].q) and torch.equal(other[0].scales, kw[0].scales)


def test_qat_from_a_config_trains_like_qat_from_keywords() -> None:
    """Same seed and data, one epoch of two steps: identical parameters, amax unchanged."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 16, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(2)]
    runs = {
        "keywords": lambda m: qat(m, data, epochs=1, lr=1e-2, weight_decay=0.01, policy="O0"),
        "positional": lambda m: qat(m, data, 1, 1e-2, None, weight_decay=0.01),
        "config": lambda m: qat(m, data, config=QATConfig(epochs=1, lr=1e-2, weight_decay=0.01)),
        "config + keywords": lambda m: qat(m, data, lr=1e-2, config=QATConfig(epochs=1, lr=1.0, policy="O0"),
                                           weight_decay=0.01),
    }
    params = {}
    for name, run in runs.items():
        model, _ = _calibrated()
        amax = {n: q.amax.clone() for n, q in quant.quantizers(model)}
        torch.manual_seed(2)
        result = run(model)
        assert len(result.history) == 1
        assert all(torch.equal(q.amax, amax[n]) for n, q in quant.quantizers(model))
        params[name] = [p.detach().clone() for p in model.parameters()]
    before = [p.detach() for p in _calibrated()[0].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(params["keywords"], before))  # it did train
    for name in runs:
        assert all(torch.equal(a, b) for a, b in zip(params[name], params["keywords"])), name
