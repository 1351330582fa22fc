from __future__ import annotations

import pytest

from overdrive._utils.errors import UsageError
from overdrive.quant import PRESETS, QuantConfig, QuantizerConfig, get_preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_json_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    assert get_preset(name) is cfg


def test_round_trip_with_changes() -> None:
    cfg = QuantConfig(method="percentile", percentile=99.9, exclude=("stem.*", "fc2"), residual_add=False)
    back = QuantConfig.from_json(cfg.to_json())
    assert back == cfg and back.exclude == ("stem.*", "fc2")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"method": "kl"}, "calibration method 'kl'"),
    ({"percentile": 40.0}, "percentile 40.0"),
    ({"num_bins": 16}, "num_bins 16"),
    ({"layer_types": ("LSTM",)}, "LSTM"),
])
def test_bad_config(kwargs: dict, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        QuantConfig(**kwargs)


def test_bad_format_and_preset_and_field() -> None:
    with pytest.raises(UsageError, match="int4"):
        QuantizerConfig(format="int4")
    with pytest.raises(UsageError, match="int2"):
        get_preset("int2")
    with pytest.raises(UsageError, match="bogus"):
        QuantConfig.from_dict({"bogus": 1})
