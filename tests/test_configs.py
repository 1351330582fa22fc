"""Every technique's config on the one config base: dict and JSON round trips, unknown keys named with the
known ones, frozen objects and presets no caller can change, the JSON that earlier versions wrote still
loads, and sparsity's old ``Config`` name still works with a DeprecationWarning."""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import pytest
import torch

from overdrive import UsageError
from overdrive._utils.config import ConfigBase
from overdrive.amp import Policy
from overdrive.data import LoaderConfig
from overdrive.data import PRESETS as DATA_PRESETS
from overdrive.distributed import PRESETS as STRATEGY_PRESETS
from overdrive.distributed import LaunchConfig, Strategy
from overdrive.engine import BF16_CUDA, FP16_CUDA, FP32_DEFAULT, BuildConfig, Builder, ShapeProfile
from overdrive.quant import PRESETS as QUANT_PRESETS
from overdrive.quant import QuantConfig, QuantizerConfig
from overdrive.sparsity import PRESETS as SPARSITY_PRESETS
from overdrive.sparsity import SparsityConfig
from tests._config_checks import assert_frozen

DYN = ShapeProfile("x", (1, 3), (4, 3), (8, 3))

# One or more instances of every config class: presets, plus non-defaults in the fields whose JSON form
# differs from the Python one (tuples, dtypes, nested configs, lists of profiles).
EXAMPLES: dict[str, ConfigBase] = {
    "Policy()": Policy(),
    "Policy(O2, bf16, resolved)": Policy(opt_level="O2", dtype=torch.bfloat16).resolve(torch.device("cpu")),
    "Policy(O1, fp16, outputs fp32)": Policy(opt_level="O1", dtype="fp16", cast_model_outputs=torch.float32,
                                             loss_scale=128, min_loss_scale=1.0),
    "QuantizerConfig(fp8)": QuantizerConfig(format="fp8_e4m3", per_channel=True),
    **{f"quant:{n}": c for n, c in QUANT_PRESETS.items()},
    "QuantConfig(changed)": QuantConfig(method="percentile", percentile=99.9, exclude=("stem.*", "fc2"),
                                        input=QuantizerConfig(format="fp8_e4m3"), residual_add=False),
    **{f"data:{n}": c for n, c in DATA_PRESETS.items()},
    "LoaderConfig(bf16)": LoaderConfig(batch_size=8, size=32, dtype=torch.bfloat16, mean=(0, 0, 0), std=(1, 1, 1)),
    **{f"sparsity:{n}": c for n, c in SPARSITY_PRESETS.items()},
    "SparsityConfig(names)": SparsityConfig(allowed_layer_names=["a", "b"], disallowed_layer_names=("b",)),
    "ShapeProfile": DYN,
    "engine:FP32_DEFAULT": FP32_DEFAULT,
    "engine:FP16_CUDA": FP16_CUDA,
    "engine:BF16_CUDA": BF16_CUDA,
    "BuildConfig(profiles)": BuildConfig(precision="fp16", profiles=[DYN, ShapeProfile.fixed("m", (4, 8))],
                                         input_io_formats="fp16:hwc", output_io_formats=["fp32"], aot=False),
    "BuildConfig(int8 dynamic)": BuildConfig(precision="int8", int8_activations="dynamic"),
    **{f"distributed:{n}": c for n, c in STRATEGY_PRESETS.items()},
    "Strategy(fsdp blocks)": Strategy(kind="fsdp", fsdp_blocks=["Block"], reshard_after_forward=False),
    "LaunchConfig()": LaunchConfig(),
    "LaunchConfig(elastic)": LaunchConfig(nnodes=2, nproc_per_node="gpu", rdzv_endpoint="node0:29400", max_restarts=3),
}
CLASSES = sorted({type(c) for c in EXAMPLES.values()}, key=lambda c: c.__name__)


