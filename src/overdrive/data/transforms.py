"""Per-sample crops, flips and normalization in pure torch (runs on CPU tensors and on the GPU).

Every sample gets its own RandomResizedCrop box and flip (torchvision v2 draws once per call, so a
batched tensor would share one crop). The random numbers are drawn up front from a seeded
generator, independent of image sizes and of which pipeline decodes, so the CPU and GPU pipelines
produce the same crops for the same (seed, epoch, batch).

Two implementations of the same math:
- :func:`transform_one` (reference, CPU pipeline): integer crop, ``F.interpolate`` bilinear
  (align_corners=False, no antialias), flip, normalize.
- :func:`transform_batch` (GPU pipeline): concatenate the batch into one flat buffer, compute every
  sample's source coordinates (the same ones, clamped like interpolate clamps) and gather and blend
  the bilinear neighbours for the whole batch at once.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from overdrive.data.config import LoaderConfig

ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before falling back to a center crop


def batch_generator(seed: int, epoch: int, shard_id: int, batch_index: int) -> torch.Generator:
    """A CPU generator keyed by (seed, epoch, shard, batch): reproducible in any process or thread."""
    key = (((seed * 1_000_003 + epoch) * 1_000_003 + shard_id) * 1_000_003 + batch_index) % (2**63 - 1)
    return torch.Generator().manual_seed(key)


def draw_params(n: int, gen: torch.Generator, flip_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform draws for ``n`` samples: (n, ATTEMPTS, 4) for the crop tries, (n,) bool flips."""
    u = torch.rand(n, ATTEMPTS, 4, generator=gen, dtype=torch.float64)
    flips = torch.rand(n, generator=gen, dtype=torch.float64) < flip_p
    return u, flips


def rrc_boxes(hw: torch.Tensor, u: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float]) -> torch.Tensor:
    """RandomResizedCrop boxes (n, 4) int64 ``(top, left, h, w)`` for images of sizes ``hw`` (n, 2).

    Same rule as torchvision: area ~ U(scale) * H*W, log-aspect ~ U(log ratio); the first of 10 tries
    that fits wins, else a center crop with the aspect clamped to ``ratio``.
    """
    H, W = hw[:, 0:1].double(), hw[:, 1:2].double()  # (n, 1)
    area = H * W * (scale[0] + (scale[1] - scale[0]) * u[..., 0])  # (n, T)
    lr = (math.log(ratio[0]), math.log(ratio[1]))
    aspect = torch.exp(lr[0] + (lr[1] - lr[0]) * u[..., 1])
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    ok = (w > 0) & (h > 0) & (w <= W) & (h <= H)  # (n, T)
    first = torch.where(ok.any(1), ok.double().argmax(1), torch.full_like(ok[:, 0], -1, dtype=torch.long))
    idx = first.clamp(min=0).unsqueeze(1)
    hh, ww = h.gather(1, idx).squeeze(1), w.gather(1, idx).squeeze(1)
    top = torch.floor(u[..., 2].gather(1, idx).squeeze(1) * (H.squeeze(1) - hh + 1))
    left = torch.floor(u[..., 3].gather(1, idx).squeeze(1) * (W.squeeze(1) - ww + 1))
    # fallback: whole image, aspect clamped to ratio, centered
    Hs, Ws = H.squeeze(1), W.squeeze(1)
    in_ratio = Ws / Hs
    fw = torch.where(in_ratio < ratio[0], Ws, torch.where(in_ratio > ratio[1], torch.round(Hs * ratio[1]), Ws))
    fh = torch.where(in_ratio < ratio[0], torch.round(Ws / ratio[0]), Hs)
    fb = first < 0
    hh, ww = torch.where(fb, fh, hh), torch.where(fb, fw, ww)
    top = torch.where(fb, torch.floor((Hs - fh) / 2), top)
    left = torch.where(fb, torch.floor((Ws - fw) / 2), left)
    return torch.stack([top, left, hh, ww], 1).long()


