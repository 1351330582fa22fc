"""ONNX Runtime's fused integer operators (com.microsoft) that its graph optimizer writes into a dynamically
quantized model, for overdrive's importer (``OPS``, merged into ``contrib.OPS``): a model saved with
``SessionOptions.optimized_model_filepath`` at level EXTENDED or ALL after ``quantize_dynamic``.

- ``DynamicQuantizeMatMul(A, B, b_scale, b_zero_point?, bias?)``: DynamicQuantizeLinear of A, MatMulInteger, the
  float scale and bias, in one node;
- ``MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zero_point?, b_zero_point?, bias?)``: MatMulInteger, Cast, the
  scale (and bias) Mul / Add, with A already quantized;
- ``QAttention``: BERT self-attention with packed (H_in, 3H) int8 QKV weights, as ``quantize_dynamic`` writes it
  from the transformer optimizer's ``Attention``. Masks: none, 1-D end positions (B), end and start positions
  (2B), raw 0/1 masks (B, T) and (B, S, T), each masked key adding ``mask_filter_value`` (-10000) to the scores;
  ``unidirectional`` adds it above the diagonal. A ``past`` state, ``do_rotary`` and 4-D masks are refused.

Numerics follow ONNX Runtime's CPU kernels: A is quantized as DynamicQuantizeLinear does (uint8, range with 0), the
integer product is exact, converted to float32 and scaled by ``a_scale * b_scale`` (float32, per tensor or per
column of B), then the bias added: the outputs match ONNX Runtime within float32 rounding (its MLAS output stage
may fuse the multiply-add). QAttention's softmax and products run in float32, within float rounding as well.

Example:
    >>> import numpy as np
    >>> a = torch.tensor([[1.0, -1.0]])
    >>> OPS["DynamicQuantizeMatMul"](None, [a, torch.tensor([[2], [1]], dtype=torch.int8), np.float32(0.5)], {})[0]
    tensor([[0.4980]])
"""

from __future__ import annotations

import math

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.integer import OPS as INTEGER_OPS
from overdrive.engine.onnx.integer import _along, _centered, _given
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor

# op -> (fewest inputs, most inputs, the inputs' names): checked when the model is imported
ARITY: dict[str, tuple[int, int, str]] = {
    "DynamicQuantizeMatMul": (3, 5, "A, B, b_scale, b_zero_point?, bias?"),
    "MatMulIntegerToFloat": (4, 7, "A, B, a_scale, b_scale, a_zero_point?, b_zero_point?, bias?"),
    "QAttention": (5, 9, "input, weight, bias, input_scale, weight_scale, mask_index?, input_zero_point?, "
                         "weight_zero_point?, past?"),
}


def _one(v: Value, what: str, op: str) -> Value:
    """A scale or zero point ONNX Runtime takes per tensor only: one element, else a clear refusal."""
    if v is not None and _tensor(v).numel() != 1:
        raise UsageError(f"{op} {what} of {_tensor(v).numel()} values; ONNX Runtime's kernel takes one value per "
                         "tensor (a scalar or a 1-element vector); re-quantize the model per tensor")
    return v


def _scaled_matmul(a: torch.Tensor, a_zp: Value, a_scale: Value, b: torch.Tensor, b_zp: Value, b_scale: Value,
                   bias: Value) -> torch.Tensor:
    """float32((A - a_zp) @ (B - b_zp)) * (a_scale * b_scale) + bias: the product exact, a_* per tensor, b_* per
    tensor or per column of B (N,), as ONNX Runtime's MLAS scale-bias output stage computes it."""
    if a.dim() < 2 or b.dim() < 2:
        raise UsageError(f"integer MatMul of shapes {tuple(a.shape)} and {tuple(b.shape)}: the importer takes operands "
                         "of rank 2 or more")
    acc = _centered(a, a_zp, -2, "a_zero_point") @ _centered(b, b_zp, -1, "b_zero_point")  # (..., M, N) float64
    mult = _tensor(a_scale).to(acc.device).float().reshape(()) * _along(b_scale, b, -1, "b_scale").float()
    y = acc.float() * mult
    return y if bias is None else y + _tensor(bias, y).float()


