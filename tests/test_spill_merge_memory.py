"""A spilled round of a streaming rule (the weight bound's first round) reads one spilled delta
at a time per tensor, not all M (at 135M, M = 64: 64 x the 113 MB embedding), and its result
is bitwise the streamed round's."""

from __future__ import annotations

import weakref

import torch

from flwr_isoloco.merging.fold import RoundFold, RoundMerge
from flwr_isoloco.merging.rules import MERGE_RULES
from flwr_isoloco.merging.spill import SpillStore


class _Reply:
    def __init__(self, i: int) -> None:
        self.node_id = i

    def update(self, theta):
        g = torch.Generator().manual_seed(self.node_id)
        return {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in theta.items()}

    def release(self) -> None:
        pass


def test_spilled_streaming_merge_holds_one_delta_and_equals_the_stream(monkeypatch):
    theta = {"emb": torch.randn(64, 8), "w": torch.randn(8, 8), "b": torch.randn(8)}
    alive: list[weakref.ref] = []
    most = [0]
    get = SpillStore.get

    def tracked(self, entry, key):
        most[0] = max(most[0], sum(r() is not None for r in alive))
        t = get(self, entry, key)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(SpillStore, "get", tracked)
    results = []
    for spill in (True, False):
        replies = [_Reply(i) for i in range(6)]
        weights = {r.node_id: float(r.node_id + 1) for r in replies}
        merger = RoundMerge(MERGE_RULES["mean"], "mean", {})
        with RoundFold(merger, theta, 1, spill=spill) as fold:
            for r in replies:
                fold.add(r, None if spill else weights[r.node_id])
            g, used = fold.finish(replies, lambda r, w=weights: w[r.node_id], lambda r, why: None)
        assert len(used) == 6
        results.append(g)
    assert len(alive) == 6 * 3  # every spilled tensor was read, once
    assert most[0] <= 1  # before: all 6 of a tensor at once
    assert all(torch.equal(results[0][k], results[1][k]) for k in theta)
