"""The histogram calibrator of the ModelOpt and pytorch-quantization faces keeps the originals' bins when later
batches grow the range: bin width fixed by the first batch (its max / num_bins), more bins of that width as larger
values arrive. Expected amax derived by hand from data placed at known bins."""

from __future__ import annotations

import copy

import torch

import overdrive.quant.modelopt as mtq
from overdrive.quant.calibrators import HistogramCalibrator
from overdrive.quant.pytorch_quantization import calib as pq_calib
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

W = 1.0 / 2048  # the first batch's max is 1.0: 2048 bins of width 2^-11 (exact in fp32)
TARGET = 10001  # the bin holding the 99.99th percentile: not a multiple of a coarsened width (2, 4, 8 bins)


def _at(bin_index: int, n: int) -> torch.Tensor:
    return torch.full((n,), (bin_index + 0.5) * W)  # bin centres: no edge ambiguity


def _batches() -> list[torch.Tensor]:
    # 1000 values in bin 5 and the max 1.0 (the last bin); then, 20x larger: 8999 in bin 100, one in bin TARGET,
    # and 20.0. N = 10002; the cdf is 10000 / N = 0.99980 before bin TARGET and 10001 / N = 0.99990002 at it, so
    # percentile 99.99 picks bin TARGET and amax is its left edge, TARGET * W = 4.88330078125 (the originals
    # grow to 20 / W = 40960 bins of width W). A histogram coarsened to width 4W gave 10000 W = 4.8828125.
    first = torch.cat([_at(5, 1000), torch.tensor([1.0])])
    second = torch.cat([_at(100, 8999), _at(TARGET, 1), torch.tensor([20.0])])
    return [first, second]


EXPECTED = TARGET * W


def test_modelopt_face_histogram_percentile_after_20x_growth() -> None:
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["calibrator"] = "histogram"
    model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(1, 1)), cfg)
    mtq.model_calib.enable_stats_collection(model)
    with torch.no_grad():
        for b in _batches():
            model(b.view(-1, 1))
    mtq.model_calib.finish_stats_collection(model, method="percentile", percentile=99.99)
    assert float(model[0].input_quantizer.amax) == EXPECTED  # exact: every value sits at a bin centre


def test_pytorch_quantization_face_histogram_percentile_after_20x_growth() -> None:
    cal = pq_calib.HistogramCalibrator(8, None, False)
    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    for b in _batches():
        cal.collect(b)
        q.disable_quant()
        q.enable_calib()
        q(b)
    assert float(cal.compute_amax("percentile", percentile=99.99)) == EXPECTED
    q.load_calib_amax(method="percentile", percentile=99.99)
    assert float(q.amax) == EXPECTED


def test_native_calibrator_still_bounds_its_bins() -> None:
    cal = HistogramCalibrator(2048)
    for b in _batches():
        cal.collect(b)
    assert cal.hist.numel() <= 8 * 2048
    assert abs(float(cal.compute_amax("percentile", 99.99)) - EXPECTED) <= 8 * W  # within one coarsened bin
