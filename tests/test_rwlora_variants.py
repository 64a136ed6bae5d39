"""RW-LoRA variants (decaying lr, momentum across hops, averaged token): exact against the
formulas of flwr_isoloco/strategies/graph/rwlora_variants.py, off by default, checked replies,
exact resume."""

import math

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid, corrupt_arrays
from rwlora_helpers import (
    HANDLERS,
    NBYTES,
    arm,
    assert_token,
    client_update,
    init_adapter,
    replay,
    run,
)

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.strategies import RWLoRA

torch.set_num_threads(1)


def walk(**kw):
    return RWLoRA("ring", num_vertices=6, seed=4, local_steps=2, fraction_evaluate=0.0, **kw)


def recording():
    """Handlers that keep every TRAIN config the clients receive (list, in order)."""
    seen = []

    def train(msg, context):
        seen.append(dict(msg.content["config"]))
        return HANDLERS["train"](msg, context)

    return {**HANDLERS, "train": train}, seen


def replay_variants(trajectory, steps, mu=0.0, beta=0.0):
    """Independent loop: token_t = token_{t-1} - m_t, m_t = mu m_{t-1} + (token_{t-1} -
    reply_t); avg_1 = token_1, avg_t = beta avg_{t-1} + (1 - beta) token_t (float64)."""
    x = {k: v.double() for k, v in init_adapter().items()}
    m, avg = None, None
    for v in trajectory:
        reply = {k: t.double() for k, t in client_update(x, v, steps).items()}
        u = {k: x[k] - reply[k] for k in x}
        m = u if m is None else {k: mu * m[k] + u[k] for k in u}
        x = {k: x[k] - m[k] for k in x}
        avg = dict(x) if avg is None else {k: beta * avg[k] + (1 - beta) * x[k] for k in x}
    return x, avg


def close(arrays, expected, tol=1e-5):
    got = arrays.to_torch_state_dict() if hasattr(arrays, "to_torch_state_dict") else arrays
    for k in expected:
        assert torch.allclose(got[k].double(), expected[k], rtol=tol, atol=tol), k


def test_defaults_are_the_paper_walk_bit_for_bit():
    plain, off = walk(), walk(lr=1e-3, lr_decay_hops=0, hop_momentum=0, average_decay=0)
    handlers, seen = recording()
    g1, g2 = FakeGrid(HANDLERS, num_nodes=6), FakeGrid(handlers, num_nodes=6)
    r1, r2 = run(plain, g1, 12), run(off, g2, 12)
    assert off.trajectory == plain.trajectory
    assert_token(r2, r1.arrays.to_torch_state_dict())
    assert_token(r2, replay(off.trajectory, 2))
    assert (off.bytes_p2p, off.bytes_relayed) == (plain.bytes_p2p, plain.bytes_relayed)
    assert len(seen) == 12 and all("lr" not in c for c in seen)
    assert off.state_dict()["tensors"].keys() == {"token", "optimizer"}


def test_decaying_lr_is_sent_per_hop():
    s = walk(lr=2e-3, lr_decay_hops=4.0)
    handlers, seen = recording()
    run(s, FakeGrid(handlers, num_nodes=6), 10)
    sent = [float(c["lr"]) for c in seen]
    assert sent == [2e-3 / math.sqrt(1 + t / 4.0) for t in range(10)]


@pytest.mark.parametrize("mu, beta", [(0.5, 0.0), (0.0, 0.8), (0.6, 0.9)])
def test_momentum_and_average_match_the_formulas(mu, beta):
    s = walk(hop_momentum=mu, average_decay=beta)
    res = run(s, FakeGrid(HANDLERS, num_nodes=6), 9)
    token, avg = replay_variants(s.trajectory, 2, mu, beta)
    close(s.token, token)
    close(res.arrays, avg if beta else token)  # what the app evaluates and exports


def test_variants_leave_the_walk_and_relayed_bytes_alone_and_count_carried_p2p_bytes():
    plain, both = walk(), walk(hop_momentum=0.5, average_decay=0.9)
    run(plain, FakeGrid(HANDLERS, num_nodes=6), 10)
    run(both, FakeGrid(HANDLERS, num_nodes=6), 10)
    assert both.trajectory == plain.trajectory
    assert both.bytes_relayed == plain.bytes_relayed
    moved = plain.bytes_p2p // NBYTES  # hops to another vertex (no lazy self-loops here)
    assert plain.bytes_p2p == moved * NBYTES and moved == 10
    assert both.bytes_p2p == 3 * plain.bytes_p2p  # token + momentum + average per hop


