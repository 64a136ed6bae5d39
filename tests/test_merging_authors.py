"""Iso-CTS and TIES sizes as the authors' code computes them, against hand computations.

References (read, not copied): iso-merging ``src/utils/iso.py`` (``iso_cts``), the IsoLoCo
code's ``src/tplr/isoctsloco.py`` and ``src/tplr/mergeloco.py`` (``_sparsify_gradient``),
mergekit ``sparsify.magnitude``.
"""

import pytest
import torch

from flwr_isoloco.merging import iso_c, merge
from flwr_isoloco.merging.rules import iso_cts_sizes, prune_smallest, ties_kept_count

torch.set_num_threads(1)
F64 = torch.float64


def _orthogonal(n, seed):
    q, r = torch.linalg.qr(
        torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    )
    return q * torch.sign(torch.diagonal(r))


# ---- Iso-CTS: k = r - round((r - int(f r)) / M) * M, s = (r - k) / M ----------------------


@pytest.mark.parametrize(
    "r,num,frac,k,s",
    [
        # r = 8, f = 0.8, M = 3: int(6.4) = 6; (8 - 6) / 3 = 0.667 -> round 1 -> 3 task-specific
        # directions: k = 8 - 3 = 5, s = 1. (Rounding down, 2 // 3 = 0, gave k = 8, s = 0.)
        (8, 3, 0.8, 5, 1),
        # r = 64, f = 0.8: int(51.2) = 51, 13 / 5 = 2.6 -> 3: k = 64 - 15 = 49 (floor gave 54)
        (64, 5, 0.8, 49, 3),
        # 13 / 8 = 1.625 -> 2: k = 64 - 16 = 48 (floor gave 56)
        (64, 8, 0.8, 48, 2),
        # r = 1024, M = 128: int(819.2) = 819, 205 / 128 = 1.6 -> 2: k = 1024 - 256 = 768
        (1024, 128, 0.8, 768, 2),
        # round half to even (Python's round on a float, as both references):
        # r = 10, f = 0.5: (10 - 5) / 2 = 2.5 -> 2 (not 3): k = 10 - 4 = 6, s = 2
        (10, 2, 0.5, 6, 2),
        # (6 - 3) / 2 = 1.5 -> 2: k = 6 - 4 = 2, s = 2
        (6, 2, 0.5, 2, 2),
        # int(0.29 * 100) = int(28.999999999999996) = 28, as the references compute it:
        # 72 / 4 = 18: k = 28
        (100, 4, 0.29, 28, 18),
        (8, 2, 0.5, 4, 2),
        (64, 1, 0.8, 51, 13),
        (16, 4, 1.0, 16, 0),
        # guard: the references' rule gives round(3 / 2) * 2 = 4 > r = 3, i.e. k = -1;
        # lowered to the largest multiple of M not above r: 2, so k = 1, s = 1
        (3, 2, 0.2, 1, 1),
        # M > r: (2 - 1) / 3 = 0.33 -> 0: k = 2, no task-specific directions
        (2, 3, 0.8, 2, 0),
    ],
)
def test_iso_cts_sizes_hand_computed(r, num, frac, k, s):
    assert iso_cts_sizes(r, num, frac) == (k, s)


def test_iso_cts_sizes_match_the_authors_formula_everywhere_it_is_defined():
    for r in range(1, 130):
        for num in (1, 2, 3, 5, 7, 8, 16, 33, 128):
            for frac in (0.1, 0.3, 0.5, 0.8, 0.9, 1.0):
                ref = r - round((r - int(frac * r)) / num) * num  # the references, verbatim rule
                k, s = iso_cts_sizes(r, num, frac)
                assert 0 <= k <= r and k + s * num == r
                if ref >= 0:
                    assert k == ref, (r, num, frac)


