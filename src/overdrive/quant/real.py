"""Real low-precision execution: calibrated fake-quant layers become int8 / fp8 GEMM modules.

- int8 (``Int8Linear``, ``Int8Conv1x1``): symmetric int8 activations (static per-tensor scale from
  the calibrated amax) times int8 weights (per output channel) with ``torch._int_mm`` (int32
  accumulate), rescaled in fp32. Runs on CUDA and on CPU (torch has both kernels).
- fp8 e4m3 (``Fp8Linear``, ``Fp8Conv1x1``): ``torch._scaled_mm`` with per-tensor scales (static,
  from amax) or per-row scales (dynamic per-token activation scales, per-channel weight scales);
  needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper); elsewhere a UsageError.
- Convolutions: on CUDA (with Triton) every 2-D convolution with groups 1 and input channels a multiple of 16
  becomes ``Int8Conv2d`` / ``Fp8Conv2d`` (``quant/conv.py``: an implicit-GEMM kernel of any kernel size whose
  epilogue an engine extends with BatchNorm, residual, ReLU and the next layer's quantize); elsewhere 1x1
  convolutions run as GEMMs on channels-last data; other convolutions go back to float with the summary saying so.
- Residual adds (``QuantAdd``, the residual-add quantizer ``quant.quantize`` inserts) become
  :class:`QuantizedResidualAdd`: the residual goes through ``overdrive::quantize`` and ``overdrive::dequantize``, the
  same values as the fake quantization, as ops an engine can see: a convolution's epilogue then reads the 8-bit tensor.
- Weight-only int8 / int4 (group-wise scales) for memory-bound Linear layers: ``weight_only`` (``quant/weight_only.py``).
- On CUDA the elementwise steps around the GEMM (quantizing the activation; the int8 rescale + bias +
  cast) each run as one fused kernel (``torch.compile`` of the small functions below); on CPU, under
  an outer torch.compile / export, or if compiling fails (one warning), they run eagerly, same numerics.

Example:
    >>> # model = quant.to_real(quant.quantize(model, quant.INT8_DEFAULT, forward_loop=loop))
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.device import supports_fp8
from overdrive._utils.errors import UsageError
from overdrive.quant import conv as qconv
from overdrive.quant import triton_linear as qlinear
from overdrive.quant.config import RealConfig
from overdrive.quant.modules import QuantAdd, QuantConv2d, QuantLinear, _QuantMixin, hf_conv1d_class
from overdrive.quant.smoothquant import SmoothedLinear
from overdrive.quant._swap import _config, _set  # noqa: F401 - _set is imported from here by the engine
from overdrive.quant.tied import read_only_weight_error, retie, tied_embeddings


def _pre(x: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
    """x in fp32, times the SmoothQuant input factors 1 / s (one per input channel, the last dim) where given."""
    return x.float() if pre is None else x.float() * pre


def _quantize_int8(x: torch.Tensor, scale: torch.Tensor, qmin: int = -128, pre: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Symmetric int8 with a per-tensor scale: clamp(round(x / scale), qmin, 127) (qmin -127: narrow range)."""
    return torch.clamp(torch.round(_pre(x, pre) / scale), qmin, 127).to(torch.int8)