def _dynamic_quantize_matmul(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """DynamicQuantizeMatMul: A (float32) quantized to uint8 as DynamicQuantizeLinear does, then as
    MatMulIntegerToFloat."""
    x = _tensor(ins[0])
    qa, a_scale, a_zp = INTEGER_OPS["DynamicQuantizeLinear"](m, [x], {})
    return [_scaled_matmul(qa, a_zp, a_scale, _tensor(ins[1], x), _given(ins, 3), ins[2], _given(ins, 4))]


def _matmul_integer_to_float(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """MatMulIntegerToFloat: (A - a_zero_point) @ (B - b_zero_point) * a_scale * b_scale + bias, float32."""
    x = _tensor(ins[0])
    op = "MatMulIntegerToFloat"
    a_scale, a_zp = _one(ins[2], "a_scale", op), _one(_given(ins, 4), "a_zero_point", op)
    return [_scaled_matmul(x, a_zp, a_scale, _tensor(ins[1], x), _given(ins, 5), ins[3], _given(ins, 6))]


def _mask_bias(mask: torch.Tensor, batch: int, seq: int, filt: float) -> torch.Tensor:
    """mask_index as an additive (B, 1, S or 1, T) score bias: 0 where a key is attended, ``filt`` where masked."""
    mask = mask.to(torch.int64)
    pos = torch.arange(seq, device=mask.device)
    if mask.dim() == 1 and mask.shape[0] in (batch, 2 * batch):
        masked = pos >= mask[:batch, None]  # (B, T): keys at or after the end position
        if mask.shape[0] == 2 * batch:
            masked = masked | (pos < mask[batch:, None])  # and before the start position (left padding)
        return (masked.float() * filt)[:, None, None, :]
    if mask.dim() == 2 and tuple(mask.shape) == (batch, seq):
        return ((mask <= 0).float() * filt)[:, None, None, :]
    if mask.dim() == 3 and tuple(mask.shape) == (batch, seq, seq):
        return ((mask <= 0).float() * filt)[:, None, :, :]
    raise UsageError(f"QAttention mask_index of shape {tuple(mask.shape)} is not supported; expected ({batch},) end "
                     f"positions, ({2 * batch},) end and start positions, a ({batch}, {seq}) or ({batch}, {seq}, "
                     f"{seq}) 0/1 mask for batch {batch} and sequence {seq}; re-export with a 2-D attention mask, "
                     "or use --backend onnxruntime")


def _qattention(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """QAttention(input (B, S, H_in) 8-bit, weight (H_in, 3H) 8-bit, bias (3H), input_scale, weight_scale,
    mask_index?, input_zero_point?, weight_zero_point?) -> output (B, S, H) float32, present (2, B, nh, S, hs)."""
    if _given(ins, 8) is not None:
        raise UsageError("QAttention with a past state (input 8) is not supported by the importer (the incremental "
                         "decoding form); export the model without past key/values, or use --backend onnxruntime")
    if int(a.get("do_rotary", 0)) or int(a.get("past_present_share_buffer", 0)):
        raise UsageError(f"QAttention do_rotary={a.get('do_rotary', 0)}, past_present_share_buffer="
                         f"{a.get('past_present_share_buffer', 0)} is not supported; expected 0 and 0 (the form "
                         "quantize_dynamic writes for BERT); use --backend onnxruntime")
    x = _tensor(ins[0])
    w = _tensor(ins[1], x)
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[2] or w.shape[1] % 3:
        raise UsageError(f"QAttention input {tuple(x.shape)} and weight {tuple(w.shape)}; expected (B, S, H_in) and "
                         "(H_in, 3 * hidden); the model is malformed: re-quantize it")
    nh = int(a["num_heads"])
    batch, seq = x.shape[0], x.shape[1]
    hidden = w.shape[1] // 3
    if hidden % nh:
        raise UsageError(f"QAttention hidden size {hidden} is not a multiple of num_heads={nh}; the model is malformed")
    hs = hidden // nh
    op = "QAttention"
    qkv = _scaled_matmul(x, _one(_given(ins, 6), "input_zero_point", op), _one(ins[3], "input_scale", op), w,
                         _given(ins, 7), ins[4], ins[2])  # (B, S, 3H) float32
    q, k, v = (t.reshape(batch, seq, nh, hs).transpose(1, 2) for t in qkv.split(hidden, -1))  # (B, nh, S, hs) each
    scale = float(a.get("scale", 0.0)) or 1.0 / math.sqrt(hs)
    filt = float(a.get("mask_filter_value", -10000.0))
    scores = (q @ k.transpose(-1, -2)) * np.float32(scale)  # (B, nh, S, S)
    mask = _given(ins, 5)
    if mask is not None:
        scores = scores + _mask_bias(_tensor(mask).to(scores.device), batch, seq, filt)
    if int(a.get("unidirectional", 0)) and seq > 1:
        future = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores + future.float() * filt
    out = torch.softmax(scores, -1) @ v  # (B, nh, S, hs)
    return [out.transpose(1, 2).reshape(batch, seq, hidden), torch.stack([k, v])]


OPS: dict[str, Op] = {
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul, "MatMulIntegerToFloat": _matmul_integer_to_float,
    "QAttention": _qattention,
}
