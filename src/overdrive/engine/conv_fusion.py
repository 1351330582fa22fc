"""Convolution + BatchNorm (+ residual add) + ReLU as one cuDNN call: an op and the engine pass that uses it.

Inductor runs a convolution as a cuDNN extern kernel and its epilogue (bias, the residual add, ReLU) as a separate
Triton pass that reads the convolution's output back from memory; it cannot fuse into cuDNN. cuDNN can apply that
epilogue inside the convolution (ATen exposes it as ``torch.cudnn_convolution_relu`` and
``torch.cudnn_convolution_add_relu``). On the H200, at ResNet-50's convolution shapes (batch 256, fp16
channels_last), the fused call ran 1.06x-2.05x Inductor's convolution + Triton epilogue on every shape
(``benchmarks/results/conv_epilogue.md``).

:func:`fuse_conv_relu` rewrites, in an exported program, ``relu(batch_norm(conv2d(x)) [+ z])`` (BatchNorm and the add
optional, the add in either order) into ``overdrive::conv2d_relu``, with the BatchNorm folded into the convolution's
weight and bias by graph ops on the weights, which Inductor's freezing computes once at compile time. The op runs
cuDNN's fused kernel on CUDA and the plain composition elsewhere (the reference it is tested against).

Example:
    >>> import torch.nn.functional as F
    >>> x, w, b = torch.randn(1, 4, 8, 8), torch.randn(8, 4, 3, 3), torch.zeros(8)
    >>> y = torch.ops.overdrive.conv2d_relu(x, w, b, None, [1, 1], [1, 1], [1, 1], 1)
    >>> torch.equal(y, F.relu(F.conv2d(x, w, b, 1, 1)))
    True
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.node import Node

from overdrive.engine.passes import node_value as _val
from overdrive.engine.passes import refresh_values
from overdrive.engine.passes import rename_output

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)  # cuDNN's fused path computes fp32 inputs in TF32: fp32 engines keep IEEE


def _channels_last(x: torch.Tensor) -> bool:
    """Whether the op lays ``x`` (and its output) out NHWC: ``x`` is channels_last-contiguous. That includes the
    tensors that are both layouts at once (one channel, as a grayscale image; or 1x1 spatial): their memory is the same
    either way, and NHWC keeps every layer after them NHWC. Read as NCHW, a one-channel stem made each later fused
    convolution's cuDNN output (NHWC, after freezing laid the weights out NHWC) be copied back to NCHW: a ResNet-18
    engine ran 0.38x torch.compile (``benchmarks/results/engine_demo_variants_static.md``)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)


def _as_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``t`` with exactly the strides of ``channels_last`` (NHWC) or NCHW: a view when its memory already is that
    layout (only the strides of size-1 dims change, so cuDNN reads the layout meant), else a copy."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if not t.is_contiguous(memory_format=fmt):
        return t.contiguous(memory_format=fmt)
    n, c, h, w = t.shape
    want = (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)
    return t if t.stride() == want else t.as_strided(t.shape, want, t.storage_offset())


