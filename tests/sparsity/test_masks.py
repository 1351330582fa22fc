"""Mask calculators: exactly 2 of 4 along the right axis, the best pattern chosen, transposability."""

from __future__ import annotations

import itertools

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.sparsity import masks as M


def _brute_1d(mat: torch.Tensor) -> float:
    """Reference: the best kept magnitude per group of 4 by enumerating all 6 two-of-four choices."""
    total = 0.0
    for row in mat.abs().double():
        for g in row.reshape(-1, 4):
            total += max(float(g[list(c)].sum()) for c in itertools.combinations(range(4), 2))
    return total


def _brute_2d_block(block: torch.Tensor) -> float:
    best = 0.0
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
    for choice in itertools.product(rows, repeat=4):
        m = torch.tensor(choice, dtype=torch.float64)
        if (m.sum(0) == 2).all():
            best = max(best, float((block.abs().double() * m).sum()))
    return best


@pytest.mark.parametrize("calc", sorted(M.CALCULATORS))
@pytest.mark.parametrize("shape", [(16, 32), (8, 16, 3, 3), (8, 16, 5), (8, 16, 1, 2, 2)])
def test_two_of_four_along_input_dim(calc: str, shape: tuple[int, ...]) -> None:
    w = torch.randn(shape)
    mask = M.compute_mask(w, calc)
    assert mask.shape == w.shape and mask.dtype == torch.bool
    # Groups of 4 run along dim 1 (input channels) at every other index: move dim 1 last and check.
    groups = mask.movedim(1, -1).reshape(-1, shape[1] // 4, 4)
    assert bool((groups.sum(-1) == 2).all())
    if calc != "m4n2_1d":  # transposable: the transposed matrix is 2:4 as well
        mat = M.to_matrix(mask)
        assert bool((mat.T.reshape(-1, mat.shape[0] // 4, 4).sum(-1) == 2).all())


def test_1d_is_optimal_against_brute_force() -> None:
    w = torch.randn(6, 24)
    kept = float((w.abs().double() * M.m4n2_1d(w)).sum())
    assert kept == pytest.approx(_brute_1d(w), rel=1e-12)


def test_2d_best_is_optimal_and_greedy_no_better() -> None:
    w = torch.randn(8, 8)
    best = M.m4n2_2d_best(w)
    greedy = M.m4n2_2d_greedy(w)
    ref = sum(_brute_2d_block(w[r:r + 4, c:c + 4]) for r in (0, 4) for c in (0, 4))
    assert float((w.abs().double() * best).sum()) == pytest.approx(ref, rel=1e-6)
    assert float((w.abs() * greedy).sum()) <= float((w.abs() * best).sum()) + 1e-5


def test_1d_keeps_largest_exact_values() -> None:
    w = torch.tensor([[0.1, -5.0, 3.0, 0.2, 7.0, 6.0, -8.0, 0.0]])
    assert M.m4n2_1d(w).tolist() == [[False, True, True, False, True, False, True, False]]


def test_retained_magnitude_and_is_2to4() -> None:
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = M.m4n2_1d(w)
    assert M.retained_magnitude(w, m) == pytest.approx(0.7)
    assert M.is_2to4(w * m) and not M.is_2to4(w)


def test_matrix_layout_round_trip() -> None:
    w = torch.randn(8, 16, 3, 3)
    assert torch.equal(M.from_matrix(M.to_matrix(w), w.shape), w)
    assert M.to_matrix(w).shape == (8 * 9, 16)


def test_bad_shapes_raise() -> None:
    with pytest.raises(UsageError, match="divide by 4"):
        M.m4n2_1d(torch.randn(4, 6))
    with pytest.raises(UsageError, match="rows divisible by 4"):
        M.m4n2_2d_best(torch.randn(6, 8))
    with pytest.raises(UsageError, match="not one of"):
        M.compute_mask(torch.randn(8, 8), "m8n4")


def test_one_dim_weight_raises_usage_error() -> None:
    for fn in (M.compute_mask, M.is_2to4):
        with pytest.raises(UsageError, match=r"2 or more dims .* got shape \(8,\)"):
            fn(torch.randn(8))
