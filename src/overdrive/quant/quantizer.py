"""TensorQuantizer: the module that sits on a layer's input or weight (pytorch-quantization style).

Modes: disabled (identity), calibrating (observe, pass through), fake-quant (quantize-dequantize
with the calibrated ``amax``). Gradients use the straight-through estimator with clipping: they
pass where |x| <= amax and are zero outside (QAT keeps amax fixed).

Example:
    >>> import torch
    >>> q = TensorQuantizer(QuantizerConfig())
    >>> q.start_calibration(); _ = q(torch.tensor([1.0, -2.0])); q.finish_calibration()
    >>> float(q.amax), abs(q(torch.tensor([0.5])).item() - round(0.5 / (2 / 127)) * (2 / 127)) < 1e-6  # fp32 math
    (2.0, True)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.calibrators import HistogramCalibrator, MaxCalibrator
from overdrive.quant.config import METHODS, QuantizerConfig, check_percentile

_TINY_AMAX = 1e-12  # floor for amax: an all-zero layer gets a tiny scale instead of a division by zero


class _FakeFp8(torch.autograd.Function):
    """Quantize-dequantize through float8 e4m3 with a clipping straight-through gradient: it passes where
    |x| <= amax and is zero outside, compared with ``amax`` itself (``|x / scale| <= 448`` rounds differently
    at the boundary, so x == amax, a max-calibrated weight's largest value, lost its gradient in about one
    channel in ten)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, axis: int,  # type: ignore[override]
                amax: torch.Tensor | None = None) -> torch.Tensor:
        if axis >= 0:  # per channel: scale (C,) broadcast along axis
            shape = [1] * x.dim()
            shape[axis] = -1
            scale = scale.view(shape)
            amax = None if amax is None else amax.view(shape)
        y = x / scale
        ctx.save_for_backward(y.abs() <= 448.0 if amax is None else x.abs() <= amax)
        return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None

    @staticmethod
    def symbolic(g, x, scale, axis, amax=None):  # ONNX (legacy exporter): Q/DQ with an fp8 zero point (opset >= 19)
        shape = [] if axis < 0 else [scale.type().sizes()[0]]
        zp = g.op("Constant", value_t=torch.zeros(shape, dtype=torch.float8_e4m3fn))
        kw = {} if axis < 0 else {"axis_i": axis}
        return g.op("DequantizeLinear", g.op("QuantizeLinear", x, scale, zp, **kw), scale, zp, **kw)


