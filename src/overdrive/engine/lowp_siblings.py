"""Sibling int8/fp8 GEMMs as one: Linear layers on the low-precision kernel that read the same quantized input
(attention's Q, K and V projections, a gated MLP's gate and up projections) run as one ``overdrive::conv2d_q`` on
their concatenated weights, its output split into their views.

:mod:`~overdrive.engine.sibling_gemms` does this for the float GEMMs of an fp16 engine; an int8/fp8 engine's Linear
layers are ``conv2d_q`` nodes (``quant.triton_linear``), each behind a quantize of its own, so that pass never saw
them: a Llama-style decoder's fp8 engine ran Q, K and V as three GEMMs where its fp16 engine ran one, and Inductor
then applied the rotary embedding to Q and K in two kernels instead of one. Here, inside
:func:`~overdrive.engine.lowp_conv_fusion.fuse_lowp_convs` (before its quantizes become ATen arithmetic), the
layers are grouped when their inputs are the same tensor quantized with the same scale (the same value: each layer
calibrated its own quantizer on that tensor), and each one's weights are 1x1 with float output, no residual, and one
output dtype. Per-channel scales and biases concatenate exactly (a layer without a bias gets zeros), so each output
channel is computed as before; a member's own ReLU / SiLU / GELU epilogue is applied to its slice after the split
(Inductor fuses it into the reader). The concatenated weights are graph ops on constants, computed once by freezing.

On CUDA :class:`TimedLowpGroups` times each group's shape both ways on the build's GPU and fuses only where one GEMM
wins, with the tile config that ran it fastest. Builds group int8/fp8 siblings when asked (``--sibling-gemms``,
``BuildConfig(sibling_gemms=True)``: :meth:`~overdrive.engine.config.BuildConfig.groups_lowp_siblings`), and then the
per-layer timing judges each group as one GEMM too (:mod:`~overdrive.engine.layer_groups`).

Example:
    >>> # fuse_lowp_convs(ep, siblings=TimedLowpGroups(torch.device("cuda")))["sibling_groups"]  # Llama fp8: 8
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import Node

from overdrive.engine.conv_q_layout import (ACT, BIAS, CONFIG, DILATION, OUT_DTYPE, OUT_SCALE, PADDING, QMIN, RELU,
                                            RES, RES_SCALE, SCALE, STRIDE, W, X, full_args)
from overdrive.engine.passes import node_value as _val
from overdrive.engine.passes import rename_output
from overdrive.quant import conv as _qconv

aten = torch.ops.aten
_CONV_Q = torch.ops.overdrive.conv2d_q.default
_QUANTIZE = torch.ops.overdrive.quantize.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

Decide = Callable[[torch.Tensor, list[torch.Tensor], list[int], bool, torch.dtype], "tuple[bool, int] | bool"]
"""``decide(x, weights, configs, has_bias, out_dtype) -> (fuse, config)`` for one group (fake tensors: the 8-bit
input in the kernel's ``(tokens, K, 1, 1)`` view and each member's ``(N, K, 1, 1)`` weight; ``configs`` the members'
tile configs); a bare bool keeps the first member's config."""


def _view_key(node: Any) -> Any:
    """A view or reshape of a node by constant sizes stands for (its source, sizes): export writes one per reader."""
    if (isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS
            and all(isinstance(d, int) for d in node.args[1])):
        return ("view", node.args[0], tuple(node.args[1]))
    return node


def _input_key(x: Any, quantize_key: Callable[[Node], Any]) -> Any:
    """What makes two conv2d_q inputs the same tensor: one node, or quantizes of one (viewed) tensor with equal
    ``quantize_key`` (scale by value, qmin, format)."""
    if isinstance(x, Node) and x.op == "call_function" and x.target is _QUANTIZE:
        return ("quantize", _view_key(x.args[0]), quantize_key(x))
    return x


