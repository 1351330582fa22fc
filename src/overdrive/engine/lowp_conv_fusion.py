"""int8 / fp8 convolution chains as TensorRT runs them: BatchNorm, residual add, ReLU and the next layer's quantize
inside each convolution's epilogue.

``quant.to_real`` turns a calibrated CNN's convolutions into ``overdrive::quantize`` + ``overdrive::conv2d_q`` pairs
(``quant/conv.py``), each convolution writing fp16 (and, in CUDA engines, a transformer's Linear layers into the same
op on their ``(tokens, K, 1, 1)`` view: ``Int8TritonLinear``). In an int8/fp8 engine :func:`fuse_lowp_convs` rewrites
the exported program so that:

0. an activation or a quantize that reads a reshaped conv2d_q output moves before the reshape (:func:`_sink_views`),
   so that a Linear layer's GELU and the next layer's quantize sit right after its conv2d_q for the steps below;
1. ``relu(batch_norm(conv2d_q(x)) [+ z])`` (each part optional, the add in either order; SiLU or GELU in place of
   the ReLU, as EfficientNet-style blocks have them) is one ``conv2d_q`` whose ``scale`` and ``bias`` carry the folded
   BatchNorm (graph ops on the weights, computed once by freezing) and whose epilogue adds ``z`` and applies the
   activation; where the model quantizes the residual itself (``quant``'s residual-add
   quantizer, which ``to_real`` writes as ``overdrive::quantize`` + ``overdrive::dequantize``), the epilogue reads the
   8-bit tensor and dequantizes it (same values, half the bytes, no float copy of the residual written);
2. a ``conv2d_q`` whose every reader is ``overdrive::quantize`` with one scale writes that quantized tensor itself
   (int8 / fp8: one byte per element written, and read by the next convolution, instead of fp16 written, read, and a
   separate quantize pass);
3. a ``conv2d_q`` read both in float (a residual add, a pooling) and through ``overdrive::quantize`` becomes one
   ``overdrive::conv2d_q_dual`` that writes both (a ResNet block's output: the next block's residual and its
   convolutions' input), so no separate pass reads the float tensor again to quantize it;
   With ``quantize_residuals`` (``BuildConfig.quantize_residuals``, off by default), a float residual that is also
   quantized for a convolution is read in 8 bits instead (:func:`_quantize_residuals`; for models calibrated without
   residual quantizers), so ResNet blocks hand over only 8-bit tensors;
4. each ``overdrive::quantize`` / ``overdrive::dequantize`` left (an input from a pooling layer, a block output also used as a residual) is
   written back as plain ATen arithmetic, which Inductor fuses into the pass that produces its input.

Example:
    >>> # ep = torch.export.export(prepared_int8_cnn, (x,)); fuse_lowp_convs(ep)
    >>> # {'folded': 53, 'quantized_out': 50, 'dual_out': 0, 'inlined': 1, 'quantized_residuals': 16}

Quantize scales are compared by value where they are build-time constants: the convolutions that read one block
output (the next block's first convolution and its shortcut) were calibrated on the same tensor.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import Node

from overdrive.engine.conv_fusion import _ADD, _BN, _BN_LEGIT, _RELU, _bn_args
from overdrive.engine.conv_q_layout import (ACT, BIAS, CONFIG, DILATION, DUAL_ACT, DUAL_RES_SCALE, OUT_DTYPE,
                                            OUT_SCALE, PADDING, QMIN, RELU, RES, RES_SCALE, SCALE, STRIDE, W, X,
                                            full_args, full_dual_args)
from overdrive.engine.lowp_siblings import group_lowp_siblings
from overdrive.engine.passes import constant_inputs, drop_inference_dropout, rename_output
from overdrive.engine.passes import refresh_values
from overdrive.engine.passes import node_value as _val
from overdrive.quant import conv as _qconv  # also registers overdrive::quantize, dequantize and conv2d_q

aten = torch.ops.aten
_CONV_Q = torch.ops.overdrive.conv2d_q.default
_QUANTIZE = torch.ops.overdrive.quantize.default
_DUAL = torch.ops.overdrive.conv2d_q_dual.default
_DEQUANT = torch.ops.overdrive.dequantize.default
_ACTS = {aten.silu.default: _qconv.ACT_SILU, aten.silu_.default: _qconv.ACT_SILU, aten.gelu.default: _qconv.ACT_GELU,
         aten.gelu_.default: _qconv.ACT_GELU}
_ACT_NAMES = {code: name for name, code in _qconv.ACTS.items()}


def _act_of(node: Node | None, tail: Node) -> int:
    """The epilogue activation code of ``node`` reading ``tail`` (SiLU, GELU in its erf form), else 0."""
    if node is None or node.target not in _ACTS or node.args[0] is not tail:
        return 0
    if _ACTS[node.target] == _qconv.ACT_GELU:
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approx != "none":  # the tanh form is another function: left to Inductor
            return 0
    return _ACTS[node.target]


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _bn_after(node: Node) -> tuple[Node, Node] | None:
    """(the BatchNorm node, the node carrying its output) when ``node``'s one reader is an eval-mode BatchNorm."""
    user = _only_user(node)
    if user is None or user.args[0] is not node:
        return None
    if user.target in _BN:
        training = user.args[5] if len(user.args) > 5 else user.kwargs.get("training", False)
        return None if training else (user, user)
    if user.target in _BN_LEGIT:
        out = _only_user(user)
        if out is not None and out.target is operator.getitem and out.args[1] == 0:
            return user, out
    return None


