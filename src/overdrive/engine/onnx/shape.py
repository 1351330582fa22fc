"""The shape and tensor-manipulation ONNX operators of overdrive's importer (``OPS``): Reshape, Shape, Gather,
Slice, (Un)Squeeze, Concat, Split, Cast, CastLike, Expand, Transpose, Flatten, ConstantOfShape, Range, Pad (constant,
reflect, edge, wrap), Tile, Trilu, ReverseSequence; Slice and Pad also in their attribute forms (opsets before 10
and 11). Shape arithmetic (Shape -> Gather -> Concat -> Reshape) runs on numpy arrays on the host (object arrays of
SymInts under dynamic export), so no data-dependent ``.tolist()`` reaches the traced graph; device data goes through
torch. Split is run by ``importer.py`` itself (it needs the node's output count).

Example:
    >>> OPS["Reshape"](None, [np.arange(6), np.array([2, -1])], {})[0].shape
    (2, 3)
    >>> [t.tolist() for t in _split(None, [torch.arange(5)], {}, 2)]
    [[0, 1, 2], [3, 4]]
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import (_DTYPES, _NP, Op, OpModule, Value, _flatten, _from_numpy, _host, _ints,
                                          _like, _tensor)


def _axes(ins: list[Value], a: dict, idx: int = 1) -> list[int] | None:
    if len(ins) > idx and ins[idx] is not None:
        return _ints(ins[idx])
    return list(a["axes"]) if "axes" in a else None


def _reshape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, shape = ins[0], _ints(ins[1])
    if not a.get("allowzero", 0):
        shape = [x.shape[i] if (not isinstance(s, torch.SymInt) and s == 0) else s for i, s in enumerate(shape)]
    if isinstance(x, np.ndarray):
        return [x.reshape(shape)]
    return [x.reshape(shape)]


def _shape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    dims = list(ins[0].shape)
    dims = dims[a.get("start", 0):a.get("end", len(dims))]
    sym = any(isinstance(d, torch.SymInt) for d in dims)
    return [np.array(dims, dtype=object if sym else np.int64)]


def _gather(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, idx, axis = ins[0], ins[1], int(a.get("axis", 0))
    if _host(x, idx):
        return [np.take(x, idx, axis=axis)]
    x = _tensor(x)
    axis %= x.dim()  # a negative axis: the shape arithmetic below needs its positive form
    i = _tensor(idx, None).to(x.device).long()
    i = torch.where(i < 0, i + x.shape[axis], i)
    if i.dim() == 0:
        return [x.select(axis, i) if isinstance(idx, torch.Tensor) else x.select(axis, int(np.asarray(idx)))]
    return [torch.index_select(x, axis, i.reshape(-1)).reshape(*x.shape[:axis], *i.shape, *x.shape[axis + 1:])]


def _slice(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = ins[0]
    if len(ins) == 1:  # opset 1-9: starts, ends and axes are attributes, steps are 1
        starts, ends = list(a["starts"]), list(a["ends"])
        axes = list(a.get("axes", range(len(starts))))
    else:
        starts, ends = _ints(ins[1]), _ints(ins[2])
        axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    axes = [ax % len(x.shape) for ax in axes]
    steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    if isinstance(x, np.ndarray) and x.dtype != object and any(isinstance(v, torch.SymInt) for v in starts + ends):
        # a host constant (position ids) cut at a symbolic length: numpy would read the SymInt as an int and fix
        # the sequence length at the traced one, so the constant becomes a tensor on the module's device
        dev = next(iter(m.buffers()), torch.empty(0)).device
        x = _tensor(x).to(dev)
    index = [slice(None)] * len(x.shape)
    big = 2**62
    for s, e, ax, st in zip(starts, ends, axes, steps):
        if st < 0:
            x, index[ax] = _slice_reversed(x, ax, s, e, st)
            continue
        if not isinstance(e, torch.SymInt) and abs(e) >= big:  # INT64_MAX: to the end; INT64_MIN: before the start
            e = None if e > 0 else 0
        if not isinstance(s, torch.SymInt) and abs(s) >= big:
            s = 0 if s < 0 else x.shape[ax]
        index[ax] = slice(s, e, st)
    return [x[tuple(index)]]


def _slice_reversed(x: Value, ax: int, s: int, e: int, st: int) -> tuple[Value, slice]:
    """One axis of a Slice with a negative step, as (x, a positive-step slice of x).

    ONNX clamps start to [0, n-1] and end to [-1, n-1] (-1: past the first element), after adding n to
    negative values; Python reads an end of -1 as the last element instead. torch has no negative steps,
    so tensors are flipped: element i of x is element n-1-i of the flipped x."""
    n = x.shape[ax]
    if isinstance(n, torch.SymInt) or isinstance(s, torch.SymInt) or isinstance(e, torch.SymInt):
        raise UsageError("Slice with a negative step over a dynamic dimension is not supported by the ONNX importer")
    s = min(max(s + n if s < 0 else s, 0), n - 1)
    e = min(max(e + n if e < 0 else e, -1), n - 1)
    if isinstance(x, np.ndarray):
        return x, slice(s, None if e < 0 else e, st)
    return x.flip(ax), slice(n - 1 - s, n - 1 - e, -st)


def _unsqueeze(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, axes = ins[0], _axes(ins, a)
    rank = len(x.shape) + len(axes)
    for ax in sorted(ax % rank for ax in axes):
        x = np.expand_dims(x, ax) if isinstance(x, np.ndarray) else x.unsqueeze(ax)
    return [x]


def _squeeze(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, axes = ins[0], _axes(ins, a)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = tuple(ax % len(x.shape) for ax in axes)
    return [np.squeeze(x, axes) if isinstance(x, np.ndarray) else x.squeeze(axes)]


def _concat(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    ins = [v for v in ins if v is not None]
    if _host(*ins):
        return [np.concatenate(ins, axis=int(a["axis"]))]
    like = _like(ins)
    return [torch.cat([_tensor(v, like) for v in ins], dim=int(a["axis"]))]


def _cast(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    dt = _DTYPES[int(a["to"])]
    if isinstance(ins[0], np.ndarray) and dt in _NP:
        return [ins[0] if ins[0].dtype == object else ins[0].astype(_NP[dt])]
    return [_tensor(ins[0]).to(dt)]


def _cast_like(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """CastLike(x, target) (opset 15; ``torch.onnx.export(dynamo=True)`` writes it): x in the target's type."""
    x, like = ins
    if isinstance(like, np.ndarray) and like.dtype != object:
        if isinstance(x, np.ndarray):
            return [x if x.dtype == object else x.astype(like.dtype)]
        return [_tensor(x).to(_from_numpy(np.zeros(0, like.dtype)).dtype)]
    dt = _tensor(like).dtype if isinstance(like, torch.Tensor) else torch.int64  # an object array: symbolic sizes
    if isinstance(x, np.ndarray) and dt in _NP:
        return [x if x.dtype == object else x.astype(_NP[dt])]
    return [_tensor(x).to(dt)]


