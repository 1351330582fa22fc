"""The ONNX ops of overdrive's importer that sample images at computed positions: GridSample (spatial transformers,
optical-flow warping, deformable-DETR-style attention; ``F.grid_sample`` exports to it) and RoiAlign (the box
heads of two-stage detectors: Faster / Mask R-CNN), both as gathers and weighted sums that ``torch.export`` traces.

Example:
    >>> sorted(OPS)
    ['GridSample', 'RoiAlign']
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor

# ONNX GridSample mode -> F.grid_sample's; opset 16 names them bilinear / bicubic, opset 20 linear / cubic
_GRID_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}
_GRID_PADS = ("zeros", "border", "reflection")


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _grid_sample(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """GridSample(X (N, C, H, W) or (N, C, D, H, W), grid (N, H_out, W_out, 2) of (x, y) in [-1, 1]) as
    ``F.grid_sample``, whose modes, paddings and ``align_corners`` are ONNX's; cubic is 2-D only, as in PyTorch.

    Example:
        >>> x, grid = torch.arange(4.0).reshape(1, 1, 2, 2), torch.zeros(1, 1, 1, 2)
        >>> _grid_sample(None, [x, grid], {"align_corners": 1})[0]
        tensor([[[[1.5000]]]])
    """
    x = _tensor(ins[0])
    grid = _tensor(ins[1], x)
    mode, pad = _text(a.get("mode", "bilinear")), _text(a.get("padding_mode", "zeros"))
    if mode not in _GRID_MODES:
        raise UsageError(f"GridSample mode={mode!r} is not an ONNX mode; expected one of {sorted(_GRID_MODES)}")
    if pad not in _GRID_PADS:
        raise UsageError(f"GridSample padding_mode={pad!r} is not an ONNX padding mode; expected one of {_GRID_PADS}")
    if x.dim() not in (4, 5) or (x.dim() == 5 and _GRID_MODES[mode] == "bicubic"):
        raise UsageError(f"GridSample mode={mode!r} on a {x.dim()}-D input is not supported by the ONNX importer; "
                         "supported: 4-D inputs in every mode, 5-D in linear and nearest; re-export with those")
    return [F.grid_sample(x, grid.to(x.dtype), mode=_GRID_MODES[mode], padding_mode=pad,
                          align_corners=bool(a.get("align_corners", 0)))]


def _roi_axis(start: torch.Tensor, size: torch.Tensor, bins: int, grid: int, n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample positions of RoiAlign along one axis, ONNX Runtime's way: ``bins * grid`` points per box, evenly inside
    each bin; a point beyond [-1, n] is invalid (it reads zeros), one in [-1, 0] reads the edge. Returns the low and
    high input indices (R, bins * grid), the weight of the high one, and the validity mask."""
    step = size / bins  # (R,)
    k = torch.arange(bins * grid, device=start.device)
    b, g = (k // grid).to(start.dtype), (k % grid).to(start.dtype)
    pos = start[:, None] + b * step[:, None] + (g + 0.5) * step[:, None] / grid  # (R, bins * grid)
    valid = (pos >= -1.0) & (pos <= n)
    pos = pos.clamp(min=0)
    low = pos.floor().long()
    edge = low >= n - 1  # at or past the last row: both neighbours are it, read exactly
    low = torch.where(edge, n - 1, low)
    high = torch.where(edge, low, low + 1)
    frac = torch.where(edge, 0.0, pos - low.to(pos.dtype))
    return low, high, frac, valid


def _roi_align(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """RoiAlign(X (N, C, H, W), rois (R, 4) as x1, y1, x2, y2, batch_indices (R,)) -> (R, C, out_h, out_w): each
    bin the mean (``mode`` avg) or the max (``max``, of the four weighted corner values, as ONNX Runtime computes
    it) of ``sampling_ratio``**2 bilinear samples. ``coordinate_transformation_mode`` half_pixel (the default from
    opset 16) shifts boxes by half a pixel; output_half_pixel (opset 10's only mode) keeps them and makes them at
    least one pixel. ``sampling_ratio=0`` (a sample count per box, from its size) has data-dependent shapes: refused.

    Example:
        >>> x = torch.arange(16.0).reshape(1, 1, 4, 4)
        >>> rois, b = torch.tensor([[0.0, 0.0, 4.0, 4.0]]), torch.tensor([0])
        >>> _roi_align(None, [x, rois, b], {"output_height": 1, "output_width": 1, "sampling_ratio": 2,
        ...                                 "coordinate_transformation_mode": b"half_pixel"})[0]
        tensor([[[[7.5000]]]])
    """
    x = _tensor(ins[0])
    rois = _tensor(ins[1], x).to(x.dtype)
    batch = _tensor(ins[2], x).long()
    ph, pw = int(a.get("output_height", 1)), int(a.get("output_width", 1))
    ratio, scale = int(a.get("sampling_ratio", 0)), float(a.get("spatial_scale", 1.0))
    mode = _text(a.get("mode", "avg"))
    default = "half_pixel" if getattr(m, "opset", 16) >= 16 else "output_half_pixel"
    ctm = _text(a.get("coordinate_transformation_mode", default))
    if mode not in ("avg", "max") or ctm not in ("half_pixel", "output_half_pixel"):
        raise UsageError(f"RoiAlign mode={mode!r}, coordinate_transformation_mode={ctm!r} is not an ONNX "
                         "combination; expected mode avg or max, and half_pixel or output_half_pixel")
    if ratio <= 0:
        raise UsageError(f"RoiAlign sampling_ratio={ratio} (adaptive: ceil(box size / output size) samples per bin, "
                         "a count that depends on the boxes' values) is not supported by the ONNX importer, whose "
                         "shapes are fixed when the graph is built; re-export with sampling_ratio > 0 (torchvision's "
                         "RoIAlign(sampling_ratio=2), as Mask R-CNN uses), or use --backend onnxruntime")
    n, c, h, w = x.shape
    off = 0.5 if ctm == "half_pixel" else 0.0
    box = rois * scale - off  # (R, 4)
    width, height = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
    if ctm == "output_half_pixel":  # opset 10: boxes at least one pixel
        width, height = width.clamp(min=1.0), height.clamp(min=1.0)
    y0, y1, fy, vy = _roi_axis(box[:, 1], height, ph, ratio, h)  # (R, ph * ratio)
    x0, x1, fx, vx = _roi_axis(box[:, 0], width, pw, ratio, w)  # (R, pw * ratio)
    rows = x.permute(0, 2, 3, 1).reshape(n * h * w, c)  # one row per pixel: a gather picks (R, Sy, Sx) pixels
    base = batch[:, None, None] * (h * w)  # (R, 1, 1)
    valid = (vy[:, :, None] & vx[:, None, :]).to(x.dtype)  # (R, Sy, Sx): a sample outside reads zeros

    def corner(yi: torch.Tensor, xi: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        idx = base + yi[:, :, None] * w + xi[:, None, :]  # (R, Sy, Sx)
        return rows[idx.reshape(-1)].reshape(*idx.shape, c) * (wt * valid)[..., None]  # (R, Sy, Sx, C)

    wy0, wx0 = 1 - fy[:, :, None], 1 - fx[:, None, :]
    wy1, wx1 = fy[:, :, None], fx[:, None, :]
    parts = [corner(y0, x0, wy0 * wx0), corner(y0, x1, wy0 * wx1), corner(y1, x0, wy1 * wx0), corner(y1, x1, wy1 * wx1)]
    r = rois.shape[0]
    if mode == "avg":
        out = (parts[0] + parts[1] + parts[2] + parts[3]).reshape(r, ph, ratio, pw, ratio, c).sum(dim=(2, 4))
        out = out / (ratio * ratio)
    else:
        best = torch.maximum(torch.maximum(parts[0], parts[1]), torch.maximum(parts[2], parts[3]))
        out = best.reshape(r, ph, ratio, pw, ratio, c).amax(dim=(2, 4))
    return [out.permute(0, 3, 1, 2)]  # (R, C, ph, pw)


OPS: dict[str, Op] = {"GridSample": _grid_sample, "RoiAlign": _roi_align}
