"""Sibling GEMMs as one: Linears that read the same input (attention's Q, K and V projections, a gated MLP's gate
and up projections) run as one GEMM on their concatenated weights, its output split into their views.

TensorRT calls this horizontal fusion; Inductor does not do it. One wider GEMM fills the GPU better and reads the
input once: on the H200 in fp16 under CUDA graphs, BERT-base's Q/K/V at 32x128 tokens ran 1.44x the three GEMMs and
a 1024-wide Llama's gate/up at 16x512 tokens 1.09x, but at 512 tokens and fewer the wider GEMM lost (0.59x-0.81x,
``benchmarks/results/gemm_siblings.md``). So each group is timed at its shape on the build's GPU
(:class:`TimedGroups`) and fused only where it wins. The concatenated weight is built by graph ops on the weights,
which Inductor's freezing computes once at compile time (the pass is applied only with freezing on).

Example:
    >>> import torch.nn as nn
    >>> class QKV(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.q(x) * self.k(x), self.v(x)
    >>> m, x = QKV().eval(), torch.randn(2, 3, 8)
    >>> with torch.no_grad():
    ...     ep = torch.export.export(m, (x,), strict=False)
    ...     groups = fuse_sibling_gemms(ep)
    ...     same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ep.module()(x), m(x)))
    >>> groups, same
    ([['linear', 'linear_1', 'linear_2']], True)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.node import Node

from overdrive.engine.passes import node_value as _val
from overdrive.engine.passes import refresh_values
from overdrive.engine.passes import rename_output

aten = torch.ops.aten
_LINEAR = aten.linear.default


def _siblings(x: Node) -> list[Node]:
    """The ``linear(x, w, b)`` users of ``x`` that can share one GEMM: 2-D weights and 1-D biases that are graph
    inputs (weights, constant under freezing), one dtype and in-features, biases on all or none."""
    lins = [u for u in x.users if u.op == "call_function" and u.target is _LINEAR and u.args[0] is x]
    ok = []
    for lin in lins:
        w = lin.args[1]
        b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
        wv = _val(w)
        if not (isinstance(w, Node) and w.op == "placeholder" and wv is not None and wv.dim() == 2):
            continue
        if b is not None and not (isinstance(b, Node) and b.op == "placeholder" and _val(b) is not None
                                  and _val(b).dim() == 1):
            continue
        ok.append(lin)
    if len(ok) < 2:
        return []
    first = _val(ok[0].args[1])
    has_bias = [(lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")) is not None for lin in ok]
    same = [lin for lin, hb in zip(ok, has_bias) if _val(lin.args[1]).shape[1] == first.shape[1]
            and _val(lin.args[1]).dtype == first.dtype and hb == has_bias[0]]
    return same if len(same) >= 2 else []


class TimedGroups:
    """Decides per group shape, by timing on ``device``, whether one GEMM beats the separate ones: both under a CUDA
    graph (the engine replays graphs, so launches do not count), the one GEMM's split included. Verdicts are kept
    per shape in ``verdicts``: ``"one 1.44x at 4096x768->768+768+768"`` (the separate time over the one).

    Example:
        >>> # fuse_sibling_gemms(ep, decide=TimedGroups(torch.device("cuda")))
    """

    def __init__(self, device: torch.device, margin: float = 1.03) -> None:
        self.device, self.margin = device, margin
        self.verdicts: dict[tuple, tuple[bool, str]] = {}

    def __call__(self, x: torch.Tensor, outs: list[int], bias: bool) -> bool:
        if any(not isinstance(d, int) for d in x.shape):
            return False  # a dynamic profile: small batches lose (measured), and there is no one shape to time
        m = x.numel() // x.shape[-1]
        key = (m, x.shape[-1], tuple(outs), x.dtype, bias)
        if key not in self.verdicts:
            self.verdicts[key] = self._time(key)
        return self.verdicts[key][0]

    def _time(self, key: tuple) -> tuple[bool, str]:
        from overdrive.engine.kernel_timing import median_ms as _ms

        m, k, outs, dtype, bias = key
        dev = self.device
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, k, generator=g).to(device=dev, dtype=dtype)
        ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(device=dev, dtype=dtype) for n in outs]
        bs = [torch.zeros(n, device=dev, dtype=dtype) if bias else None for n in outs]
        wcat = torch.cat(ws)
        bcat = torch.cat(bs) if bias else None  # type: ignore[arg-type]

        def separate() -> Any:
            return [F.linear(x, w, b) for w, b in zip(ws, bs)]

        def one() -> Any:
            return F.linear(x, wcat, bcat).split(list(outs), dim=-1)

        with torch.no_grad():
            t_one, t_sep = _ms(one, dev), _ms(separate, dev)
        win = t_sep >= self.margin * t_one
        return win, f"{'one' if win else 'separate'} {t_sep / t_one:.2f}x at {m}x{k}->{'+'.join(map(str, outs))}"


def fuse_sibling_gemms(ep: Any, decide: Any = None) -> list[list[str]]:
    """Rewrite Linears that read the same input into one ``linear`` on the concatenated weights plus a split, in place.

    ``decide(x, out_features, has_bias) -> bool`` (``x`` a fake tensor; e.g. :class:`TimedGroups`) may veto a group.
    Returns the groups fused, each as its Linear nodes' names.

    Example:
        >>> # fuse_sibling_gemms(torch.export.export(bert, (ids,)))  # [['linear', 'linear_1', 'linear_2'], ...]
    """
    gm = ep.graph_module
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    fused: list[list[str]] = []
    for x in list(graph.nodes):
        group = sorted(_siblings(x), key=order.__getitem__)
        if not group:
            continue
        outs = [int(_val(lin.args[1]).shape[0]) for lin in group]
        biases = [lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias") for lin in group]
        has_bias = biases[0] is not None
        xv = _val(x)
        if xv is None or (decide is not None and not decide(xv, outs, has_bias)):
            continue
        with graph.inserting_before(group[0]):
            wcat = graph.call_function(aten.cat.default, ([lin.args[1] for lin in group], 0))
            bcat = graph.call_function(aten.cat.default, (biases, 0)) if has_bias else None
            y = graph.call_function(_LINEAR, (x, wcat, bcat))
            parts = graph.call_function(aten.split_with_sizes.default, (y, outs, -1))
            views = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(group))]
        for lin, view in zip(group, views):
            lin.replace_all_uses_with(view)
            rename_output(ep, lin.name, view.name)
            graph.erase_node(lin)
        fused.append([lin.name for lin in group])
    if fused:
        refresh_values(gm)
    return fused