def _split(m: OpModule, ins: list[Value], a: dict, n_out: int) -> list[Value]:
    x, axis = _tensor(ins[0]), int(a.get("axis", 0))
    sizes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(a.get("split", []))
    if not sizes:  # opset 18 num_outputs: equal parts of ceil(n / k), the last one smaller when n % k != 0
        part = math.ceil(x.shape[axis] / n_out)
        sizes = [part] * (n_out - 1) + [x.shape[axis] - part * (n_out - 1)]
    return list(torch.split(x, sizes, dim=axis))


def _expand(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, shape = _tensor(ins[0]), _ints(ins[1])
    # ONNX Expand broadcasts both ways (a 1 in `shape` keeps x's size); torch expand does not.
    rank = max(x.dim(), len(shape))
    xs = [1] * (rank - x.dim()) + list(x.shape)
    shape = [1] * (rank - len(shape)) + shape
    target = [d if (not isinstance(s, torch.SymInt) and s == 1) else s for s, d in zip(shape, xs)]
    return [x.reshape(xs).expand(target)]


def _const_of_shape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    val = a.get("value", np.zeros(1, np.float32))
    shape = _ints(ins[0])
    if not any(isinstance(s, torch.SymInt) for s in shape):
        return [np.full(shape, val.reshape(-1)[0], dtype=val.dtype)]
    return [torch.full(shape, val.reshape(-1)[0].item(), dtype=_from_numpy(val).dtype)]  # a copy: val is read-only


def _range(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    s, e, d = (np.asarray(v).reshape(-1)[0] if not isinstance(v, torch.Tensor) else v.item() for v in ins)
    sym = any(isinstance(v, torch.SymInt) for v in (s, e, d))
    if _host(*ins) and not sym:
        return [np.arange(s, e, d, dtype=np.asarray(ins[0]).dtype)]
    # a symbolic bound (a dynamic dim) must not reach np.arange, which would specialize it to its traced value
    like = _like(ins)
    device = like.device if like is not None else next((b.device for b in m.buffers()), torch.device("cpu"))
    return [torch.arange(s, e, d, device=device)]


def _pad(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Pad, all its forms: pads (and the constant ``value``) as attributes before opset 11, as inputs after, for the
    axes in the opset 18 ``axes`` input only; modes constant, reflect (``nn.ReflectionPad2d``), edge
    (``nn.ReplicationPad2d``) and wrap (opset 19, circular). Negative pads crop, in every mode.

    Example:
        >>> _pad(None, [torch.arange(3.0), np.array([2, 1])], {"mode": b"reflect"})[0].tolist()
        [2.0, 1.0, 0.0, 1.0, 2.0, 1.0]
    """
    x = _tensor(ins[0])
    mode = a.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise UsageError(f"Pad mode={mode!r} is not an ONNX pad mode; expected constant, reflect, edge or wrap")
    n = x.dim()
    if len(ins) > 1 and ins[1] is not None:
        pads = _ints(ins[1])
        value = float(np.asarray(ins[2]).reshape(-1)[0]) if len(ins) > 2 and ins[2] is not None else 0.0
    else:  # opset 2-10: pads and value are attributes
        pads, value = list(a.get("pads", [0] * 2 * n)), float(a.get("value", 0.0))
    axes = [ax % n for ax in _ints(ins[3])] if len(ins) > 3 and ins[3] is not None else list(range(n))
    if len(pads) != 2 * len(axes):
        raise UsageError(f"Pad has {len(pads)} pads for {len(axes)} axes of a {n}-D input; expected {2 * len(axes)} "
                         "(all begins, then all ends); the ONNX model is malformed, re-export it")
    begin, end = [0] * n, [0] * n
    for k, ax in enumerate(axes):
        begin[ax], end[ax] = pads[k], pads[k + len(axes)]
    if mode == "constant":
        fp: list[int] = []
        for d in reversed(range(n)):
            fp += [begin[d], end[d]]
        return [F.pad(x, fp, value=value)]
    for ax in range(n):  # reflect / edge / wrap: one gather of computed source indices per padded axis
        b, e = begin[ax], end[ax]
        if (isinstance(b, int) and b == 0) and (isinstance(e, int) and e == 0):
            continue
        if b < 0 or e < 0:  # negative pads crop first; the rest pads what is left (wrap then wraps the cropped axis)
            x = x.narrow(ax, -min(b, 0), x.shape[ax] + min(b, 0) + min(e, 0))
            b, e = max(b, 0), max(e, 0)
        size = x.shape[ax]
        i = torch.arange(-b, size + e, device=x.device)  # output position -> input position before folding
        if mode == "edge":
            i = i.clamp(0, size - 1)
        elif mode == "wrap":
            i = torch.remainder(i, size)
        else:  # reflect about the first and last elements (not repeating them): period 2 * (size - 1)
            i = torch.remainder(i, 2 * size - 2) if not (isinstance(size, int) and size == 1) else torch.zeros_like(i)
            i = torch.where(i >= size, 2 * size - 2 - i, i)
        x = x.index_select(ax, i)
    return [x]


def _tile(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    reps = _ints(ins[1])
    if isinstance(ins[0], np.ndarray):
        return [np.tile(ins[0], reps)]
    return [_tensor(ins[0]).repeat(*reps)]


def _trilu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    k = int(_ints(ins[1])[0]) if len(ins) > 1 and ins[1] is not None else 0
    x = _tensor(ins[0])
    return [torch.triu(x, k) if a.get("upper", 1) else torch.tril(x, k)]


def _reverse_sequence(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ReverseSequence(x, sequence_lens (B,)): the first ``sequence_lens[b]`` steps of each batch entry reversed
    along ``time_axis``, the rest kept (bidirectional RNNs over padded batches); one gather along the time axis."""
    x = _tensor(ins[0])
    lens = _tensor(ins[1], x).long()
    t_ax, b_ax = int(a.get("time_axis", 0)), int(a.get("batch_axis", 1))
    t = torch.arange(x.shape[t_ax], device=x.device)
    src = torch.where(t[None, :] < lens[:, None], lens[:, None] - 1 - t[None, :], t[None, :])  # (B, T)
    shape = [1] * x.dim()
    shape[b_ax], shape[t_ax] = x.shape[b_ax], x.shape[t_ax]
    src = src if b_ax < t_ax else src.t()  # (B, T) or (T, B), in x's axis order
    return [torch.gather(x, t_ax, src.reshape(shape).expand(x.shape))]


OPS: dict[str, Op] = {
    "Identity": lambda m, ins, a: [ins[0]], "Dropout": lambda m, ins, a: [ins[0]], "Reshape": _reshape,
    "Shape": _shape, "Gather": _gather, "Slice": _slice, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Concat": _concat, "Cast": _cast, "CastLike": _cast_like, "Expand": _expand,
    "Transpose": lambda m, ins, a: [np.transpose(ins[0], a.get("perm")) if isinstance(ins[0], np.ndarray) else _tensor(ins[0]).permute(*(a.get("perm") or reversed(range(ins[0].dim()))))],
    "Flatten": lambda m, ins, a: [_flatten(_tensor(ins[0]), int(a.get("axis", 1)))],
    "ConstantOfShape": _const_of_shape, "Range": _range, "Pad": _pad, "Tile": _tile, "Trilu": _trilu,
    "ReverseSequence": _reverse_sequence,
}
