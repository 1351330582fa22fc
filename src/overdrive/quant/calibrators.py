"""Calibrators: turn observed activations into an ``amax`` (the clipping range).

One calibration pass feeds a :class:`HistogramCalibrator` (which also tracks the exact max); every
method (max, percentile, entropy, MSE) is then computed from the stored histogram without running
data again, which is what makes ``compare_calibrators`` cheap.

Example:
    >>> import torch
    >>> cal = HistogramCalibrator(num_bins=2048)
    >>> cal.collect(torch.randn(10000))
    >>> bool(3.0 < cal.compute_amax("max") < 5.0 and cal.compute_amax("percentile", 99.0) < cal.compute_amax("max"))
    True
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from overdrive._utils.errors import UsageError

_MAX_BINS_FACTOR = 8  # the histogram may grow to this many times num_bins before it is coarsened
MODELOPT_MAX_BINS_FACTOR = 128  # the same for the ModelOpt / pytorch-quantization faces (see HistogramCalibrator)


def _check_finite(x: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise UsageError(
            f"calibration data reaching {where} has {bad} NaN/inf value(s) out of {x.numel()}; clean the calibration "
            "batches (or fix the layer producing them) before calibrating"
        )


class MaxCalibrator:
    """Running max of |x|, per tensor (``axis=None``) or per channel along ``axis``."""

    def __init__(self, axis: int | None = None) -> None:
        self.axis = axis
        self.amax: torch.Tensor | None = None

    def collect(self, x: torch.Tensor, where: str = "a quantizer") -> None:
        x = x.detach().float()
        _check_finite(x, where)
        if self.axis is None:
            m = x.abs().amax()
        else:
            dims = [d for d in range(x.dim()) if d != self.axis % x.dim()]
            m = x.abs().amax(dim=dims) if dims else x.abs()
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)

    def compute_amax(self, method: str = "max", percentile: float | None = None) -> torch.Tensor:
        if self.amax is None:
            raise UsageError("the calibrator saw no data; run the forward loop over at least one batch first")
        return self.amax.clone()


class HistogramCalibrator:
    """Histogram of |x| with fixed bin width that grows as larger values arrive (one pass).

    ``compute_amax`` supports ``max``, ``percentile`` (e.g. 99.99), ``entropy`` (TensorRT's KL
    divergence search over 128-level quantizations of the reference distribution) and ``mse``.
    """

    def __init__(self, num_bins: int = 2048, bound: float = 127.0, max_bins: int | None = None) -> None:
        self.num_bins = num_bins
        # coarsening starts beyond this many bins (default 8x num_bins); the ModelOpt and pytorch-quantization faces
        # allow 128x (MODELOPT_MAX_BINS_FACTOR), so their bins stay the originals' (which never coarsen) while the
        # data grows up to 128x the first batch's max
        self.max_bins = _MAX_BINS_FACTOR * num_bins if max_bins is None else max(int(max_bins), num_bins)
        self.bound = bound  # 127 for int8, 448 for fp8 (the MSE search simulates this format)
        self.hist: torch.Tensor | None = None  # (bins,) float64 counts
        self.width = 0.0
        self.max = 0.0

    def collect(self, x: torch.Tensor, where: str = "a quantizer") -> None:
        x = x.detach().float().abs().flatten()
        _check_finite(x, where)
        xmax = float(x.max()) if x.numel() else 0.0
        self.max = max(self.max, xmax)
        if self.hist is None:
            if xmax == 0.0:
                self._zeros = getattr(self, "_zeros", 0) + x.numel()  # all-zero so far: no width to choose yet
                return
            self.width = xmax / self.num_bins
            self.hist = torch.zeros(self.num_bins, dtype=torch.float64)
            zeros = getattr(self, "_zeros", 0)
            self.hist[0] += zeros
        needed = max(int(np.ceil(xmax / self.width)) if xmax > 0 else 0, self.hist.numel())
        # Coarsen before growing: merging bin pairs k times (width * 2^k) until at most
        # _MAX_BINS_FACTOR * num_bins bins cover xmax. Growing first would allocate xmax / width bins
        # at once: terabytes when a near-zero first batch set a tiny width.
        factor = 1
        while needed > getattr(self, "max_bins", _MAX_BINS_FACTOR * self.num_bins):  # (pickles from before it)
            needed = -(-needed // 2)  # ceil: an odd count gets a zero bin before merging pairs
            factor *= 2
        if factor > 1:  # merge blocks of `factor` bins (zero-padded): the same as merging pairs k times
            h = self.hist
            if factor >= h.numel():  # the whole old range falls into the first new bin
                self.hist = h.sum().reshape(1)
            else:
                pad = -h.numel() % factor
                if pad:
                    h = torch.cat([h, h.new_zeros(pad)])
                self.hist = h.view(-1, factor).sum(1)
            self.width *= factor
        if needed > self.hist.numel():
            self.hist = torch.cat([self.hist, torch.zeros(needed - self.hist.numel(), dtype=torch.float64)])
        n = self.hist.numel()
        self.hist += torch.histc(x, bins=n, min=0.0, max=n * self.width).double().cpu()  # hist lives on the CPU

    # --- methods, all from the stored histogram -----------------------------------------------
    def compute_amax(self, method: str = "max", percentile: float | None = None, *, stride: int = 1,
                     start_bin: int = 128) -> torch.Tensor:
        """amax by ``method`` from the stored histogram. ``stride`` / ``start_bin``: the entropy and MSE searches
        try every ``stride``-th bin from ``start_bin`` on, as pytorch-quantization's ``compute_amax``.

        Example:
            >>> cal = HistogramCalibrator(num_bins=100)
            >>> cal.collect(torch.arange(1.0, 101.0))  # one value per bin, width 1
            >>> float(cal.compute_amax("percentile", 50.0))  # the left edge of the bin where the cdf reaches 50%
            50.0
        """
        for name, v, low in (("stride", stride, 1), ("start_bin", start_bin, 1)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
                raise UsageError(f"compute_amax {name}={v!r} must be an integer >= {low} (defaults: stride=1, "
                                 "start_bin=128)")
        if self.hist is None:
            if getattr(self, "_zeros", 0):
                return torch.tensor(0.0)  # all-zero activations: amax 0 (the quantizer guards the division)
            raise UsageError("the calibrator saw no data; run the forward loop over at least one batch first")
        if method == "max":
            return torch.tensor(self.max)
        hist = self.hist.numpy()
        if method == "percentile":
            p = 99.99 if percentile is None else percentile
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 100.0:
                # 200 would silently mean max; quant.calibrate / load_calib_amax also refuse <= 50 (a fraction)
                raise UsageError(f"percentile {p!r} must be a number in [0, 100], a percent such as 99.99")
            # As pytorch-quantization's _compute_amax_percentile: the first bin whose cdf reaches p, and amax that
            # bin's LEFT edge (bin_edges[idx]); the cdf summed from normalised counts, so a p that the cdf meets
            # exactly picks the same bin as there. (Earlier: the right edge, one bin larger.) One departure: when
            # bin 0 already holds p of the data (a few huge outliers), its left edge would be amax 0, quantizing
            # every value to 0; its right edge is taken instead (and the quantizer's outlier warning says why).
            cdf = np.cumsum(hist / hist.sum())
            idx = min(int(np.searchsorted(cdf, p / 100.0)), hist.size)
            return torch.tensor(float(min(max(idx, 1) * self.width, self.max)))
        if method == "entropy":
            return torch.tensor(float(_entropy_amax(hist, self.width, stride=stride, start_bin=start_bin)))
        if method == "mse":
            return torch.tensor(float(_mse_amax(hist, self.width, self.bound, stride=stride, start_bin=start_bin)))
        raise UsageError(f"calibration method {method!r} is not one of max, percentile, entropy, mse")


def _entropy_amax(hist: np.ndarray, width: float, num_quant_bins: int = 128, stride: int = 1,
                  start_bin: int = 128) -> float:
    """TensorRT's entropy calibration: the clipping bin i minimising KL(P_i || Q_i).

    P_i is hist[:i] with the clipped tail folded into its last bin; Q_i merges hist[:i] into 128
    levels and spreads each level's mass evenly over the level's non-empty bins (pytorch-quantization's algorithm,
    detailed below).
    """
    hist = hist.copy()
    nbins = hist.size
    if nbins <= num_quant_bins or np.count_nonzero(hist[1:]) <= num_quant_bins:
        # Already coarse data (e.g. 8x8 digit pixels take 17 values): any clipping bin whose levels
        # cover the non-empty bins has KL 0, so the search is degenerate; keep the full range.
        return nbins * width
    # As pytorch-quantization's _compute_amax_entropy (TensorRT's calibration, which users compare against): bin 0
    # (the exact zeros after a ReLU) counts as bin 1; each candidate i >= 128 bins merges bins[:i] into 128 levels
    # (bin j to level floor(128 j / i)), spreads each level's mass evenly over its non-empty bins, and is scored by
    # KL(P || Q) with P the first i bins and the clipped tail folded into the last; the last minimum wins and amax is
    # the left edge of bin i. (This package's earlier search merged with truncated linspace edges and took the first
    # minimum at the bin's middle: up to 11.5% larger amax on ReLU outputs.)
    hist[0] = hist[1]
    total_tail = np.cumsum(hist[::-1])[::-1]  # total_tail[i] = sum(hist[i:])
    kls = []
    cands = list(range(min(start_bin, nbins), nbins + 1, stride))
    for i in cands:
        h = hist[:i]
        nonzero = h != 0
        level = (np.arange(i) * num_quant_bins) // i
        sums = np.bincount(level[nonzero], weights=h[nonzero], minlength=num_quant_bins)
        counts = np.bincount(level[nonzero], minlength=num_quant_bins)
        q = np.where(nonzero, sums[level] / np.maximum(counts[level], 1), 0.0)
        p = h.copy()
        if i < nbins:
            p[i - 1] += total_tail[i]
        ps, qs = p.sum(), q.sum()
        if ps == 0 or qs == 0:
            kls.append(np.inf)
            continue
        pn, qn = p / ps, q / qs
        m = pn > 0
        if np.any(qn[m] == 0):  # mass P has where Q has none: infinite divergence (scipy's entropy gives inf)
            kls.append(np.inf)
            continue
        kls.append(float(np.sum(pn[m] * np.log(pn[m] / qn[m]))))
    arr = np.array(kls)
    if not np.isfinite(arr).any():
        return nbins * width
    best = len(arr) - 1 - int(np.argmin(arr[::-1]))  # the last minimum, as pytorch-quantization
    return cands[best] * width


def _mse_amax(hist: np.ndarray, width: float, bound: float, stride: int = 1, start_bin: int = 128) -> float:
    """pytorch-quantization's (and ModelOpt's) MSE search: the candidates are the bin centres from ``start_bin`` on
    (every ``stride``-th, as there); each quantizes every bin centre symmetrically
    (``bound`` levels, int8's narrow range [-127, 127] or fp8 e4m3), and the count-weighted squared error picks
    the first minimum. (Earlier: 256 evenly spaced candidates, up to 4 bins off the original's choice.)"""
    centers = (np.arange(hist.size) + 0.5) * width
    cands = centers[start_bin::stride] if hist.size > start_bin else centers  # a short histogram: every centre
    best, best_err = float(centers[-1]), np.inf
    for amax in cands:
        scale = amax / bound
        if bound == 127.0:
            q = np.clip(np.round(centers / scale), -bound, bound) * scale
        else:  # fp8 e4m3: round through the real format
            t = torch.from_numpy(np.clip(centers / scale, -bound, bound)).float()
            q = t.to(torch.float8_e4m3fn).double().numpy() * scale
        err = float(np.sum(hist * (centers - q) ** 2))
        if err < best_err:
            best_err, best = err, float(amax)
    return best