def _eligible(conv: Node, first_pos: int, order: dict[Node, int]) -> bool:
    a = full_args(conv)
    w = _val(a[W])
    if w is None or w.dim() != 4 or tuple(w.shape[2:]) != (1, 1):
        return False
    if list(a[STRIDE]) != [1, 1] or list(a[PADDING]) != [0, 0] or list(a[DILATION]) != [1, 1]:
        return False
    if a[RES] is not None or a[OUT_SCALE] is not None or a[RES_SCALE] is not None:
        return False
    scale, bias = _val(a[SCALE]), _val(a[BIAS])
    if scale is None or scale.dim() != 1 or scale.shape[0] != w.shape[0]:
        return False
    if a[BIAS] is not None and (bias is None or bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        return False
    # the weights, scales and bias must exist where the one GEMM goes (before the first member)
    return all(not isinstance(t, Node) or t.op == "placeholder" or order[t] < first_pos
               for t in (a[W], a[SCALE], a[BIAS]))


def _groups(graph: torch.fx.Graph, quantize_key: Callable[[Node], Any]) -> list[list[Node]]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_input: dict[Any, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _CONV_Q:
            by_input.setdefault(_input_key(n.args[X], quantize_key), []).append(n)
    groups = []
    for convs in by_input.values():
        if len(convs) < 2:
            continue
        first = min(order[c] for c in convs)
        ok = [c for c in convs if _eligible(c, first, order)]
        # one group per (weight dtype, K, output dtype, qmin): the one kernel computes one of each
        kinds: dict[tuple, list[Node]] = {}
        for c in ok:
            a, w = full_args(c), _val(c.args[W])
            kinds.setdefault((w.dtype, int(w.shape[1]), a[OUT_DTYPE], a[QMIN]), []).append(c)
        groups += [sorted(g, key=order.__getitem__) for g in kinds.values() if len(g) >= 2]
    return groups


def _epilogue(graph: torch.fx.Graph, y: Node, relu: bool, act: int) -> Node:
    """A member's own activation, applied to its slice of the one GEMM's output."""
    if relu:
        y = graph.call_function(aten.relu.default, (y,))
    if act == _qconv.ACT_SILU:
        y = graph.call_function(aten.silu.default, (y,))
    elif act == _qconv.ACT_GELU:
        y = graph.call_function(aten.gelu.default, (y,))
    return y


def group_lowp_siblings(ep: Any, graph: torch.fx.Graph, quantize_key: Callable[[Node], Any],
                        decide: Decide | None = None) -> list[list[str]]:
    """Rewrite each group of sibling ``conv2d_q`` Linear layers into one ``conv2d_q`` plus a split, in place
    (module docstring). ``quantize_key(q)``: what makes two ``overdrive::quantize`` nodes of one tensor equal (their
    scale's value, qmin, format); ``decide`` may veto a group and pick its tile config. Returns the groups fused,
    each as its nodes' names. Meta values of the new nodes are left to the caller's refresh."""
    fused: list[list[str]] = []
    for group in _groups(graph, quantize_key):
        args = [full_args(c) for c in group]
        weights = [_val(a[W]) for a in args]
        outs = [int(w.shape[0]) for w in weights]
        has_bias = any(a[BIAS] is not None for a in args)
        x = args[0][X]
        configs = [int(a[CONFIG]) for a in args]
        verdict = True if decide is None else decide(_val(x), weights, configs, has_bias, args[0][OUT_DTYPE])
        fuse, config = verdict if isinstance(verdict, tuple) else (verdict, configs[0])
        if not fuse:
            continue
        with graph.inserting_before(group[0]):
            call = graph.call_function
            wcat = call(aten.cat.default, ([a[W] for a in args], 0))
            scat = call(aten.cat.default, ([call(aten._to_copy.default, (a[SCALE],), {"dtype": torch.float32})
                                            for a in args], 0))
            bcat = None
            if has_bias:  # a member without a bias adds zeros
                parts = [call(aten._to_copy.default, (a[BIAS],), {"dtype": torch.float32}) if a[BIAS] is not None
                         else call(aten.zeros_like.default, (call(aten._to_copy.default, (a[SCALE],),
                                                                  {"dtype": torch.float32}),))
                         for a in args]
                bcat = call(aten.cat.default, (parts, 0))
            one = [x, wcat, scat, bcat, None, False, None, args[0][OUT_DTYPE], args[0][QMIN], [1, 1], [0, 0], [1, 1],
                   config, None, 0]
            y = call(_CONV_Q, tuple(one))
            if "nn_module_stack" in group[0].meta:
                y.meta["nn_module_stack"] = group[0].meta["nn_module_stack"]
            split = call(aten.split_with_sizes.default, (y, outs, 1))
            views = [_epilogue(graph, call(operator.getitem, (split, i)), bool(a[RELU]), int(a[ACT]))
                     for i, a in enumerate(args)]
        for conv, view in zip(group, views):
            conv.replace_all_uses_with(view)
            rename_output(ep, conv.name, view.name)
            graph.erase_node(conv)
        fused.append([c.name for c in group])
    return fused


class TimedLowpGroups:
    """Decides per group shape, by timing on ``device``, whether one int8/fp8 GEMM beats the separate ones, each
    under a CUDA graph (the engine replays graphs), the one GEMM with the tile config that ran it fastest (the
    members' configs and the GEMM-form tiles). Verdicts are kept per shape in ``verdicts``:
    ``"one 1.12x at 8192x1024->1024+1024+1024 fp8"`` (the separate time over the one).

    Example:
        >>> # fuse_lowp_convs(ep, siblings=TimedLowpGroups(torch.device("cuda")))
    """

    def __init__(self, device: torch.device, margin: float = 1.02) -> None:
        self.device, self.margin = device, margin
        self.verdicts: dict[tuple, tuple[bool, int, str]] = {}

    def __call__(self, x: torch.Tensor, weights: list[torch.Tensor], configs: list[int], has_bias: bool,
                 out_dtype: torch.dtype) -> tuple[bool, int]:
        if x is None or any(not isinstance(d, int) for d in x.shape):
            return False, -1  # a dynamic profile: no one shape to time
        key = (tuple(x.shape), x.dtype, tuple(int(w.shape[0]) for w in weights), tuple(configs), has_bias, out_dtype)
        if key not in self.verdicts:
            try:
                self.verdicts[key] = self._time(key)
            except Exception as exc:  # noqa: BLE001 - a group that cannot be timed here runs as separate GEMMs
                self.verdicts[key] = (False, -1, f"separate: the one GEMM failed to run ({type(exc).__name__}: "
                                                 f"{str(exc)[:120]})")
        return self.verdicts[key][:2]

    def _time(self, key: tuple) -> tuple[bool, int, str]:
        from overdrive.engine.kernel_timing import median_ms as _ms
        from overdrive.quant.conv_tiles import GEMM, candidates

        shape, dtype, outs, configs, has_bias, out_dtype = key
        dev = self.device
        g = torch.Generator(device="cpu").manual_seed(0)
        k = shape[1]

        def eight_bit(*size: int) -> torch.Tensor:
            t = torch.randn(*size, generator=g).clamp(-3, 3) * 30
            return (t.round().to(torch.int8) if dtype == torch.int8 else (t / 10).to(dtype)).to(dev)

        x = eight_bit(*shape).contiguous(memory_format=torch.channels_last)
        ws = [eight_bit(n, k, 1, 1) for n in outs]
        ss = [torch.full((n,), 1e-3, device=dev) for n in outs]
        bs = [torch.zeros(n, device=dev) if has_bias else None for n in outs]
        wcat, scat = torch.cat(ws), torch.cat(ss)
        bcat = torch.cat(bs) if has_bias else None  # type: ignore[arg-type]
        qmin = -128

        def conv(w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, cfg: int) -> torch.Tensor:
            return _CONV_Q(x, w, s, b, None, False, None, out_dtype, qmin, [1, 1], [0, 0], [1, 1], cfg)

        def separate() -> Any:
            return [conv(w, s, b, c) for w, s, b, c in zip(ws, ss, bs, configs)]

        with torch.no_grad():
            t_sep = _ms(separate, dev)
            tried = dict.fromkeys([*configs, *candidates(k, sum(outs), gemm=True)])
            best = min(((_ms(lambda c=c: conv(wcat, scat, bcat, c).split(list(outs), dim=1), dev), c)
                        for c in tried if c >= 0 and c in GEMM or c in configs), key=operator.itemgetter(0))
        t_one, config = best
        win = t_sep >= self.margin * t_one
        kind = "int8" if dtype == torch.int8 else "fp8"
        rows = shape[0] * shape[2] * shape[3]
        return win, config, (f"{'one' if win else 'separate'} {t_sep / t_one:.2f}x at "
                             f"{rows}x{k}->{'+'.join(map(str, outs))} {kind}")
