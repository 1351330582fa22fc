"""The ONNX ops of overdrive's importer whose output length depends on the data: Compress and Unique. The importer
builds fixed-shape graphs, so each runs where the data that sets its length is a build-time constant (Compress by
a constant condition, as exporters write a column selection; Unique of a constant, folded on the host) and is
refused, naming the node, where it is computed at run time. NonMaxSuppression (whose kept-box count always
depends on the scores) is refused when the model is loaded: ``REFUSED`` holds the reason the importer gives.

Example:
    >>> import numpy as np
    >>> _compress(None, [torch.arange(6).reshape(2, 3), np.array([True, False, True])], {"axis": 1})[0]
    tensor([[0, 2],
            [3, 5]])
"""

from __future__ import annotations

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor

_RUN_TIME = ("computed at run time has a data-dependent output shape, which the ONNX importer (fixed shapes, "
             "set when the graph is built) cannot build; use --backend onnxruntime, or export the model with a "
             "fixed-size form")

# operators refused at load time, with the reason and the fix
REFUSED: dict[str, str] = {
    "NonMaxSuppression": "its number of kept boxes depends on the scores at run time, and the ONNX importer builds "
                         "fixed-shape graphs; export the detector without its NMS (post-process the boxes in "
                         "PyTorch, e.g. torchvision.ops.batched_nms, or TensorRT's EfficientNMS plugin), or use "
                         "--backend onnxruntime",
}


def _compress(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Compress(x, condition): the slices of x along ``axis`` (or of flattened x, without one) where condition is
    true; a condition shorter than that axis counts as false beyond its end. The condition must be a constant."""
    x, cond = ins
    if not isinstance(cond, np.ndarray) or cond.dtype == object:
        raise UsageError(f"Compress with a condition {_RUN_TIME} (a mask and torch.where, or a constant index)")
    keep = np.flatnonzero(np.asarray(cond).reshape(-1).astype(bool))
    if isinstance(x, np.ndarray) and x.dtype != object:
        return [np.compress(np.asarray(cond).reshape(-1).astype(bool), x, axis=a.get("axis"))]
    x = _tensor(x)
    axis = a.get("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = int(axis) % x.dim()
    if keep.size and keep[-1] >= x.shape[axis]:
        raise UsageError(f"Compress condition is true at index {int(keep[-1])}, past the end of axis {axis} "
                         f"(length {x.shape[axis]}); the ONNX model is inconsistent, re-export it")
    return [x.index_select(axis, torch.from_numpy(keep).to(x.device))]


def _unique(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Unique of a constant, folded on the host: (Y, indices, inverse_indices, counts), Y sorted (``sorted`` 1) or
    in order of first occurrence (0), over the flattened input or the slices along ``axis``.

    Example:
        >>> [v.tolist() for v in _unique(None, [np.array([2, 1, 2, 3])], {"sorted": 0})]
        [[2, 1, 3], [0, 1, 3], [0, 1, 0, 2], [2, 1, 1]]
    """
    x = ins[0]
    if not isinstance(x, np.ndarray) or x.dtype == object:
        raise UsageError(f"Unique of a tensor {_RUN_TIME} (torch.unique's sorted output of a fixed size, e.g. via "
                         "a one-hot count)")
    axis = a.get("axis")
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                          axis=None if axis is None else int(axis))
    inverse = inverse.reshape(-1)
    if not a.get("sorted", 1):  # first-occurrence order: renumber the sorted uniques by where each first appears
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if axis is None else int(axis))
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return [y, *(v.astype(np.int64) for v in (first, inverse, counts))]


OPS: dict[str, Op] = {"Compress": _compress, "Unique": _unique}
# kept on the host when they are initializers: Compress's condition, Unique's input (a buffer would be run-time data)
HOST_INPUTS: dict[str, tuple[int, ...]] = {"Compress": (1,), "Unique": (0,)}