def _fold_bn(graph: torch.fx.Graph, conv: Node, bn: Node) -> tuple[Node, Node]:
    """Graph nodes for the (scale, bias) of ``conv`` with ``bn`` folded in, in fp32:
    scale * g / sqrt(var + eps) and (bias - mean) * g / sqrt(var + eps) + beta."""
    f32 = torch.float32
    gamma, beta, mean, var, eps = _bn_args(bn)

    def call(op: Any, *args: Any, **kw: Any) -> Node:
        return graph.call_function(op, args, kw)

    def to32(n: Any) -> Node:
        return call(aten._to_copy.default, n, dtype=f32)

    k = call(aten.rsqrt.default, call(aten.add.Tensor, to32(var), eps))
    if isinstance(gamma, Node):
        k = call(aten.mul.Tensor, k, to32(gamma))
    scale = call(aten.mul.Tensor, conv.args[SCALE], k)
    b = conv.args[BIAS]
    shift = call(aten.neg.default, to32(mean)) if b is None else call(aten.sub.Tensor, to32(b), to32(mean))
    bias = call(aten.mul.Tensor, shift, k)
    if isinstance(beta, Node):
        bias = call(aten.add.Tensor, bias, to32(beta))
    return scale, bias


def _same_module(new: Node, old: Node) -> None:
    """``new`` stands for ``old``'s layer: keep the module it came from (``conv_epilogues`` reads it)."""
    if "nn_module_stack" in old.meta:
        new.meta["nn_module_stack"] = old.meta["nn_module_stack"]


def _replace(ep: Any, graph: torch.fx.Graph, old: Node, new: Node) -> None:
    old.replace_all_uses_with(new)
    rename_output(ep, old.name, new.name)


