"""The per-layer timing's view of sibling GEMMs: int8/fp8 Linear layers on the Triton kernel that read one input
(attention's Q, K and V projections, a gated MLP's gate and up projections) are judged together as the one GEMM the
engine would run them as (:mod:`~overdrive.engine.lowp_siblings`).

:func:`~overdrive.engine.layer_choice.keep_float_where_faster` times each layer alone, so a small Q projection can
lose to cuBLAS's fp16 GEMM (or its int8/fp8 GEMM) where one Triton GEMM over Q, K and V would beat all three; and
the float side of that comparison is three GEMMs where the fp16 engine runs one (:mod:`sibling_gemms`).
:func:`choose_sibling_groups` times, for each group whose layers did not all stay on the Triton kernel, the one
low-precision GEMM (its tile tuned) against what the layers were given alone, the best of the float layers as one
GEMM included, and puts the group back on the Triton kernel where the one GEMM wins. The engine's graph pass then
runs it as one (timed again there, with its tile), and the whole-engine timing still guards the build.

Example:
    >>> # changed = choose_sibling_groups(model, originals, inputs, seen, torch.device("cuda"), torch.float16, plan,
    >>> #                                 kept, swapped)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from overdrive.engine.kernel_timing import median_ms as _ms
from overdrive.engine.path_timing import _conv_input, _float_linear_ms, _library_linear_ms

GROUP_MARGIN = 1.03
"""How much faster the one low-precision GEMM must time than the layers as chosen alone to replace them."""


def input_key(x: torch.Tensor) -> tuple:
    """What makes two layers' inputs the same tensor on the example forward: its memory, shape, strides and dtype.

    Example:
        >>> t = torch.randn(2, 3)
        >>> input_key(t) == input_key(t), input_key(t) == input_key(t.clone())
        (True, False)
    """
    return (x.device.type, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)


def _groups(originals: dict[str, nn.Module], inputs: dict[str, tuple], plan: dict[str, dict[str, Any]]
            ) -> list[list[str]]:
    from overdrive.quant.triton_linear import Int8TritonLinear

    by_key: dict[tuple, list[str]] = {}
    for n, m in originals.items():
        if not isinstance(m, Int8TritonLinear) or n not in inputs:
            continue
        epi = plan.get(n) or {}
        if epi.get("residual") is not None or epi.get("out", "float") != "float":
            continue  # a residual or an 8-bit output is this layer's own epilogue: it runs alone
        key = (inputs[n], m.fmt, float(m.x_scale.float().reshape(-1)[0]), m.x_qmin, m.in_channels, m.w_q.dtype)
        by_key.setdefault(key, []).append(n)
    return [names for names in by_key.values() if len(names) >= 2]


def _leaves(names: list[str]) -> str:
    """A group by its layers' own names (``q_proj+k_proj+v_proj``), the same in every decoder layer."""
    return "+".join(n.rpartition(".")[2] for n in names)


def choose_sibling_groups(model: nn.Module, originals: dict[str, nn.Module], inputs: dict[str, tuple],
                          seen: dict[str, Any], device: torch.device, float_dtype: torch.dtype | None,
                          plan: dict[str, dict[str, Any]], kept: dict[str, str], swapped: set[str],
                          margin: float = GROUP_MARGIN) -> dict[str, str]:
    """Put each sibling group back on the Triton kernel where its one GEMM beats the layers as chosen alone, in
    place (``model``'s layers, and ``kept`` / ``swapped`` updated). ``originals``: each low-precision layer as
    built, by name; ``inputs``: each layer's :func:`input_key` on the example; ``seen``: the timing's (shape,
    dtype, nhwc) per layer. Returns the verdict of every group timed, by member name."""
    from overdrive.quant.real import _set

    verdicts: dict[str, str] = {}
    timed: dict[tuple, tuple[bool, int, str]] = {}  # by group shape and the layers' current kinds: decoder layers repeat
    for names in _groups(originals, inputs, plan):
        current = {n: model.get_submodule(n) for n in names}
        if all(current[n] is originals[n] for n in names):
            continue  # all on the Triton kernel already: the graph pass times them as one
        kinds = tuple("lowp" if current[n] is originals[n] else "cublas" if n in swapped else "float" for n in names)
        key = (tuple(seen[names[0]][0]), seen[names[0]][1], tuple(originals[n].out_channels for n in names), kinds,
               repr([sorted((plan.get(n) or {}).items()) for n in names]),
               tuple(originals[n].bias is not None for n in names))
        if key not in timed:
            try:
                timed[key] = _time_group(names, originals, current, seen, device, float_dtype, plan, kept, swapped,
                                         margin)
            except Exception as exc:  # noqa: BLE001 - a group that cannot be timed here keeps its layers as chosen
                timed[key] = (False, -1, f"sibling group {_leaves(names)}: not timed as one GEMM "
                                         f"({type(exc).__name__}: {str(exc)[:120]}); kept as chosen")
        one, config, why = timed[key]
        for n in names:
            verdicts[n] = why
            if one:
                m = originals[n]
                m.config = config
                _set(model, n, m)
                kept.pop(n, None)
                swapped.discard(n)
    return verdicts


