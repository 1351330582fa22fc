"""ModelOpt's ``quant_cfg`` in both forms: the current ordered list of entries and the older dict.

Reference: ModelOpt's quant_cfg semantics, stated per test as the table of quantizers that end up enabled and with
which format and axis on a small model with a Conv2d, a BatchNorm2d, a Linear and a head named ``lm_head``.
Entries apply in order, later ones override earlier ones; a ``cfg`` entry replaces the attributes (what it leaves
out is int8 per tensor) and enables unless ``enable`` says otherwise; an ``enable``-only entry only switches on or
off; ``parent_class`` keeps an entry to quantizers whose owning layer is of that class. The old dict form applies
``"default"`` first, then each key in order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq  # was: import modelopt.torch.quantization as mtq
from overdrive import quant
from overdrive._utils.errors import UsageError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 16)
        self.lm_head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))  # (B, 8)
        return self.lm_head(torch.relu(self.fc(h)))


def make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def loop(model: nn.Module) -> None:
    model(X)


BITS = {"int8": 8, "fp8_e4m3": (4, 3)}
INT8_W, INT8_A, FP8 = (True, 8, 0), (True, 8, None), (True, (4, 3), None)
OFF = False


def table(model: nn.Module) -> dict[str, object]:
    """quantizer name -> (True, num_bits, axis) if enabled, else False."""
    return {n: (True, BITS[q.config.format], q.axis) if q.enabled else OFF for n, q in quant.quantizers(model)}


def names(prefix: str) -> list[str]:
    return [f"{prefix}.input_quantizer", f"{prefix}.weight_quantizer"]


# the INT8_DEFAULT_CFG table: weights int8 per output channel, inputs int8 per tensor, lm_head in float
INT8_TABLE = {"conv.input_quantizer": INT8_A, "conv.weight_quantizer": INT8_W, "fc.input_quantizer": INT8_A,
              "fc.weight_quantizer": INT8_W, "lm_head.input_quantizer": OFF, "lm_head.weight_quantizer": OFF}

OLD_INT8_DICT = {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                 "nn.BatchNorm2d": {"*": {"enable": False}}, "*lm_head*": {"enable": False},
                 "default": {"enable": False}}


def test_preset_is_the_list_form_and_matches_the_old_dict_form_bit_for_bit():
    listed = mtq.quantize(make(), mtq.INT8_DEFAULT_CFG, loop)
    old = mtq.quantize(make(), {"quant_cfg": copy.deepcopy(OLD_INT8_DICT), "algorithm": "max"}, loop)
    assert isinstance(mtq.INT8_DEFAULT_CFG["quant_cfg"], list)
    assert mtq.INT8_DEFAULT_CFG["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}
    assert table(listed) == table(old) == INT8_TABLE
    for (n, a), (_, b) in zip(quant.quantizers(listed), quant.quantizers(old)):
        assert (a.amax is None and b.amax is None) or torch.equal(a.amax, b.amax), n
    with torch.no_grad():
        assert torch.equal(listed(X), old(X))


def test_a_later_cfg_entry_replaces_the_attributes_it_does_not_merge():
    base = [{"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None}}]
    fc_fp8 = {"quantizer_name": "fc.weight_quantizer", "cfg": {"num_bits": (4, 3)}}
    model = mtq.quantize(make(), {"quant_cfg": [*base, fc_fp8], "algorithm": "max"}, loop)
    # axis 0 of the earlier entry is not inherited: fp8 per tensor
    assert table(model) == {**INT8_TABLE, "fc.weight_quantizer": FP8, "lm_head.input_quantizer": INT8_A,
                            "lm_head.weight_quantizer": INT8_W}
    model = mtq.quantize(make(), {"quant_cfg": [base[0], fc_fp8, *base[1:]], "algorithm": "max"}, loop)
    assert table(model)["fc.weight_quantizer"] == INT8_W  # the later, broader entry wins


def test_enable_only_entries_keep_the_attributes():
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                         {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": "e4m3", "axis": None}},
                         {"quantizer_name": "*weight_quantizer", "enable": False},
                         {"quantizer_name": "fc.weight_quantizer", "enable": True},
                         {"quantizer_name": "lm_head.input_quantizer", "enable": True}]}
    assert table(mtq.quantize(make(), cfg, loop)) == {
        "conv.input_quantizer": OFF, "conv.weight_quantizer": OFF, "fc.input_quantizer": OFF,
        "fc.weight_quantizer": FP8,  # switched back on with the fp8 cfg it had
        "lm_head.input_quantizer": INT8_A,  # never configured: a fresh quantizer's int8 per tensor
        "lm_head.weight_quantizer": OFF}


def test_parent_class_restricts_an_entry_to_one_layer_class():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "parent_class": "nn.Conv2d", "enable": False})
    cfg["quant_cfg"].append({"quantizer_name": "*weight_quantizer", "parent_class": "nn.Linear",
                             "cfg": {"num_bits": (4, 3), "axis": None}})
    assert table(mtq.quantize(make(), cfg, loop)) == {
        **INT8_TABLE, "conv.input_quantizer": OFF, "fc.weight_quantizer": FP8,
        "lm_head.weight_quantizer": FP8}  # the later Linear entry enables lm_head's weight quantizer again
    old = {"quant_cfg": {**OLD_INT8_DICT, "nn.Conv2d": {"*input_quantizer": {"enable": False}}}}
    assert table(mtq.quantize(make(), old, loop)) == {**INT8_TABLE, "conv.input_quantizer": OFF}


def test_old_and_new_edit_styles_on_a_preset_copy_give_the_same_model():
    new = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    new["quant_cfg"].append({"quantizer_name": "fc.*", "enable": False})
    mtq.find_quant_cfg_entry_by_path(new["quant_cfg"], "*weight_quantizer")["cfg"]["axis"] = None
    old = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    old["quant_cfg"]["fc.*"] = {"enable": False}
    old["quant_cfg"]["*weight_quantizer"]["axis"] = None
    expected = {**INT8_TABLE, "conv.weight_quantizer": INT8_A, "fc.input_quantizer": OFF, "fc.weight_quantizer": OFF}
    a, b = mtq.quantize(make(), new, loop), mtq.quantize(make(), old, loop)
    assert table(a) == table(b) == expected
    with torch.no_grad():
        assert torch.equal(a(X), b(X))
    # an old-style assignment to a key the preset has replaces that entry where it stands
    again = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    at = [e.get("quantizer_name") for e in again["quant_cfg"]].index("*lm_head*")
    again["quant_cfg"]["*lm_head*"] = {"enable": True}
    assert again["quant_cfg"][at] == {"quantizer_name": "*lm_head*", "cfg": {"enable": True}}
    assert table(mtq.quantize(make(), again, loop)) == {**INT8_TABLE, "lm_head.input_quantizer": INT8_A,
                                                        "lm_head.weight_quantizer": INT8_W}


def test_old_dict_form_applies_default_first_and_legacy_entries_inside_a_list():
    """"default" is applied before every other key however the dict is ordered (the old semantics), and a list
    may mix old single-key entries with new ones."""
    old = {"quant_cfg": copy.deepcopy(OLD_INT8_DICT)}
    assert list(old["quant_cfg"])[-1] == "default"  # last here, applied first
    assert table(mtq.quantize(make(), old, loop)) == INT8_TABLE
    mixed = [{"default": {"enable": False}}, {"*weight_quantizer": {"num_bits": 8, "axis": 0}},
             {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}}, {"*lm_head*": {"enable": False}}]
    assert table(mtq.quantize(make(), {"quant_cfg": mixed}, loop)) == INT8_TABLE


def test_a_config_loaded_from_yaml():
    yaml = pytest.importorskip("yaml")
    text = """