def _fold_epilogues(ep: Any, graph: torch.fx.Graph) -> int:
    """Step 1 for every conv2d_q writing a float tensor: returns how many took at least one epilogue step."""
    folded = 0
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is _CONV_Q]:
        if conv.args[OUT_SCALE] is not None or conv.args[RES] is not None or conv.args[RELU] or full_args(conv)[ACT]:
            continue
        args = full_args(conv)
        tail, chain = conv, [conv]
        got = _bn_after(tail)
        if got is not None:
            bn, bn_out = got
            with graph.inserting_before(conv):
                args[SCALE], args[BIAS] = _fold_bn(graph, conv, bn)
            tail = bn_out
            chain += [bn] + ([bn_out] if bn_out is not bn else [])
        add = _only_user(tail)
        if add is not None and add.target in _ADD and len(add.args) == 2 and add.kwargs.get("alpha", 1) == 1:
            other = add.args[1] if add.args[0] is tail else add.args[0]
            ov, tv = _val(other) if isinstance(other, Node) else None, _val(tail)
            inplace_on_other = add.target is aten.add_.Tensor and add.args[0] is other
            if ov is not None and tv is not None and tuple(ov.shape) == tuple(tv.shape) and not inplace_on_other:
                if other.target is _DEQUANT:  # a residual the model quantizes (quant's residual-add quantizer)
                    args[RES], args[RES_SCALE] = other.args[0], other.args[1]  # read 8-bit, dequantized in-kernel
                else:
                    args[RES] = other
                tail = add
                chain.append(add)
        relu = _only_user(tail)
        if relu is not None and relu.target in _RELU and relu.args[0] is tail:
            args[RELU] = True
            tail = relu
            chain.append(relu)
        elif _act_of(relu, tail):  # SiLU / GELU (EfficientNet's, ConvNeXt-style CNNs'): in the epilogue too
            args[ACT] = _act_of(relu, tail)
            tail = relu
            chain.append(relu)
        if len(chain) == 1:
            continue
        tv = _val(tail)
        if tv is not None:
            args[OUT_DTYPE] = tv.dtype
        with graph.inserting_before(tail):  # every input (the residual too) is defined before the chain's end
            new = graph.call_function(_CONV_Q, tuple(args))
        new.meta["val"] = tail.meta.get("val")
        _same_module(new, conv)
        _replace(ep, graph, tail, new)
        for node in reversed(chain):  # in-place adds / ReLUs count as impure: dead-code elimination would keep them
            if not node.users:
                graph.erase_node(node)
        folded += 1
    return folded


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SINKABLE = {aten.relu.default, aten.silu.default, aten.gelu.default}  # elementwise, one input: order with views free


def _reads_conv_q(node: Any, depth: int = 8) -> bool:
    """Whether ``node`` is a conv2d_q's output, through reshapes and the activations above only."""
    for _ in range(depth):
        if not isinstance(node, Node) or node.op != "call_function":
            return False
        if node.target is _CONV_Q:
            return True
        if node.target not in _VIEWS and node.target not in _SINKABLE:
            return False
        node = node.args[0]
    return False


def _written_in_place(node: Node, depth: int = 8) -> bool:
    """Whether ``node``'s value, or a view of it, is changed in place by a reader (``mul_`` on a view the model
    returns): an epilogue that quantizes it when it is made would miss the change."""
    for u in node.users:
        schema = getattr(u.target, "_schema", None)
        if schema is not None and (schema.is_mutable or any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)):
            return True
        if depth and u.target in _VIEWS and _written_in_place(u, depth - 1):
            return True
    return False


def _sink_views(ep: Any, graph: torch.fx.Graph) -> int:
    """Step 0: an activation or an ``overdrive::quantize`` that reads a reshaped conv2d_q output is moved before the
    reshape (``act(view(y))`` -> ``view(act(y))``; both are elementwise, and a quantize's scale is per tensor), so that
    steps 1-2 find them right after the convolution. This is how a Linear layer run as a 1x1 convolution
    (``quant.triton_linear.Int8TritonLinear``: ``(tokens, K, 1, 1)`` in, reshaped back to ``(..., N)``) gets the GELU after it
    and the next layer's quantize into its epilogue. Returns how many ops moved."""
    moved = 0
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or (node.target is not _QUANTIZE and node.target not in _SINKABLE):
                continue
            view = node.args[0]
            if not (isinstance(view, Node) and view.target in _VIEWS and _reads_conv_q(view.args[0])):
                continue
            root = view.args[0]
            while isinstance(root, Node) and root.target in _VIEWS:
                root = root.args[0]
            if _written_in_place(root):  # the quantize must read the value as changed, so it stays where it is
                continue
            if node.target is not _QUANTIZE and len(view.users) != 1:  # others read the value before the activation
                continue
            base, base_val = view.args[0], _val(view.args[0])
            with graph.inserting_before(node):
                inner = graph.call_function(node.target, (base, *node.args[1:]), dict(node.kwargs))
                outer = graph.call_function(view.target, (inner, *view.args[1:]), dict(view.kwargs))
            if base_val is not None:
                dtype = getattr(_val(node), "dtype", base_val.dtype)
                inner.meta["val"] = base_val if dtype == base_val.dtype else torch.empty_like(base_val, dtype=dtype)
            outer.meta["val"] = node.meta.get("val")
            _same_module(inner, node)
            _same_module(outer, view)
            _replace(ep, graph, node, outer)
            graph.erase_node(node)
            if not view.users:
                graph.erase_node(view)
            moved += 1
            changed = True
    return moved


