"""The tile configs of the int8/fp8 convolution kernel (``quant/_triton_conv.py``) and how one is picked, without
Triton (so the table is importable and testable anywhere). ``overdrive::conv2d_q`` takes a config index; engines tune
it per shape at build time (``quant.conv.tune``), other calls take :func:`default_config`.

    >>> CONFIGS[default_config(m=256 * 14 * 14, n_out=256, c=256, taps=9)]
    (128, 256, 128, 8, 3)
"""

from __future__ import annotations

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the candidates build-time tuning times (CONFIGS[i] is config i;
# an engine stores the index, so new configs are appended). The two-stage ones (12-20) are for convolutions with few
# K steps (1x1 over 64-256 channels): there more stages buy no overlap and cost the shared memory that would let a
# second tile's loads run under the first one's epilogue; the 64-wide N tiles are for 64 output channels.
CONFIGS: list[tuple[int, int, int, int, int]] = [
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 128, 4, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 3),
    (128, 128, 128, 4, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 4),
    (64, 256, 64, 4, 4),
    (128, 128, 128, 4, 2),
    (128, 256, 128, 8, 2),
    (128, 64, 128, 4, 2),
    (64, 128, 128, 4, 2),
    (256, 128, 128, 8, 2),
    (128, 64, 64, 4, 3),
    (128, 64, 64, 4, 2),
    (256, 64, 64, 8, 3),
    (128, 128, 64, 4, 2),
    # persistent (PERSISTENT below): a few programs per SM loop over the tiles, the next tile's loads under this one's
    # epilogue; for the layers whose K loop is one or two steps (1x1 over 64-512 channels, often with a residual)
    (64, 128, 128, 4, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 128, 4, 3),
    # the GEMM form (GEMM below: TMA loads, persistent, one program per SM), for plain GEMMs only (1x1 stride-1
    # convolutions, Linear layers): where the convolution form's im2col address math and pointer loads cost most
    (128, 256, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 4, 4),
    (128, 128, 64, 4, 4),
    # two programs per SM: one's epilogue (CUDA cores: an erf GELU, the quantize) runs under the other's MMAs
    (128, 128, 128, 8, 2),
    (128, 128, 128, 4, 2),
]

# config index -> programs per SM of its persistent grid: as many as fit Hopper's 227 KB of shared memory per SM with
# the most any of the kernel's variants takes (compiled offline for sm_90: 80, 128, 176, 72 and 80 KB)
PERSISTENT: dict[int, int] = {21: 2, 22: 1, 23: 1, 24: 3, 25: 2}

# config index -> (epilogue in two column halves, programs per SM) of the GEMM-form configs
GEMM: dict[int, tuple[bool, int]] = {26: (True, 1), 27: (True, 1), 28: (False, 1), 29: (False, 1), 30: (False, 2),
                                     31: (True, 2)}


def candidates(c: int, n_out: int | None = None, gemm: bool = False) -> list[int]:
    """The configs worth timing for ``c`` input channels and ``n_out`` output channels: K tiles of 64 when ``c`` <= 64
    (a 128-wide tile would be half padding), else the 128-wide ones; N tiles no wider than ``n_out`` rounded up to a
    power of two (at least 64), since the rest of a wider tile is padding. ``gemm``: the problem is a plain GEMM
    (a 1x1 convolution with stride 1 and no padding, a Linear layer), so the GEMM-form configs are timed too.

        >>> [i for i in candidates(768, 3072, gemm=True) if i in GEMM]
        [26, 27, 28, 30, 31]
    """
    widest = max(64, 1 << max(0, (n_out or 0) - 1).bit_length()) if n_out else 1 << 30
    return [i for i, cfg in enumerate(CONFIGS) if (cfg[2] == 64) == (c <= 64) and cfg[1] <= widest
            and (gemm or i not in GEMM)]


def default_config(m: int, n_out: int, c: int, taps: int = 1) -> int:
    """A config index for ``m`` output pixels by ``n_out`` channels over ``c`` input channels and ``taps`` kernel
    taps (KH * KW) when none was tuned: the choices the H200 tuning made at ResNet-50's shapes, batch 256
    (``benchmarks/results/lowp_conv.json``, the cfg fields): 64-channel layers on 64-wide K tiles, 64-output layers
    on 64-wide N tiles, two-stage tiles where the K loop has one or two steps, the large tiles elsewhere."""
    if c <= 64:
        return 17 if n_out <= 64 else 20
    if n_out <= 64:
        return 14
    if taps * c <= 256:
        return 15
    if m <= 4096:
        return 6
    return 1 if n_out >= 256 else 2
