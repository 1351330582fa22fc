"""pytorch-quantization scripts ported with the import changed: histogram methods against the original's published
formulas, the amax setter, and export of a quantizer that was never calibrated."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.pytorch_quantization import calib
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor


def _pq_hist(x: torch.Tensor, num_bins: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """pytorch-quantization's first-batch histogram of |x|: integer counts, edges linspace(0, max, bins + 1)."""
    a = x.abs().float()
    hist = torch.histc(a, bins=num_bins, min=0, max=float(a.max())).int().numpy()
    return hist, np.linspace(0.0, float(a.max()), num_bins + 1)


def _pq_percentile(hist: np.ndarray, edges: np.ndarray, pct: float) -> float:
    """_compute_amax_percentile as published: cdf of normalised counts, amax = bin_edges[first bin reaching p]."""
    cdf = np.cumsum(hist / hist.sum())
    return float(edges[np.searchsorted(cdf, pct / 100)])


def _pq_mse(hist: np.ndarray, edges: np.ndarray, start_bin: int = 128, stride: int = 1) -> float:
    """_compute_amax_mse as published: candidates are bin centres[start_bin::stride], each fake-quantizes every
    centre in int8's narrow range; the count-weighted mean squared error picks the first minimum."""
    centers = (edges[1:] + edges[:-1]) / 2
    errs, cands = [], list(range(start_bin, len(centers), stride))
    for i in cands:
        s = 127.0 / centers[i]
        q = np.clip(np.round(centers * s), -127, 127) / s
        errs.append(float(((q - centers) ** 2 * hist).mean()))
    return float(centers[cands[int(np.argmin(errs))]])


def _data(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "gaussian":
        return torch.randn(100_000, generator=g)
    return torch.relu(torch.randn(50_000, generator=g) * 2.0) ** 1.5  # a skewed, post-ReLU activation


@pytest.mark.parametrize("kind", ["gaussian", "relu_skewed"])
@pytest.mark.parametrize("pct", [99.0, 99.9, 99.99])
def test_percentile_is_the_left_bin_edge_as_pytorch_quantization(kind: str, pct: float) -> None:
    # this returned the right edge (one bin, 0.1% of the range, larger), and summed the cdf differently, which at
    # 99.99 on 100k Gaussian samples picked a bin 20 bins away (3.885 against 3.930)
    x = _data(kind)
    cal = calib.HistogramCalibrator(8, None, False)
    cal.collect(x)
    ref = _pq_percentile(*_pq_hist(x), pct)
    assert float(cal.compute_amax("percentile", percentile=pct)) == pytest.approx(ref, rel=1e-6)
    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    q.disable_quant()
    q.enable_calib()
    q(x)
    q.load_calib_amax(method="percentile", percentile=pct)
    assert float(q.amax) == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("kind", ["gaussian", "relu_skewed"])
def test_mse_searches_bin_centres_as_pytorch_quantization(kind: str) -> None:
    # this searched 256 evenly spaced candidates: 4.0637 against the original's 4.0603 on the Gaussian
    x = _data(kind)
    cal = calib.HistogramCalibrator(8, None, False)
    cal.collect(x)
    hist, edges = _pq_hist(x)
    assert float(cal.compute_amax("mse")) == pytest.approx(_pq_mse(hist, edges), rel=1e-6)
    # compute_amax's stride / start_bin were refused; they now narrow the search as there
    got = float(cal.compute_amax("mse", stride=3, start_bin=300))
    assert got == pytest.approx(_pq_mse(hist, edges, start_bin=300, stride=3), rel=1e-6)
    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    q.disable_quant()
    q.enable_calib()
    q(x)
    q.load_calib_amax("mse", stride=3, start_bin=300)
    assert float(q.amax) == pytest.approx(got, rel=1e-6)


def test_compute_amax_rejects_bad_stride() -> None:
    cal = calib.HistogramCalibrator(8, None, False)
    cal.collect(torch.randn(1000))
    with pytest.raises(UsageError, match="stride=0"):
        cal.compute_amax("entropy", stride=0)


def test_amax_setter_takes_numbers_as_pytorch_quantization() -> None:
    # pytorch-quantization's setter: ``q.amax = 2.5`` (this raised torch's "cannot assign 'float' as buffer")
    q = quant_nn.TensorQuantizer(QuantDescriptor())
    q.amax = 2.5
    assert q.amax.dtype == torch.float32 and float(q._amax) == 2.5
    x = torch.tensor([1.0, -4.0])
    ref = torch.clamp(torch.round(x / (2.5 / 127)), -128, 127) * (2.5 / 127)
    assert torch.allclose(q(x), ref, atol=1e-6)
    w = quant_nn.TensorQuantizer(QuantDescriptor(axis=(0,)))
    w.amax = [1.0, 2.0]
    assert w.amax.tolist() == [1.0, 2.0]
    with pytest.raises(UsageError, match="amax = 'big'"):
        q.amax = "big"


def _export(model: nn.Module) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 8),), buf, opset_version=13, dynamo=False)
    return buf.getvalue()


def test_export_of_an_uncalibrated_activation_quantizer_is_refused() -> None:
    # this exported silently, with the example input's max baked in as the input's scale
    quant_nn.TensorQuantizer.use_fb_fake_quant = True  # the TensorRT samples' export switch, readable here
    try:
        assert quant_nn.TensorQuantizer.use_fb_fake_quant is True
        model = nn.Sequential(quant_nn.QuantLinear(8, 4), nn.ReLU())
        with pytest.raises(UsageError, match="never calibrated"):
            _export(model)
        model[0]._input_quantizer.amax = 3.0  # the weight quantizer may stay uncalibrated: its max is a constant
        assert len(_export(model)) > 0
        model[0]._input_quantizer.amax = None
        model[0]._input_quantizer.disable()  # or the input kept in float
        assert len(_export(model)) > 0
    finally:
        quant_nn.TensorQuantizer.use_fb_fake_quant = False
    assert quant_nn.TensorQuantizer().use_fb_fake_quant is False


def test_percentile_never_gives_amax_zero_for_nonzero_data() -> None:
    # the left edge of bin 0 is 0: one outlier at 1e4 among normals put 99.99% of the data in bin 0, and amax 0
    # quantized every input to 0; the right edge of bin 0 is kept instead
    x = torch.randn(65_536, generator=torch.Generator().manual_seed(0))
    x[5] = 1e4
    cal = calib.HistogramCalibrator(8, None, False)
    cal.collect(x)
    assert float(cal.compute_amax("percentile", percentile=99.99)) == pytest.approx(1e4 / 2048, rel=1e-6)