def _quantize_residuals(ep: Any, graph: torch.fx.Graph) -> int:
    """Step 1b (``quantize_residuals``): a conv2d_q adding a float residual that is also quantized for a convolution
    (a ResNet block's input, read by the block's first convolution and by its residual add) reads the quantized
    tensor instead, dequantized in its epilogue by that quantize's scale. One byte per residual element is read
    instead of two, and once no float reader is left the block before writes only the 8-bit tensor. The residual
    then carries 8-bit rounding: pytorch-quantization's ResNets quantize it the same way, and TensorRT's int8 ResNets
    run it so."""
    done = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is _CONV_Q]:
        args = full_args(conv)
        r = args[RES]
        if not isinstance(r, Node) or args[RES_SCALE] is not None:
            continue
        rv = _val(r)
        if rv is None or rv.dtype in (torch.int8, torch.float8_e4m3fn):
            continue
        qs = [u for u in r.users if u.target is _QUANTIZE and u.args[0] is r and order[u] < order[conv]]
        if not qs:
            continue
        q = qs[0]
        args[RES], args[RES_SCALE] = q, q.args[1]
        with graph.inserting_before(conv):
            new = graph.call_function(_CONV_Q, tuple(args))
        new.meta["val"] = conv.meta.get("val")
        _same_module(new, conv)
        _replace(ep, graph, conv, new)
        graph.erase_node(conv)
        done += 1
    return done


def _scale_key(scale: Any, consts: dict[str, torch.Tensor]) -> Any:
    """What makes two quantize scales the same: the value of a one-element build-time constant, else the node."""
    value = consts.get(scale.name) if isinstance(scale, Node) and scale.op == "placeholder" else None
    if value is not None and value.numel() == 1:
        return ("value", float(value.float().item()))
    return scale


def _quantize_key(q: Node, consts: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
    return _scale_key(q.args[1], consts), q.args[2], q.args[3]


def _quantize_outputs(ep: Any, graph: torch.fx.Graph, consts: dict[str, torch.Tensor]) -> int:
    """Step 2: a conv2d_q whose readers all quantize it with one scale writes the quantized tensor."""
    done = 0
    order = {n: i for i, n in enumerate(graph.nodes)}  # the readers are quantize nodes present before the loop
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is _CONV_Q]:
        users = list(conv.users)
        if conv.args[OUT_SCALE] is not None or not users or any(u.target is not _QUANTIZE or u.args[0] is not conv
                                                                 for u in users):
            continue
        if _written_in_place(conv):
            continue
        if len({_quantize_key(u, consts) for u in users}) != 1:
            continue
        first = min(users, key=order.__getitem__)
        _, scale, qmin, fp8 = first.args
        args = full_args(conv)
        args[OUT_SCALE], args[QMIN] = scale, qmin
        args[OUT_DTYPE] = torch.float8_e4m3fn if fp8 else torch.int8
        with graph.inserting_before(first):  # after the conv and the scale, before every reader
            new = graph.call_function(_CONV_Q, tuple(args))
        new.meta["val"] = first.meta.get("val")
        _same_module(new, conv)
        for u in users:
            _replace(ep, graph, u, new)
            graph.erase_node(u)
        graph.erase_node(conv)
        done += 1
    return done