def test_every_config_class_is_covered() -> None:
    names = {c.__name__ for c in CLASSES}
    assert names == {"Policy", "QuantizerConfig", "QuantConfig", "LoaderConfig", "SparsityConfig", "ShapeProfile",
                     "BuildConfig", "Strategy", "LaunchConfig"}
    assert all(issubclass(c, ConfigBase) and dataclasses.is_dataclass(c) for c in CLASSES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_dict_and_json_round_trip(name: str) -> None:
    cfg = EXAMPLES[name]
    d = cfg.to_dict()
    json.dumps(d, allow_nan=False)  # JSON-safe as it is: no tuples-as-objects, no dtypes
    assert list(d) == [f.name for f in dataclasses.fields(cfg)]
    back = type(cfg).from_dict(d)
    assert back == cfg and hash(back) == hash(cfg)
    assert type(cfg).from_json(cfg.to_json()) == cfg
    assert type(cfg).from_dict(json.loads(json.dumps(d))) == cfg  # through real JSON: lists, dtype names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_unknown_key_is_a_usage_error_naming_it_and_the_known_keys(cls: type) -> None:
    cfg = next(c for c in EXAMPLES.values() if type(c) is cls)
    known = [f.name for f in dataclasses.fields(cls)]
    d = {**cfg.to_dict(), "bogus_key": 1}
    calls = {
        "from_dict": lambda: cls.from_dict(d),
        "from_json": lambda: cls.from_json(json.dumps(d)),
        "replace": lambda: cfg.replace(bogus_key=1),
    }
    for how, call in calls.items():
        with pytest.raises(UsageError) as info:
            call()
        msg = str(info.value)
        assert msg == f"{cls.__name__}: unknown key(s) ['bogus_key']; known keys: {known}", how


def test_unknown_nested_key_names_the_nested_class() -> None:
    d = QuantConfig().to_dict()
    d["weight"]["bitz"] = 4
    with pytest.raises(UsageError, match=r"QuantizerConfig: unknown key\(s\) \['bitz'\]; known keys: \['format'"):
        QuantConfig.from_dict(d)
    d = BuildConfig(profiles=[DYN]).to_dict()
    d["profiles"][0]["maxx"] = [9, 3]
    with pytest.raises(UsageError, match=r"ShapeProfile: unknown key\(s\) \['maxx'\]"):
        BuildConfig.from_dict(d)


def test_build_config_from_json_unknown_key_is_not_a_type_error() -> None:
    with pytest.raises(UsageError, match=r"BuildConfig: unknown key\(s\) \['precison'\]; known keys: \['precision'"):
        BuildConfig.from_json('{"precison": "fp16"}')


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_bad_json_and_non_dict_are_usage_errors(cls: type) -> None:
    with pytest.raises(UsageError, match=f"{cls.__name__}: the text is not valid JSON"):
        cls.from_json("{not json")
    with pytest.raises(UsageError, match=f"{cls.__name__}: expected a dict"):
        cls.from_json("[1, 2]")


def test_missing_required_key_is_named() -> None:
    with pytest.raises(UsageError, match=r"ShapeProfile: missing key\(s\) \['opt', 'max'\]"):
        ShapeProfile.from_dict({"name": "x", "min": [1]})


def test_validation_still_runs_on_from_dict_and_replace() -> None:
    with pytest.raises(UsageError, match="precision='fp12' is not one of"):
        BuildConfig.from_dict({"precision": "fp12"})
    with pytest.raises(UsageError, match="precision='fp12' is not one of"):
        FP16_CUDA.replace(precision="fp12")
    with pytest.raises(UsageError, match="dtype=.*int8"):
        LoaderConfig.from_dict({"dtype": "int8"})
    with pytest.raises(UsageError, match="is a string"):
        SparsityConfig().replace(disallowed_layer_names="head")
    assert SparsityConfig().replace(mask_calculator="m4n2_2d").mask_calculator == "m4n2_2d_best"  # normalized


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_frozen(name: str) -> None:
    assert_frozen(EXAMPLES[name])


def test_presets_cannot_be_changed_by_a_caller() -> None:
    before = FP16_CUDA.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP16_CUDA.precision = "fp32"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        FP16_CUDA.profiles.append(DYN)  # type: ignore[attr-defined]
    changed = FP16_CUDA.replace(device="cuda:1", profiles=[DYN])
    assert changed.device == "cuda:1" and changed.profiles == (DYN,)
    builder = Builder(FP16_CUDA, profiles=[DYN])
    assert builder.config.profiles == (DYN,)
    assert FP16_CUDA.to_dict() == before and FP16_CUDA == BuildConfig(precision="fp16", device="cuda")
    assert FP16_CUDA.profiles == () and FP16_CUDA.device == "cuda"


def test_engine_presets_like_the_others() -> None:
    from overdrive import engine

    assert engine.PRESETS == {"fp32": FP32_DEFAULT, "fp16_cuda": FP16_CUDA, "bf16_cuda": BF16_CUDA}
    assert all(engine.get_preset(n) is c for n, c in engine.PRESETS.items())
    with pytest.raises(UsageError, match="'fp64' is not one of"):
        engine.get_preset("fp64")
    assert {"PRESETS", "get_preset"} <= set(engine.__all__)


# JSON exactly as the hand-written round trips of earlier versions wrote it: it must still load, and be written
# the same way (sparsity checkpoints and saved recipes hold it).
OLD_JSON: dict[str, tuple[ConfigBase, str]] = {
    "Policy": (Policy(opt_level="O2", dtype=torch.bfloat16).resolve(torch.device("cpu")),
               '{"cast_model_outputs": "float32", "cast_model_type": "bfloat16", "dtype": "bfloat16", '
               '"growth_interval": 2000, "init_scale": 65536.0, "keep_batchnorm_fp32": true, "loss_scale": 1.0, '
               '"master_weights": true, "max_loss_scale": 16777216.0, "min_loss_scale": null, "opt_level": "O2"}'),
    # layer_types as that version spelled them out (its default then; Conv1D, GPT-2's layer, came later)
    "QuantConfig": (QuantConfig(method="percentile", exclude=("fc2",), input=QuantizerConfig(format="fp8_e4m3"),
                                layer_types=("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d")),
                    '{\n  "input": {\n    "format": "fp8_e4m3",\n    "per_channel": false,\n    "narrow_range": false,\n'
                    '    "enabled": true\n  },\n  "weight": {\n    "format": "int8",\n    "per_channel": true,\n'
                    '    "narrow_range": true,\n    "enabled": true\n  },\n  "method": "percentile",\n'
                    '  "percentile": 99.99,\n  "num_bins": 2048,\n  "layer_types": [\n    "Linear",\n    "Conv1d",\n'
                    '    "Conv2d",\n    "Conv3d",\n    "ConvTranspose2d"\n  ],\n  "include": [\n    "*"\n  ],\n'
                    '  "exclude": [\n    "fc2"\n  ],\n  "residual_add": true,\n  "quantize_matmuls": false\n}'),
    "BuildConfig": (BuildConfig(precision="fp16", device="cuda", profiles=[DYN], input_io_formats="fp16:chw"),
                    '{"precision": "fp16", "backend": "auto", "device": "cuda", "profiles": [{"name": "x", "min": [1, 3], '
                    '"opt": [4, 3], "max": [8, 3]}], "compile_mode": null, "aot": null, "channels_last": true, '
                    '"opset": 18, "timing_cache": null, "input_io_formats": ["fp16:chw"], "output_io_formats": [], '
                    '"freezing": null, "gemm_gelu": null, "drop_constant_masks": true}'),
    # num_workers given: its default is 4 capped at this machine's cores; what old JSON says is kept
    "LoaderConfig": (LoaderConfig(batch_size=64, dtype=torch.bfloat16, num_workers=4),
                     '{"batch_size": 64, "size": 224, "train": true, "scale": [0.08, 1.0], "ratio": [0.75, '
                     '1.3333333333333333], "flip": 0.5, "crop_fraction": 0.875, "mean": [0.485, 0.456, 0.406], "std": '
                     '[0.229, 0.224, 0.225], "dtype": "bfloat16", "channels_last": false, "drop_last": false, "seed": 0, '
                     '"shard_id": 0, "num_shards": 1, "num_workers": 4, "read_workers": 12, "gpu_threads": 4, '
                     '"fused": false, "prefetch": 2, "pipeline": "auto"}'),
    "SparsityConfig": (SparsityConfig(mask_calculator="m4n2_2d_best", disallowed_layer_names=("head",)),
                       '{"allow_recompute_mask": false, "allowed_layer_names": null, "disallowed_layer_names": ["head"], '
                       '"layer_types": ["Linear", "Conv1d", "Conv2d", "Conv3d", "MultiheadAttention"], "mask_calculator": '
                       '"m4n2_2d_best", "pattern": "2:4", "permutation": false, "permutation_budget_s": 2.0}'),
    "Strategy": (Strategy(kind="fsdp", fsdp_blocks=("Block",)),
                 '{"kind": "fsdp", "bucket_cap_mb": 25.0, "gradient_as_bucket_view": true, "static_graph": false, '
                 '"find_unused_parameters": false, "broadcast_buffers": true, "reshard_after_forward": true, '
                 '"fsdp_blocks": ["Block"]}'),
}


@pytest.mark.parametrize("name", list(OLD_JSON))
def test_json_written_by_earlier_versions_loads_and_is_written_the_same(name: str) -> None:
    cfg, text = OLD_JSON[name]
    assert type(cfg).from_json(text) == cfg
    assert cfg.to_json() == text


def test_engine_header_inputs_entry_reads_as_a_profile() -> None:
    # Engine headers store each input as the profile's dict plus the binding's dtype and layout
    entry = {**DYN.to_dict(), "dtype": "float16", "layout": "hwc"}
    assert ShapeProfile.from_dict(entry) == DYN
    assert BuildConfig.from_dict({"profiles": [DYN.to_dict()]}).profiles == (DYN,)


def test_dtypes_come_back_as_dtypes() -> None:
    p = Policy.from_json(Policy(opt_level="O3", dtype="bf16", cast_model_outputs="float32").to_json())
    assert p.dtype is torch.bfloat16 and p.cast_model_outputs is torch.float32
    assert LoaderConfig.from_dict({"dtype": "float16"}).dtype is torch.float16


@dataclasses.dataclass(frozen=True)
class _Hooked(ConfigBase):
    """A field whose JSON form differs: a set written as a sorted list (one hook each way)."""

    tags: frozenset[str] = frozenset()
    ratio: tuple[float, float] = (0.5, 2.0)

    def _encode_field(self, name: str, value: Any) -> Any:
        return sorted(value) if name == "tags" else super()._encode_field(name, value)

    @classmethod
    def _decode_field(cls, name: str, value: Any, hint: Any) -> Any:
        return frozenset(value) if name == "tags" else super()._decode_field(name, value, hint)


def test_per_field_hooks() -> None:
    cfg = _Hooked(tags=frozenset({"b", "a"}), ratio=(1.0, 3.0))
    assert cfg.to_dict() == {"tags": ["a", "b"], "ratio": [1.0, 3.0]}
    assert _Hooked.from_json(cfg.to_json()) == cfg


def test_sparsity_config_old_name_warns_and_is_the_same_class() -> None:
    import overdrive.sparsity
    import overdrive.sparsity.config

    for module in (overdrive.sparsity, overdrive.sparsity.config):
        with pytest.warns(DeprecationWarning, match="SparsityConfig"):
            old = module.Config
        assert old is SparsityConfig
    with pytest.warns(DeprecationWarning):
        from overdrive.sparsity import Config
    assert Config is SparsityConfig
    assert "Config" not in overdrive.sparsity.__all__ and "SparsityConfig" in overdrive.sparsity.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert overdrive.sparsity.SparsityConfig is SparsityConfig  # the new name does not warn
    with pytest.raises(AttributeError):
        overdrive.sparsity.NoSuchName  # noqa: B018
