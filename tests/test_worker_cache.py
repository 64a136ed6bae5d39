"""The DiLoCo worker's per-process cache (``flwr_isoloco.clients.worker_cache``): the model and a
node's AdamW moments stay on the device between messages, used only when the node's stored
AdamW record is the one this process wrote last, and bitwise the same as reading it back.

Reference in every test: the same messages through a handler with ``Runtime(cache_nodes=0)`` (the model
rebuilt and the moments read from ``context.state`` every message, as before the cache).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord
from test_diloco_worker import (
    BATCHES,
    TRAIN,
    data_fn,
    fresh_process,
    handler,
    model_fn,
    new_context,
    send,
)

from flwr_isoloco.clients import Runtime, TrainSettings
from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY, WORKER_STATE_KEY
from flwr_isoloco.clients.node_state import HANDLE_KEY, with_node_state
from flwr_isoloco.clients.worker_cache import TOKEN_KEY, cache_stats, clear_caches

ROUNDS = 2  # test_diloco_worker's run: 2 rounds of H = 3 steps


@pytest.fixture(autouse=True)
def _empty_caches():
    clear_caches()
    yield
    clear_caches()


def _theta0():
    return {k: v.detach() for k, v in model_fn().state_dict().items()}


def _arrays(reply):
    assert not reply.has_error()
    return reply.content["arrays"].to_torch_state_dict()


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _stored(ctx):
    """The node's stored AdamW arrays without the cache's token."""
    arrays = ctx.state[ADAMW_STATE_KEY].to_torch_state_dict()
    return {k: v for k, v in arrays.items() if k != TOKEN_KEY}


def _rounds(train, ctx, theta, rounds=ROUNDS, **config):
    out = []
    for rnd in range(1, rounds + 1):
        theta = _arrays(send(train, theta, rnd, ctx, **config))
        out.append(theta)
    return out


def test_cache_hits_give_bitwise_the_replies_and_state_of_no_cache():
    cached, ctx = handler(runtime=Runtime(cache_nodes=1)), new_context()
    got = _rounds(cached, ctx, _theta0())
    assert cache_stats()["hits"] == ROUNDS - 1 and cache_stats()["model-builds"] == 1
    ref_ctx = new_context()
    want = _rounds(handler(runtime=Runtime(cache_nodes=0)), ref_ctx, _theta0())
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))
    assert _same(_stored(ctx), _stored(ref_ctx))  # the stored state is written as before
    assert (
        TOKEN_KEY in ctx.state[ADAMW_STATE_KEY] and TOKEN_KEY not in ref_ctx.state[ADAMW_STATE_KEY]
    )
    assert dict(ctx.state[WORKER_STATE_KEY]) == dict(ref_ctx.state[WORKER_STATE_KEY])


def test_a_hit_does_not_build_the_model_again():
    calls = []

    def counting_model_fn(ctx):
        calls.append(1)
        return model_fn(ctx)

    from flwr_isoloco.clients import make_diloco_train_handler

    train = make_diloco_train_handler(
        counting_model_fn,
        lambda c: BATCHES,
        train=TrainSettings(local_steps=2, num_server_rounds=3),
    )
    ctx = new_context()
    theta = _theta0()
    for rnd in (1, 2, 3):
        theta = _arrays(send(train, theta, rnd, ctx))
    assert len(calls) == 1 and cache_stats()["hits"] == 2


def _round1_state(lr):
    """A node state after round 1 of a no-cache handler with learning rate ``lr``."""
    ctx = new_context()
    theta1 = _arrays(
        send(handler(replace(TRAIN, lr=lr), runtime=Runtime(cache_nodes=0)), _theta0(), 1, ctx)
    )
    return ctx, theta1


@pytest.mark.parametrize("change", ["replaced", "deleted", "token-removed", "token-garbled"])
def test_a_changed_or_deleted_stored_state_is_read_not_the_cache(change):
    """After a cached round 1, the node's stored AdamW record is replaced by another's (e.g. a
    file restored from another run), deleted, or stripped of its token: round 2 equals the
    no-cache round 2 from that stored state, and the cache reports a miss."""
    cached, ctx = handler(runtime=Runtime(cache_nodes=1)), new_context()
    theta1 = _arrays(send(cached, _theta0(), 1, ctx))
    if change == "replaced":
        other, _ = _round1_state(lr=5e-2)
        ctx.state[ADAMW_STATE_KEY] = other.state[ADAMW_STATE_KEY]
    elif change == "deleted":
        del ctx.state[ADAMW_STATE_KEY]
    else:
        arrays = ctx.state[ADAMW_STATE_KEY].to_torch_state_dict()
        if change == "token-removed":
            del arrays[TOKEN_KEY]
        else:
            arrays[TOKEN_KEY] = torch.zeros(16, dtype=torch.uint8)
        ctx.state[ADAMW_STATE_KEY] = ArrayRecord(arrays)
    before = fresh_process(ctx)  # the stored state the no-cache handler reads
    got = _arrays(send(cached, theta1, 2, ctx))
    want = _arrays(send(handler(runtime=Runtime(cache_nodes=0)), theta1, 2, before))
    assert cache_stats()["hits"] == 0 and cache_stats()["misses"] == 2
    assert _same(got, want)
    if change != "deleted":  # control: the stored record did matter
        fresh = new_context()
        fresh.state[WORKER_STATE_KEY] = ctx.state[WORKER_STATE_KEY]
        assert not _same(
            got, _arrays(send(handler(runtime=Runtime(cache_nodes=0)), theta1, 2, fresh))
        )


def test_an_older_stored_state_is_read_not_the_newer_cache():
    """The node's state goes back a round (its round-2 state was not kept, e.g. a resume from an
    older file): round 2 runs again from the round-1 state and equals the no-cache reply."""
    cached, ctx = handler(runtime=Runtime(cache_nodes=1)), new_context()
    theta1 = _arrays(send(cached, _theta0(), 1, ctx))
    after1, ref1 = fresh_process(ctx), fresh_process(ctx)
    first = _arrays(send(cached, theta1, 2, ctx))  # a hit: the cache now holds round 2
    again = _arrays(send(cached, theta1, 2, after1))  # the stored state is round 1's
    assert cache_stats()["hits"] == 1 and cache_stats()["misses"] == 2
    want = _arrays(send(handler(runtime=Runtime(cache_nodes=0)), theta1, 2, ref1))
    assert _same(again, want) and _same(first, want)


def test_a_failed_message_drops_the_half_updated_moments():
    """Round 2 fails after one inner step (its moments were updated in place): the next try
    of round 2 reads the stored round-1 state and equals the no-cache reply."""
    failing = {"on": False}

    def data_fn(_ctx):
        def batch(i):
            if failing["on"] and i == 4:
                raise RuntimeError("data source went away")
            return BATCHES[i % len(BATCHES)]

        return batch

    from flwr_isoloco.clients import make_diloco_train_handler

    kw = dict(train=TRAIN)
    cached = make_diloco_train_handler(model_fn, data_fn, **kw)
    ctx = new_context()
    theta1 = _arrays(send(cached, _theta0(), 1, ctx))
    failing["on"] = True
    with pytest.raises(RuntimeError, match="went away"):
        send(cached, theta1, 2, ctx)
    failing["on"] = False
    assert cache_stats()["nodes"] == 0
    got = _arrays(send(cached, theta1, 2, ctx))
    ref = make_diloco_train_handler(model_fn, data_fn, runtime=Runtime(cache_nodes=0), **kw)
    ref_ctx = new_context()
    want = _arrays(send(ref, _arrays(send(ref, _theta0(), 1, ref_ctx)), 2, ref_ctx))
    assert _same(got, want)


def _two_node_data(ctx):
    """Node-specific batches: a node that used the other's moments would reply differently."""
    g = torch.Generator().manual_seed(100 + int(ctx.node_config["partition-id"]))
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]
    return lambda i: batches[i % 4]