def _dual_outputs(ep: Any, graph: torch.fx.Graph, consts: dict[str, torch.Tensor]) -> int:
    """Step 3: a float-writing conv2d_q with quantize readers and other readers writes both tensors at once; where
    its quantize readers use several scales, the most common one is served (the others stay quantize ops)."""
    done = 0
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is _CONV_Q]:
        if conv.args[OUT_SCALE] is not None:
            continue
        readers = [u for u in conv.users if u.target is _QUANTIZE and u.args[0] is conv]
        if not readers or _written_in_place(conv):
            continue
        groups: dict[Any, list[Node]] = {}
        for u in readers:
            groups.setdefault(_quantize_key(u, consts), []).append(u)
        served = max(groups.values(), key=len)
        if len(served) == len(conv.users):  # every reader quantizes with one scale: step 2's case
            continue
        _, scale, qmin, fp8 = served[0].args
        if isinstance(scale, Node) and scale.op != "placeholder":  # computed after the conv, maybe: not movable
            continue
        a = full_args(conv)
        with graph.inserting_before(conv):
            new = graph.call_function(_DUAL, (a[X], a[W], a[SCALE], a[BIAS], a[RES], a[RELU], a[OUT_DTYPE], scale,
                                              qmin, fp8, a[STRIDE], a[PADDING], a[DILATION], a[CONFIG],
                                              a[RES_SCALE], a[ACT]))
            y = graph.call_function(operator.getitem, (new, 0))
            q = graph.call_function(operator.getitem, (new, 1))
        new.meta["val"] = (conv.meta.get("val"), served[0].meta.get("val"))
        _same_module(new, conv)
        y.meta["val"], q.meta["val"] = conv.meta.get("val"), served[0].meta.get("val")
        for u in served:
            _replace(ep, graph, u, q)
            graph.erase_node(u)
        _replace(ep, graph, conv, y)
        graph.erase_node(conv)
        done += 1
    return done


def _merge_equal_quantizes(graph: torch.fx.Graph, consts: dict[str, torch.Tensor]) -> None:
    """Quantizes of one tensor with equal scales (a block input read by a convolution and its shortcut) become one,
    so the tensor is quantized once."""
    seen: dict[tuple[Any, ...], Node] = {}
    for q in [n for n in graph.nodes if n.op == "call_function" and n.target is _QUANTIZE]:
        key = (q.args[0], *_quantize_key(q, consts))
        if key in seen:
            q.replace_all_uses_with(seen[key])
        else:
            seen[key] = q


def _inline_quantizes(graph: torch.fx.Graph) -> int:
    """Step 4: each quantize left becomes the ATen ops it stands for (clamp(round(x / s)) -> int8, or x / s clamped
    to +-448 -> fp8), so Inductor fuses it into its producer."""
    n_done = 0
    for d in [n for n in graph.nodes if n.op == "call_function" and n.target is _DEQUANT]:
        q, scale, dtype = d.args
        with graph.inserting_before(d):
            y = graph.call_function(aten.mul.Tensor, (graph.call_function(aten._to_copy.default, (q,),
                                                                         {"dtype": torch.float32}), scale))
            y = graph.call_function(aten._to_copy.default, (y,), {"dtype": dtype})
        d.replace_all_uses_with(y)
        graph.erase_node(d)
    for q in [n for n in graph.nodes if n.op == "call_function" and n.target is _QUANTIZE]:
        if not q.users:  # merged into an equal quantize of the same tensor below
            continue
        x, scale, qmin, fp8 = q.args
        with graph.inserting_before(q):
            y = graph.call_function(aten.div.Tensor, (graph.call_function(aten._to_copy.default, (x,),
                                                                         {"dtype": torch.float32}), scale))
            if fp8:
                y = graph.call_function(aten.clamp.default, (y, -448.0, 448.0))
                dtype = torch.float8_e4m3fn
            else:
                y = graph.call_function(aten.clamp.default, (graph.call_function(aten.round.default, (y,)),
                                                             float(qmin), 127.0))
                dtype = torch.int8
            y = graph.call_function(aten._to_copy.default, (y,), {"dtype": dtype})
        q.replace_all_uses_with(y)
        graph.erase_node(q)
        n_done += 1
    return n_done


