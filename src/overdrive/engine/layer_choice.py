"""Per-layer precision by measurement: a low-precision GEMM that loses to the float one stays float.

TensorRT times every layer's candidate kernels at build time and keeps the fastest, so an int8 build still runs a
layer in fp16 where its int8 kernel loses (small GEMMs, shapes the int8 kernels handle badly). This module does the
same for the real int8/fp8 GEMM layers of ``overdrive.quant.real`` (``Int8Linear``, ``Fp8Linear``, the 1x1
convolutions): each distinct layer shape is timed at the input shape it meets on the example batch, its quantize and
rescale steps included, against the float layer in the build's float dtype; where the low-precision layer is slower
by more than ``margin``, the layer goes back to a float ``nn.Linear`` / ``nn.Conv2d`` holding its dequantized weights
(so the result keeps the weight rounding and drops the activation rounding: at least as accurate as the int8 layer).
The int8/fp8 convolutions of ``overdrive.quant.conv`` (any kernel size, Triton) are timed in the form the engine's
fusion pass gives them (:func:`conv_plan`: residual, ReLU, 8-bit or dual output) against the float convolution as
the fp16 engine runs it. A Linear layer on the convolution kernel (``Int8TritonLinear``: its epilogue takes the GELU
after it and the next layer's quantize) is timed three ways, in its fused form, as the cuBLAS GEMM
(``torch._scaled_mm`` / ``_int_mm``, with the pass that applies what the kernel would have fused), and as the float
GEMM (cuBLAS's GELU epilogue where there is one, plus the quantize pass an 8-bit reader needs), and runs as the
fastest.

Where it matters most: ``torch._int_mm`` on a CPU without VNNI or AMX (AVX2 only) runs a reference loop about 30x
slower than fp32 matmul; there every int8 layer stays float, and the build says so rather than ship an "int8"
engine 30x slower than fp32.

    >>> import torch.nn as nn
    >>> from overdrive.quant.real import Int8Linear
    >>> m = nn.Sequential(Int8Linear.dynamic(nn.Linear(64, 64)))
    >>> m, kept = keep_float_where_faster(m, (torch.randn(8, 64),), torch.device("cpu"), margin=1e9)
    >>> kept  # with a huge margin nothing is reverted
    {}
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from overdrive.engine.kernel_timing import median_ms as _ms
from overdrive.engine.layer_groups import choose_sibling_groups, input_key
from overdrive.engine.path_timing import _conv_input, _float_conv_ms, _float_linear_ms, _library_linear_ms
from overdrive.engine.path_timing import _quantize_ms


def _float_twin(m: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The float layer a low-precision GEMM module stands for, with its dequantized weights, in ``dtype``; a
    SmoothQuant layer's input factors (``x_pre``, 1 / s) are folded back into the weight: x (W s / s)^T."""
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import Int8Conv1x1
    from overdrive.quant.triton_linear import Int8TritonLinear

    if isinstance(m, Int8TritonLinear):
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight.data = m.dequantized_weight().reshape(m.out_features, m.in_features)
        if m.bias is not None:
            lin.bias.data = m.bias.detach().float()
        return lin.to(device=m.w_q.device, dtype=dtype).eval().requires_grad_(False)
    if isinstance(m, Int8Conv2d):
        conv = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                         dilation=m.dilation, bias=m.bias is not None)
        conv.weight.data = m.dequantized_weight()
        if m.bias is not None:
            conv.bias.data = m.bias.detach().float()
        return conv.to(device=m.w_q.device, dtype=dtype, memory_format=torch.channels_last).eval().requires_grad_(False)
    w = m.w_q.float() * (m.w_scale.view(-1, 1) if m.w_scale.dim() else m.w_scale)
    if getattr(m, "x_pre", None) is not None:
        w = w * m.x_pre.to(w.device).view(1, -1)
    bias = m.bias is not None
    if isinstance(m, Int8Conv1x1):
        twin: nn.Module = nn.Conv2d(m.in_features, m.out_features, 1, stride=m.stride, bias=bias)
        twin.weight.data = w.view(m.out_features, m.in_features, 1, 1)
    else:
        twin = nn.Linear(m.in_features, m.out_features, bias=bias)
        twin.weight.data = w
    if bias:
        twin.bias.data = m.bias.detach().float()
    return twin.to(device=m.w_q.device, dtype=dtype).eval().requires_grad_(False)


