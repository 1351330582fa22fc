"""ONNX Runtime's own operators that overdrive's importer runs (``OPS``, domain ``com.microsoft``, and
``DEFAULT_DOMAIN_OPS``, the ones ONNX Runtime writes in the default domain although the ONNX standard has no such
operator). ``onnxruntime.transformers.optimizer`` rewrites BERT / GPT-2 style graphs with them; the importer takes
the simple, fully specified ones, with the semantics of ONNX Runtime's CPU kernels:

- ``Gelu`` (erf form), ``FastGelu`` (tanh form; optional bias input), ``BiasGelu`` (``Gelu(A + B)``),
  ``QuickGelu`` (``x * sigmoid(alpha * x)``, alpha 1.702 by default);
- ``SkipLayerNormalization`` (``LayerNorm(input + skip + bias)`` over the last axis, epsilon 1e-12 by default) and
  ``SkipSimplifiedLayerNormalization`` (the RMS form), with their optional outputs mean, inv_std_var and
  input_skip_bias_sum; ``SimplifiedLayerNormalization`` (RMSNorm over ``axis``.., epsilon 1e-5, default domain);
- ``FusedConv`` (Conv, an optional sum input Z, then the ``activation`` attribute);
- ``FusedMatMul`` (``alpha * A' @ B'``, the MatMul / Transpose / Mul fusion of ONNX Runtime's graph optimizer).

The norms compute in float32 and return their statistics in float32, as ONNX Runtime does for float16 inputs.
The QLinear* operators of ``qlinear`` and the fused integer ones of ``qfused`` (DynamicQuantizeMatMul,
MatMulIntegerToFloat, QAttention) are merged in. The float fused attention and embedding operators (Attention,
MultiHeadAttention, EmbedLayerNormalization) stay refused.

Example:
    >>> x = torch.tensor([[1.0, -1.0]])
    >>> OPS["SkipLayerNormalization"](None, [x, torch.zeros(1, 2), torch.ones(2)], {})[0]
    tensor([[ 1., -1.]])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import qfused, qlinear
from overdrive.engine.onnx.layers import OPS as LAYER_OPS
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor

# op -> (fewest inputs, most inputs, the inputs' names): checked when the model is imported
ARITY: dict[str, tuple[int, int, str]] = {
    "Gelu": (1, 1, "X"), "FastGelu": (1, 2, "X, bias?"), "BiasGelu": (2, 2, "A, B"), "QuickGelu": (1, 1, "X"),
    "SkipLayerNormalization": (3, 5, "input, skip, gamma, beta?, bias?"),
    "SkipSimplifiedLayerNormalization": (3, 4, "input, skip, gamma, bias?"),
    "SimplifiedLayerNormalization": (2, 2, "X, scale"), "FusedConv": (2, 4, "X, W, B?, Z?"),
    "FusedMatMul": (2, 2, "A, B"), **qlinear.ARITY, **qfused.ARITY,
}


def _opt(ins: list[Value], i: int, like: torch.Tensor) -> torch.Tensor | None:
    return _tensor(ins[i], like) if len(ins) > i and ins[i] is not None else None


def _gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    return [F.gelu(_tensor(ins[0]))]


def _fast_gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of x = X + bias: torch's tanh GELU, the same constants."""
    x = _tensor(ins[0])
    b = _opt(ins, 1, x)
    return [F.gelu(x if b is None else x + b, approximate="tanh")]


def _bias_gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    return [F.gelu(x + _tensor(ins[1], x))]


def _quick_gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    return [x * torch.sigmoid(float(a.get("alpha", 1.702)) * x)]


def _skip_norm(simplified: bool) -> Op:
    """Skip(Simplified)LayerNormalization: s = input + skip (+ bias), skip (B, S, H), (1, S, H) or (S, H);
    LayerNorm (or RMSNorm) of s over H, times gamma (+ beta). Outputs: output, mean (zeros in the RMS form),
    inv_std_var (both (..., 1), float32), input_skip_bias_sum (s, in the input's dtype)."""
    bias_at = 3 if simplified else 4

    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        skip, gamma = _tensor(ins[1], x), _tensor(ins[2], x)
        beta, bias = (None if simplified else _opt(ins, 3, x)), _opt(ins, bias_at, x)
        s = x + skip if bias is None else x + skip + bias  # (B, S, H), ONNX Runtime adds in the input's dtype
        sf = s.float()
        eps = float(a.get("epsilon", 1e-12))
        if simplified:
            mean = torch.zeros_like(sf[..., :1])
            inv = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)  # (B, S, 1)
            y = sf * inv * gamma.float()
        else:
            mean = sf.mean(-1, keepdim=True)
            inv = torch.rsqrt((sf - mean).pow(2).mean(-1, keepdim=True) + eps)
            y = (sf - mean) * inv * gamma.float()
            if beta is not None:
                y = y + beta.float()
        return [y.to(x.dtype), mean, inv, s]
    return run


