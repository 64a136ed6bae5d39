"""Update chains: a node that skipped rounds gets the updates since the version it holds (one
record of consecutive updates) instead of the full model, while that is smaller; the chain is
checked as hostile input and applied as the server advanced B (the node's digest check)."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import Array, ArrayRecord
from test_download import make_app, run, theta0

from flwr_isoloco.compression import compress, payload_nbytes
from flwr_isoloco.compression.broadcast import (
    CHAIN_KEY,
    MAX_LINKS,
    Broadcast,
    apply_download,
    apply_update,
    chain,
    model_digest,
)
from flwr_isoloco.compression.record import decompress


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_sampled_nodes_get_chains_not_the_model(fraction):
    """4 nodes, a share of them per round: every train round after the first sends each sampled
    node less than the model (its chain), and every reply is used (each chain rebuilt the
    announced B, or download_mod would have refused)."""
    rounds = 8
    s, res, _ = run(
        "int8", rounds=rounds, nodes=4, fraction=fraction, grid=FakeGrid(make_app(), num_nodes=4)
    )
    m = res.train_metrics_clientapp
    full = payload_nbytes(ArrayRecord(theta0()))
    sampled = max(1, round(fraction * 4))
    assert all(m[r]["replies-used"] == sampled for r in range(1, rounds + 1))
    later = [m[r]["bytes-down"] for r in range(5, rounds + 1)]
    # a node's first message is the model (it holds nothing); by round 5 most hold a version
    assert sum(later) < len(later) * sampled * full * 0.8, (later, full)


def test_chain_applies_links_in_order_as_the_server_advanced():
    b = Broadcast("int8", {})
    theta = theta0()
    b.advance(theta, {})
    versions = [dict(b.base)]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        theta = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in theta.items()}
        b.advance(theta, {})
        versions.append(dict(b.base))
    assert len(b.history) == 3
    b.held[7] = model_digest(versions[0])
    rec, entries = b.for_node(7)
    assert CHAIN_KEY in rec and entries["download-base"] == model_digest(versions[0])
    got = apply_download(versions[0], rec)
    assert model_digest(got) == b.digest
    # the same as applying the three updates one by one
    one_by_one = versions[0]
    for link in [h[2] for h in b.history]:
        one_by_one = apply_update(one_by_one, decompress(link))
    assert all(torch.equal(one_by_one[k], got[k]) for k in got)
    b.held[8] = model_digest(versions[2])  # one version behind: the single update
    rec, _ = b.for_node(8)
    assert CHAIN_KEY not in rec and rec is b.history[-1][2]
    b.held[9] = "f" * 64  # unknown version: the full model
    rec, entries = b.for_node(9)
    assert entries["download-base"] == "" and payload_nbytes(rec) == payload_nbytes(b.full())


def test_history_stays_below_the_model_in_bytes():
    b = Broadcast("int8", {})
    theta = theta0()
    b.advance(theta, {})
    full = sum(v.numel() * v.element_size() for v in b.base.values())
    for i in range(12):
        theta = {k: v + 0.01 * (i + 1) for k, v in theta.items()}
        b.advance(theta, {})
        assert sum(h[3] for h in b.history) < full
        assert len(b.history) <= MAX_LINKS
    assert 1 <= len(b.history) < 12  # int8 updates are ~1/4 of the model: a few fit


def test_a_tampered_chain_is_refused():
    held = theta0()
    u = compress({k: torch.zeros_like(v) for k, v in held.items()}, "int8")
    rec = chain([u, u])
    stray = ArrayRecord({**dict(rec.items()), "l5:w/q": rec["l0:w/q"]})
    with pytest.raises(ValueError, match="unexpected array"):
        apply_download(held, stray)
    head = ArrayRecord({**dict(rec.items()), CHAIN_KEY: Array(torch.tensor([1, 2]).numpy())})
    with pytest.raises(ValueError, match=CHAIN_KEY):
        apply_download(held, head)
    missing = ArrayRecord({k: v for k, v in rec.items() if k != "l1:w/q"})
    with pytest.raises(ValueError):
        apply_download(held, missing)