def _alternate(cache_nodes, rounds=3):
    from flwr_isoloco.clients import make_diloco_train_handler

    train = make_diloco_train_handler(
        model_fn, _two_node_data,
        train=TrainSettings(lr=1e-2, local_steps=2, num_server_rounds=rounds),
        runtime=Runtime(cache_nodes=cache_nodes),
    )  # fmt: skip
    ctxs = {pid: new_context(pid) for pid in (0, 1)}
    for pid, ctx in ctxs.items():
        ctx.node_id = 500 + pid  # two nodes of one run, one process
    thetas = {pid: _theta0() for pid in ctxs}
    nodes_held = []
    for rnd in range(1, rounds + 1):
        for pid, ctx in ctxs.items():
            thetas[pid] = _arrays(send(train, thetas[pid], rnd, ctx))
            nodes_held.append(cache_stats()["nodes"])
    return thetas, nodes_held


@pytest.mark.parametrize("cache_nodes", [1, 2])
def test_two_nodes_alternating_in_one_process_keep_their_own_moments(cache_nodes):
    want, _ = _alternate(0)
    clear_caches()
    got, held = _alternate(cache_nodes)
    assert all(_same(got[pid], want[pid]) for pid in want)
    assert not _same(got[0], got[1])
    assert max(held) == cache_nodes  # the bound holds
    # two nodes share one pooled model; with room for both, every round after the first hits
    assert cache_stats()["model-builds"] == 1
    assert cache_stats()["hits"] == (4 if cache_nodes == 2 else 0)