def test_hostile_reply_leaves_token_momentum_and_average_untouched():
    s = RWLoRA(
        "complete",
        num_vertices=4,
        seed=2,
        hop_momentum=0.5,
        average_decay=0.9,
        fraction_evaluate=0.0,
    )
    grid = FakeGrid(HANDLERS, num_nodes=4)
    arm(s, grid, 1, corrupt_arrays(lambda a: {k: v * np.nan for k, v in a.items()}))
    res = run(s, grid, 15)
    assert 1 not in s.trajectory and s.failures_by_vertex.get(1, 0) > 0
    assert all(v == 1 and "non-finite" in why for _, v, why in s.failure_log)
    token, avg = replay_variants(s.trajectory, 1, 0.5, 0.9)
    close(s.token, token)
    close(res.arrays, avg)


def test_resume_with_momentum_and_average_is_exact(tmp_path):
    def make():
        return walk(lr=1e-3, lr_decay_hops=3.0, hop_momentum=0.5, average_decay=0.9)

    full = make()
    res_full = run(full, FakeGrid(HANDLERS, num_nodes=6), 12)
    first = make()
    run(first, FakeGrid(HANDLERS, num_nodes=6), 6)
    sd = first.state_dict()
    assert {"momentum", "average"} <= sd["tensors"].keys()
    save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], {"strategy": sd["meta"]})
    tensors, meta = load_checkpoint(tmp_path / "ck.safetensors")
    second = make()
    handlers, seen = recording()
    g2 = FakeGrid(handlers, num_nodes=6, seed=1)
    second.load_state_dict({"tensors": tensors, "meta": meta["strategy"]}, reference=init_adapter())
    res_second = run(second, g2, 12)
    assert second.trajectory == full.trajectory
    assert_token(res_second, res_full.arrays.to_torch_state_dict())
    assert [float(c["lr"]) for c in seen] == [1e-3 / math.sqrt(1 + t / 3.0) for t in range(6, 12)]
    bad = {**tensors, "average": {k: v[:1] for k, v in tensors["average"].items()}}
    with pytest.raises(ValueError, match="average/"):
        make().load_state_dict({"tensors": bad, "meta": meta["strategy"]}, reference=init_adapter())


@pytest.mark.parametrize(
    "kw, what",
    [
        ({"lr_decay_hops": 4.0}, "base lr"),
        ({"lr": 1e-3, "lr_decay_hops": -1.0}, "lr_decay_hops"),
        ({"hop_momentum": 1.0}, "hop_momentum"),
        ({"average_decay": -0.1}, "average_decay"),
        ({"average_decay": float("nan")}, "average_decay"),
    ],
)
def test_bad_variant_options(kw, what):
    with pytest.raises(ValueError, match=what):
        walk(**kw)


@pytest.mark.parametrize("start", [1, 4])
def test_tail_average_is_the_mean_of_the_tokens_from_hop_h(start):
    s = walk(tail_average_from=start)
    res = run(s, FakeGrid(HANDLERS, num_nodes=6), 9)
    tokens, x = [], init_adapter()
    for v in s.trajectory:  # the plain walk's tokens (training is unchanged)
        x = client_update(x, v, 2)
        tokens.append({k: t.double() for k, t in x.items()})
    tail = tokens[start - 1 :]
    close(s.token, tokens[-1])
    close(res.arrays, {k: sum(t[k] for t in tail) / len(tail) for k in tail[0]})
    assert (
        s.bytes_p2p
        == 2
        * walk()
        .start(
            grid=FakeGrid(HANDLERS, num_nodes=6),
            initial_arrays=res.arrays.__class__(init_adapter()),
            num_rounds=9,
            timeout=5,
        )
        .train_metrics_clientapp[9]["bytes-p2p-total"]
    )  # the average travels in P2P


def test_tail_average_is_the_token_before_hop_h():
    s = walk(tail_average_from=6)
    run(s, FakeGrid(HANDLERS, num_nodes=6), 5)
    assert s.average is None
    shown = s.current_arrays().to_torch_state_dict()
    for k, t in s.token.to_torch_state_dict().items():
        assert torch.equal(shown[k], t)
    with pytest.raises(ValueError, match="choose one"):
        walk(tail_average_from=2, average_decay=0.9)
    with pytest.raises(ValueError, match="tail_average_from"):
        walk(tail_average_from=-1)