def _time_group(names: list[str], originals: dict[str, nn.Module], current: dict[str, nn.Module],
                seen: dict[str, Any], device: torch.device, float_dtype: torch.dtype | None,
                plan: dict[str, dict[str, Any]], kept: dict[str, str], swapped: set[str], margin: float
                ) -> tuple[bool, int, str]:
    """(one GEMM wins, its tile config, the verdict) for one sibling group (:func:`choose_sibling_groups`)."""
    from overdrive.quant import conv as qconv

    ms = [originals[n] for n in names]
    shape, dtype, _ = seen[names[0]]
    fdt = float_dtype or dtype
    out_dtype = fdt if fdt in (torch.float16, torch.bfloat16) else torch.float32
    x, xq, _ = _conv_input(ms[0], shape, fdt, device)
    rows = shape[0]
    x2, xq2 = x.reshape(rows, -1), xq.reshape(rows, -1)
    acts = [qconv.ACTS.get((plan.get(n) or {}).get("act"), 0) for n in names]
    relus = [bool((plan.get(n) or {}).get("relu")) for n in names]
    with torch.no_grad():
        t_now = 0.0
        for n, m, act, relu in zip(names, ms, acts, relus):
            mod = current[n]
            if mod is m:
                t_now += _ms(lambda m=m, relu=relu, act=act: qconv.conv2d_q(
                    xq, m.w_q, m.scale, m.bias, None, relu, None, out_dtype, -128, [1, 1], [0, 0], [1, 1],
                    m.config, None, act), device)
            elif n in swapped:
                t_now += _library_linear_ms(mod, xq2, relu, act, "float", None, out_dtype, device)
            else:
                t_now += _float_linear_ms(x2.to(fdt), mod, relu, act, device)
        wcat = torch.cat([m.w_q for m in ms]).contiguous(memory_format=torch.channels_last)
        scat = torch.cat([m.scale.float() for m in ms])
        has_bias = any(m.bias is not None for m in ms)
        bcat = torch.cat([m.bias.float() if m.bias is not None else torch.zeros_like(m.scale.float())
                          for m in ms]) if has_bias else None
        if all(n in kept for n in names):  # the fp16 engine may run the float layers as one GEMM too
            lin = [current[n] for n in names]
            wf = torch.cat([m.weight for m in lin])
            bf = torch.cat([m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in lin]) \
                if has_bias else None
            t_now = min(t_now, _ms(lambda: F.linear(x2.to(wf.dtype), wf, bf), device))
        config = -1
        if device.type == "cuda":
            config, _ = qconv.tune(xq, wcat, out_dtype=out_dtype)
        t_one = _ms(lambda: qconv.conv2d_q(xq, wcat, scat, bcat, None, False, None, out_dtype, -128, [1, 1],
                                           [0, 0], [1, 1], config), device)
    one = t_now >= margin * t_one
    outs = "+".join(str(m.out_channels) for m in ms)
    why = (f"{ms[0].fmt} sibling group {_leaves(names)}: one Triton GEMM {t_now / t_one:.2f}x the layers as "
           f"chosen alone at {rows}x{ms[0].in_channels}->{outs} ({'one GEMM' if one else 'kept as chosen'})")
    return one, config, why
