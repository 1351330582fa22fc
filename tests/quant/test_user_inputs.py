"""Bad user input to the native quant API: refused with a one-line UsageError naming the value, never a silently
wrong amax or a layer quantized that was meant to stay float."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError
from overdrive.quant import QuantConfig, QuantizerConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _data() -> torch.Tensor:
    return torch.randn(512, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pct", [0.9999, 200.0, 50.0, -1.0, float("nan"), "99.9"])
def test_percentile_out_of_range_is_refused_and_amax_kept(pct: object) -> None:
    """0.9999 (a fraction) used to give amax at the 0.9999th percentile (every activation clipped), 200 silently
    meant max; now every entry point refuses it and leaves amax as it was."""
    x = _data()
    q = quant.quantize(_model(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    before = q[0].input_quantizer.amax.clone()
    assert float(before) == pytest.approx(float(x.abs().max()), rel=1e-6)  # max calibration: the reference
    for call in (lambda: quant.load_calib_amax(q, "percentile", pct),
                 lambda: quant.calibrate(q, lambda m: m(x), method="percentile", percentile=pct),
                 lambda: quant.compare_calibrators(q, lambda m: 0.0, methods=[("percentile", pct)])):
        with pytest.raises(UsageError, match=r"percentile .* must be a number in \(50, 100\]"):
            call()
        assert torch.equal(q[0].input_quantizer.amax, before)
    with pytest.raises(UsageError, match="percentile"):
        QuantConfig(method="percentile", percentile=pct)  # type: ignore[arg-type]


def test_percentile_in_range_still_matches_the_data() -> None:
    x = _data()
    q = quant.quantize(_model(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    quant.load_calib_amax(q, "percentile", 99.0)
    ref = float(torch.quantile(x.abs().flatten(), 0.99))
    assert float(q[0].input_quantizer.amax) == pytest.approx(ref, rel=0.02)  # within the histogram's bins


@pytest.mark.parametrize("kwargs, fragment", [
    ({"exclude": "fc2"}, r"exclude='fc2' is a string; give a tuple of strings, e.g. exclude=\('fc2',\)"),
    ({"include": "0"}, r"include='0' is a string"),
    ({"layer_types": "Linear"}, r"layer_types='Linear' is a string"),
    ({"exclude": (2,)}, r"non-string item\(s\) \[2\]"),
    ({"input": "fp8_e4m3"}, r"input='fp8_e4m3' must be a QuantizerConfig"),
    ({"num_bins": 300.5}, r"num_bins 300.5 must be an int"),
])
def test_bad_config_values_are_named(kwargs: dict, fragment: str) -> None:
    """A string exclude was read one pattern per character ('f', 'c', '2'): nothing excluded, no error."""
    with pytest.raises(UsageError, match=fragment):
        QuantConfig(**kwargs)


def test_config_lists_from_json_still_accepted() -> None:
    cfg = QuantConfig(exclude=["2"], include=["*"], input=QuantizerConfig(format="fp8_e4m3"))
    assert cfg.exclude == ("2",) and QuantConfig.from_json(cfg.to_json()) == cfg


def test_exclude_pattern_matching_nothing_warns_with_the_full_name() -> None:
    """exclude=("head",) does not match "decoder.head" (fnmatch on the dotted name): the head was quantized in
    silence; now a warning names the pattern and the full names it may have meant."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.ModuleDict({"body": nn.Linear(8, 8), "head": nn.Linear(8, 3)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder["head"](self.decoder["body"](x))

    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"exclude pattern 'head' matches no module.*\['decoder.head'\]"):
        q = quant.quantize(Net().eval(), quant.INT8_DEFAULT.replace(exclude=("head",)), forward_loop=lambda m: m(x))
    assert "decoder.head" in quant.quantized_layers(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching pattern, and the default include ("*",), say nothing
        q = quant.quantize(Net().eval(), quant.INT8_DEFAULT.replace(exclude=("decoder.head",)),
                           forward_loop=lambda m: m(x))
    assert quant.quantized_layers(q) == ["decoder.body"]


def test_excluding_an_inserted_residual_add_by_name_does_not_warn() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(x)

    model = nn.Sequential(Block()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        q = quant.quantize(model, quant.INT8_DEFAULT.replace(exclude=("0.residual_add0",)),
                           forward_loop=lambda m: m(torch.randn(4, 8)))
    assert quant.quantized_layers(q) == ["0.fc"]


def test_forward_loop_and_model_mistakes_are_one_line_errors() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(UsageError, match=r"forward_loop must be a function .* got a list; e.g. forward_loop=lambda m"):
        quant.quantize(_model(), quant.INT8_DEFAULT, forward_loop=[x])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="takes no argument; it is called with the model"):
        quant.quantize(_model(), quant.INT8_DEFAULT, forward_loop=lambda: None)  # type: ignore[arg-type, misc]
    with pytest.raises(UsageError, match="model must be a torch.nn.Module, got function"):
        quant.quantize(lambda t: t, quant.INT8_DEFAULT)  # type: ignore[arg-type]
    q = quant.quantize(_model(), quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match="got a list"):
        quant.calibrate(q, [x])  # type: ignore[arg-type]


def test_set_quantizers_enabled_takes_one_name_as_a_string() -> None:
    """A string was iterated per character: '2' happened to work, 'fc' raised 'no quantized layer named ['f', 'c']'."""
    x = _data()
    q = quant.quantize(_model(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    quant.set_quantizers_enabled(q, False, "2")
    assert not q[2].input_quantizer.enabled and q[0].input_quantizer.enabled
    with pytest.raises(UsageError, match=r"no quantized layer named \['fc'\]"):
        quant.set_quantizers_enabled(q, False, "fc")