def _simplified_norm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """SimplifiedLayerNormalization (RMSNorm): X / sqrt(mean(X^2 over axis..) + epsilon) * scale; outputs Y and
    inv_std_var (the normalized axes kept as 1s, float32)."""
    x = _tensor(ins[0])
    scale = _tensor(ins[1], x)
    axis = int(a.get("axis", -1))
    if not -x.dim() <= axis < x.dim():
        raise UsageError(f"SimplifiedLayerNormalization axis={axis} is out of range for a rank-{x.dim()} input; "
                         f"expected -{x.dim()}..{x.dim() - 1}")
    axis %= x.dim()
    if int(a.get("stash_type", 1)) != 1:
        raise UsageError(f"SimplifiedLayerNormalization stash_type={a['stash_type']} is not supported; expected 1 "
                         "(float32 statistics, ONNX Runtime's default); re-export the model with the default")
    xf = x.float()
    dims = tuple(range(axis, x.dim()))
    inv = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + float(a.get("epsilon", 1e-5)))
    return [(xf * inv * scale.float()).to(x.dtype), inv]


# FusedConv's activation attribute -> the function, given activation_params
_ACTIVATIONS = {
    "Relu": (0, lambda y, p: F.relu(y)), "Tanh": (0, lambda y, p: torch.tanh(y)),
    "Sigmoid": (0, lambda y, p: torch.sigmoid(y)), "LeakyRelu": (1, lambda y, p: F.leaky_relu(y, p[0])),
    "Clip": (2, lambda y, p: y.clamp(p[0], p[1])), "HardSigmoid": (2, lambda y, p: (p[0] * y + p[1]).clamp(0, 1)),
}


def _fused_conv(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """FusedConv: act(Conv(X, W, B) + Z), Conv's attributes; ``activation`` one of ``_ACTIVATIONS`` (or none)."""
    act = a.get("activation", b"")
    act = act.decode() if isinstance(act, bytes) else str(act)
    params = [float(p) for p in a.get("activation_params", [])]
    if act and act not in _ACTIVATIONS:
        raise UsageError(f"FusedConv activation={act!r} is not one ONNX Runtime fuses; expected one of "
                         f"{sorted(_ACTIVATIONS)}")
    if act and len(params) != _ACTIVATIONS[act][0]:
        raise UsageError(f"FusedConv activation={act!r} takes {_ACTIVATIONS[act][0]} activation_params, got {params}")
    conv_attrs = {k: v for k, v in a.items() if k not in ("activation", "activation_params")}
    y = LAYER_OPS["Conv"](m, ins[:3], conv_attrs)[0]
    z = _opt(ins, 3, y)
    if z is not None:
        y = y + z
    return [_ACTIVATIONS[act][1](y, params) if act else y]


def _fused_matmul(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """FusedMatMul: alpha * A' @ B'. transBatchA / transBatchB move an operand's first axis behind its other batch
    axes ((d0, d1, .., M, K) -> (d1, .., d0, M, K)) first; transA / transB then swap its last two axes."""
    x = _tensor(ins[0])
    y = _tensor(ins[1], x)
    if (int(a.get("transBatchA", 0)) or int(a.get("transBatchB", 0))) and not x.dim() == y.dim() >= 3:
        raise UsageError(f"FusedMatMul with transBatchA / transBatchB of inputs of shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}; expected two inputs of the same rank, 3 or more (ONNX Runtime's rule)")

    def prep(t: torch.Tensor, batch: str, last: str) -> torch.Tensor:
        if int(a.get(batch, 0)):
            t = t.permute(*range(1, t.dim() - 1), 0, t.dim() - 1)
        return t.transpose(-1, -2) if int(a.get(last, 0)) and t.dim() > 1 else t

    out = LAYER_OPS["MatMul"](m, [prep(x, "transBatchA", "transA"), prep(y, "transBatchB", "transB")], {})[0]
    alpha = float(a.get("alpha", 1.0))
    return [out if alpha == 1.0 else out * alpha]


OPS: dict[str, Op] = {
    "Gelu": _gelu, "FastGelu": _fast_gelu, "BiasGelu": _bias_gelu, "QuickGelu": _quick_gelu,
    "SkipLayerNormalization": _skip_norm(False), "SkipSimplifiedLayerNormalization": _skip_norm(True),
    "FusedConv": _fused_conv, "FusedMatMul": _fused_matmul, **qlinear.OPS, **qfused.OPS,
}
# what ONNX Runtime writes in the default domain, though the ONNX standard has no operator of that name
DEFAULT_DOMAIN_OPS: dict[str, Op] = {"SimplifiedLayerNormalization": _simplified_norm}
# each stays refused by name: fused attention and embeddings carry masks, packing and caches in many layouts
REFUSED_HINT = ("the importer runs com.microsoft " + ", ".join(sorted(OPS)) + " only, not the float fused attention "
                "and embedding operators (Attention, MultiHeadAttention, EmbedLayerNormalization: "
                "onnxruntime.transformers.optimizer writes none of them with FusionOptions' enable_attention and "
                "enable_embed_layer_norm set to False), nor DynamicQuantizeLSTM or QEmbedLayerNormalization")
