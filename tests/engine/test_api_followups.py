"""BuildConfig.allow_tf32 (trtexec's --noTF32), the compile_mode warning off Inductor, engine.layer_info."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig
from overdrive.engine.fp32_flags import fp32_flags, precision_flags


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8", "fp8"])
def test_allow_tf32_false_gives_the_strict_flags(precision: str) -> None:
    strict = fp32_flags("fp32")
    assert fp32_flags(precision)["cuda.matmul"] == "tf32"
    assert fp32_flags(precision, allow_tf32=False) == strict
    with precision_flags(fp32_flags(precision, allow_tf32=False)):  # the flags an engine call runs under
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_allow_tf32_config_field() -> None:
    cfg = BuildConfig(precision="fp16", device="cuda", allow_tf32=False)
    assert BuildConfig.from_json(cfg.to_json()) == cfg and '"allow_tf32": false' in cfg.to_json()
    assert "allow_tf32" not in BuildConfig().to_json()  # at its default, JSON stays as earlier versions wrote it
    with pytest.raises(UsageError, match="opposite fp32 math"):
        BuildConfig(precision="tf32", allow_tf32=False)
    with pytest.raises(UsageError, match=r"allow_tf32 'no' is not a bool"):
        BuildConfig(allow_tf32="no")
    with pytest.raises(UsageError, match="opposite fp32 math"):
        fp32_flags("tf32", allow_tf32=False)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_compile_mode_on_onnxruntime_warns() -> None:
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    cfg = BuildConfig(backend="onnxruntime", compile_mode="max-autotune")
    with pytest.warns(UserWarning, match=r"compile_mode='max-autotune'\) has no effect with the onnxruntime backend"
                                         r".*backend='inductor'"):
        Builder(cfg).build(_Mlp().eval(), (torch.randn(2, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Builder(BuildConfig(backend="onnxruntime")).build(_Mlp().eval(), (torch.randn(2, 8),))


def test_engine_layer_info_is_trtexecs_json() -> None:
    pytest.importorskip("onnxruntime")
    from overdrive.engine import format_layer_info, layer_info

    torch.manual_seed(0)
    engine = Builder(BuildConfig(backend="onnxruntime")).build(_Mlp().eval(), (torch.randn(2, 8),))
    info = layer_info(engine)
    assert info["Bindings"] == [*engine.input_names, "output"]
    assert [layer["LayerType"] for layer in info["Layers"]] == ["FusedGemm", "Gemm"]  # ONNX Runtime fused the ReLU
    assert all(layer["Inputs"] for layer in info["Layers"])
    text = format_layer_info(info, "onnxruntime")
    assert text.startswith(f"[I] Layer Information (onnxruntime, {len(info['Layers'])} layers):")


def test_a_bf16_engine_built_without_tf32_keeps_the_strict_flags() -> None:
    """BuildConfig(allow_tf32=False) (``build --noTF32``) reaches the engine: the fp32 flags it applies at every call
    (and again at load) are IEEE fp32's, not the TF32 ones a bf16 engine's fp32 layers get by default."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    strict = Builder(BuildConfig(precision="bf16", backend="inductor", device="cpu", allow_tf32=False)).build(model, x)
    default = Builder(BuildConfig(precision="bf16", backend="inductor", device="cpu")).build(model, x)
    assert strict.header["backend_meta"]["fp32_precision"] == fp32_flags("fp32")
    assert default.header["backend_meta"]["fp32_precision"] == fp32_flags("bf16")
    assert fp32_flags("bf16") != fp32_flags("fp32")