def test_the_bound_evicts_the_least_recently_used_node():
    from flwr_isoloco.clients import make_diloco_train_handler

    train = make_diloco_train_handler(
        model_fn,
        _two_node_data,
        train=TrainSettings(local_steps=1, num_server_rounds=2),
        runtime=Runtime(cache_nodes=2),
    )
    ctxs = []
    for pid in range(3):
        ctx = new_context(pid)
        ctx.node_id = 600 + pid
        ctxs.append(ctx)
    theta = _theta0()
    for ctx in ctxs:  # round 1: nodes 0, 1, 2 -> node 0 is evicted
        send(train, theta, 1, ctx)
        assert cache_stats()["nodes"] <= 2
    send(train, theta, 2, ctxs[2])
    assert cache_stats()["hits"] == 1
    send(train, theta, 2, ctxs[0])
    assert cache_stats()["hits"] == 1 and cache_stats()["misses"] == 4
    assert cache_stats()["nodes"] == 2


def test_cache_with_node_state_files_equals_in_memory_without_cache(tmp_path):
    """Offloaded to a node-state file between rounds (the LM app's default), the cache still
    hits (the file holds the token this process wrote) and the replies are unchanged."""
    ctx = new_context()
    train = with_node_state(handler(runtime=Runtime(cache_nodes=1)), default_dir=tmp_path)
    got = _rounds(train, ctx, _theta0())
    assert HANDLE_KEY in ctx.state and ADAMW_STATE_KEY not in ctx.state
    assert cache_stats()["hits"] == ROUNDS - 1
    want = _rounds(handler(runtime=Runtime(cache_nodes=0)), new_context(), _theta0())
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))


def test_cache_nodes_is_checked():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="cache_nodes must be an int >= 0"):
            Runtime(cache_nodes=bad)


def test_an_unhashable_model_fn_is_built_every_message_and_the_moments_still_hit():
    """A callable that cannot key the model pool (a dataclass instance) builds the model every
    message; the node's moments are still kept, and the replies are the no-cache ones."""
    from dataclasses import dataclass

    from flwr_isoloco.clients import make_diloco_train_handler

    @dataclass
    class ModelFn:
        built: int = 0

        def __call__(self, ctx):
            self.built += 1
            return model_fn(ctx)

    fn = ModelFn()
    kw = dict(train=TRAIN)
    got = _rounds(make_diloco_train_handler(fn, data_fn, **kw), new_context(), _theta0())
    assert fn.built == ROUNDS and cache_stats()["hits"] == ROUNDS - 1
    assert cache_stats()["model-builds"] == 0
    want = _rounds(handler(runtime=Runtime(cache_nodes=0)), new_context(), _theta0())
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))