def fuse_lowp_convs(ep: Any, quantize_residuals: bool = False, siblings: Any = None) -> dict[str, int]:
    """Fold epilogues into ``overdrive::conv2d_q`` nodes and quantize their outputs where every reader wants that, in
    place (module docstring: steps 1-4). Returns the counts: ``folded``, ``quantized_out``, ``dual_out``, ``inlined``
    and ``quantized_residuals`` (convolutions reading their residual in 8 bits: quantized by the model, or with
    ``quantize_residuals`` by :func:`_quantize_residuals`).

    ``siblings``: also run the Linear layers that read one quantized input as one GEMM
    (:func:`~overdrive.engine.lowp_siblings.group_lowp_siblings`, before step 4): True for every such group, or a
    decider such as :class:`~overdrive.engine.lowp_siblings.TimedLowpGroups`; the counts then include
    ``sibling_groups``.

    Example:
        >>> # fuse_lowp_convs(torch.export.export(quant.to_real(calibrated_cnn), (x,)))
    """
    gm = ep.graph_module
    graph = gm.graph
    if not any(n.op == "call_function" and n.target in (_CONV_Q, _QUANTIZE, _DEQUANT) for n in graph.nodes):
        none = {"folded": 0, "quantized_out": 0, "dual_out": 0, "inlined": 0, "quantized_residuals": 0}
        return none if siblings is None or siblings is False else {**none, "sibling_groups": 0}
    drop_inference_dropout(ep)  # an eval-mode dropout between an epilogue and its reader's quantize: the identity
    consts = constant_inputs(ep)
    _sink_views(ep, graph)
    folded = _fold_epilogues(ep, graph)
    graph.eliminate_dead_code()
    if quantize_residuals:
        _quantize_residuals(ep, graph)
    quantized = _quantize_outputs(ep, graph, consts)
    graph.eliminate_dead_code()
    dual = _dual_outputs(ep, graph, consts)
    graph.eliminate_dead_code()
    _merge_equal_quantizes(graph, consts)
    graph.eliminate_dead_code()
    grouped = None
    if siblings is not None and siblings is not False:
        grouped = group_lowp_siblings(ep, graph, lambda q: _quantize_key(q, consts),
                                      None if siblings is True else siblings)
        graph.eliminate_dead_code()
    inlined = _inline_quantizes(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    with contextlib.suppress(Exception):  # meta values refresh; a failure leaves the (valid) graph as it is
        refresh_values(gm)
    residuals = sum(1 for n in graph.nodes if n.op == "call_function" and (
        (n.target is _CONV_Q and full_args(n)[RES_SCALE] is not None)
        or (n.target is _DUAL and full_dual_args(n)[DUAL_RES_SCALE] is not None)))
    counts = {"folded": folded, "quantized_out": quantized, "dual_out": dual, "inlined": inlined,
              "quantized_residuals": residuals}
    return counts if grouped is None else {**counts, "sibling_groups": len(grouped)}


def conv_epilogues(ep: Any) -> dict[str, dict[str, Any]]:
    """What each int8/fp8 convolution of a program fused by :func:`fuse_lowp_convs` does besides convolving, by the
    name of the module it came from: ``residual`` (None, ``"float"`` or ``"8-bit"``), ``relu``, ``out``
    (``"float"``, ``"8-bit"``: the next layer's quantized input, or ``"dual"``: both), and ``act`` (``"silu"`` /
    ``"gelu"``) where the epilogue has one. The per-layer timing times each convolution in this form
    (``layer_choice``).

    Example:
        >>> # conv_epilogues(ep)["layer1.0.conv3"]
        >>> # {'residual': 'float', 'relu': True, 'out': 'dual'}
    """
    out: dict[str, dict[str, Any]] = {}
    for n in ep.graph_module.graph.nodes:
        if n.op != "call_function" or n.target not in (_CONV_Q, _DUAL):
            continue
        stack = n.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        name = list(stack.values())[-1][0]
        if n.target is _DUAL:
            a = full_dual_args(n)
            res, res_scale, relu, act, kind = a[RES], a[DUAL_RES_SCALE], a[RELU], a[DUAL_ACT], "dual"
        else:
            a = full_args(n)
            res, res_scale, relu, act = a[RES], a[RES_SCALE], a[RELU], a[ACT]
            kind = "8-bit" if a[OUT_SCALE] is not None else "float"
        out[name] = {"residual": None if res is None else "8-bit" if res_scale is not None else "float",
                     "relu": bool(relu), "out": kind}
        if act:  # only where there is one, so plans without it read as before (0 is no activation)
            out[name]["act"] = _ACT_NAMES[act]
        if _from_float_conv(a[X]):  # likewise: only where the input is quantized after a float convolution
            out[name]["input"] = "float conv"
    return out


# what the fp16 engine's conv fusion folds into a float convolution (engine/conv_fusion.py: cuDNN's fused
# conv + bias (+ residual) + ReLU), and the inlined quantize (_inline_quantizes) that follows it
_THROUGH = {aten._to_copy.default, aten.div.Tensor, aten.clamp.default, aten.round.default, *_RELU, *_ADD, *_BN,
            *_BN_LEGIT, operator.getitem}
_FLOAT_CONV = {aten.convolution.default, aten.conv2d.default}


def _from_float_conv(x: Any, depth: int = 12) -> bool:
    """Whether the 8-bit input ``x`` of a convolution is quantized from a float convolution's output through only
    what the fp16 engine fuses into that convolution's cuDNN kernel (BatchNorm, a residual add, ReLU): the engine
    then quantizes it in a pass of its own (the fused kernel writes fp16), which the low-precision convolution's
    timing must pay. Quantized after anything else (a pooling, SiLU, an SE scale), the quantize joins the pass
    Inductor runs there anyway and costs nothing extra.

    Example:
        >>> _from_float_conv(None)
        False
    """
    if not isinstance(x, Node) or x.op != "call_function" or depth == 0:
        return False
    if x.target in _FLOAT_CONV:
        return True
    if x.target not in _THROUGH or x.target in (_CONV_Q, _DUAL):
        return False
    return any(_from_float_conv(a, depth - 1) for a in x.args if isinstance(a, Node))


_CONV_OPS = ("conv2d_q", "conv2d_q_dual")


def _zeros_like_value(v: Any, device: torch.device) -> Any:
    """A zero tensor with the fake tensor ``v``'s shape, strides and dtype on ``device``; other values as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    # bytes, then viewed as the dtype: zero-filling works for every dtype (fp8 included)
    raw = torch.zeros(_span(v) * v.element_size(), dtype=torch.uint8, device=device)
    return raw.view(v.dtype).as_strided(tuple(v.shape), tuple(v.stride()))


def _span(v: torch.Tensor) -> int:
    """Elements a tensor of ``v``'s shape and strides spans in memory."""
    if any(d == 0 for d in v.shape):
        return 1
    return 1 + sum((d - 1) * abs(st) for d, st in zip(v.shape, v.stride()))


def _signature(a: Any) -> Any:
    v = _val(a) if isinstance(a, Node) else a
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_signature(x) for x in v)
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)


