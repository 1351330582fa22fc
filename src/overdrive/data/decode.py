"""Decoding: Pillow on CPU (any format), nvJPEG on the GPU (baseline JPEG), with a CPU fallback.

torchvision is imported lazily and only for the GPU path, so the CPU pipeline needs Pillow alone.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from overdrive._utils.errors import OverdriveError
from overdrive._utils.optional import require


class DecodeError(OverdriveError):
    """An image could not be decoded (corrupt, truncated, or not an image)."""


@dataclass(frozen=True)
class JpegInfo:
    is_jpeg: bool
    progressive: bool = False
    components: int = 0
    complete: bool = False  # ends with the EOI marker (FFD9): not truncated

    @property
    def gpu_ok(self) -> bool:
        """Baseline/extended JPEG with 1 (gray) or 3 (YCbCr) components, not truncated: nvJPEG's safe case."""
        return self.is_jpeg and not self.progressive and self.components in (1, 3) and self.complete


def jpeg_info(data: bytes) -> JpegInfo:
    """Read the JPEG markers up to the frame header (SOFn): progressive? how many components?"""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return JpegInfo(False)
    complete = data[-2:] == b"\xff\xd9" or (data[-1] == 0 and data.rstrip(b"\x00")[-2:] == b"\xff\xd9")
    i = 2
    n = len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return JpegInfo(True, complete=False)  # malformed: let the CPU decoder judge it
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        seg = (data[i + 2] << 8) | data[i + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            comps = data[i + 9] if i + 9 < n else 0
            # "progressive" here: anything but Huffman sequential (SOF0/1): progressive or arithmetic coded
            return JpegInfo(True, progressive=marker in (0xC2, 0xC6, 0xCA, 0xCE) or marker >= 0xC9,
                            components=comps, complete=complete)
        i += 2 + seg
    return JpegInfo(True, complete=False)


def _gray_to_rgb8(a: np.ndarray, mode: str) -> np.ndarray:
    """A 16/32-bit integer or float gray image as 8-bit RGB, scaled, not clipped: Pillow's convert("RGB") clipped
    every value above 255 to white (a 16-bit PNG at half gray came out 255). Integers are read as 16-bit (the
    PNG/TIFF depth behind Pillow's I;16 and I modes): 0..65535 -> 0..255; floats as 0..1 (values outside clipped)."""
    a = a.astype(np.float64)
    if mode.startswith("F"):
        g = np.clip(a, 0.0, 1.0) * 255.0
    else:
        g = np.clip(a, 0.0, 65535.0) / 257.0  # 65535 -> 255, 32768 -> 127.5
    g = np.rint(g).astype(np.uint8)
    return np.repeat(g[..., None], 3, axis=2)


EXIF_ORIENTATION = 0x0112  # the EXIF tag: 1 = stored upright, 2-8 = mirrored and/or rotated


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) of an encoded image; 1 (upright) when it has none or it cannot be read.

    Example:
        >>> exif_orientation(b"not an image")
        1
    """
    Image = require("PIL.Image", extra="vision", feature="CPU image decoding")
    try:
        with Image.open(io.BytesIO(data)) as im:  # headers only: the pixels are not decoded
            return _orientation(im)
    except Exception:  # not an image: the decoder judges the file
        return 1


def _orientation(im: object) -> int:
    """An open Pillow image's EXIF orientation, 1 when absent, out of range or unreadable (a broken EXIF block
    leaves the pixels as stored rather than losing the image)."""
    try:
        value = im.getexif().get(EXIF_ORIENTATION, 1)  # type: ignore[attr-defined]
    except Exception:
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def decode_cpu(data: bytes, apply_exif_orientation: bool = False) -> torch.Tensor:
    """Any Pillow-readable image -> (3, H, W) uint8 RGB (grayscale, palette, RGBA and CMYK converted).

    ``apply_exif_orientation=True`` turns the image upright as its EXIF orientation tag says (what
    ``PIL.ImageOps.exif_transpose`` and torchvision's ``decode_image(..., apply_exif_orientation=True)`` do);
    the default leaves the pixels as stored, as torchvision's default and its ImageFolder loader do.
    Raises :class:`DecodeError` for corrupt or truncated data.

    Example:
        >>> # decode_cpu(open("cat.jpg", "rb").read()).shape -> torch.Size([3, H, W])
    """
    Image = require("PIL.Image", extra="vision", feature="CPU image decoding")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # raises on truncated data (LOAD_TRUNCATED_IMAGES stays False)
            if apply_exif_orientation and _orientation(im) != 1:
                from PIL import ImageOps

                im = ImageOps.exif_transpose(im)  # a new, upright image (the file's one is closed on exit)
            if im.mode.startswith(("I", "F")):  # 16-bit and 32-bit gray (depth maps, scans), float gray
                arr = _gray_to_rgb8(np.asarray(im), im.mode)
            else:
                rgb = im.convert("RGB") if im.mode != "RGB" else im
                arr = np.asarray(rgb)
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... for bad files
        # Pillow names the buffer it was given ("cannot identify image file <_io.BytesIO object at 0x7f...>"): the
        # caller names the file, so the address is dropped
        why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc))
        raise DecodeError(f"cannot decode image ({type(exc).__name__}: {why})") from exc
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)  # (3, H, W), a view over HWC memory


def gpu_decodable(data: bytes, apply_exif_orientation: bool = False) -> bool:
    """Whether nvJPEG decodes ``data`` as the CPU path would: a safe JPEG (:attr:`JpegInfo.gpu_ok`) and, when
    EXIF orientation is applied, stored upright (a rotated one goes to the CPU, which turns it)."""
    return jpeg_info(data).gpu_ok and not (apply_exif_orientation and exif_orientation(data) != 1)


def decode_gpu(datas: Sequence[bytes | torch.Tensor], device: torch.device,
               gpu_ok: Sequence[bool] | None = None,
               apply_exif_orientation: bool = False) -> tuple[list[torch.Tensor | None], int]:
    """Batched nvJPEG decode of the GPU-safe JPEGs; the rest (PNG, CMYK, progressive, truncated,
    or anything nvJPEG rejects) decode on the CPU and are copied over.

    ``datas`` are encoded images as bytes or 1-D uint8 CPU tensors; ``gpu_ok`` (from
    :func:`gpu_decodable`, when the caller parsed the headers already) saves parsing them again. With
    ``apply_exif_orientation`` a JPEG whose EXIF tag says it is rotated decodes on the CPU, turned upright.
    Returns ((3, H, W) uint8 tensors on ``device``, None where the image is corrupt) and the number
    that fell back to the CPU.
    """
    tv_io = require("torchvision.io", extra="vision", feature="GPU JPEG decoding")

    def raw(d: bytes | torch.Tensor) -> bytes:
        return d if isinstance(d, (bytes, bytearray)) else d.numpy().tobytes()

    out: list[torch.Tensor | None] = [None] * len(datas)
    ok = list(gpu_ok) if gpu_ok is not None else [gpu_decodable(raw(d), apply_exif_orientation) for d in datas]
    gpu_idx = [i for i in range(len(datas)) if ok[i]]
    cpu_idx = [i for i in range(len(datas)) if not ok[i]]
    if gpu_idx:
        tensors = [datas[i] if isinstance(datas[i], torch.Tensor) else torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8)
                   for i in gpu_idx]
        try:
            decoded = tv_io.decode_jpeg(tensors, mode=tv_io.ImageReadMode.RGB, device=device)
            for i, img in zip(gpu_idx, decoded):
                out[i] = img
        except Exception:  # nvJPEG rejected something in the batch (torchvision raises RuntimeError or ValueError)
            for i, t in zip(gpu_idx, tensors):  # find the offender(s) one by one
                try:
                    out[i] = tv_io.decode_jpeg(t, mode=tv_io.ImageReadMode.RGB, device=device)
                except Exception:
                    cpu_idx.append(i)
    for i in cpu_idx:
        try:
            out[i] = decode_cpu(raw(datas[i]), apply_exif_orientation).to(device, non_blocking=False)
        except DecodeError:
            out[i] = None
    return out, len(cpu_idx)