def _quantize_int8_rowwise(x: torch.Tensor, pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) symmetric int8: scales amax / 127, (M, 1), and the quantized rows in [-127, 127]."""
    x = _pre(x, pre)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8), scale


def _quantize_fp8(x: torch.Tensor, scale: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 with a per-tensor scale (or an (M, 1) per-row one)."""
    return (_pre(x, pre) / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _quantize_fp8_rowwise(x: torch.Tensor, pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) fp8 scales amax / 448 and the quantized rows."""
    x = _pre(x, pre)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0  # (M, 1)
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _int8_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """int32 accumulator -> acc * x_scale * w_scale (+ bias) in ``out_dtype``."""
    y = acc.float() * (x_scale * w_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _can_compile(x: torch.Tensor) -> bool:
    """Compile the small steps only for plain CUDA tensors in eager code: not on CPU (slow to start),
    not while an outer torch.compile / export / jit trace / CUDA-graph capture sees this code (the
    outer compiler fuses them itself; a FakeTensor or other subclass means such a trace)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    if is_exporting is not None and is_exporting():
        return False
    if not x.is_cuda or type(x) is not torch.Tensor:
        return False
    return not torch.cuda.is_current_stream_capturing()


def _default_compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config

    # Triton's fp32 `/` is approximate (div.full, 2 ulp): it would move round(x / scale) across .5
    # ties now and then; ask Inductor for IEEE division like eager (the option's name changed in 2.11,
    # and Inductor rejects unknown options)
    options: dict[str, Any] = {}
    if hasattr(inductor_config, "emulate_divison_rounding"):
        options["emulate_divison_rounding"] = True
    elif hasattr(getattr(inductor_config, "eager_numerics", None), "division_rounding"):
        options["eager_numerics.division_rounding"] = True
    # fullgraph=False only so that hitting Dynamo's recompile limit (dtype x bias x grad-mode variants)
    # runs the extra variants eagerly instead of raising; each function is one graph (no breaks)
    return torch.compile(fn, dynamic=True, fullgraph=False, options=options or None)


def _variant(fn: Callable[..., Any], x: torch.Tensor, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a compiled step is specialised on besides sizes: the function, each tensor's dtype, rank and layout,
    the other arguments' values (a qmin, an fp8 flag, an output dtype, a missing bias) and grad mode.

    Example:
        >>> _variant(_quantize_int8, torch.zeros(2, 3), (torch.tensor(1.0), -128))[1:]
        ((torch.float32, 2, True), (torch.float32, 0, True), -128, True)
    """
    def one(a: Any) -> Any:
        return (a.dtype, a.dim(), a.is_contiguous()) if isinstance(a, torch.Tensor) else a

    return (fn, one(x), *map(one, args), torch.is_grad_enabled())


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps its compiled variants, and counts them against its
    recompile limit (8), per code object: one code per variant keeps every variant compiled. With one code, an
    engine build that met int8 and fp8, fp16 and fp32, hit the limit (Dynamo logged it), and the variants after
    ran eagerly: several memory passes, which the layer timing then charged to the low-precision kernel."""
    import types

    clone = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__, clone.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return clone


class _FusedSteps:
    """Runs the elementwise steps around a low-precision GEMM, each compiled into one fused kernel.

    A compile failure (no Triton, an unsupported GPU, a torch bug) warns once and switches this
    object to eager for good; the eager functions compute the same values.
    """

    def __init__(self, compiler: Callable[[Callable[..., Any]], Callable[..., Any]] = _default_compiler) -> None:
        self.compiler = compiler
        self.compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        self.failed = False

    def __call__(self, fn: Callable[..., Any], x: torch.Tensor, *args: Any) -> Any:
        if self.failed or not _can_compile(x):
            return fn(x, *args)
        key = _variant(fn, x, args)
        c = self.compiled.get(key)
        try:
            if c is None:
                c = self.compiled[key] = self.compiler(_own_code(fn))
            return c(x, *args)
        except Exception as exc:  # noqa: BLE001 - any compile failure: fall back to the eager steps
            self.failed = True
            warnings.warn(f"overdrive.quant: torch.compile of the int8/fp8 quantize/rescale steps failed "
                          f"({type(exc).__name__}: {str(exc)[:300]}); running them eagerly from now on "
                          "(same results, several memory passes per layer instead of one)", RuntimeWarning,
                          stacklevel=3)
            return fn(x, *args)


_FUSED = _FusedSteps()  # one process-wide cache of the compiled steps (compiled graphs are shared anyway)


class _LowPrecisionGemm(nn.Module):
    """y = x @ W^T (+ b) with quantized x and W. ``w_q``: (N, K) int8 or float8_e4m3fn.

    ``x_pre`` (K,): SmoothQuant's input factors 1 / s, applied to x in the quantize step (one fused pass); the
    ``weight`` given is then the smoothed one, W * s, that ``w_amax`` was calibrated on."""

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, w_amax: torch.Tensor, x_amax: torch.Tensor, bias: torch.Tensor | None,
                 rowwise: bool = False, x_qmin: int = -128, w_qmin: int = -127,
                 x_pre: torch.Tensor | None = None) -> None:
        super().__init__()
        bound = 127.0 if self.fmt == "int8" else 448.0
        w = weight.detach().float().reshape(weight.shape[0], -1)
        w_amax = w_amax.detach().float().to(w.device)
        w_scale = w_amax.clamp_min(1e-12) / bound  # () or (N,)
        if self.fmt == "fp8" and not rowwise and w_scale.dim():
            w_scale = w_scale.max()  # per-tensor fp8 _scaled_mm takes one weight scale
        ws = w_scale.view(-1, 1) if w_scale.dim() else w_scale
        if self.fmt == "int8":
            w_q = torch.clamp(torch.round(w / ws), w_qmin, 127).to(torch.int8)
        else:
            w_q = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
        self.register_buffer("w_q", w_q)  # (N, K)
        self.register_buffer("w_scale", w_scale.reshape(-1) if w_scale.dim() else w_scale)
        self.register_buffer("x_scale", x_amax.detach().float().clamp_min(1e-12).to(w.device) / bound)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("x_pre", None if x_pre is None else x_pre.detach().float().reshape(-1).to(w.device))
        self.rowwise = rowwise
        # True: a static input quantize as ``overdrive::quantize`` (an engine folds it into the layer before: an
        # int8/fp8 convolution kernel then writes this layer's input 8-bit); False: plain arithmetic, fused by torch
        self.quantize_op = False
        self.x_qmin = x_qmin  # int8: -128, or -127 for a narrow-range input quantizer (as its fake quantization)
        self.weight_dtype = weight.dtype  # the float layer's: what `weight` reads back as when there is no bias
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    _KEEP_DTYPES = ("w_q", "w_scale", "x_scale", "x_pre")  # 8-bit weights and fp32 scales, whatever .half() says

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        # .half() / .bfloat16() / .to(dtype) change the dtype `weight` reads back in, as they would a float layer's
        # (with no bias buffer to follow, it stayed fp32 and T5-style code cast its bf16 activations back to fp32)
        probe = fn(torch.empty(0, dtype=self.weight_dtype))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return qconv.keep_dtypes(self, self._KEEP_DTYPES, fn, lambda: super(_LowPrecisionGemm, self)._apply(fn, recurse))

    def gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) float -> (M, N) in x's dtype."""
        out_dtype = x2.dtype if x2.dtype in (torch.float16, torch.bfloat16) else torch.float32
        m = x2.shape[0]
        pad = 0
        if self.fmt == "int8" and x2.is_cuda:  # _int_mm on CUDA needs M > 16
            # under torch.export M may be symbolic (a dynamic batch): no branch on it, 16 more rows always
            # keep M > 16 (a branch failed the export of int8 engines with a batch profile 1..N)
            pad = 16 if torch.compiler.is_exporting() else (17 - m if m <= 16 else 0)
        xq_op = None
        if getattr(self, "quantize_op", False) and not self.rowwise:  # quantized before the padding
            xq_op = torch.ops.overdrive.quantize(x2, self.x_scale, self.x_qmin if self.fmt == "int8" else -128,
                                                 self.fmt == "fp8") if self.x_pre is None else None
        if pad > 0:
            x2 = F.pad(x2, (0, 0, 0, pad))
            xq_op = None if xq_op is None else F.pad(xq_op.view(torch.int8), (0, 0, 0, pad)).view(xq_op.dtype)
        # w_q is (N, K) contiguous, so w_q.t() is the column-major (K, N) operand cuBLAS(Lt) takes as is
        # ("TN" layout, required by _scaled_mm and int8 IMMA): no weight copy per call
        if self.fmt == "int8":
            if self.rowwise:  # dynamic per-token scales (M, 1) times per-channel weight scales (N,)
                xq, xs = _FUSED(_quantize_int8_rowwise, x2, self.x_pre)
            else:
                xs = self.x_scale
                xq = xq_op if xq_op is not None else _FUSED(_quantize_int8, x2, xs, self.x_qmin, self.x_pre)
            acc = torch._int_mm(xq, self.w_q.t())  # (M, N) int32
            y = _FUSED(_int8_epilogue, acc, xs, self.w_scale, self.bias, out_dtype)
        else:
            if self.rowwise:  # dynamic per-token scales
                xq, xs = _FUSED(_quantize_fp8_rowwise, x2, self.x_pre)
                ws = self.w_scale.view(1, -1)
                od = torch.bfloat16
            else:
                xs, ws, od = self.x_scale, self.w_scale, (out_dtype if out_dtype != torch.float32 else torch.bfloat16)
                xq = xq_op if xq_op is not None else _FUSED(_quantize_fp8, x2, xs, self.x_pre)
            bias = None if self.bias is None else self.bias.to(od)
            # _scaled_mm takes a row-major mat1 only; x2 may be a column-major view (a 1x1 conv at batch 1 on an
            # NCHW-contiguous input: permute + reshape merge without a copy), and the quantize keeps its strides
            xq = xq.contiguous()
            y = torch._scaled_mm(xq, self.w_q.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=od).to(out_dtype)
        return y[:m] if pad > 0 else y

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, {self.fmt}{' rowwise' if self.rowwise else ''}"
                f"{' smoothed' if self.x_pre is not None else ''}")