def precompile_convs(ep: Any, device: torch.device,
                     run: Callable[[list[Callable[[], Any]], torch.device], None] | None = None) -> int:
    """Run each distinct ``overdrive::conv2d_q`` / ``conv2d_q_dual`` call of the fused program ``ep`` once, on zero
    tensors of its arguments' shapes, strides and dtypes, so that the Triton kernels the engine will launch compile
    side by side (``quant.conv.compile_in_threads``) before Inductor compiles the program, where each would compile
    alone at its first call. The layer timing compiles each convolution in its planned form; the program can still
    hold other forms (an epilogue whose reader was kept float, a dual output), and a ResNet-50 int8 build once spent
    93 s in that compile against 22 s for fp8. Returns how many distinct calls ran; a call that fails is left for the
    engine's own call to report. ``run`` replaces ``compile_in_threads`` (tests).

    Example:
        >>> # precompile_convs(ep, torch.device("cuda"))  # after fuse_lowp_convs(ep), before compiling
    """
    targets = {getattr(torch.ops.overdrive, op).default: op for op in _CONV_OPS}
    calls: dict[Any, Callable[[], Any]] = {}
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target not in targets:
            continue
        values = [(_val(a) if isinstance(a, Node) else a) for a in n.args]
        kw = {k: (_val(a) if isinstance(a, Node) else a) for k, a in n.kwargs.items()}
        if any(isinstance(a, Node) and v is None for a, v in zip(n.args, values)):
            continue  # an argument without a recorded value: nothing to build it from
        key = (targets[n.target], tuple(_signature(a) for a in n.args),
               tuple(sorted((k, _signature(a)) for k, a in n.kwargs.items())))

        def call(op: Any = n.target, values: list[Any] = values, kw: dict[str, Any] = kw) -> Any:
            with torch.no_grad():  # tensors made here, one call at a time: no layer's buffers held for all the others
                return op(*[_zeros_like_value(v, device) for v in values],
                          **{k: _zeros_like_value(v, device) for k, v in kw.items()})

        calls.setdefault(key, call)
    (run or _qconv.compile_in_threads)(list(calls.values()), device)
    return len(calls)
