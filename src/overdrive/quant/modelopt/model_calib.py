"""ModelOpt's ``modelopt.torch.quantization.model_calib``: the statistics-collection steps under ``mtq.calibrate``,
which scripts call themselves to compute amax from histograms (quant_cfg attribute ``"calibrator": "histogram"``)
with entropy, MSE or a percentile.

A quantizer with the histogram calibrator collects a histogram of |x| (per tensor, activations only);
``finish_stats_collection(model, method)`` turns it into amax: ``"entropy"`` (TensorRT's KL-divergence search),
``"mse"``, ``"percentile"`` (``percentile=99.99``). Max-calibrated quantizers get their max whatever the method.
``method=None`` (what ``max_calibrate`` and ``mtq.calibrate(model, "max")`` finish with) gives a histogram
quantizer the exact max it saw, where ModelOpt stops with a TypeError; its histogram is kept, so a later
``finish_stats_collection(model, "entropy")`` recomputes amax without rerunning data.

Example:
    >>> import copy, torch, overdrive.quant.modelopt as mtq
    >>> cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    >>> cfg["quant_cfg"]["*input_quantizer"]["calibrator"] = "histogram"
    >>> model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), cfg)
    >>> mtq.model_calib.enable_stats_collection(model)
    >>> _ = model(torch.randn(4096, 8, generator=torch.Generator().manual_seed(0)))  # a fixed sample
    >>> mtq.model_calib.finish_stats_collection(model, method="entropy")
    >>> bool(model[0].input_quantizer.amax < model[0].input_quantizer.calibrator.max)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.calibrators import HistogramCalibrator, MaxCalibrator
from overdrive.quant.config import check_percentile
from overdrive.quant.quantizer import TensorQuantizer

_HISTOGRAM_METHODS = ("entropy", "mse", "percentile")


def _quantizers(model: torch.nn.Module) -> list[TensorQuantizer]:
    """The enabled, static quantizers of ``model`` (a bare TensorQuantizer counts as its own model)."""
    return [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.enabled and not m.dynamic]


def _saw_data(cal: Any) -> bool:
    if isinstance(cal, HistogramCalibrator):
        return cal.hist is not None or bool(getattr(cal, "_zeros", 0))
    return isinstance(cal, MaxCalibrator) and cal.amax is not None


def enable_stats_collection(model: torch.nn.Module) -> None:
    """Every enabled quantizer observes from now on (values pass through unquantized), adding to the statistics
    it has; weights are observed as the forward passes them, as in ModelOpt."""
    for name, q in api.quantizers(model):
        q.name = q.name or name
    for q in _quantizers(model):
        q.disable_quant()
        q.enable_calib()


def finish_stats_collection(model: torch.nn.Module, method: str | None = None, **kwargs: Any) -> None:
    """amax from the statistics of every enabled quantizer, then quantizing again (ModelOpt's function).

    ``method``: None (max), or ``"entropy"`` / ``"mse"`` / ``"percentile"`` for quantizers with the histogram
    calibrator (``percentile=`` 99.99 by default; ``stride`` / ``start_bin`` for the entropy and MSE searches).
    A quantizer that saw no data keeps its amax.
    """
    if method not in (None, "max", *_HISTOGRAM_METHODS):
        raise UsageError(f"finish_stats_collection method={method!r}: expected None (max) or one of "
                         f"{_HISTOGRAM_METHODS} (for quantizers with 'calibrator': 'histogram')")
    percentile = kwargs.pop("percentile", 99.99)
    if method == "percentile":
        check_percentile(percentile)
    bad = set(kwargs) - {"stride", "start_bin"}
    if bad:
        raise UsageError(f"finish_stats_collection got unexpected keyword(s) {sorted(bad)}; it takes percentile, "
                         "stride and start_bin")
    for q in _quantizers(model):
        if q.calibrator is not None and _saw_data(q.calibrator):
            if isinstance(q.calibrator, HistogramCalibrator) and method in _HISTOGRAM_METHODS:
                q.load_calib_amax(method, percentile, **kwargs)
            else:
                q.load_calib_amax("max")
        q.enable_quant()
        q.disable_calib()


@torch.no_grad()
def max_calibrate(model: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], Any] | None = None,
                  distributed_sync: bool = True) -> None:
    """ModelOpt's ``max_calibrate``: collect statistics over ``forward_loop(model)`` (the weights alone when it
    is None), then :func:`finish_stats_collection` with max. ``distributed_sync``: one process, nothing to sync."""
    enable_stats_collection(model)
    if forward_loop is None:
        api._calibrate_weights(model)
    else:
        forward_loop(model)
    finish_stats_collection(model)


__all__ = ["enable_stats_collection", "finish_stats_collection", "max_calibrate"]