class Int8Linear(_LowPrecisionGemm):
    """Linear on int8 tensor cores (``torch._int_mm``), from a calibrated QuantLinear."""

    fmt = "int8"

    @classmethod
    def dynamic(cls, linear: nn.Module) -> Int8Linear:
        """An int8 Linear with dynamic activations, from a float one (``nn.Linear``, ``SmoothedLinear`` or transformers'
        ``Conv1D``; no calibration): each input row (token) gets its own scale, amax / 127, at run time; weights int8
        per output channel.

        Example:
            >>> lin = torch.nn.Linear(64, 32)
            >>> x = torch.randn(4, 64)
            >>> bool(torch.nn.functional.cosine_similarity(Int8Linear.dynamic(lin)(x), lin(x)).min() > 0.999)
            True
        """
        w = linear.weight.detach()
        conv1d = hf_conv1d_class()
        if conv1d is not None and isinstance(linear, conv1d):  # transformers' Conv1D: its weight is (in, out)
            w = w.t()
        return cls(w, w.float().abs().amax(dim=1), torch.ones(()), linear.bias, rowwise=True, x_qmin=-127,
                   x_pre=getattr(linear, "inv_s", None))  # a SmoothedLinear's 1 / s

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight the GEMM computes with, dequantized (w_q * w_scale; the smoothed W * s where ``x_pre``
        is set) in the float layer's dtype, computed on each read. Model code reads ``layer.weight.dtype`` (Hugging
        Face T5 casts its hidden states to the ``wo`` layer's weight dtype), so a converted layer keeps one."""
        dtype = self.bias.dtype if self.bias is not None else self.weight_dtype
        ws = self.w_scale.view(-1, 1) if self.w_scale.dim() else self.w_scale
        return (self.w_q.float() * ws).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the float layer's weight, dequantized alone (``(*ids.shape, K)``; SmoothQuant's factor
        undone): the lookup of an input embedding tied to this layer (:class:`~overdrive.quant.tied.TiedEmbedding`).

        Example:
            >>> q = Int8Linear.dynamic(torch.nn.Linear(64, 16))
            >>> torch.equal(q.rows(torch.tensor([2, 7])), q.weight[[2, 7]])
            True
        """
        dtype = self.bias.dtype if self.bias is not None else self.weight_dtype
        w = self.w_q[ids].float() * (self.w_scale[ids].unsqueeze(-1) if self.w_scale.dim() else self.w_scale)
        if self.x_pre is not None:  # the GEMM holds the smoothed W * s; x_pre is 1 / s
            w = w * self.x_pre
        return w.to(dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            raise read_only_weight_error(self, f"{self.fmt} weights")
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)


class Fp8Linear(Int8Linear):
    """Linear on fp8 e4m3 tensor cores (``torch._scaled_mm``), per-tensor or per-row scales."""

    fmt = "fp8"


class Int8Conv1x1(_LowPrecisionGemm):
    """A 1x1 convolution (any stride, groups 1) as an int8 GEMM over channels-last pixels."""

    fmt = "int8"

    def __init__(self, *args, stride: int = 1, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        if self.stride > 1:
            x = x[:, :, ::self.stride, ::self.stride]
        b, c, h, w = x.shape
        x2 = x.permute(0, 2, 3, 1).reshape(-1, c)  # (B*H*W, C): a view for channels-last input
        return self.gemm(x2).view(b, h, w, -1).permute(0, 3, 1, 2)  # channels-last (B, N, H, W)


class Fp8Conv1x1(Int8Conv1x1):
    fmt = "fp8"


def dynamic_int8(model: nn.Module, exclude: tuple[str, ...] | list[str] = ()) -> nn.Module:
    """Swap every float ``nn.Linear`` and transformers ``Conv1D`` (GPT-2's projections, a Linear whose weight is
    stored (in, out)) whose name matches no ``exclude`` fnmatch pattern for :meth:`Int8Linear.dynamic`:
    int8 GEMMs (``torch._int_mm``) with per-token activation scales computed at run time, no calibration. In place;
    ``model._overdrive_real`` lists the layers converted. The scale and rescale steps are elementwise passes around
    each GEMM: compile the model (``torch.compile``, an overdrive engine) to fuse them into their neighbours.

    Example:
        >>> m = dynamic_int8(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
        >>> m._overdrive_real
        {'0': 'int8 dynamic (per-token)', '2': 'int8 dynamic (per-token)'}
    """
    import fnmatch

    conv1d = hf_conv1d_class()  # transformers' Conv1D (GPT-2): x @ W + b with W (in, out), a Linear stored transposed
    if type(model) in (nn.Linear, SmoothedLinear) or (conv1d is not None and type(model) is conv1d):
        new = Int8Linear.dynamic(model)
        new._overdrive_real = {"": "int8 dynamic (per-token)"}
        return new
    report: dict[str, str] = {}
    ties = tied_embeddings(model)  # an embedding tied to a head reads the head's int8 rows, not a float copy
    for name, m in list(model.named_modules()):
        gemm = type(m) in (nn.Linear, SmoothedLinear) or (conv1d is not None and type(m) is conv1d)
        if gemm and not any(fnmatch.fnmatch(name, p) for p in exclude):
            new = Int8Linear.dynamic(m)
            _set(model, name, new)
            report[name] = "int8 dynamic (per-token)" + (", smoothed" if isinstance(m, SmoothedLinear) else "")
            if type(m) is nn.Linear:
                for emb in retie(model, ties, m, new):
                    report[emb] = f"embedding tied to {name}: rows read from its int8 weights"
    model._overdrive_real = report
    return model


def _x_amax(iq: Any) -> torch.Tensor:
    """The input amax a GEMM module is built with: calibrated, or a placeholder for dynamic (per-row) scales."""
    return torch.ones(()) if iq.dynamic else iq.amax


def _gemm_ok(k: int, n: int, fmt: str) -> str | None:
    mult = 8 if fmt == "int8" else 16
    if k % mult or n % mult:
        return f"in/out features ({k}, {n}) not multiples of {mult} ({'_int_mm' if fmt == 'int8' else '_scaled_mm'})"
    return None


def to_real(model: nn.Module, config: RealConfig | None = None, **settings: Any) -> nn.Module:
    """Replace calibrated QuantLinear / QuantConv1D (GPT-2) / QuantConv2d layers by real int8 or fp8 modules: GEMMs
    for Linear layers and 1x1 convolutions; on CUDA with Triton, any 2-D convolution with groups 1 (``Int8Conv2d`` /
    ``Fp8Conv2d``, an implicit-GEMM kernel of any kernel size).

    Other quantized layers (convolutions other than 1x1 off CUDA, ConvTranspose, disabled ones, unsupported
    shapes) go back to their float layer; ``model._overdrive_real`` lists what was converted and what was not, and why.
    A Linear / GPT-2 Conv1D with int8 weights and its input quantizer off (weight-only) becomes a
    :class:`~overdrive.quant.weight_only.WeightOnlyLinear` holding the fake quantization's int8 codes.
    The settings are a :class:`RealConfig` (``rowwise``: fp8 with dynamic per-token activation scales
    and per-channel weight scales; ``device``), given as ``config``, as keywords that replace its fields
    (``to_real(model, rowwise=True)``), or both.

    Example:
        >>> # real = quant.to_real(calibrated_model)   # int8: CUDA or CPU; fp8: CUDA sm_89+
        >>> # real = quant.to_real(calibrated_fp8_model, RealConfig(rowwise=True))
    """
    if isinstance(config, bool):  # the old second positional argument: rowwise
        settings = {"rowwise": config, **settings}
        config = None
    cfg = _config(RealConfig, config, settings)
    rowwise = cfg.rowwise
    first = next(model.parameters(), None)
    dev = torch.device(cfg.device) if cfg.device is not None else (
        first.device if first is not None else torch.device("cpu"))
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, _QuantMixin)]
    if not layers:
        if hasattr(model, "_overdrive_real"):  # a second call on the result: nothing is left to convert
            done = dict(list(model._overdrive_real.items())[:4])
            raise UsageError(f"{type(model).__name__} was already converted to low precision (quant.to_real or "
                             f"quant.dynamic_int8: {done}); use it as it is, or call to_real on the calibrated "
                             "fake-quant model")
        raise UsageError("the model has no quantized layers; call quant.quantize(model, config, forward_loop) first")
    report: dict[str, str] = {}
    ties = tied_embeddings(model)  # an embedding tied to a head reads the head's 8-bit rows, not a float copy
    for name, m in layers:
        iq, wq = m.input_quantizer, m.weight_quantizer
        dyn = iq.enabled and iq.dynamic  # per-token scales at run time: the per-row GEMMs, int8 or fp8
        if iq.enabled and not iq.is_calibrated:
            raise UsageError(f"cannot convert {name} before calibration: its input quantizer has no amax; run "
                             "quant.quantize(model, config, forward_loop=...) first")
        fmt = "fp8" if iq.config.format == "fp8_e4m3" else "int8"
        if fmt == "fp8" and not supports_fp8(dev):
            what = "a CPU" if dev.type == "cpu" else f"compute capability {torch.cuda.get_device_capability(dev)}"
            raise UsageError(f"fp8 execution of {name} needs a CUDA GPU of compute capability 8.9+ (Ada/Hopper), "
                             f"but the model is on {what}; use the int8 config, or keep the fake-quant model for "
                             "accuracy checks and export_onnx for deployment")
        new: nn.Module | None = None
        reason = None
        # the int8 ranges of the fake quantization: [-127, 127] where the quantizer is narrow-range
        ranges = {"x_qmin": -127 if iq.config.narrow_range else -128, "w_qmin": -127 if wq.config.narrow_range else -128,
                  "x_pre": iq.pre_quant_scale}  # SmoothQuant's 1 / s (the weight is taken smoothed: W * s)
        weight_only_int8 = (wq.enabled and not iq.enabled and wq.config.format == "int8" and wq.amax is not None
                            and iq.pre_quant_scale is None and wq.pre_quant_scale is None)
        if weight_only_int8 and (isinstance(m, QuantLinear) or (hf_conv1d_class() is not None
                                                               and isinstance(m, hf_conv1d_class()))):
            # int8 weights, float activations (mtq.INT8_WEIGHT_ONLY_CFG): stored int8, dequantized per call
            from overdrive.quant.weight_only import WeightOnlyLinear  # (weight_only imports this module)
            new = WeightOnlyLinear.from_quantized(m)
        elif not (iq.enabled and wq.enabled):
            reason = "quantizers disabled (kept in float)"
        elif iq.config.format != wq.config.format:  # no kernel takes an int8 input with fp8 weights, or the reverse
            reason = (f"input {iq.config.format} and weight {wq.config.format}: no kernel takes both formats (float); "
                      "quantize both the same way")
        elif isinstance(m, QuantLinear) and cfg.linear_kernel == "triton" and not dyn \
                and not (rowwise and fmt == "fp8") \
                and iq.pre_quant_scale is None and wq.pre_quant_scale is None \
                and qlinear.linear_unsupported(m.in_features, m.out_features) is None \
                and (dev.type != "cuda" or qconv.triton_available()):  # the convolution kernel on the 1x1 view
            cls3 = qlinear.Fp8TritonLinear if fmt == "fp8" else qlinear.Int8TritonLinear
            new = cls3(m.weight, wq.amax, iq.amax, m.bias, x_qmin=ranges["x_qmin"], w_qmin=ranges["w_qmin"])
        elif isinstance(m, QuantLinear):
            reason = _gemm_ok(m.in_features, m.out_features, fmt)
            if reason is None:
                cls = Fp8Linear if fmt == "fp8" else Int8Linear
                new = cls(wq.apply_pre_quant_scale(m.weight), wq.amax, _x_amax(iq), m.bias,
                          rowwise=dyn or (rowwise and fmt == "fp8"), **ranges)
        elif hf_conv1d_class() is not None and isinstance(m, hf_conv1d_class()):  # GPT-2's Conv1D: weight (in, out)
            reason = _gemm_ok(m.nx, m.nf, fmt)
            if reason is None:
                cls = Fp8Linear if fmt == "fp8" else Int8Linear
                new = cls(wq.apply_pre_quant_scale(m.weight).t(), wq.amax, _x_amax(iq), m.bias,
                          rowwise=dyn or (rowwise and fmt == "fp8"), **ranges)
        elif isinstance(m, QuantConv2d) and dev.type == "cuda" and not dyn and not (rowwise and fmt == "fp8") \
                and iq.pre_quant_scale is None and wq.pre_quant_scale is None and qconv.unsupported(m) is None \
                and qconv.triton_available():  # any kernel size: one Triton implicit-GEMM kernel, epilogue fused
            cls2 = qconv.Fp8Conv2d if fmt == "fp8" else qconv.Int8Conv2d
            new = cls2(m.weight, wq.amax, iq.amax, m.bias, m.stride, m.padding, m.dilation, x_qmin=ranges["x_qmin"],
                       w_qmin=ranges["w_qmin"])
        elif isinstance(m, QuantConv2d) and m.kernel_size == (1, 1) and m.groups == 1 and m.padding in ((0, 0), 0) \
                and m.stride[0] == m.stride[1]:
            reason = _gemm_ok(m.in_channels, m.out_channels, fmt)
            if reason is None:
                cls = Fp8Conv1x1 if fmt == "fp8" else Int8Conv1x1
                new = cls(wq.apply_pre_quant_scale(m.weight), wq.amax, _x_amax(iq), m.bias,
                          rowwise=dyn or (rowwise and fmt == "fp8"), stride=m.stride[0], **ranges)
        else:
            reason = f"{type(m).__name__} {getattr(m, 'kernel_size', '')} has no low-precision kernel here (float)"
        if new is None:
            new = m.to_float()
            report[name] = reason or "float"
        else:
            kind = "dynamic (per-token)" if dyn else "rowwise" if rowwise and fmt == "fp8" else "per-tensor"
            report[name] = "int8 weight-only" if weight_only_int8 else f"{fmt} {kind}"
        if name == "":  # a bare quantized layer
            new._overdrive_real = report
            return new
        _set(model, name, new)
        if isinstance(m, QuantLinear) and not isinstance(new, QuantLinear) and type(new) is not nn.Linear:
            for emb in retie(model, ties, m, new):
                report[emb] = f"embedding tied to {name}: rows read from its {fmt} weights"
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantAdd)]:
        add = _real_residual_add(m)
        if add is not None:
            _set(model, name, add)
    model._overdrive_real = report
    return model


class QuantizedResidualAdd(nn.Module):
    """``a + b`` with the residual ``b`` quantized to int8 / fp8 by its calibrated per-tensor scale and read back
    (``overdrive::quantize`` then ``overdrive::dequantize``): the values of :class:`~overdrive.quant.QuantAdd`'s fake
    quantization, as ops an engine finds. ``quant.to_real`` puts one in place of each calibrated ``QuantAdd``; an
    int8 / fp8 engine then hands the 8-bit tensor itself to the convolution that adds it (its epilogue dequantizes),
    which is where TensorRT puts the Q/DQ of a residual too. ``scale`` stays fp32.

    Example:
        >>> add = QuantizedResidualAdd(torch.tensor(4.0), fmt="int8")
        >>> [round(v, 4) for v in add(torch.zeros(3), torch.tensor([0.01, 1.0, 9.0])).tolist()]  # step 4 / 127
        [0.0, 1.0079, 4.0]
    """

    def __init__(self, amax: torch.Tensor, fmt: str = "int8", qmin: int = -128, residual_first: bool = False) -> None:
        super().__init__()
        if fmt not in ("int8", "fp8"):
            raise UsageError(f"QuantizedResidualAdd fmt={fmt!r} must be 'int8' or 'fp8'")
        bound = 127.0 if fmt == "int8" else 448.0
        self.register_buffer("scale", amax.detach().float().clamp_min(1e-12).reshape(()) / bound)
        self.fmt, self.qmin, self.residual_first = fmt, int(qmin), bool(residual_first)
        self.enabled = True  # False: a plain add (an engine with no kernel to read the 8-bit residual drops it)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.enabled or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return a + b  # numbers the tracer could not tell from tensors: nothing to quantize (as QuantAdd)
        if self.residual_first:
            a, b = b, a
        q = torch.ops.overdrive.quantize(b, self.scale, self.qmin, self.fmt == "fp8")
        r = torch.ops.overdrive.dequantize(q, self.scale, b.dtype)
        return r + a if self.residual_first else a + r

    def extra_repr(self) -> str:
        return f"{self.fmt}, scale={float(self.scale):.4g}" + ("" if self.enabled else ", off")


def _real_residual_add(m: QuantAdd) -> QuantizedResidualAdd | None:
    """The real form of a calibrated static per-tensor ``QuantAdd``; None where it has no quantizer to apply (disabled)
    or one of another kind (dynamic, per-channel, pre-scaled): that add keeps its fake quantization."""
    q = m.residual_quantizer
    if not q.enabled or q.dynamic or q.amax is None or q.amax.numel() != 1 or q.axis is not None \
            or q.pre_quant_scale is not None:
        return None
    fmt = "fp8" if q.config.format == "fp8_e4m3" else "int8"
    new = QuantizedResidualAdd(q.amax, fmt, -127 if q.config.narrow_range else -128, m.residual_first)
    return new.to(q.amax.device)
