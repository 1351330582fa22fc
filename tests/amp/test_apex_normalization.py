"""``overdrive.apex.normalization``: apex's fused norms with apex's dtypes. Under ``torch.autocast`` apex casts the
input, weight and bias to the autocast dtype (``_cast_if_autocast_enabled``) and returns that dtype; the ``Mixed``
forms return the parameters' dtype; the functional forms Megatron and NeMo import exist with apex's signatures.
Reference: layer / RMS norm in float64 from the tensors the kernel sees (bf16-rounded under autocast), gradients
by float64 autograd; tolerance: bf16's rounding (2^-8 relative to the largest value). The CPU bf16 autocast runs
here; CUDA fp16 autocast is the same code path (only the device's autocast dtype differs)."""

from __future__ import annotations

import pytest
import torch

from overdrive.apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from overdrive.apex.normalization import fused_layer_norm as fln

_BF16_REL = 2.0**-8
_CLASSES = [FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm]


def _ref(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, rms: bool, eps: float) -> torch.Tensor:
    """Layer / RMS norm over the last dim in float64."""
    x = x.double()
    if rms:
        y = x / (x.square().mean(-1, keepdim=True) + eps).sqrt()
    else:
        y = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, (err, want.abs().max().item())


def _norm(cls: type, affine: bool, g: torch.Generator) -> torch.nn.Module:
    norm = cls(16, eps=1e-5) if cls.__name__.startswith("Mixed") else cls(16, eps=1e-5, elementwise_affine=affine)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.randn(16, generator=g))
    return norm


_AUTOCAST = [("cpu", torch.bfloat16, _BF16_REL),
             pytest.param("cuda", torch.float16, 2.0**-11, marks=pytest.mark.gpu)]