def _cudnn_operands(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The fused call's operands all in the input's layout. cuDNN picks its output layout from the input and the
    weight (NHWC if either is), so a weight laid out otherwise (Inductor's freezing lays conv weights out NHWC) would
    make the output need a copy back to the layout the op promises.

    Example:
        >>> x = torch.randn(2, 1, 8, 8)  # one channel: NCHW and NHWC at once
        >>> xo, wo, _ = _cudnn_operands(x, torch.randn(4, 1, 3, 3), None)
        >>> xo.stride(), xo.data_ptr() == x.data_ptr()
        ((64, 1, 8, 1), True)
    """
    cl = _channels_last(x)
    return (_as_layout(x, cl), _as_layout(weight, cl),
            None if residual is None else _as_layout(residual, cl))


def _out_shape(x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
               dilation: list[int]) -> list[Any]:
    n, _, h, wd = x.shape
    k_h, k_w = w.shape[2], w.shape[3]
    h_out = (h + 2 * padding[0] - dilation[0] * (k_h - 1) - 1) // stride[0] + 1
    w_out = (wd + 2 * padding[1] - dilation[1] * (k_w - 1) - 1) // stride[1] + 1
    return [n, w.shape[0], h_out, w_out]


def _empty_like_out(x: torch.Tensor, shape: list[Any]) -> torch.Tensor:
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)


@torch.library.custom_op("overdrive::conv2d_relu", mutates_args=())
def conv2d_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, bias) + residual)`` (residual optional) in one cuDNN call on CUDA.

    The output is channels_last when ``x`` is, else contiguous, on every device (the fake kernel says the same).
    """
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if residual is not None:
        y = y + residual
    return _laid_out(torch.relu(y), x)


@conv2d_relu.register_kernel("cuda")
def _conv2d_relu_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                      stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    x, weight, residual = _cudnn_operands(x, weight, residual)
    if residual is None:
        y = torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    else:
        y = torch.cudnn_convolution_add_relu(x, weight, residual, 1.0, bias, stride, padding, dilation, groups)
    return _laid_out(y, x)


@conv2d_relu.register_fake
def _conv2d_relu_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                      stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    return _empty_like_out(x, _out_shape(x, weight, stride, padding, dilation))


def _laid_out(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` with exactly the strides the fake kernel promises (Inductor indexes the output by them)."""
    n, c, h, w = y.shape
    want = (h * w * c, 1, w * c, c) if _channels_last(x) else (c * h * w, h * w, w, 1)
    return y if y.stride() == want else _empty_like_out(x, [n, c, h, w]).copy_(y)


_RELU = {aten.relu.default, aten.relu_.default}
_ADD = {aten.add.Tensor, aten.add_.Tensor}
_BN = {aten.batch_norm.default}
_BN_LEGIT = {aten._native_batch_norm_legit_no_training.default}
_CONV = {aten.conv2d.default}


def _pair(v: Any, default: int) -> list[int] | None:
    v = [default] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]
    if len(v) == 1:
        v = v * 2
    return v if len(v) == 2 and all(isinstance(i, int) for i in v) else None


def _conv_of(node: Any) -> tuple[Node, Node | None] | None:
    """(conv2d node, its BatchNorm node or None) when ``node`` is ``conv2d`` or ``batch_norm(conv2d)`` in eval mode,
    each value used once (by the next op in the chain)."""
    if not isinstance(node, Node) or len(node.users) != 1:
        return None
    bn = None
    if node.target is operator.getitem and node.args[1] == 0 and getattr(node.args[0], "target", None) in _BN_LEGIT:
        bn = node.args[0]
        if len(bn.users) != 1:
            return None
        src = bn.args[0]
    elif node.target in _BN:
        if node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False):
            return None  # training-mode BatchNorm normalizes by the batch's statistics
        bn, src = node, node.args[0]
    else:
        src = node
    if not isinstance(src, Node) or src.target not in _CONV or (bn is not None and len(src.users) != 1):
        return None
    return src, bn


def _bn_args(bn: Node) -> tuple[Any, Any, Node, Node, float]:
    """(gamma, beta, mean, var, eps) of a batch_norm / _native_batch_norm_legit_no_training node."""
    a = list(bn.args)
    if bn.target in _BN:  # (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
        return a[1], a[2], a[3], a[4], float(a[7])
    return a[1], a[2], a[3], a[4], float(a[6])  # (input, weight, bias, running_mean, running_var, momentum, eps)


def _folded(graph: torch.fx.Graph, conv: Node, bn: Node | None, channels_last: bool) -> tuple[Node, Node]:
    """Graph nodes computing the convolution's weight and bias with ``bn`` folded in (in fp32, then cast back),
    the weight in channels_last when the input is."""
    f32 = torch.float32
    w = conv.args[1]
    cb = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    wv = _val(w)
    dtype, out_ch = wv.dtype, wv.shape[0]

    def call(op: Any, *args: Any, **kw: Any) -> Node:
        return graph.call_function(op, args, kw)

    def to(n: Any, dt: torch.dtype) -> Node:
        return call(aten._to_copy.default, n, dtype=dt)

    if bn is None:
        weight = w
        bias = cb if isinstance(cb, Node) else call(aten.zeros.default, [out_ch], dtype=dtype, device=wv.device)
    else:
        gamma, beta, mean, var, eps = _bn_args(bn)
        scale = call(aten.rsqrt.default, call(aten.add.Tensor, to(var, f32), eps))
        if isinstance(gamma, Node):
            scale = call(aten.mul.Tensor, scale, to(gamma, f32))
        weight = to(call(aten.mul.Tensor, to(w, f32), call(aten.reshape.default, scale, [-1, 1, 1, 1])), dtype)
        shift = call(aten.neg.default, to(mean, f32)) if not isinstance(cb, Node) else \
            call(aten.sub.Tensor, to(cb, f32), to(mean, f32))
        bias = call(aten.mul.Tensor, shift, scale)
        if isinstance(beta, Node):
            bias = call(aten.add.Tensor, bias, to(beta, f32))
        bias = to(bias, dtype)
    if channels_last:
        weight = call(aten.clone.default, weight, memory_format=torch.channels_last)
    return weight, bias


_EPILOGUE: Any = None  # the add (+ ReLU) after a convolution, one dynamic-shape compile shared by every timing


def _add_relu(y: torch.Tensor, r: torch.Tensor | None, relu: bool, act: int = 0) -> torch.Tensor:
    y = y + r if r is not None else y
    if act:  # 1 SiLU, 2 GELU (overdrive::conv2d_q's codes)
        return F.silu(y) if act == 1 else F.gelu(y)
    return torch.relu(y) if relu else y


def conv_paths_ms(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, z: torch.Tensor | None, stride: list[int],
                  padding: list[int], dilation: list[int], groups: int, relu: bool = True, act: int = 0
                  ) -> tuple[float | None, float]:
    """ms of ``relu(conv2d(x, w, b) (+ z))`` on ``x``'s device both ways an fp16 engine can run it: cuDNN's fused
    call (None without a ReLU, or where cuDNN refuses the shape) and ``conv2d`` then the add (+ ReLU) as one compiled
    pass (eager on CPU), each replayed in a CUDA graph (``kernel_timing``). ``act`` (1 SiLU, 2 GELU) in place of
    the ReLU: the compiled pass applies it (cuDNN's fused call has ReLU only).

    Example:
        >>> x, w = torch.randn(1, 4, 8, 8), torch.randn(4, 4, 3, 3)
        >>> fused, plain = conv_paths_ms(x, w, torch.zeros(4), None, [1, 1], [1, 1], [1, 1], 1)
        >>> plain > 0
        True
    """
    global _EPILOGUE
    from overdrive.engine.kernel_timing import median_ms

    dev = x.device
    if dev.type == "cuda" and _EPILOGUE is None:
        _EPILOGUE = torch.compile(_add_relu, dynamic=True)
    epilogue = _EPILOGUE if dev.type == "cuda" else _add_relu
    t_plain = median_ms(lambda: epilogue(F.conv2d(x, w, b, stride, padding, dilation, groups), z, relu, act), dev)
    t_fused = None
    if relu and not act:
        try:
            t_fused = median_ms(lambda: conv2d_relu(x, w, b, z, stride, padding, dilation, groups), dev)
        except RuntimeError:
            pass
    return t_fused, t_plain


class TimedChoice:
    """Decides per convolution shape, by timing on ``device``, whether the fused call beats the unfused path the engine
    would run otherwise: ``conv2d`` with its bias (cuDNN) then the add + ReLU as one compiled pass (one dynamic-shape
    compile shared by all shapes), each captured in a CUDA graph and replayed, so launches do not count. Verdicts are
    kept per shape in ``verdicts`` as ``"fused 1.62x at 256x64x56x56 k3 s1"`` (the unfused time over the fused).

    Example:
        >>> # fuse_conv_relu(ep, decide=TimedChoice(torch.device("cuda")))
    """

    def __init__(self, device: torch.device, margin: float = 1.0) -> None:
        self.device, self.margin = device, margin
        self.verdicts: dict[tuple, tuple[bool, str]] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, residual: bool, stride: list[int], padding: list[int],
                 dilation: list[int], groups: int) -> bool:
        if any(not isinstance(d, int) for d in x.shape):  # a dynamic profile: no one shape to time, fuse (as measured
            return True                                     # at ResNet-50's shapes, batch 256)
        cl = _channels_last(x)
        key = (tuple(x.shape), tuple(w.shape), x.dtype, residual, tuple(stride), tuple(padding), tuple(dilation),
               groups, cl)
        if key not in self.verdicts:
            self.verdicts[key] = self._time(key)
        return self.verdicts[key][0]

    def _time(self, key: tuple) -> tuple[bool, str]:
        xs, ws, dtype, residual, stride, padding, dilation, groups, cl = key
        dev = self.device
        fmt = torch.channels_last if cl else torch.contiguous_format
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(xs, generator=g).to(device=dev, dtype=dtype).contiguous(memory_format=fmt)
        w = (torch.randn(ws, generator=g) / max(1, ws[1] * ws[2] * ws[3]) ** 0.5).to(device=dev, dtype=dtype)
        w = w.contiguous(memory_format=fmt)
        b = torch.zeros(ws[0], device=dev, dtype=dtype)
        out = _out_shape(x, w, list(stride), list(padding), list(dilation))
        z = torch.randn(out, generator=g).to(device=dev, dtype=dtype).contiguous(memory_format=fmt) \
            if residual else None
        with torch.no_grad():
            t_fused, t_plain = conv_paths_ms(x, w, b, z, list(stride), list(padding), list(dilation), groups)
        if t_fused is None:  # a shape cuDNN's fused path refuses: leave it unfused
            return False, "unfused: the fused call failed"
        win = t_plain >= self.margin * t_fused
        return win, (f"{'fused' if win else 'unfused'} {t_plain / t_fused:.2f}x at {'x'.join(map(str, xs))} "
                     f"k{ws[2]} s{stride[0]}{' +add' if residual else ''}")


def fuse_conv_relu(ep: Any, decide: Any = None) -> list[str]:
    """Rewrite ``relu(batch_norm(conv2d(x)) + z)`` into one ``overdrive::conv2d_relu`` call, in place.

    Matches a 2-D convolution (BatchNorm in eval mode after it optional) followed by ReLU, with an elementwise add
    of a same-shape, same-dtype tensor between them optional (ResNet's ``out += identity; relu(out)``), where each
    intermediate value has no other use; fp16 and bf16 only. ``decide(x, weight, has_residual, stride, padding,
    dilation, groups) -> bool`` (the values as fake tensors; e.g. :class:`TimedChoice`) may veto a match.
    Returns the names of the ReLU nodes folded.

    Example:
        >>> ep = torch.export.export(resnet.eval().half().cuda(), (x,))   # doctest: +SKIP
        >>> len(fuse_conv_relu(ep))                                        # doctest: +SKIP
        33
    """
    from torch._guards import detect_fake_mode

    gm = ep.graph_module
    graph = gm.graph
    fused: list[str] = []
    for relu in list(graph.nodes):
        if relu.op != "call_function" or relu.target not in _RELU:
            continue
        src, residual, chain = relu.args[0], None, None
        if isinstance(src, Node) and src.target in _ADD and len(src.users) == 1 and len(src.args) == 2 \
                and src.kwargs.get("alpha", 1) == 1:
            a, b = src.args
            for cand, other in ((a, b), (b, a)):
                got = _conv_of(cand)
                if got is None or not isinstance(other, Node):
                    continue
                ov, cv = _val(other), _val(cand)
                if ov is None or cv is None or tuple(ov.shape) != tuple(cv.shape) or ov.dtype != cv.dtype:
                    continue
                if src.target is aten.add_.Tensor and other is a and len(other.users) != 1:
                    continue  # `z += conv(x)` writes z, which something else reads after: leave it
                chain, residual = got, other
                break
        else:
            chain = _conv_of(src)
        if chain is None:
            continue
        conv, bn = chain
        x = conv.args[0]
        xv, wv = _val(x), _val(conv.args[1])
        if xv is None or wv is None or xv.dim() != 4 or wv.dim() != 4 or xv.dtype not in _HALF or wv.dtype != xv.dtype:
            continue
        a = list(conv.args) + [None] * (7 - len(conv.args))
        stride, padding, dilation = _pair(a[3], 1), _pair(a[4], 0), _pair(a[5], 1)
        groups = a[6] if a[6] is not None else 1
        if stride is None or padding is None or dilation is None or not isinstance(groups, int):
            continue
        if decide is not None and not decide(xv, wv, residual is not None, stride, padding, dilation, groups):
            continue
        with graph.inserting_before(relu):
            weight, bias = _folded(graph, conv, bn, _channels_last(xv))
            out = graph.call_function(torch.ops.overdrive.conv2d_relu.default,
                                      (x, weight, bias, residual, stride, padding, dilation, groups))
        with detect_fake_mode([xv]) or contextlib.nullcontext():  # later matches read the value's shape and layout
            out.meta["val"] = _empty_like_out(xv, _out_shape(xv, wv, stride, padding, dilation))
        relu.replace_all_uses_with(out)
        rename_output(ep, relu.name, out.name)  # the program's output may be this ReLU: it is `out` now
        fused.append(relu.name)
        graph.erase_node(relu)  # in-place ReLU / add count as impure: dead-code elimination would keep them
        if residual is not None:
            graph.erase_node(src)
    if fused:
        graph.eliminate_dead_code()
        refresh_values(gm)
    return fused


STEM_CHANNELS = 4
"""The channel count a convolution on few channels (an image's 1 or 3) is padded to: cuDNN's first-layer kernels
take NHWC with 4 channels (``..._first_layer_..._k64c4r7s7``) and convert anything else in extra kernels first."""


def _pad_channels(x: torch.Tensor, to: int) -> torch.Tensor:
    """``x`` (N, C, H, W) with zero channels appended up to ``to``, NHWC: one pass that Inductor fuses with the
    input's cast."""
    return F.pad(x, (0, 0, 0, 0, 0, to - x.shape[1])).contiguous(memory_format=torch.channels_last)


class TimedStemPad:
    """Decides per convolution shape, by timing on ``device``, whether the convolution runs faster on its input padded
    to :data:`STEM_CHANNELS` NHWC channels (the weight padded with zeros) than on the input as it is. On the H200,
    cuDNN converted a one-channel 224x224 batch of 256 in three kernels that took 0.57 ms of a 3.05 ms ResNet-18
    engine (``engine_demo_variants_fixed.md``); the padded path is timed with its pad as a separate pass, which the
    engine fuses into the input's cast. Verdicts per shape in ``verdicts``: ``(True, "padded 1.40x at 256x1x224x224
    k7 s2")``.

    Example:
        >>> t = TimedStemPad(torch.device("cpu"))
        >>> isinstance(t(torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3), [1, 1], [1, 1], [1, 1]), bool)
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.verdicts: dict[tuple, tuple[bool, str]] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
                 dilation: list[int]) -> bool:
        if any(not isinstance(d, int) for d in x.shape):
            return False
        key = (tuple(x.shape), tuple(w.shape), x.dtype, tuple(stride), tuple(padding), tuple(dilation),
               _channels_last(x))
        if key not in self.verdicts:
            self.verdicts[key] = self._time(key)
        return self.verdicts[key][0]

    def _time(self, key: tuple) -> tuple[bool, str]:
        from overdrive.engine.kernel_timing import median_ms

        xs, ws, dtype, stride, padding, dilation, cl = key
        dev = self.device
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(xs, generator=g).to(device=dev, dtype=dtype)
        x = x.contiguous(memory_format=torch.channels_last) if cl else x
        w = (torch.randn(ws, generator=g) / max(1, ws[1] * ws[2] * ws[3]) ** 0.5).to(device=dev, dtype=dtype)
        w = w.contiguous(memory_format=torch.channels_last) if cl else w
        wp = _pad_channels(w, STEM_CHANNELS)
        args = (None, list(stride), list(padding), list(dilation))
        with torch.no_grad():
            t_plain = median_ms(lambda: F.conv2d(x, w, *args), dev)
            t_pad = median_ms(lambda: F.conv2d(_pad_channels(x, STEM_CHANNELS), wp, *args), dev)
        win = t_pad < t_plain
        return win, (f"{'padded' if win else 'as is'} {t_plain / t_pad:.2f}x at {'x'.join(map(str, xs))} "
                     f"k{ws[2]} s{stride[0]}")


def pad_stem_channels(ep: Any, decide: Any = None) -> list[str]:
    """Pad the input channels of fp16/bf16 convolutions on fewer than :data:`STEM_CHANNELS` channels (a network's
    first layer on RGB or grayscale images) to that many, NHWC, with the weight padded with zero input channels, in
    place: the result is the same, since the added channels are zero in both. ``decide(x, weight, stride, padding,
    dilation) -> bool`` (fake tensors; e.g. :class:`TimedStemPad`) may veto one. Returns the convolution nodes padded.

    Example:
        >>> ep = torch.export.export(torch.nn.Conv2d(1, 8, 3).half(), (torch.randn(2, 1, 8, 8).half(),))  # doctest: +SKIP
        >>> pad_stem_channels(ep)                                                                  # doctest: +SKIP
        ['conv2d']
    """

    gm = ep.graph_module
    graph = gm.graph
    padded: list[str] = []
    for conv in list(graph.nodes):
        if conv.op != "call_function" or conv.target not in _CONV:
            continue
        x, w = conv.args[0], conv.args[1]
        xv, wv = _val(x), _val(w)
        if xv is None or wv is None or xv.dim() != 4 or xv.dtype not in _HALF or wv.dtype != xv.dtype:
            continue
        c = xv.shape[1]
        a = list(conv.args) + [None] * (7 - len(conv.args))
        stride, pad, dilation = _pair(a[3], 1), _pair(a[4], 0), _pair(a[5], 1)
        if not isinstance(c, int) or c >= STEM_CHANNELS or (a[6] or 1) != 1 or None in (stride, pad, dilation):
            continue
        if decide is not None and not decide(xv, wv, stride, pad, dilation):
            continue
        extra = [0, 0, 0, 0, 0, STEM_CHANNELS - c]
        with graph.inserting_before(conv):
            xp = graph.call_function(aten.constant_pad_nd.default, (x, extra, 0.0))
            xp = graph.call_function(aten.clone.default, (xp,), {"memory_format": torch.channels_last})
            wp = graph.call_function(aten.constant_pad_nd.default, (w, extra, 0.0))
            wp = graph.call_function(aten.clone.default, (wp,), {"memory_format": torch.channels_last})
        conv.update_arg(0, xp)
        conv.update_arg(1, wp)
        padded.append(conv.name)
    if padded:
        refresh_values(gm)
    return padded