class _FakeInt8(torch.autograd.Function):
    """int8 quantize-dequantize (torch's fake_quantize) whose gradient passes where |x| <= amax and is
    zero outside: pytorch-quantization's clipped straight-through estimator. torch's own backward
    passes it wherever round(x / scale) is in [qmin, 127], i.e. up to 127.5 * scale (and -128.5 *
    scale), slightly beyond amax."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, axis: int | None,  # type: ignore[override]
                qmin: int) -> torch.Tensor:
        if axis is None:
            zp = torch.zeros((), dtype=torch.int32, device=x.device)
            y = torch.fake_quantize_per_tensor_affine(x, scale, zp, qmin, 127)
        else:
            zp = torch.zeros(scale.numel(), dtype=torch.int32, device=x.device)
            y = torch.fake_quantize_per_channel_affine(x, scale, zp, axis, qmin, 127)
            shape = [1] * x.dim()
            shape[axis] = -1
            amax = amax.view(shape)
        ctx.save_for_backward(x.abs() <= amax)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None, None


class TensorQuantizer(nn.Module):
    """Quantizer for one tensor; ``axis`` is the per-channel axis (None: per tensor).

    ``amax`` is a buffer (saved in state_dict once calibrated). Activation quantizers collect a
    histogram during calibration so every method can be applied afterwards with
    :meth:`load_calib_amax`; weight quantizers use the exact max of the weight.
    """

    def __init__(self, config: QuantizerConfig | None = None, axis: int | None = None, num_bins: int = 2048,
                 histogram: bool = False, pre_quant_axis: int = -1) -> None:
        super().__init__()
        config = QuantizerConfig() if config is None else config  # int8 per tensor (ModelOpt's TensorQuantizer())
        # SmoothQuant: a per-channel factor applied before quantizing (and also when disabled, since the paired
        # weight factor keeps the layer's float math: x / s with w * s); None: no smoothing. The axis is the
        # channel axis of the tensor: -1 for a layer input (B, ..., C_in), the input axis for a weight.
        self.register_buffer("pre_quant_scale", None)
        self.pre_quant_axis = pre_quant_axis
        self.config = config
        self.axis = axis if config.per_channel else None
        self.num_bins = num_bins
        self.histogram = histogram and self.axis is None
        self.enabled = config.enabled
        self.calibrating = False
        self.quant_enabled = True  # False: pass values through (pytorch-quantization's disable_quant)
        self.register_buffer("amax", None)
        self.calibrator: MaxCalibrator | HistogramCalibrator | None = None
        self.hist_max_bins: int | None = None  # HistogramCalibrator's max_bins (None: its default, 8x num_bins)
        self.name = ""  # set by quantize(): used in error messages and the summary

    # --- modes ------------------------------------------------------------------------------
    def new_calibrator(self) -> MaxCalibrator | HistogramCalibrator:
        """An empty calibrator of this quantizer's kind (histogram for per-tensor activations, else max)."""
        if not self.histogram:
            return MaxCalibrator(self.axis)
        return HistogramCalibrator(self.num_bins, self.config.bound, getattr(self, "hist_max_bins", None))

    @property
    def dynamic(self) -> bool:
        """Per-token scales computed from each input at run time (``QuantizerConfig.dynamic``): no calibration."""
        return self.config.dynamic

    def start_calibration(self) -> None:
        """Observe from now on with fresh statistics (what quant.calibrate does)."""
        if self.dynamic:
            return  # nothing to observe: every input brings its own scales
        self.calibrating = True
        self.calibrator = self.new_calibrator()

    # --- pytorch-quantization's switches, for hand-placed quantizers and the TensorRT samples' loop:
    # disable_quant(); enable_calib(); <run data>; load_calib_amax(...); enable_quant(); disable_calib()
    def enable_calib(self) -> None:
        """Observe inputs, adding to the statistics collected so far (none yet: a fresh calibrator).
        While observing, values pass through unquantized."""
        if self.dynamic:
            return
        if self.calibrator is None:
            self.calibrator = self.new_calibrator()
        self.calibrating = True

    def disable_calib(self) -> None:
        self.calibrating = False

    def enable_quant(self) -> None:
        self.quant_enabled = True

    def disable_quant(self) -> None:
        self.quant_enabled = False

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        """Identity: neither observe nor quantize."""
        self.enabled = False

    @property
    def _calibrator(self) -> MaxCalibrator | HistogramCalibrator:
        """pytorch-quantization's name for :attr:`calibrator`; made empty on first use, as pytorch-quantization
        makes one with every quantizer (the TensorRT samples test ``_calibrator is not None``)."""
        if self.calibrator is None:
            self.calibrator = self.new_calibrator()
        return self.calibrator

    def finish_calibration(self, method: str = "max", percentile: float | None = None) -> None:
        self.calibrating = False
        if not self.dynamic:
            self.load_calib_amax(method, percentile)

    def warn_if_degenerate(self) -> None:
        """Say so when calibration data leaves this quantizer's range meaningless: every input zero, or
        (int8) a few outliers so far out that 99.99% of the values share the lowest 1/64 of the range, where
        int8 has two steps for them whatever the calibrator (the histogram's bins are that coarse too)."""
        cal = self.calibrator
        hist = getattr(cal, "hist", None)
        name = self.name or "a quantizer"
        if self.amax is not None and float(self.amax.max()) == 0.0:
            warnings.warn(f"calibration of {name}: every input it saw was zero (amax 0), so it quantizes every "
                          "value to 0; check that the forward loop feeds real data, or disable this quantizer",
                          RuntimeWarning, stacklevel=4)
            return
        if self.config.format != "int8" or hist is None or hist.numel() < 64 or float(hist.sum()) == 0.0:
            return
        low = float(hist[: hist.numel() // 64].sum() / hist.sum())
        if low >= 0.9999:
            warnings.warn(
                f"calibration of {name}: outliers dominate the range: {100 * low:.3f}% of the values lie below "
                f"{getattr(cal, 'max', 0.0) / 64:.4g}, 1/64 of the largest ({getattr(cal, 'max', 0.0):.4g}), so int8 "
                "gives them about 2 steps with any calibrator; remove the outliers from the calibration data, or "
                "keep this layer in float (quant.partial_quantize / disable the quantizer)", RuntimeWarning, stacklevel=4)

    def load_calib_amax(self, method: str = "max", percentile: float | None = None, *, strict: bool = True,
                        **kwargs: Any) -> None:
        """Set amax from the stored calibration statistics with ``method`` (no data rerun).

        ``strict=False`` (pytorch-quantization's keyword, as YOLOv7's QAT recipe passes it): a quantizer whose
        calibrator saw no data (a layer the calibration never ran) warns and keeps its amax instead of raising.
        ``stride`` / ``start_bin`` (pytorch-quantization's ``compute_amax`` keywords) go to the entropy and MSE
        searches of a histogram calibrator.
        """
        if self.dynamic:
            return  # no amax: scales come from each input
        if self.calibrator is None:
            raise UsageError(f"quantizer {self.name or '?'} has no calibration statistics; run quantize(...) with a forward_loop")
        unknown = set(kwargs) - {"stride", "start_bin"}
        if unknown:
            raise UsageError(f"load_calib_amax got unexpected keyword(s) {sorted(unknown)}; it takes method, "
                             "percentile and strict")
        if method not in METHODS:  # a misspelt method ran max, silently
            raise UsageError(f"load_calib_amax method {method!r} is not one of {', '.join(METHODS)}")
        if method == "percentile" and percentile is not None:
            check_percentile(percentile)  # 0.9999 (a fraction) clipped nearly every activation
        if isinstance(self.calibrator, MaxCalibrator) and method != "max":
            if not self.config.per_channel and not (self.name or "").endswith("weight_quantizer"):
                warnings.warn(f"quantizer {self.name or '?'} was calibrated with max (no histogram), so {method!r} "
                              "gives its max; calibrate it with calib_method='histogram' (QuantDescriptor) or the "
                              f"method {method!r} in its QuantConfig for that method", RuntimeWarning, stacklevel=2)
            method = "max"  # weights and per-channel quantizers are max-calibrated by design
        try:
            if isinstance(self.calibrator, HistogramCalibrator):
                amax = self.calibrator.compute_amax(method, percentile, **kwargs)
            else:
                amax = self.calibrator.compute_amax(method, percentile)
        except UsageError as exc:
            if strict or "saw no data" not in str(exc):
                raise
            warnings.warn(f"quantizer {self.name or '?'}: {exc}; amax left as it was (strict=False)", RuntimeWarning,
                          stacklevel=2)
            return
        device = self.amax.device if self.amax is not None else getattr(self, "_calib_device", amax.device)
        self.amax = amax.float().to(device)  # on the data's device: no copy per forward, CUDA-graph safe

    def set_amax(self, amax: torch.Tensor) -> None:
        self.amax = amax.detach().float().clone()

    def __setattr__(self, name: str, value: object) -> None:
        if name == "amax" and value is not None and not isinstance(value, torch.Tensor):
            # pytorch-quantization's setter takes a number or a list (``q.amax = 2.5``, ``q.amax = amaxes``)
            try:
                value = torch.tensor(value, dtype=torch.float32,
                                     device=self.amax.device if self.amax is not None else None)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise UsageError(f"quantizer {self.name or '?'}: amax = {value!r} is not a number, a list of numbers "
                                 "or a tensor; give the largest magnitude to represent, e.g. q.amax = 2.5") from exc
        if name == "amax" and isinstance(value, torch.Tensor):
            value = self._amax_shape(value)
        super().__setattr__(name, value)

    def _amax_shape(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax`` as this quantizer keeps it: () per tensor, (C,) per channel. pytorch-quantization and
        ModelOpt keep the reduced dimensions ((C, 1) for a Linear weight, (C, 1, 1, 1) for a conv), so an amax
        assigned or loaded in that shape is flattened here; any other shape is refused."""
        axis = getattr(self, "axis", None)
        if amax.device.type != "meta" and amax.numel() and not bool((amax >= 0).all()):
            # a negative amax (a postprocess that flipped the sign, a hand-set value) made every scale the tiny floor:
            # the layer's input quantized to about 0, silently (pytorch-quantization: "Negative values in amax")
            raise UsageError(f"quantizer {self.name or '?'}: amax holds a negative or NaN value (min "
                             f"{float(amax.min()):g}); amax is the largest magnitude to represent, >= 0; check the "
                             "function that set it (postprocess_amax, load_calib_amax) or the checkpoint")
        if axis is None and amax.numel() == 1:
            return amax.reshape(())
        if axis is not None and amax.dim() > 1 and sorted(amax.shape)[:-1] == [1] * (amax.dim() - 1):
            return amax.reshape(-1)
        if axis is None and amax.dim() > 0:
            raise UsageError(f"quantizer {self.name or '?'} quantizes per tensor, but the amax given has shape "
                             f"{tuple(amax.shape)}; give one value, or make the quantizer per channel")
        return amax

    # --- pytorch-quantization's private names, which its users' scripts read and write (the Hugging Face
    # qdqbert quant_trainer: ``_amax.fill_``, ``setattr(q, "_disabled", True)``), and ModelOpt's is_enabled
    @property
    def _amax(self) -> torch.Tensor:
        """pytorch-quantization's amax buffer: :attr:`amax` itself (in-place edits reach it); an AttributeError
        before calibration, as there (``hasattr(q, "_amax")`` is False)."""
        if self.amax is None:
            raise AttributeError(f"quantizer {self.name or '?'} has no _amax: it is not calibrated")
        return self.amax

    @_amax.setter
    def _amax(self, value: torch.Tensor) -> None:
        self.amax = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)

    @property
    def num_bits(self) -> int | tuple[int, int]:
        """8 (int8) or (4, 3) (fp8 e4m3), as pytorch-quantization and ModelOpt name the format.

        Settable, as in ModelOpt (``q.num_bits = (4, 3)``): the format changes and amax is kept (the scale
        becomes amax / 448 instead of amax / 127), as ModelOpt's setter keeps it.

        Example:
            >>> q = TensorQuantizer(); q.amax = 448.0; q.num_bits = (4, 3)
            >>> q.config.format, q.maxbound, float(q.scale())
            ('fp8_e4m3', 448.0, 1.0)
        """
        return (4, 3) if self.config.format == "fp8_e4m3" else 8

    @num_bits.setter
    def num_bits(self, value: Any) -> None:
        bits = tuple(value) if isinstance(value, list) else value
        if isinstance(bits, str) and bits.lower() == "e4m3":
            bits = (4, 3)
        fmt = {8: "int8", (4, 3): "fp8_e4m3"}.get(bits) if isinstance(bits, (int, tuple)) and not isinstance(
            bits, bool) else None
        if fmt is None:
            raise UsageError(f"quantizer {self.name or '?'}: num_bits = {value!r} is not supported; use 8 (int8) or "
                             "(4, 3) (fp8 e4m3); for 4-bit weights use quant.weight_only(model, bits=4)")
        self.config = self.config.replace(format=fmt)

    @property
    def unsigned(self) -> bool:
        return False  # symmetric, zero point 0

    @property
    def narrow_range(self) -> bool:
        return self.config.narrow_range

    @property
    def fake_quant(self) -> bool:
        return True  # real low precision is quant.to_real(model)

    @property
    def maxbound(self) -> float:
        """The largest quantized magnitude, ModelOpt's ``maxbound``: 2**(num_bits-1) - 1 = 127 for int8 (narrow
        range or not), 448 for fp8 e4m3; the scale is ``amax / maxbound``.

        Example:
            >>> TensorQuantizer().maxbound, TensorQuantizer(QuantizerConfig(format="fp8_e4m3")).maxbound
            (127, 448.0)
        """
        return 448.0 if self.config.format == "fp8_e4m3" else (1 << 7) - 1

    @property
    def block_sizes(self) -> None:
        """ModelOpt's block-quantization sizes: always None here (per tensor or per channel; grouped int4 / int8
        weights are ``quant.weight_only``), so export code takes its per-tensor / per-channel branch."""
        return None

    @property
    def trt_high_precision_dtype(self) -> str:
        """ModelOpt's dtype of the Q/DQ scales in ONNX export: ``"Float"`` (``quant.export_onnx`` writes fp32 scales)."""
        return "Float"

    def export_amax(self) -> torch.Tensor | None:
        """amax as ModelOpt's ``export_amax()`` gives it to TensorRT-LLM-style exporters: None before calibration;
        else a copy with 0 and NaN replaced by :attr:`maxbound`, clamped to fp32's positive range, shape (1,) per
        tensor and (C,) per channel (``scale = export_amax() / maxbound``). The amax buffer is not changed.

        Example:
            >>> q = TensorQuantizer(); q.amax = 2.5
            >>> q.export_amax(), q.export_amax() / q.maxbound
            (tensor([2.5000]), tensor([0.0197]))
        """
        if self.amax is None:
            return None
        amax = self.amax.detach().float().clone()
        amax = torch.nan_to_num(torch.where(amax == 0, torch.full_like(amax, self.maxbound), amax), nan=self.maxbound)
        amax = amax.clamp(torch.finfo(amax.dtype).tiny, torch.finfo(amax.dtype).max)
        return amax.reshape(1) if self.axis is None else amax.squeeze()

    def set_from_attribute_config(self, attribute_cfg: Any) -> None:
        """ModelOpt's: set the attributes given (a dict such as ``{"num_bits": (4, 3), "axis": None}``, or a
        ``mtq.QuantizerAttributeConfig``), keeping the others; see
        :func:`overdrive.quant.modelopt.conversion.set_from_attribute_config`."""
        from overdrive.quant.modelopt.conversion import set_from_attribute_config

        set_from_attribute_config(self, attribute_cfg)

    def reset_amax(self) -> None:
        """Forget amax and the calibration statistics (ModelOpt's ``reset_amax``): the quantizer is uncalibrated
        until the next calibration (``mtq.calibrate``)."""
        self.amax = None
        self.calibrator = None

    @property
    def step_size(self) -> torch.Tensor | None:
        """amax / 127 (pytorch-quantization's name for the scale); None before calibration."""
        return None if self.amax is None else self.amax / self.config.bound

    @property
    def is_enabled(self) -> bool:
        """ModelOpt's name for :attr:`enabled`."""
        return self.enabled

    @property
    def _disabled(self) -> bool:
        """pytorch-quantization's flag: ``not enabled``."""
        return not self.enabled

    @_disabled.setter
    def _disabled(self, value: bool) -> None:
        self.enabled = not value

    # pytorch-quantization's (and ModelOpt's) mode flags, which scripts read and set directly: ``_if_quant`` is
    # quantization on (enable_quant / disable_quant), ``_if_calib`` observing (enable_calib / disable_calib)
    @property
    def _if_quant(self) -> bool:
        return bool(self.quant_enabled)

    @_if_quant.setter
    def _if_quant(self, value: bool) -> None:
        self.quant_enabled = bool(value)

    @property
    def _if_calib(self) -> bool:
        return bool(self.calibrating)

    @_if_calib.setter
    def _if_calib(self, value: bool) -> None:
        if value:
            self.enable_calib()  # a calibrator to collect into, as enable_calib makes one
        else:
            self.disable_calib()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # noqa: ANN001
        if prefix + "_amax" in state_dict and prefix + "amax" not in state_dict:
            # a pytorch-quantization checkpoint: its buffer is _amax, in the keep-dims shape
            state_dict[prefix + "amax"] = self._amax_shape(state_dict.pop(prefix + "_amax"))
        elif prefix + "amax" in state_dict:
            state_dict[prefix + "amax"] = self._amax_shape(state_dict[prefix + "amax"])
        # amax is None until calibration; take it from a calibrated checkpoint so quantize() + load works.
        for attr in ("amax", "pre_quant_scale"):
            key = prefix + attr
            if getattr(self, attr) is None and key in state_dict:
                setattr(self, attr, state_dict[key].detach().clone().float())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def is_calibrated(self) -> bool:
        """Ready to quantize: an amax from calibration, or a dynamic quantizer (which needs none)."""
        return self.amax is not None or self.dynamic

    # --- numerics ---------------------------------------------------------------------------
    def scale(self) -> torch.Tensor:
        """amax / 127 (int8) or amax / 448 (fp8) in fp32; shape () or (C,).

        fp32 whatever the amax buffer's dtype: casting a model to fp16/bf16 (``model.half()``, amp
        O2) casts the buffer too, and fake_quantize takes only fp32 scales (a bf16 one trips an
        internal assert)."""
        if self.amax is None:
            raise UsageError(
                f"quantizer {self.name or '?'} is not calibrated: call quant.quantize(model, config, forward_loop=...) "
                "(or give it a forward_loop) before running, exporting or converting the model"
            )
        return self.amax.float().clamp_min(_TINY_AMAX) / self.config.bound

    def apply_pre_quant_scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times :attr:`pre_quant_scale` broadcast along :attr:`pre_quant_axis` (``x`` when there is none)."""
        s = self.pre_quant_scale
        if s is None:
            return x
        shape = [1] * x.dim()
        shape[self.pre_quant_axis] = -1
        return x * s.to(device=x.device, dtype=x.dtype).view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.apply_pre_quant_scale(x)
        if not self.enabled:
            return x
        if self.calibrating:
            self.calibrator.collect(x, where=self.name or "a quantizer")  # type: ignore[union-attr]
            self._calib_device = x.device  # where amax goes: the histogram calibrator keeps its counts on the CPU
            return x
        if not self.quant_enabled:
            return x
        if self.dynamic:
            return self._dynamic_fake_quant(x)
        scale = self.scale().to(x.device)
        ax = self.axis
        if ax is not None and scale.numel() > 1 and (x.dim() <= ax or scale.numel() != x.shape[ax]):
            raise UsageError(f"quantizer {self.name or '?'}: {scale.numel()} per-channel amax values along axis {ax}, "
                             f"but its input has shape {tuple(x.shape)}; its amax must have one value per channel "
                             f"({x.shape[ax] if x.dim() > ax else 'no such axis'}): recalibrate it, or set_amax of "
                             "that size")
        if torch.onnx.is_in_onnx_export() and not torch.compiler.is_exporting():
            # the TorchScript exporter: a constant in the graph, not ops on the amax buffer (torch.onnx.export's
            # torch.export-based exporter, the default since torch 2.9, traces the buffer as it is)
            scale = torch.tensor(scale.tolist(), dtype=torch.float32, device=x.device)
        # fake_quantize runs in fp32 (it rejects fp16 on the CPU); the result goes back to x's dtype
        out = self._fake_quant(x if x.dtype == torch.float32 else x.float(), scale)
        return out if out.dtype == x.dtype else out.to(x.dtype)  # (no Cast nodes in fp32 ONNX graphs)

    def _fake_quant(self, xf: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export() and torch.compiler.is_exporting():
            return self._export_qdq(xf, scale)
        # a negative axis (TensorQuantizer(axis=-1): the last dimension) counted from the front, as torch's
        # fake_quantize_per_channel_affine takes it (a negative one raised "axis must be between 0 and ...")
        axis = None if self.axis is None else self.axis % xf.dim()
        if self.config.format == "fp8_e4m3":
            if torch.onnx.is_in_onnx_export():
                return _FakeFp8.apply(xf, scale, -1 if axis is None else axis)
            amax = (self.amax if amax is None else amax).float().clamp_min(_TINY_AMAX).to(xf.device)  # type: ignore[union-attr]
            return _FakeFp8.apply(xf, scale, -1 if axis is None else axis, amax)
        qmin = -127 if self.config.narrow_range else -128
        if torch.onnx.is_in_onnx_export():
            # The exporter translates only the ranges [-128, 127] / [0, 255], so a narrow range is
            # exported as a clamp to [-127, 127] * scale followed by the [-128, 127] Q/DQ: then
            # round(x / scale) >= -127 and ONNX Runtime agrees with the [-127, 127] fake quantization.
            if self.config.narrow_range:
                xf = self._clamp_for_export(xf, scale)
            if axis is None:
                return torch.fake_quantize_per_tensor_affine(xf, float(scale), 0, -128, 127)
            zp = torch.zeros(scale.numel(), dtype=torch.int32, device=xf.device)
            return torch.fake_quantize_per_channel_affine(xf, scale, zp, axis, -128, 127)
        if torch.compiler.is_exporting():
            # torch.export has no kernel for aten._fake_quantize_*_cachemask: trace the same arithmetic
            # (x * (1 / scale), round half to even, clamp, rescale: fake_quantize's own) as plain ops,
            # which Inductor fuses into the neighbouring kernels.
            s = scale if axis is None else scale.view([-1 if d == axis else 1 for d in range(xf.dim())])
            return torch.clamp(torch.round(xf * (1.0 / s)), qmin, 127) * s
        amax = (self.amax if amax is None else amax).float().clamp_min(_TINY_AMAX).to(xf.device)  # type: ignore[union-attr]
        return _FakeInt8.apply(xf, scale, amax, axis, qmin)

    def _dynamic_fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize with one scale per token, amax(|row|) / bound over the last dimension, in fp32: the
        values ``to_real``'s per-row int8 / fp8 GEMM inputs take (``_quantize_int8_rowwise``). Gradient: straight
        through (nothing is clipped: every value lies within its row's amax)."""
        if torch.onnx.is_in_onnx_export():
            raise UsageError(f"quantizer {self.name or '?'} has dynamic per-token scales, which have no ONNX Q/DQ "
                             "form (QuantizeLinear takes a fixed scale); export a static config (quant.INT8_DEFAULT) "
                             "or build an engine from the PyTorch model")
        xf = x.float()
        scale = xf.detach().abs().amax(dim=-1, keepdim=True).clamp_min(_TINY_AMAX) / self.config.bound
        if self.config.format == "fp8_e4m3":
            q = (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
        else:
            q = torch.clamp(torch.round(xf / scale), -127 if self.config.narrow_range else -128, 127) * scale
        out = xf + (q - xf).detach()
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _export_qdq(self, xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """QuantizeLinear + DequantizeLinear as ONNX ops, for ``torch.onnx.export``'s torch.export-based exporter
        (torch's default since 2.9). Its trace has no Q/DQ form of ``fake_quantize`` (the op it decomposes to has
        no fake kernel, and its strict fallback wrote Mul/Round/Clip, which a TensorRT-style builder runs in
        float), so the nodes are written out: int8 with an int8 zero point (a narrow range clamped first, as the
        TorchScript path does), fp8 with a float8e4m3fn one (opset >= 19), per channel along ``axis``."""
        from torch.onnx import ops as onnx_ops

        fp8 = self.config.format == "fp8_e4m3"
        if not fp8 and self.config.narrow_range:
            xf = self._clamp_for_export(xf, scale)
        shape = () if self.axis is None else (scale.numel(),)
        zp = torch.zeros(shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=xf.device)
        s = scale.reshape(shape).to(torch.float32)
        attrs = {"axis": self.axis % xf.dim()} if self.axis is not None else {}
        q = onnx_ops.symbolic("QuantizeLinear", (xf, s, zp), attrs, dtype=zp.dtype, shape=xf.shape)
        return onnx_ops.symbolic("DequantizeLinear", (q, s, zp), attrs, dtype=torch.float32, shape=xf.shape)

    def _clamp_for_export(self, xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``xf`` clamped to [-127 * scale, 127 * scale] (per channel along ``axis``) for the ONNX graph."""
        shape = [1] * xf.dim()
        if self.axis is not None:
            shape[self.axis] = -1
        s = scale.detach().view(shape) if self.axis is not None else scale.detach()
        # A weight is a constant of the graph, so it is checked here once: when every value already
        # quantizes to >= -127 (max-calibrated, untrained weights) the initializer keeps feeding
        # QuantizeLinear directly (TensorRT's weight pattern; weights found by name); weights that
        # QAT moved past -amax get Max/Min nodes.
        if torch.compiler.is_exporting():  # torch.export-based ONNX export: values unknown, the clamp as graph ops
            limit = 127.0 * s
            return torch.minimum(torch.maximum(xf, -limit), limit)
        if isinstance(xf, nn.Parameter) and bool((xf.detach() / s > -127.5).all()):
            return xf
        if self.axis is None:
            limit = 127.0 * float(scale)
            return xf.clamp(-limit, limit)
        limit = torch.tensor((127.0 * scale).tolist(), dtype=torch.float32, device=xf.device).view(shape)
        return torch.minimum(torch.maximum(xf, -limit), limit)

    def extra_repr(self) -> str:
        if not self.enabled:
            return "disabled"
        if not self.quant_enabled:
            return "quantization off (disable_quant)" + (", calibrating" if self.calibrating else "")
        if self.dynamic:
            return f"{self.config.format} dynamic per-token"
        amax = "uncalibrated" if self.amax is None else (
            f"amax={float(self.amax):.4g}" if self.amax.dim() == 0 else
            f"amax=[{float(self.amax.min()):.4g}, {float(self.amax.max()):.4g}] ({self.amax.numel()} channels)")
        kind = f"per-channel axis {self.axis}" if self.axis is not None else "per-tensor"
        smooth = "" if self.pre_quant_scale is None else f" pre_quant_scale ({self.pre_quant_scale.numel()} channels)"
        return f"{self.config.format} {kind} {amax}{smooth}"