def test_iso_cts_hand_worked_authors_rule_r8_m3():
    """8 x 8, M = 3, default common_fraction 0.8: k = 5 common, s = 1 per worker.

    In the basis (P, R) of two fixed orthogonal matrices, delta_i = P diag(v_i) R^T with
      v_0 = (9, 8, 7, 6, 5, 6, 3, 0)
      v_1 = (9, 8, 7, 6, 5, 0, 6, 3)
      v_2 = (9, 8, 7, 6, 5, 3, 0, 6)
    uniform weights 1/3: mean = diag(9, 8, 7, 6, 5, 3, 3, 3); common = its top 5 directions,
    singular values 9, 8, 7, 6, 5. Outside them, delta_i / 3 is diag(0,..,0, 2, 1, 0) (and
    rotations): each worker's top direction is its own (e6, e7, e8), singular value 2.
    Stacked U = P (a permutation of its columns), likewise V = R, so the polar factors give
    P R^T; the flat spectrum is mean(9, 8, 7, 6, 5, 2, 2, 2) = 41 / 8 = 5.125.
    Result: 5.125 * P R^T. (Rounding the per-worker count down gave k = 8, s = 0: Iso-C of the
    mean, mean(9, 8, 7, 6, 5, 3, 3, 3) = 5.5 * P R^T, 7.3% away.)
    """
    p, r = _orthogonal(8, 1), _orthogonal(8, 2)
    vs = [
        [9.0, 8, 7, 6, 5, 6, 3, 0],
        [9.0, 8, 7, 6, 5, 0, 6, 3],
        [9.0, 8, 7, 6, 5, 3, 0, 6],
    ]
    deltas = [{"w": p @ torch.diag(torch.tensor(v, dtype=F64)) @ r.T} for v in vs]
    out = merge("iso_cts", deltas)["w"]
    torch.testing.assert_close(out, 5.125 * p @ r.T, rtol=1e-10, atol=1e-10)
    mean_iso_c = iso_c(merge("mean", deltas)["w"])
    torch.testing.assert_close(mean_iso_c, 5.5 * p @ r.T, rtol=1e-10, atol=1e-10)


# ---- TIES: keep max(1, int((1 - p) * n)) entries per worker and tensor --------------------


@pytest.mark.parametrize(
    "numel,p,kept",
    [
        (6, 0.25, 4),  # int(4.5) = 4; zeroing floor(1.5) = 1 would keep 5
        (6, 0.1, 5),  # int(5.4) = 5; zeroing floor(0.6) = 0 would keep all 6
        (10, 0.3, 7),  # int(7.000000000000001) = 7
        (10, 0.1, 9),
        (4, 0.9, 1),  # int(0.4) = 0 -> at least one entry kept
        (1, 0.5, 1),
        (10, 0.0, 10),
    ],
)
def test_ties_kept_count_hand_computed(numel, p, kept):
    assert ties_kept_count(numel, p) == kept
    d = torch.arange(1.0, numel + 1)
    assert int((prune_smallest(d, p) != 0).sum()) == kept


def test_ties_hand_worked_kept_count_differs_from_floor_pruning():
    """2 x 3, prune_fraction 0.25: each worker keeps int(0.75 * 6) = 4 of its 6 entries.

    d1 = [[4, -3, 2], [1, -0.5, 6]]: |d1| ranked 6, 4, 3, 2 | 1, 0.5 -> [[4, -3, 2], [0, 0, 6]]
    d2 = [[-1, -2, 3], [5, 0.25, -2.5]]: |d2| ranked 5, 3, 2.5, 2 | 1, 0.25
         -> [[0, -2, 3], [5, 0, -2.5]]
    weighted sum (1/2 each) signs: [[+, -, +], [+, 0, +]]
    agreeing kept entries, weighted mean:
      (0,0) 4 | (0,1) -3, -2 -> -2.5 | (0,2) 2, 3 -> 2.5 | (1,0) 5 | (1,1) 0 | (1,2) 6
    Zeroing only floor(0.25 * 6) = 1 entry (the old count) kept d1's 1 at (1,0): 3 there.
    """
    d1 = torch.tensor([[4.0, -3.0, 2.0], [1.0, -0.5, 6.0]])
    d2 = torch.tensor([[-1.0, -2.0, 3.0], [5.0, 0.25, -2.5]])
    out = merge("ties", [{"w": d1}, {"w": d2}], prune_fraction=0.25)["w"]
    torch.testing.assert_close(out, torch.tensor([[4.0, -2.5, 2.5], [5.0, 0.0, 6.0]]))