algorithm: max
quant_cfg:
  - quantizer_name: '*'
    enable: false
  - quantizer_name: '*weight_quantizer'
    cfg: {num_bits: [4, 3], axis: null}
  - quantizer_name: '*input_quantizer'
    cfg: {num_bits: e4m3}
  - quantizer_name: '*input_quantizer'
    parent_class: nn.Conv2d
    enable: false
  - quantizer_name: '*lm_head*'
    enable: false
"""
    model = mtq.quantize(make(), yaml.safe_load(text), loop)
    assert table(model) == {"conv.input_quantizer": OFF, "conv.weight_quantizer": FP8, "fc.input_quantizer": FP8,
                            "fc.weight_quantizer": FP8, "lm_head.input_quantizer": OFF,
                            "lm_head.weight_quantizer": OFF}


def test_set_quantizer_by_cfg_takes_the_list_form():
    model = mtq.quantize(make(), mtq.INT8_DEFAULT_CFG, loop)
    amax = model.fc.weight_quantizer.amax.clone()
    mtq.set_quantizer_by_cfg(model, [{"quantizer_name": "*", "parent_class": "nn.Linear", "enable": False},
                                     {"quantizer_name": "fc.weight_quantizer", "enable": True}])
    assert table(model) == {**INT8_TABLE, "fc.input_quantizer": OFF}
    assert torch.equal(model.fc.weight_quantizer.amax, amax)  # only switched off and on: calibration kept


BAD = [
    ({"quantizer_name": "*weight_quantizer", "cfg": [{"num_bits": 4, "block_sizes": {-1: 128}}, {"num_bits": (4, 3)}]},
     r"cfg is a list \(2 formats.*SequentialQuantizer.*give cfg one dict"),
    ({"quantizer_name": "*input_quantizer", "parent_class": "nn.NotAModule", "enable": False},
     r"parent_class='nn.NotAModule' is not a module class.*'nn.Linear'"),
    ({"quantizer_name": "*weight_quantizer"}, r"neither 'cfg' nor 'enable'"),
    ({"quantizer_name": "*weight_quantizer", "num_bits": 8}, r"unknown key\(s\) \['num_bits'\].*inside 'cfg'"),
    ({"$import": "configs/numerics/fp8", "quantizer_name": "*"}, r"unknown key\(s\) \['\$import'\]"),
    ({"quantizer_name": "*weight_quantizer", "cfg": {}}, r"cfg is empty"),
    ({"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4}}, r"num_bits=4 is not supported"),
    ({"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "type": "dynamic"}},
     r"type='dynamic'.*not support"),
    ({"quantizer_name": "*", "enable": "no"}, r"enable='no' must be True or False"),
    ("*lm_head*", r"not a quant_cfg entry"),
]


@pytest.mark.parametrize("entry,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_unsupported_entries_raise_one_line_before_the_model_is_touched(entry, message):
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"].append(entry)
    model = make()
    with pytest.raises(UsageError, match=message) as err:
        mtq.quantize(model, cfg, loop)
    assert "\n" not in str(err.value)
    assert type(model.fc) is nn.Linear and type(model.conv) is nn.Conv2d  # refused before any layer swap


def test_quant_cfg_list_reads_and_edits_like_the_old_dict():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)["quant_cfg"]
    n = len(cfg)
    assert cfg["default"] == {"enable": False} and "default" in cfg and "*lm_head*" in cfg and "*nope*" not in cfg
    assert cfg.get("*nope*") is None and cfg["nn.BatchNorm2d"] == {"*": {"enable": False}}
    with pytest.raises(KeyError):
        cfg["*nope*"]  # noqa: B018
    cfg.update({"*proj*": {"enable": False}, "*router*": {"enable": True}})
    assert len(cfg) == n + 1 and cfg[-1] == {"quantizer_name": "*proj*", "cfg": {"enable": False}}
    assert cfg.pop("*proj*") == {"enable": False} and len(cfg) == n and cfg.pop("*proj*", None) is None
    del cfg["*router*"]
    assert "*router*" not in cfg and len(cfg) == n - 1
    assert list(cfg.keys())[:3] == ["*", "*weight_quantizer", "*input_quantizer"]
    fresh = mtq.QuantCfgList()
    fresh["*weight_quantizer"] = {"num_bits": 8, "axis": 0}
    fresh["default"] = {"enable": False}  # goes first, as the old dict applied it
    assert fresh[0]["quantizer_name"] == "*" and isinstance(fresh.copy(), mtq.QuantCfgList)
    assert mtq.normalize_quant_cfg_list(fresh) == [
        {"quantizer_name": "*", "parent_class": None, "cfg": None, "enable": False},
        {"quantizer_name": "*weight_quantizer", "parent_class": None, "cfg": {"num_bits": 8, "axis": 0},
         "enable": True}]