_COMPILED: Any = None


def _call(mod: nn.Module, t: torch.Tensor) -> Any:
    """What the shared compile traces: one layer applied to one input."""
    return mod(t)


def _compiled_so_far() -> int:
    """How many compiled entries the shared compile already holds in this process (earlier builds' layers)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(_call.__code__))
    except Exception:  # noqa: BLE001 - a torch without the helper: assume none (the limit then covers this build)
        return 0


def _as_engine_runs(layer: nn.Module, x: torch.Tensor, device: torch.device) -> Any:
    """``layer(x)`` as the engine runs it: on CUDA through torch.compile (one dynamic-shape compile shared by the
    layers, so a quantize and rescale fuse into one kernel each as in the engine's program), else eager."""
    global _COMPILED
    if device.type != "cuda":
        return lambda: layer(x)
    if _COMPILED is None:
        _COMPILED = torch.compile(_call, dynamic=True)
    compiled = _COMPILED

    def run() -> Any:
        return compiled(layer, x)

    try:
        run()
        run.compiled = True  # type: ignore[attr-defined]
        return run
    except Exception:  # noqa: BLE001 - a layer the compiler cannot take is timed eagerly
        return lambda: layer(x)


def _compile_limits(n_layers: int) -> Any:
    """A context for timing ``n_layers`` layers through the one shared compile: each layer class and shape is a
    recompile, so dynamo's recompile limit (8) is raised to cover them all (and the entries earlier builds in this
    process left), and hitting it anyway raises (the
    layer is then timed eagerly, knowingly) instead of silently running eager inside the compiled function."""
    import torch._dynamo.config as dynamo_config

    # dynamo counts recompiles per code object for the whole process: the entries earlier builds left count too
    limit = max(8, _compiled_so_far() + 2 * n_layers + 8)
    wanted = {"recompile_limit": limit, "accumulated_recompile_limit": max(256, limit + 64),
              "fail_on_recompile_limit_hit": True}
    return dynamo_config.patch(**{k: v for k, v in wanted.items() if hasattr(dynamo_config, k)})


def conv_plan(model: nn.Module, example: tuple[torch.Tensor, ...], quantize_residuals: bool = False
              ) -> dict[str, dict[str, Any]]:
    """How the engine will run each int8/fp8 convolution of ``model`` (:func:`lowp_conv_fusion.conv_epilogues` of
    the exported, fused program: residual, ReLU, float / 8-bit / dual output), by module name; {} when the model has
    none or cannot be exported here (the layers are then timed alone, as before).

    Example:
        >>> conv_plan(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
        {}
    """
    from overdrive.engine.lowp_conv_fusion import conv_epilogues, fuse_lowp_convs
    from overdrive.quant.conv import Int8Conv2d

    if not any(isinstance(m, Int8Conv2d) for m in model.modules()):
        return {}
    try:
        with torch.no_grad():
            ep = torch.export.export(model, example, strict=False)
        fuse_lowp_convs(ep, quantize_residuals)
        return conv_epilogues(ep)
    except Exception:  # noqa: BLE001 - the build exports again and says what fails; timing alone is the fallback
        return {}


CONV_MARGIN = 1.0
"""How much slower than the float path an int8/fp8 convolution may time and stay low precision: none. Its fused form
is timed as the engine runs it (input 8-bit already, its epilogue, and on the float side the quantize pass an 8-bit
reader needs), and re-timed in the form its float neighbours leave it (``replan``). At 1.1 (the GEMMs' margin, whose
timing charges them a quantize pass the engine often fuses away), layers up to 10% slower stayed low precision, and
EfficientNet-B0's int8/fp8 engines ran 0.96x its fp16 engine (0.98x / 0.99x at 1.0, before the re-planning)."""


def keep_float_where_faster(model: nn.Module, example: tuple[torch.Tensor, ...], device: torch.device,
                            float_dtype: torch.dtype | None = None, margin: float = 1.1,
                            plan: dict[str, dict[str, Any]] | None = None, timings: dict[str, Any] | None = None,
                            conv_margin: float = CONV_MARGIN,
                            replan: Callable[[nn.Module], dict[str, dict[str, Any]]] | None = None,
                            groups: bool = True) -> tuple[nn.Module, dict[str, str]]:
    """Time every distinct low-precision GEMM layer of ``model`` against its float twin at the input shape it meets on
    ``example``; layers slower than ``margin`` x the float twin (convolutions: ``conv_margin``) are replaced by it.
    In place. Every timed layer's verdict, kept or not, is left in ``model._overdrive_layer_verdicts`` (name -> why).

    Returns ``(model, kept)``: ``kept`` maps each layer left float to why (``"int8 0.03x fp32 at 1024x384->1536"``).
    ``float_dtype``: the float layers' dtype (default: each layer's input dtype on the example). ``plan``
    (:func:`conv_plan`): each convolution's fused form in the engine, so it is timed as it will run (its residual,
    ReLU and 8-bit or dual output) against the float convolution with the same epilogue plus the quantize pass the
    float path would need for an 8-bit reader. ``timings`` (a ``--timing-cache``'s): verdicts measured before on
    this GPU with this torch and overdrive, by layer key; those found are reused instead of timed again
    (``model._overdrive_timings_reused`` counts them) and the new ones are added to it.

    ``groups``: sibling Linear layers on the Triton kernel (Q/K/V, gate/up) are then judged together as the one GEMM
    the engine's graph pass runs them as (:func:`~overdrive.engine.layer_groups.choose_sibling_groups`); pass False
    when the build does not group them (:meth:`BuildConfig.groups_siblings`).

    ``replan`` (``model -> plan``, :func:`conv_plan` of the model as it stands): the plan assumes every convolution
    low precision, so once some go float their neighbours run in another form (a float output where an 8-bit one
    was planned, a float residual, an input quantized in a pass of its own after a float convolution). Each
    low-precision convolution whose form changed is timed again in its new form, until no more go float (at most
    :data:`REPLAN_ROUNDS` rounds; ``model._overdrive_replanned`` counts the layers timed again). Without it, a
    ResNet-50 int8 engine whose timing sent 15 of 53 convolutions to float kept neighbours that were faster only
    in their planned form, and ran 0.90x its fp16 engine.

    Example:
        >>> # model, kept = keep_float_where_faster(int8_model, (x,), torch.device("cuda"), torch.float16,
        >>> #                                       plan=conv_plan(int8_model, (x,)), replan=lambda m: conv_plan(m, (x,)))
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import _LowPrecisionGemm, _set
    from overdrive.quant.triton_linear import Int8TritonLinear

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (_LowPrecisionGemm, Int8Conv2d))]
    if not layers:
        return model, {}
    seen: dict[str, tuple[torch.Size, torch.dtype, bool]] = {}
    linears = {n for n, m in layers if isinstance(m, Int8TritonLinear)}
    inputs: dict[str, tuple] = {}  # each Linear's input tensor on the example: sibling layers share one

    def record(n: str, x: torch.Tensor) -> None:
        if n in linears:  # the kernel's view of its input: (tokens, K, 1, 1)
            seen.setdefault(n, (torch.Size((x.numel() // x.shape[-1], x.shape[-1], 1, 1)), x.dtype, False))
            inputs.setdefault(n, input_key(x))
            return
        seen.setdefault(n, (x.shape, x.dtype, x.dim() == 4 and not x.is_contiguous()
                            and x.is_contiguous(memory_format=torch.channels_last)))

    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: record(n, args[0])) for n, m in layers if n]
    try:
        with torch.no_grad():
            model(*example)
    finally:
        for h in hooks:
            h.remove()
    _SPLIT.clear()
    with _compile_limits(len(layers)):
        tiles: dict[tuple, int] = {}
        swapped: set[str] = set()  # Linear layers moved to the cuBLAS GEMM: their neighbours' forms change too
        kept = _choose(model, layers, seen, device, float_dtype, margin, _set, plan or {}, timings, conv_margin, tiles,
                       swapped)
        flipped = [n for n, m in layers if (n in kept or n in swapped) and isinstance(m, Int8Conv2d)]
        replanned = 0
        for _ in range(REPLAN_ROUNDS):
            if replan is None or not plan or not flipped:
                break
            with _timed("replan"):
                new_plan = replan(model)
            changed = [(n, m) for n, m in model.named_modules()
                       if isinstance(m, Int8Conv2d) and n in seen and n in new_plan and new_plan[n] != plan.get(n)]
            plan = new_plan
            if not changed:
                break
            replanned += len(changed)
            before = set(swapped)
            more = _choose(model, changed, seen, device, float_dtype, margin, _set, plan, timings, conv_margin, tiles,
                           swapped)
            kept.update(more)
            flipped = [*more, *(swapped - before)]
        model._overdrive_replanned = replanned
        if groups:  # sibling Linear layers (Q/K/V, gate/up) judged as the one GEMM the engine will run them as
            t0 = time.perf_counter()
            grouped = choose_sibling_groups(model, dict(layers), inputs, seen, device, float_dtype, plan or {}, kept,
                                            swapped)
            if grouped:  # a step of the timing only where a group was timed
                _SPLIT["groups"] = time.perf_counter() - t0
            model.__dict__.setdefault("_overdrive_layer_verdicts", {}).update(grouped)
    model._overdrive_layer_timing_s = dict(_SPLIT)  # where the timing went (tile tuning, 8-bit, float): the build meta
    return model, kept


LIBRARY = -2
"""The tile config a Triton Linear's verdict carries when its cuBLAS GEMM (``library_twin``) timed fastest."""

REPLAN_ROUNDS = 4
"""How many times :func:`keep_float_where_faster` re-plans after convolutions go float (each round times only the
layers whose fused form changed; a chain of them settles in a round or two)."""

_SPLIT: dict[str, float] = {}  # seconds per step of the last keep_float_where_faster, compiles included


@contextlib.contextmanager
def _timed(step: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _SPLIT[step] = _SPLIT.get(step, 0.0) + time.perf_counter() - t0


def _timing_key(key: tuple, device: torch.device) -> str:
    """A layer key as a ``--timing-cache`` stores it: valid on this GPU (or CPU) with this torch and overdrive."""
    import overdrive

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{where} | torch {torch.__version__} | overdrive {overdrive.__version__} | {key!r}"


def _cached(entry: Any, conv: bool) -> tuple[Any, ...] | None:
    """A cached verdict as ``_choose`` keeps it: (slower, why) or, for a convolution, (slower, why, tile config)."""
    from overdrive.quant.conv_tiles import CONFIGS

    if not isinstance(entry, list) or len(entry) != (3 if conv else 2) or not isinstance(entry[0], bool) \
            or not isinstance(entry[1], str):
        return None
    if conv and not (isinstance(entry[2], int) and LIBRARY <= entry[2] < len(CONFIGS)):
        return None
    return tuple(entry)


def _choose(model: nn.Module, layers: list[tuple[str, nn.Module]], seen: dict[str, Any], device: torch.device,
            float_dtype: torch.dtype | None, margin: float, _set: Any, plan: dict[str, dict[str, Any]],
            timings: dict[str, Any] | None = None, conv_margin: float = CONV_MARGIN,
            configs: dict[tuple, int] | None = None, swapped: set[str] | None = None) -> dict[str, str]:
    """The timing loop of :func:`keep_float_where_faster`: one measurement per distinct layer key (none for a key
    ``timings`` holds). ``configs``: the convolutions' tuned tiles by shape, kept across calls (a re-planned layer
    keeps its tile). ``swapped`` collects the Triton Linear layers replaced by their cuBLAS GEMM."""
    from overdrive.quant.conv import Int8Conv2d

    verdict: dict[tuple, tuple[Any, ...]] = {}
    kept: dict[str, str] = {}
    verdicts: dict[str, str] = model.__dict__.setdefault("_overdrive_layer_verdicts", {})

    def key_of(name: str, m: nn.Module) -> tuple:
        shape, dtype, nhwc = seen[name]
        key = (type(m).__name__, tuple(shape), dtype, float_dtype or dtype, m.in_features, m.out_features, m.rowwise,
               str(getattr(m, "stride", 1)), str(getattr(m, "kernel_size", 1)), str(getattr(m, "padding", 0)),
               str(getattr(m, "dilation", 1)), nhwc)
        if isinstance(m, Int8Conv2d):  # the margin too: a cached verdict holds the decision made with it
            epi = plan.get(name)
            key = (*key, conv_margin, tuple(sorted(epi.items())) if epi else None)
        return key

    reused = 0
    for n, m in layers if timings is not None else ():
        key = key_of(n, m) if n in seen else None
        hit = _cached(timings.get(_timing_key(key, device)), isinstance(m, Int8Conv2d)) if key else None
        if hit is not None and key not in verdict:
            verdict[key] = hit
            reused += 1
    model._overdrive_timings_reused = reused
    # convolutions: tiles tuned per shape first, then every layer's fused form compiled side by side (Triton compiles
    # outside the GIL), then each timed alone
    convs = {k: (n, m) for n, m in layers if n in seen and isinstance(m, Int8Conv2d)
             for k in [key_of(n, m)] if k not in verdict}
    configs = {} if configs is None else configs
    for key, (name, m) in convs.items():
        plain = key[:-1]  # the tiles depend on the shape, not on the epilogue
        if plain not in configs:
            configs[plain] = _tune_conv(m, seen[name][0], float_dtype or seen[name][1], device)
    if device.type == "cuda" and convs:
        from overdrive.quant.conv import compile_in_threads

        with _timed("lowp_compile"):
            compile_in_threads([functools.partial(_time_conv, m, seen[n][0], seen[n][1], float_dtype or seen[n][1],
                                                  device, conv_margin, plan.get(n), configs[key[:-1]], True)
                                for key, (n, m) in convs.items()], device)
    for name, m in layers:
        if name not in seen:  # not reached on the example: nothing to measure it on, keep it as built
            continue
        shape, dtype, nhwc = seen[name]
        fdt = float_dtype or dtype
        key = key_of(name, m)
        if isinstance(m, Int8Conv2d):
            epi = plan.get(name)
            if key not in verdict:
                config = configs[key[:-1]]
                try:
                    verdict[key] = _time_conv(m, shape, dtype, fdt, device, conv_margin, epi, config)
                except Exception as exc:  # noqa: BLE001 - the fused form failed to run here: time the layer alone
                    if not epi:
                        raise
                    slower, why, cfg = _time_conv(m, shape, dtype, fdt, device, conv_margin, None, config)
                    verdict[key] = (slower, f"{why} (alone: its fused form failed, {type(exc).__name__})", cfg)
            m.config = verdict[key][2]
        elif key not in verdict:
            x = torch.randn(shape, device=device).to(dtype)
            if nhwc:
                x = x.contiguous(memory_format=torch.channels_last)
            twin = _float_twin(m, fdt)
            xf = x.to(fdt)
            with torch.no_grad(), _timed("gemm"):
                t_low = _ms(_as_engine_runs(m, x, device), device)
                t_float = _ms(_as_engine_runs(twin, xf, device), device)
            rows = shape.numel() // shape[-1] if getattr(m, "stride", None) is None else shape.numel() // shape[1]
            verdict[key] = (t_low > margin * t_float,
                            f"{m.fmt} {t_float / t_low:.2f}x {str(fdt).removeprefix('torch.')} at "
                            f"{rows}x{m.in_features}->{m.out_features}")
        slower, why = verdict[key][:2]
        verdicts[name] = why
        if slower:
            kept[name] = why
            _set(model, name, _float_twin(m, fdt))
        elif isinstance(m, Int8Conv2d) and verdict[key][2] == LIBRARY:  # a Triton Linear: cuBLAS's GEMM won
            _set(model, name, m.library_twin())
            if swapped is not None:
                swapped.add(name)
        if timings is not None:
            timings[_timing_key(key, device)] = list(verdict[key])
    return kept


def _tune_conv(m: nn.Module, shape: torch.Size, fdt: torch.dtype, device: torch.device) -> int:
    """The tile config of an int8/fp8 convolution at ``shape``: tuned on CUDA on the plain form (the Triton kernel
    compiles once per config and epilogue flags, so tuning each epilogue variant would multiply the compiles); the
    shape's default (-1) elsewhere."""
    from overdrive.quant import conv as qconv

    if device.type != "cuda":
        return -1
    _, xq, _ = _conv_input(m, shape, fdt, device)
    out_dtype = fdt if fdt in (torch.float16, torch.bfloat16) else torch.float32
    with torch.no_grad(), _timed("tune"):
        config, _ = qconv.tune(xq, m.w_q, out_dtype=out_dtype, stride=m.stride, padding=m.padding,
                               dilation=m.dilation)
    return config


def _time_conv(m: nn.Module, shape: torch.Size, dtype: torch.dtype, fdt: torch.dtype, device: torch.device,
               margin: float, epilogue: dict[str, Any] | None = None, config: int | None = None,
               warm_only: bool = False) -> tuple[bool, str, int] | None:
    """(slower, why, kernel config) for an int8/fp8 convolution: its kernel tuned and timed on an input quantized
    already (in an engine its input's quantize runs in the producing layer's epilogue, or fused into the pass that
    makes it) against the float convolution (cuDNN) on the float input, each replayed in a CUDA graph.

    With ``epilogue`` (its entry of :func:`conv_plan`) both run as the engine would: the low-precision kernel with
    its residual (float or 8-bit), ReLU and 8-bit or dual output; the float side as the fp16 engine runs it
    (:func:`_float_conv_ms`), plus the quantize pass (one compiled kernel) that an 8-bit reader of its output then
    needs. ``config``: the tile config (:func:`_tune_conv`'s; None: tuned here). ``warm_only``: run the
    low-precision kernel once and return None (its compile, which a build runs for many layers side by side)."""
    from overdrive.quant import conv as qconv

    epi = epilogue or {}
    res_kind, relu, out_kind = epi.get("residual"), bool(epi.get("relu")), epi.get("out", "float")
    act = qconv.ACTS.get(epi.get("act"), 0)
    fp8 = m.fmt == "fp8"
    qdt, bound = (qconv.FP8, 448.0) if fp8 else (torch.int8, 127.0)
    from overdrive.quant.triton_linear import Int8TritonLinear

    linear = isinstance(m, Int8TritonLinear)
    if config is None:
        config = _tune_conv(m, shape, fdt, device)
    x, xq, g = _conv_input(m, shape, fdt, device)
    twin = _float_twin(m, fdt)
    rows = shape[0]
    with torch.no_grad():
        out_dtype = fdt if fdt in (torch.float16, torch.bfloat16) else torch.float32
        y = twin(x.view(rows, -1)).view(rows, -1, 1, 1) if linear else twin(x)
        z = zq = zs = None
        if res_kind is not None:
            z = torch.randn(tuple(y.shape), generator=g, device=device).to(y.dtype).contiguous(
                memory_format=torch.channels_last)
            if res_kind == "8-bit":
                zs = (z.float().abs().amax() / bound).reshape(())
                zq = torch.ops.overdrive.quantize(z, zs, -128, fp8)
        qs = (y.float().abs().amax().clamp_min(1e-6) / bound).reshape(())
        kernel_out = qdt if out_kind == "8-bit" else out_dtype
        res_in = zq if zq is not None else z
        geo = (m.stride, m.padding, m.dilation, config)

        def low() -> Any:
            if out_kind == "dual":
                return torch.ops.overdrive.conv2d_q_dual(xq, m.w_q, m.scale, m.bias, res_in, relu, out_dtype, qs,
                                                         -128, fp8, *geo, zs, act)
            return torch.ops.overdrive.conv2d_q(xq, m.w_q, m.scale, m.bias, res_in, relu,
                                                qs if out_kind == "8-bit" else None, kernel_out, -128, *geo, zs, act)

        if warm_only:
            low()
            return None
        with _timed("lowp"):
            t_low = _ms(low, device)
            if epi.get("input") == "float conv":  # its input quantized in a pass of its own (conv_epilogues)
                t_low += _quantize_ms(x, m.x_scale, fp8, device)
        with _timed("float"):
            if linear:  # cuBLAS: the float GEMM with its GELU / ReLU epilogue
                t_float = _float_linear_ms(x.view(rows, -1), twin, relu, act, device)
                if out_kind in ("8-bit", "dual"):
                    t_float += _quantize_ms(y, qs, fp8, device)
            elif not epi:  # no plan: the layer alone against cuDNN alone
                t_float = _ms(lambda: twin(x), device)
            else:
                t_float = _float_conv_ms(x, twin, z, relu, device, act)
                if out_kind in ("8-bit", "dual"):  # the float path's output, quantized for its 8-bit reader
                    t_float += _quantize_ms(y, qs, fp8, device)
        if linear:  # the same layer on cuBLAS's int8/fp8 GEMM, and one pass for what the kernel would have fused
            with _timed("gemm"):
                t_lib = _library_linear_ms(m.library_twin(), xq.view(rows, -1), relu, act, out_kind, qs, out_dtype,
                                           device)
            best = min(t_low, t_lib)
            form = "".join(s for s, on in ((" relu", relu), (f" {epi.get('act')}", bool(act)),
                                            (f" ->{out_kind}", bool(epi))) if on)
            why = (f"{m.fmt} {t_float / best:.2f}x {str(fdt).removeprefix('torch.')} at {rows}x{m.in_features}->"
                   f"{m.out_features}{form} on {'cuBLAS' if t_lib < t_low else 'Triton'} "
                   f"(Triton {t_float / t_low:.2f}x, cuBLAS {t_float / t_lib:.2f}x)")
            return best > margin * t_float, why, LIBRARY if t_lib < t_low else config
    n, c, h, w_ = shape
    kh, kw = m.kernel_size
    form = "".join(s for s, on in ((" q-in", epi.get("input") == "float conv"),
                                    (" +res8" if res_kind == "8-bit" else " +res", res_kind is not None),
                                    (" relu", relu), (f" {epi.get('act')}", bool(act)), (f" ->{out_kind}", bool(epi)))
                   if on)
    why = (f"{m.fmt} {t_float / t_low:.2f}x {str(fdt).removeprefix('torch.')} at {n}x{c}x{h}x{w_} k{kh}x{kw} "
           f"s{m.stride[0]}->{m.out_channels}{form}")
    return t_low > margin * t_float, why, config


def lowp_layer_names(model: nn.Module) -> list[str]:
    """The names of the layers of a prepared int8/fp8 model that run a low-precision kernel.

    Example:
        >>> from overdrive.quant.real import Int8Linear
        >>> lowp_layer_names(nn.Sequential(Int8Linear.dynamic(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 8)))
        ['0']
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import _LowPrecisionGemm

    return [n for n, m in model.named_modules() if isinstance(m, (_LowPrecisionGemm, Int8Conv2d))]


def float_everywhere(model: nn.Module, float_dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """A copy of a prepared int8/fp8 model with every low-precision layer replaced by its float twin in
    ``float_dtype`` (dequantized weights: the weight rounding kept, the activation rounding dropped, so at least as
    accurate), and the names replaced. ``model`` is left as it is. The whole-engine check of an int8/fp8 build
    compiles this beside the low-precision engine and keeps the faster.

    Example:
        >>> from overdrive.quant.real import Int8Linear
        >>> m = nn.Sequential(Int8Linear.dynamic(nn.Linear(8, 8)), nn.ReLU())
        >>> twin, names = float_everywhere(m, torch.float32)
        >>> names, type(twin[0]).__name__, type(m[0]).__name__
        (['0'], 'Linear', 'Int8Linear')
    """
    import copy

    from overdrive.quant.real import _set

    twin = copy.deepcopy(model)
    names = lowp_layer_names(twin)
    for n in names:
        _set(twin, n, _float_twin(twin.get_submodule(n), float_dtype))
    return twin, names


def placement_summary(layers: dict[str, str]) -> str:
    """One line from ``engine.info["layers"]``: how many layers run on each kernel, and how many stay float and why.

    Example:
        >>> placement_summary({"a": "int8 GEMM (torch._int_mm)", "b": "float16: timed faster than its low-precision "
        ...                    "kernel (int8 0.5x float16 at 8x64->64)", "c": "int8 GEMM (torch._int_mm), timed int8 "
        ...                    "1.3x float16 at 8x64->64"})
        "layers: 2 int8 GEMM (torch._int_mm), 1 float16 (timed faster); engine.info['layers'] lists each"
    """
    counts: dict[str, int] = {}
    for where in layers.values():
        where = where.split(", timed ")[0]  # a low-precision layer's timing verdict: counted by its kernel
        dtype, _, why = where.partition(": ")
        key = where if not why else f"{dtype} ({'timed faster' if why.startswith('timed faster') else 'no kernel'})"
        counts[key] = counts.get(key, 0) + 1
    listed = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"layers: {listed}; engine.info['layers'] lists each"
