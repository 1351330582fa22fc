"""2:4 mask calculators on weight matrices, and the weight <-> matrix layout apex uses.

A weight is pruned as a matrix (rows, in) with groups of 4 consecutive entries along ``in`` (the
reduction dimension of the GEMM, which is what sparse tensor cores compress). Conv weights
(O, I, *k) are laid out as (O * prod(k), I): groups of 4 run along input channels, as apex does.
"""

from __future__ import annotations

import functools
import itertools

import torch

from overdrive._utils.errors import UsageError


def to_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(O, I) -> (O, I); conv (O, I, *k) -> (O * prod(k), I) with input channels last."""
    if weight.dim() < 2:
        raise UsageError(f"2:4 sparsity applies to weights of 2 or more dims (out, in, *kernel), got shape "
                         f"{tuple(weight.shape)}; pass a Linear or Conv weight")
    if weight.dim() == 2:
        return weight
    return weight.movedim(1, -1).reshape(-1, weight.shape[1])


def from_matrix(matrix: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`to_matrix` for a weight of ``shape``."""
    if len(shape) == 2:
        return matrix.reshape(shape)
    o, i, *k = shape
    return matrix.reshape(o, *k, i).movedim(-1, 1)


def m4n2_1d(matrix: torch.Tensor) -> torch.Tensor:
    """Boolean mask keeping the 2 largest |w| of every 4 consecutive entries along dim 1.

    Example:
        >>> m4n2_1d(torch.tensor([[1., -4., 3., 2.]])).tolist()
        [[False, True, True, False]]
    """
    _check_cols(matrix)
    rows, cols = matrix.shape
    groups = matrix.detach().abs().float().reshape(rows, cols // 4, 4)
    # Ties broken by position (stable), so the same weights always get the same mask.
    idx = torch.topk(groups, 2, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(rows, cols)


@functools.lru_cache(maxsize=None)
def _patterns_2d(device: str) -> torch.Tensor:
    """All 90 4x4 0/1 patterns with exactly 2 ones in every row and column, as (90, 16) floats."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
    pats = []
    for choice in itertools.product(rows, repeat=4):
        block = torch.tensor(choice, dtype=torch.float32)
        if bool((block.sum(0) == 2).all()):
            pats.append(block.reshape(16))
    return torch.stack(pats).to(device)


def _blocks(matrix: torch.Tensor) -> torch.Tensor:
    """(R, C) -> (R/4 * C/4, 16) 4x4 blocks, row-major inside each block."""
    r, c = matrix.shape
    return matrix.reshape(r // 4, 4, c // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def _unblocks(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    r, c = shape
    return blocks.reshape(r // 4, c // 4, 4, 4).permute(0, 2, 1, 3).reshape(r, c)


def m4n2_2d_best(matrix: torch.Tensor) -> torch.Tensor:
    """Transposable 2:4 mask: in every 4x4 block, the 2-per-row-and-column pattern of largest |w|.

    Exhaustive over the 90 valid patterns (one matmul), so it is optimal per block.
    """
    _check_cols(matrix)
    _check_rows(matrix)
    mag = _blocks(matrix.detach().abs().float())  # (nblocks, 16)
    pats = _patterns_2d(str(matrix.device))
    best = (mag @ pats.T).argmax(dim=1)  # (nblocks,)
    return _unblocks(pats[best].bool(), tuple(matrix.shape))


def m4n2_2d_greedy(matrix: torch.Tensor) -> torch.Tensor:
    """Transposable 2:4 mask, greedy: take entries of each 4x4 block from largest |w| down while
    their row and column still have fewer than 2 kept. Can miss the optimum (see m4n2_2d_best)."""
    _check_cols(matrix)
    _check_rows(matrix)
    mag = _blocks(matrix.detach().abs().float())
    n = mag.shape[0]
    order = mag.argsort(dim=1, descending=True, stable=True)  # (n, 16)
    keep = torch.zeros(n, 16, dtype=torch.bool, device=matrix.device)
    row_cnt = torch.zeros(n, 4, dtype=torch.int64, device=matrix.device)
    col_cnt = torch.zeros(n, 4, dtype=torch.int64, device=matrix.device)
    ar = torch.arange(n, device=matrix.device)
    for step in range(16):  # vectorized over blocks; 16 steps per block
        pos = order[:, step]
        r, c = pos // 4, pos % 4
        ok = (row_cnt[ar, r] < 2) & (col_cnt[ar, c] < 2)
        keep[ar, pos] |= ok
        row_cnt[ar, r] += ok.long()
        col_cnt[ar, c] += ok.long()
    # Greedy can dead-end with fewer than 8 kept (a row and column both short but their cell
    # taken); fill such blocks with the best valid pattern so the mask is always 2:4 both ways.
    short = keep.sum(1) != 8
    if bool(short.any()):
        pats = _patterns_2d(str(matrix.device))
        keep[short] = pats[(mag[short] @ pats.T).argmax(1)].bool()
    return _unblocks(keep, tuple(matrix.shape))


CALCULATORS = {"m4n2_1d": m4n2_1d, "m4n2_2d_greedy": m4n2_2d_greedy, "m4n2_2d_best": m4n2_2d_best}


def compute_mask(weight: torch.Tensor, calculator: str = "m4n2_1d") -> torch.Tensor:
    """Boolean mask of ``weight``'s shape from a named calculator (layout as :func:`to_matrix`).

    Example:
        >>> w = torch.randn(8, 16)
        >>> int(compute_mask(w).sum())
        64
    """
    if calculator not in CALCULATORS:
        raise UsageError(f"mask calculator {calculator!r} is not one of {sorted(CALCULATORS)}")
    return from_matrix(CALCULATORS[calculator](to_matrix(weight)), weight.shape)


def is_2to4(weight_or_mask: torch.Tensor) -> bool:
    """True when every group of 4 along the input dimension has at most 2 nonzeros."""
    m = to_matrix(weight_or_mask)
    if m.shape[1] % 4:
        return False
    return bool(((m != 0).reshape(m.shape[0], -1, 4).sum(-1) <= 2).all())


def retained_magnitude(weight: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of sum |w| that the mask keeps."""
    total = weight.detach().abs().float().sum()
    return float((weight.detach().abs().float() * mask).sum() / total) if total > 0 else 1.0


def _check_cols(matrix: torch.Tensor) -> None:
    if matrix.dim() != 2 or matrix.shape[1] % 4:
        raise UsageError(f"2:4 masks need a matrix whose columns divide by 4, got shape {tuple(matrix.shape)}")


def _check_rows(matrix: torch.Tensor) -> None:
    if matrix.shape[0] % 4:
        raise UsageError(
            f"transposable (m4n2_2d) masks need rows divisible by 4, got shape {tuple(matrix.shape)}; use m4n2_1d"
        )
