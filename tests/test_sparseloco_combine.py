"""merge="sparseloco": SparseLoCo's combine (clip to the median norm, per-entry mean over the
peers that sent it) against an independent computation in the reference's own form (values and
indices concatenated, ``scatter_reduce(..., "mean", include_self=False)``)."""

from __future__ import annotations

import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, merge
from flwr_isoloco.merging.sparse import lower_median_clip, sparse_mean


def _peers(m: int, n: int, k: int, seed: int, overlap: float = 0.0):
    """``m`` peers' (indices, values) of a flat tensor of ``n`` entries, ``k`` each; a share
    ``overlap`` of each peer's indices drawn from a common pool."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randperm(n, generator=g)[:k]
    out = []
    for i in range(m):
        own = torch.randperm(n, generator=g)[:k]
        take = int(overlap * k)
        idx = torch.unique(torch.cat([common[:take], own]))[:k]
        vals = torch.randn(idx.numel(), generator=g) * (1.0 + 3.0 * i)  # norms spread out
        out.append((idx, vals))
    return out


def _reference(peers, n: int) -> torch.Tensor:
    """The reference's arithmetic: per-peer norm of its values, torch.median, clip factor
    min(1, med / (norm + 1e-8)), then one scatter_reduce mean over all (index, value) pairs."""
    norms = torch.stack([torch.norm(v, p=2) for _, v in peers])
    med = torch.median(norms)
    vals = [
        v * torch.clamp(med / (nrm + 1e-8), max=1) for (_, v), nrm in zip(peers, norms, strict=True)
    ]
    idx = torch.cat([i for i, _ in peers])
    x = torch.zeros(n)
    return x.scatter_reduce_(0, idx, torch.cat(vals), reduce="mean", include_self=False)


def _dense(peers, shape):
    n = shape[0] * shape[1]
    out = []
    for idx, v in peers:
        d = torch.zeros(n)
        d[idx] = v
        out.append({"w": d.view(shape)})
    return out


@pytest.mark.parametrize("m,overlap", [(8, 0.0), (8, 0.5), (7, 0.9), (2, 0.3)])
def test_matches_reference_scatter_mean(m, overlap):
    shape = (64, 128)
    peers = _peers(m, shape[0] * shape[1], 300, seed=m, overlap=overlap)
    got = merge("sparseloco", _dense(peers, shape), device="cpu")["w"].reshape(-1)
    want = _reference(peers, shape[0] * shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32 sums in another order


def test_entry_chosen_by_one_peer_counts_fully_not_one_mth():
    shape = (4, 4)
    deltas = [{"w": torch.zeros(shape)} for _ in range(8)]
    for d in deltas:
        d["w"][0, 0] = 1.0  # every peer: norm 1 (no clipping)
    deltas[3]["w"][0, 0] = 0.0
    deltas[3]["w"][2, 2] = 1.0  # only peer 3 sent (2, 2)
    g = merge("sparseloco", deltas, device="cpu")["w"]
    assert g[2, 2] == 1.0  # the mean over its one sender; the plain mean gives 1/8
    assert g[0, 0] == 1.0  # seven senders of 1.0
    assert merge("mean", deltas, device="cpu")["w"][2, 2] == pytest.approx(1 / 8)
    assert int((g != 0).sum()) == 2


def test_lower_median_clips_as_torch_median():
    # two peers, norms 1 and 3: torch.median takes the lower (1), so the second is scaled 1/3
    assert torch.allclose(lower_median_clip(torch.tensor([1.0, 3.0])), torch.tensor([1.0, 1 / 3]))
    a = {"w": torch.tensor([[1.0, 0.0]])}
    b = {"w": torch.tensor([[0.0, 3.0]])}
    g = merge("sparseloco", [a, b], device="cpu")["w"]
    torch.testing.assert_close(g, torch.tensor([[1.0, 1.0]]))


def test_weighted_form_and_one_d_tensors_take_the_mean():
    torch.manual_seed(0)
    d1 = {"w": torch.tensor([[2.0, 0.0, 1.0]]), "b": torch.tensor([1.0, 2.0])}
    d2 = {"w": torch.tensor([[0.0, 4.0, 3.0]]), "b": torch.tensor([3.0, 0.0])}
    g = merge("sparseloco", [d1, d2], [1.0, 3.0], device="cpu")
    n1, n2 = 5**0.5, 5.0
    c2 = n1 / (n2 + 1e-8)  # lower median = n1
    w1, w2 = 0.25, 0.75
    want = torch.tensor(
        [[2.0, 4.0 * c2, (w1 * 1.0 + w2 * c2 * 3.0) / (w1 + w2)]], dtype=torch.float32
    )
    torch.testing.assert_close(g["w"], want)
    torch.testing.assert_close(g["b"], torch.tensor([2.5, 0.5]))  # 1-D: the weighted mean


def test_sparse_mean_is_order_fixed_and_bitwise_repeatable():
    peers = _peers(8, 4096, 64, seed=3)
    deltas = [d["w"].reshape(-1) for d in _dense(peers, (64, 64))]
    coefs = torch.rand(8, generator=torch.Generator().manual_seed(1))
    w = torch.full((8,), 0.125)
    assert torch.equal(sparse_mean(deltas, coefs, w), sparse_mean(deltas, coefs.clone(), w))
    assert "sparseloco" in MERGE_RULES and not MERGE_RULES["sparseloco"].streaming