def eval_geometry(hw: torch.Tensor, size: int, crop_fraction: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Resize-shorter-side + center-crop as (resize target R, resized sizes (n, 2), crop offsets (n, 2))."""
    R = int(round(size / crop_fraction))
    H, W = hw[:, 0].double(), hw[:, 1].double()
    short = torch.minimum(H, W)
    rh = torch.where(H <= W, torch.full_like(H, R), torch.floor(R * H / short))  # torchvision Resize(int)
    rw = torch.where(W < H, torch.full_like(W, R), torch.floor(R * W / short))
    rw = torch.where(H == W, torch.full_like(W, R), rw)
    off = torch.stack([torch.round((rh - size) / 2), torch.round((rw - size) / 2)], 1)
    return R, torch.stack([rh, rw], 1), off


def _mean_inv(cfg: LoaderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(3,) mean and 1/std in [0, 255] units; for uint8 output (no normalization) 0 and 1."""
    if cfg.dtype == torch.uint8:
        return torch.zeros(3), torch.ones(3)
    mean, std = torch.tensor(cfg.mean, dtype=torch.float32), torch.tensor(cfg.std, dtype=torch.float32)
    return mean * 255.0, 1.0 / (std * 255.0)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Normalized float values to the output dtype; uint8 rounds to the nearest level (a plain cast truncates: 254.9
    became 254) and saturates to [0, 255], as DALI converts to uint8."""
    return (x.round().clamp(0, 255) if dtype == torch.uint8 else x).to(dtype)


def _normalize(x: torch.Tensor, cfg: LoaderConfig) -> torch.Tensor:
    """(B, 3, S, S) float in [0, 255] -> normalized (uint8: rounded only), in cfg.dtype and memory format."""
    mean, inv = (t.to(x.device).view(1, 3, 1, 1) for t in _mean_inv(cfg))
    x = _cast((x - mean) * inv, cfg.dtype)
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x.contiguous()


def transform_one(img: torch.Tensor, u: torch.Tensor, flip: bool, cfg: LoaderConfig,
                  box: list[int] | None = None) -> torch.Tensor:
    """Reference path for one (3, H, W) uint8 image -> (3, S, S) float32 in [0, 255] (not yet normalized).

    ``box`` (top, left, h, w) may be passed when computed for a whole batch with :func:`rrc_boxes`.
    """
    hw = torch.tensor([[img.shape[1], img.shape[2]]])
    S = cfg.size
    if cfg.train:
        t, l, h, w = box if box is not None else rrc_boxes(hw, u.unsqueeze(0), cfg.scale, cfg.ratio)[0].tolist()
        crop = img[:, t:t + h, l:l + w].contiguous().float().unsqueeze(0)  # contiguous first: only the crop is copied
        out = F.interpolate(crop, size=(S, S), mode="bilinear", align_corners=False, antialias=False)[0]
        return out.flip(-1) if flip else out
    _, rs, off = eval_geometry(hw, S, cfg.crop_fraction)
    rh, rw = int(rs[0, 0]), int(rs[0, 1])
    big = F.interpolate(img.contiguous().float().unsqueeze(0), size=(rh, rw), mode="bilinear", align_corners=False, antialias=False)[0]
    t, l = int(off[0, 0]), int(off[0, 1])
    return big[:, t:t + S, l:l + S]


def finish(batch: torch.Tensor, cfg: LoaderConfig) -> torch.Tensor:
    """Normalize + cast a (B, 3, S, S) [0, 255] float batch (the step both pipelines share)."""
    return _normalize(batch, cfg)


def source_coords(hw: torch.Tensor, u: torch.Tensor, flips: torch.Tensor, cfg: LoaderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Source pixel coordinates (rows ``ys``, columns ``xs``; each (n, S) float64) of every output pixel.

    Output pixel i samples source row ``y = top + (i + 0.5) * h / S - 0.5``, clamped to the crop
    (train) or the image (eval): exactly where ``F.interpolate`` on the crop samples. Flipped
    samples read their columns in reverse.
    """
    S = cfg.size
    n = hw.shape[0]
    ar = torch.arange(S, dtype=torch.float64) + 0.5  # (S,)
    if cfg.train:
        box = rrc_boxes(hw, u, cfg.scale, cfg.ratio).double()  # (n, 4) top, left, h, w
        ys = box[:, 0:1] + ar * box[:, 2:3] / S - 0.5  # (n, S)
        xs = box[:, 1:2] + ar * box[:, 3:4] / S - 0.5
        ys = torch.minimum(torch.maximum(ys, box[:, 0:1]), box[:, 0:1] + box[:, 2:3] - 1)
        xs = torch.minimum(torch.maximum(xs, box[:, 1:2]), box[:, 1:2] + box[:, 3:4] - 1)
        xs = torch.where(flips.view(n, 1), xs.flip(1), xs)
    else:
        _, rs, off = eval_geometry(hw, S, cfg.crop_fraction)
        sy, sx = rs[:, 0:1] / hw[:, 0:1].double(), rs[:, 1:2] / hw[:, 1:2].double()  # resize factors (n, 1)
        ys = (ar + off[:, 0:1]) / sy - 0.5
        xs = (ar + off[:, 1:2]) / sx - 0.5
        ys = ys.clamp(min=0).minimum(hw[:, 0:1].double() - 1)
        xs = xs.clamp(min=0).minimum(hw[:, 1:2].double() - 1)
    return ys, xs


def _blend(flat: torch.Tensor, base: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, wy: torch.Tensor,
           wx: torch.Tensor, mean: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    """Bilinear gather-and-blend of every output pixel from the flat image buffer, then normalize.

    flat (L,) uint8; base (n, 3) channel starts; rows/cols (2, n, S) offsets of the two neighbour
    rows (already times the width) and columns; wy/wx (n, S) blend weights; mean/inv (3,) in [0, 255]
    units. Written as one expression so that torch.compile makes it a single kernel; channels_last
    computes the (n, S, S, 3) layout directly.
    """
    if channels_last:  # dims (n, i, j, c)
        b, r0, r1 = base[:, None, None, :], rows[0][:, :, None, None], rows[1][:, :, None, None]
        c0, c1 = cols[0][:, None, :, None], cols[1][:, None, :, None]
        wy_, wx_, m, v = wy[:, :, None, None], wx[:, None, :, None], mean, inv
    else:  # dims (n, c, i, j)
        b, r0, r1 = base[:, :, None, None], rows[0][:, None, :, None], rows[1][:, None, :, None]
        c0, c1 = cols[0][:, None, None, :], cols[1][:, None, None, :]
        wy_, wx_, m, v = wy[:, None, :, None], wx[:, None, None, :], mean[:, None, None], inv[:, None, None]

    def at(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return flat[b + r + c].float()

    top = torch.lerp(at(r0, c0), at(r0, c1), wx_)
    bottom = torch.lerp(at(r1, c0), at(r1, c1), wx_)
    out = _cast((torch.lerp(top, bottom, wy_) - m) * v, dtype)
    return out.permute(0, 3, 1, 2) if channels_last else out


_FUSED_FN: list[Any] = []  # _blend compiled, made on first use (torch.compile stays out of import time)
_FUSED_WARM: set[tuple[str, torch.dtype, bool]] = set()  # (device, dtype, layout) variants compiled already
_FUSED_LOCK = threading.Lock()


def _fused_blend(key: tuple[str, torch.dtype, bool], *args: Any) -> torch.Tensor:
    """``_blend`` compiled once per process (dynamic shapes: the buffer length changes every batch). The first
    call of each variant compiles under a lock, one thread at a time (loaders run several threads)."""
    if key in _FUSED_WARM:
        return _FUSED_FN[0](*args)
    with _FUSED_LOCK:
        if not _FUSED_FN:
            _FUSED_FN.append(torch.compile(_blend, dynamic=True, fullgraph=True))
        out = _FUSED_FN[0](*args)
        _FUSED_WARM.add(key)
        return out


def transform_batch(images: list[torch.Tensor], u: torch.Tensor, flips: torch.Tensor, cfg: LoaderConfig,
                    fused: bool = False) -> torch.Tensor:
    """Batched path: list of (3, H_i, W_i) uint8 images (any device) -> (B, 3, S, S) normalized batch.

    A fixed number of kernels whatever the batch size (a per-image loop costs a launch per image,
    which at batch 256 was a fifth of the GPU pipeline's time): the images are concatenated into one
    flat buffer, every output pixel's four bilinear neighbours are gathered from it by index, and
    blended with the weights ``F.interpolate`` uses. ``fused=True`` runs the gather-blend-normalize
    as one torch.compile'd kernel (the GPU pipeline's default: its eager form writes and reads
    ~1.5 GB of index and float temporaries per batch of 256 at 224x224, GPU time taken from training).

    Example:
        >>> imgs = [torch.randint(0, 256, (3, 40, 60), dtype=torch.uint8) for _ in range(4)]
        >>> u, f = draw_params(4, torch.Generator().manual_seed(0), 0.5)
        >>> transform_batch(imgs, u, f, LoaderConfig(size=32)).shape
        torch.Size([4, 3, 32, 32])
    """
    device = images[0].device
    hw = torch.tensor([[im.shape[1], im.shape[2]] for im in images])  # (n, 2)
    ys, xs = source_coords(hw, u, flips, cfg)  # (n, S) float64, inside each image
    y0, x0 = ys.floor(), xs.floor()
    H, W = hw[:, 0:1], hw[:, 1:2]
    y1 = torch.minimum(y0.long() + 1, H - 1)  # the neighbour past the last row/column has weight 0
    x1 = torch.minimum(x0.long() + 1, W - 1)
    plane = hw[:, 0] * hw[:, 1]  # (n,)
    base = (torch.cumsum(3 * plane, 0) - 3 * plane)[:, None] + torch.arange(3) * plane[:, None]  # (n, 3) channel starts
    small = torch.stack([y0.long() * W, y1 * W, x0.long(), x1]).to(device, non_blocking=True)  # (4, n, S)
    wts = torch.stack([ys - y0, xs - x0]).float().to(device, non_blocking=True)  # (2, n, S)
    mean, inv = _mean_inv(cfg)
    flat = torch.cat([im.reshape(-1) for im in images])  # one buffer, uint8
    args = (flat, base.to(device, non_blocking=True), small[0:2], small[2:4], wts[0], wts[1], mean.to(device),
            inv.to(device), cfg.dtype, cfg.channels_last)
    out = _fused_blend((str(device), cfg.dtype, cfg.channels_last), *args) if fused else _blend(*args)
    return out if cfg.channels_last else out.contiguous()


def reference_batch(images: list[torch.Tensor], u: torch.Tensor, flips: torch.Tensor, cfg: LoaderConfig) -> torch.Tensor:
    """The reference path over a batch (what the CPU pipeline computes), for tests and the CPU loader."""
    out = torch.stack([transform_one(im, u[i], bool(flips[i]), cfg) for i, im in enumerate(images)])
    return finish(out, cfg)
