"""The ONNX selection ops of overdrive's importer: TopK (a detection head's best boxes, beam search) and
ArgMax / ArgMin (a classifier's label), as ``torch.topk`` / ``torch.argmax`` / ``torch.argmin``.

Example:
    >>> sorted(OPS)
    ['ArgMax', 'ArgMin', 'TopK']
"""

from __future__ import annotations

import torch

from overdrive.engine.onnx.values import Op, OpModule, Value, _ints, _tensor


def _topk(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """TopK(X, K) -> (Values, Indices int64) along ``axis`` (default -1), the largest first (``largest`` 1) or the
    smallest; ``sorted`` 0 lets the order be any, which torch's sorted order satisfies. K is read on the host
    (a constant, or a size computed from the input's shape)."""
    x = _tensor(ins[0])
    k = _ints(ins[1])[0]
    axis = int(a.get("axis", -1))
    values, idx = torch.topk(x, k, dim=axis, largest=bool(a.get("largest", 1)), sorted=True)
    return [values, idx]


def _arg(largest: bool) -> Op:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        axis, keep = int(a.get("axis", 0)) % x.dim(), bool(a.get("keepdims", 1))
        if a.get("select_last_index", 0):  # the last of equal values: the first one of the flipped axis
            flipped = (torch.argmax if largest else torch.argmin)(x.flip(axis), dim=axis, keepdim=keep)
            return [x.shape[axis] - 1 - flipped]
        return [(torch.argmax if largest else torch.argmin)(x, dim=axis, keepdim=keep)]
    return run


OPS: dict[str, Op] = {"TopK": _topk, "ArgMax": _arg(True), "ArgMin": _arg(False)}
HOST_INPUTS: dict[str, tuple[int, ...]] = {"TopK": (1,)}  # K, as a Python number
