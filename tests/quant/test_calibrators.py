"""Calibrators against closed-form references on known distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.quant.calibrators import HistogramCalibrator, MaxCalibrator


def test_max_per_tensor_and_per_channel() -> None:
    cal = MaxCalibrator()
    cal.collect(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))
    cal.collect(torch.tensor([[0.0, 2.5]]))
    assert float(cal.compute_amax()) == 3.0
    pc = MaxCalibrator(axis=0)
    pc.collect(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))
    assert pc.compute_amax().tolist() == [3.0, 2.0]


def test_histogram_max_equals_exact_max_over_batches() -> None:
    cal = HistogramCalibrator()
    xs = [torch.randn(5000) * s for s in (1.0, 3.0, 0.5)]  # the second batch grows the range
    for x in xs:
        cal.collect(x)
    assert float(cal.compute_amax("max")) == pytest.approx(max(float(x.abs().max()) for x in xs))
    assert float(cal.hist.sum()) == 15000


@pytest.mark.parametrize("pct", [99.0, 99.9, 99.99])
def test_percentile_matches_numpy_quantile(pct: float) -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    cal = HistogramCalibrator(num_bins=2048)
    cal.collect(x)
    ref = float(np.quantile(x.abs().numpy(), pct / 100))
    assert float(cal.compute_amax("percentile", pct)) == pytest.approx(ref, abs=2 * cal.width)


def test_entropy_clips_gaussian_outliers() -> None:
    """For a Gaussian with two far outliers, KL calibration clips well below the max, above 2 sigma."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g), torch.tensor([40.0, -35.0])])
    cal = HistogramCalibrator()
    cal.collect(x)
    amax = float(cal.compute_amax("entropy"))
    assert 2.0 < amax < 20.0, amax


def _pq_entropy_amax(bins: np.ndarray, width: float, start_bin: int = 128) -> float:
    """The reference: pytorch-quantization's _compute_amax_entropy (TensorRT's calibrator), as published, in plain
    loops: bin 0 counted as bin 1; bins[:i] digitized into 128 levels over linspace(0, i, 129); empty bins left out;
    each level's mass spread evenly; KL(P || Q) with the tail folded into P's last bin; the last minimum; amax the
    left edge of bin i."""
    bins = bins.astype(np.float64).copy()
    bins[0] = bins[1]
    divergences = []
    for i in range(start_bin, len(bins) + 1):
        space = np.linspace(0, i, num=129)
        level = np.digitize(np.arange(i), space) - 1
        level[bins[:i] == 0] = -1
        dens, cnt = np.zeros(128), np.zeros(128)
        for j, lv in enumerate(level):
            if lv != -1:
                dens[lv] += bins[j]
                cnt[lv] += 1
        q = np.array([dens[lv] / cnt[lv] if lv != -1 else 0.0 for lv in level])
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        pn, qn = p / p.sum(), q / q.sum()
        m = pn > 0
        divergences.append(np.inf if np.any(qn[m] == 0) else float(np.sum(pn[m] * np.log(pn[m] / qn[m]))))
    d = np.array(divergences)
    return (len(d) - 1 - int(np.argmin(d[::-1])) + start_bin) * width


@pytest.mark.parametrize("kind", ["relu_laplace", "gaussian"])
def test_entropy_follows_pytorch_quantization(kind: str) -> None:
    # the same histogram gave amax 10.79 here against 9.68 in pytorch-quantization (ReLU of Laplace data): bins were
    # merged with truncated linspace edges and the first minimum taken at the bin's middle
    from overdrive.quant.calibrators import _entropy_amax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(60_000, generator=g)
    if kind == "relu_laplace":
        torch.manual_seed(0)
        x = torch.relu(torch.distributions.Laplace(0.0, 1.0).sample((60_000,)))
    hist = np.histogram(x.abs().numpy(), bins=400, range=(0.0, float(x.abs().max())))[0]
    width = float(x.abs().max()) / 400
    assert _entropy_amax(hist, width) == pytest.approx(_pq_entropy_amax(hist, width), rel=1e-9)


@pytest.mark.parametrize("outlier", [8.0, 60.0])
def test_mse_matches_brute_force_optimum(outlier: float) -> None:
    """The histogram MSE search lands within 5% of the error of a brute-force search on the raw data."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(50_000, generator=g), torch.tensor([outlier])])
    cal = HistogramCalibrator()
    cal.collect(x)

    def err(amax: float) -> float:
        s = amax / 127
        return float(((torch.clamp(torch.round(x / s), -127, 127) * s - x) ** 2).mean())

    best = min(err(a) for a in np.linspace(0.5, outlier, 400))
    assert err(float(cal.compute_amax("mse"))) <= 1.05 * best


def test_all_zero_and_no_data() -> None:
    cal = HistogramCalibrator()
    cal.collect(torch.zeros(100))
    assert float(cal.compute_amax("entropy")) == 0.0
    with pytest.raises(UsageError, match="saw no data"):
        HistogramCalibrator().compute_amax("max")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_rejected(bad: float) -> None:
    with pytest.raises(UsageError, match="NaN/inf"):
        HistogramCalibrator().collect(torch.tensor([1.0, bad]), where="layer1.input_quantizer")


def test_entropy_keeps_range_of_coarse_data() -> None:
    """Data with few distinct values (the digits' pixels are k/16) would make KL pick a tiny range."""
    x = torch.randint(0, 17, (10_000,)).float() / 16
    cal = HistogramCalibrator()
    cal.collect(x)
    assert float(cal.compute_amax("entropy")) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("tiny", [1e-4, 1e-9, 1e-30])
def test_histogram_stays_bounded_after_a_near_zero_first_batch(tiny: float) -> None:
    """The first batch sets the bin width; a later batch 1e4-1e30 times larger must coarsen the
    histogram first, not allocate max / width bins (terabytes for 1e-9)."""
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(64, generator=g) * tiny, torch.randn(10_000, generator=g)
    cal = HistogramCalibrator(num_bins=2048)
    cal.collect(first)
    cal.collect(second)
    assert cal.hist.numel() <= 8 * 2048
    assert cal.hist.numel() * cal.width >= float(second.abs().max())  # the range is covered
    assert float(cal.compute_amax("max")) == float(second.abs().max())
    assert float(cal.hist.sum()) == 64 + 10_000
    # reference: numpy's quantile of all the data (the smallest value with cdf >= p, which lies in
    # the bin whose left edge the calibrator returns), within two (coarse) bins
    x = torch.cat([first, second]).abs().numpy()
    for pct in (50.0, 99.0, 99.9):
        ref = float(np.quantile(x, pct / 100, method="inverted_cdf"))
        assert float(cal.compute_amax("percentile", pct)) == pytest.approx(ref, abs=2 * cal.width)