@pytest.mark.parametrize(("device", "dtype", "rel"), _AUTOCAST, ids=["cpu-bf16", "cuda-fp16"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("cls", _CLASSES, ids=lambda c: c.__name__)
def test_norms_under_autocast_return_the_autocast_dtype(cls: type, affine: bool, device: str, dtype: torch.dtype,
                                                        rel: float) -> None:
    """An fp32 model with ``FusedLayerNorm`` under autocast got fp32 out of the norm (torch's LayerNorm is on
    autocast's fp32 list), where apex gives fp16/bf16: the next layers and the activation memory differed."""
    if cls.__name__.startswith("Mixed") and not affine:
        pytest.skip("the Mixed forms always have a weight")
    g = torch.Generator().manual_seed(0)
    norm = _norm(cls, affine, g).to(device)
    x = (torch.randn(3, 5, 16, generator=g) * 3 + 1).to(device).requires_grad_(True)
    with torch.autocast(device, dtype=dtype):
        y = norm(x)
    assert y.dtype == dtype
    rms = "RMS" in cls.__name__
    # what apex's kernel sees: every tensor rounded to the autocast dtype
    x16 = x.detach().to(dtype).double().requires_grad_(True)
    w16 = None if norm.weight is None else norm.weight.detach().to(dtype).double().requires_grad_(True)
    b = getattr(norm, "bias", None)
    b16 = None if b is None else b.detach().to(dtype).double().requires_grad_(True)
    want = _ref(x16, w16, b16, rms, 1e-5)
    _close(y, want.detach(), rel)
    gy = torch.randn(want.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    y.backward(gy)
    want.backward(gy.double())
    assert x.grad is not None and x.grad.dtype == torch.float32  # back through the cast, to the fp32 input
    _close(x.grad, x16.grad, 2 * rel)
    if w16 is not None:
        assert norm.weight.grad.dtype == torch.float32
        _close(norm.weight.grad, w16.grad, 2 * rel)
    if b16 is not None:
        _close(b.grad, b16.grad, 2 * rel)


@pytest.mark.parametrize("cls", _CLASSES, ids=lambda c: c.__name__)
def test_mixed_forms_return_the_parameters_dtype(cls: type) -> None:
    """apex's mixed-dtype kernels write the output in the weight's dtype (Megatron's fp32 residual stream into
    bf16 norm weights comes out bf16 for the bf16 linear after it); the plain forms keep the input's dtype.
    The Mixed forms returned the input's dtype, so the next bf16 Linear got fp32 activations."""
    g = torch.Generator().manual_seed(1)
    norm = _norm(cls, True, g).bfloat16()
    x = torch.randn(4, 16, generator=g) * 2
    y = norm(x)  # fp32 input, bf16 parameters
    mixed = cls.__name__.startswith("Mixed")
    assert y.dtype == (torch.bfloat16 if mixed else torch.float32)
    b = getattr(norm, "bias", None)
    _close(y, _ref(x, norm.weight, b, "RMS" in cls.__name__, 1e-5), _BF16_REL)
    if mixed:  # and the other way round: bf16 activations into fp32 weights come out fp32
        assert norm.float()(x.bfloat16()).dtype == torch.float32


def test_functional_forms_as_megatron_and_nemo_import_them() -> None:
    """``manual_rms_norm`` and the ``...MixedDtypesFunction`` autograd functions were missing; the ``apply``
    forms (apex's kernel called directly, no autocast cast) returned fp32 for bf16 tensors under autocast."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=g)
    w, b = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g)
    x16, w16, b16 = x.bfloat16(), w.bfloat16(), b.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fln.FusedLayerNormAffineFunction.apply(x16, w16, b16, (8,), 1e-5).dtype == torch.bfloat16
        assert fln.FusedRMSNormAffineFunction.apply(x16, w16, [8], 1e-5).dtype == torch.bfloat16
        assert fln.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5).dtype == torch.float32  # no cast
        for f in (fln.fused_layer_norm_affine(x, w, b, 8), fln.fused_layer_norm(x, 8),
                  fln.fused_rms_norm_affine(x, w, 8), fln.fused_rms_norm(x, torch.Size([8])),
                  fln.mixed_dtype_fused_layer_norm_affine(x, w, b, 8), fln.mixed_dtype_fused_rms_norm_affine(x, w, 8)):
            assert f.dtype == torch.bfloat16
    assert fln.FusedLayerNormAffineMixedDtypesFunction.apply(x16, w, b, (8,), 1e-5).dtype == torch.float32
    out = fln.FusedRMSNormAffineMixedDtypesFunction.apply(x, w16, (8,), 1e-5, True)
    assert out.dtype == torch.bfloat16
    _close(out, _ref(x, w16, None, True, 1e-5), _BF16_REL)
    # manual_rms_norm (apex's CPU path): fp32 statistics; fp32 out for a half input, the weight's dtype if half
    _close(fln.manual_rms_norm(x, (8,), w, 1e-6), _ref(x, w, None, True, 1e-6), 1e-6)
    assert fln.manual_rms_norm(x16, (8,), None, 1e-6).dtype == torch.float32
    assert fln.manual_rms_norm(x16, (8,), w16, 1e-6).dtype == torch.bfloat16
    assert fln.manual_rms_norm(x16, (8,), w, 1e-6).dtype == torch.float32


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm], ids=lambda c: c.__name__)
def test_memory_efficient_changes_no_numbers(cls: type) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, generator=g)
    outs = []
    for me in (False, True):
        norm = cls(torch.Size([4, 8]), eps=1e-6, elementwise_affine=True, memory_efficient=me)
        xi = x.clone().requires_grad_(True)
        y = norm(xi)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xi.grad, norm.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_constructors_take_apex_arguments_and_refuse_bad_ones() -> None:
    """apex's ``Mixed*`` constructors: ``elementwise_affine`` warned about, ``False`` refused with the fix;
    other keywords ignored as apex ignores them (NeMo passes its own), with a warning naming them."""
    with pytest.warns(UserWarning, match="elementwise_affine"), pytest.raises(RuntimeError, match="FusedLayerNorm"):
        MixedFusedLayerNorm(8, elementwise_affine=False)
    with pytest.warns(UserWarning, match="elementwise_affine"):
        assert MixedFusedRMSNorm(8, elementwise_affine=True).weight.shape == (8,)
    with pytest.warns(UserWarning, match="sequence_parallel_enbaled"):
        norm = MixedFusedLayerNorm(8, 1e-5, sequence_parallel_enbaled=False)
    assert norm.eps == 1e-5 and norm.weight.dtype == torch.float32
    assert FusedRMSNorm(8, elementwise_affine=False).weight is None
    assert FusedLayerNorm((2, 8), memory_efficient=True).normalized_shape == (2, 8)
    with pytest.raises(TypeError, match=r"normalized_shape.*'8'"):
        fln.fused_layer_norm(torch.randn(2, 8), "8")
