"""The DiLoCo worker's moments file (``flwr_isoloco.clients.moments_file``), used under
``with_node_state(temp_dir=True)``: a fresh process continues bitwise from it, a message that
fails leaves the previous round's file for an exact retry, and a file that is damaged, replaced,
cut short or not completely written is refused with a logged reason and the node's optimiser
starts fresh, exactly as a node whose state was lost."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
from test_diloco_worker import (
    BATCHES,
    TRAIN,
    fresh_process,
    handler,
    model_fn,
    new_context,
    send,
)

from flwr_isoloco.clients import moments_file as mf
from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY
from flwr_isoloco.clients.node_state import with_node_state
from flwr_isoloco.clients.worker_cache import clear_caches


@pytest.fixture(autouse=True)
def _private_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    clear_caches()
    yield
    clear_caches()


def _theta0():
    return {k: v.detach() for k, v in model_fn().state_dict().items()}


def _arrays(reply):
    assert not reply.has_error(), reply.error
    return reply.content["arrays"].to_torch_state_dict()


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _round1(**kw):
    """Round 1 under the temp folder; (theta1, the context as a fresh process sees it, path)."""
    train = with_node_state(handler(**kw), temp_dir=True)
    ctx = new_context()
    theta1 = _arrays(send(train, _theta0(), 1, ctx))
    path = mf.Path(ctx.state[ADAMW_STATE_KEY]["path"])
    clear_caches()  # a fresh process: no cache, no mapping
    return train, theta1, fresh_process(ctx), path


def _fresh_optimiser_reply(theta1):
    """Round 2 of a node that lost its AdamW state (the reference for a refused file)."""
    ctx = new_context()
    send(handler(), _theta0(), 1, ctx)
    del ctx.state[ADAMW_STATE_KEY]
    return _arrays(send(handler(), theta1, 2, ctx))


def test_a_fresh_process_continues_bitwise_from_the_file():
    train, theta1, ctx, path = _round1()
    assert path.is_file() and (path.stat().st_mode & 0o777) == 0o600
    got = _arrays(send(train, theta1, 2, ctx))
    ref_ctx = new_context()
    want = _arrays(send(handler(), _arrays(send(handler(), _theta0(), 1, ref_ctx)), 2, ref_ctx))
    assert _same(got, want)
    assert not _same(got, _fresh_optimiser_reply(theta1))  # control: the moments mattered


def _flip_value(path):
    with open(path, "r+b") as fh:
        fh.seek(mf.HEADER_BYTES + 40)
        b = fh.read(1)
        fh.seek(mf.HEADER_BYTES + 40)
        fh.write(bytes([b[0] ^ 0x10]))


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 8)


def _other_token(path):
    with open(path, "r+b") as fh:
        fh.seek(16)
        fh.write(b"\xff" * 16)


def _unfinished(path):
    with open(path, "r+b") as fh:
        fh.seek(16)
        fh.write(bytes(16))


def _garbage(path):
    path.write_bytes(b"not a moments file" * 100)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_flip_value, "damaged"),
        (_truncate, "bytes"),
        (_other_token, "not the file this node wrote last"),
        (_unfinished, "did not complete"),
        (_garbage, "bytes"),
        (lambda p: p.unlink(), "unreadable"),
    ],
)
def test_a_bad_file_is_refused_logged_and_the_optimiser_starts_fresh(damage, reason, caplog):
    train, theta1, ctx, path = _round1()
    damage(path)
    with caplog.at_level(logging.WARNING):
        got = _arrays(send(train, theta1, 2, ctx))
    assert "moments file refused" in caplog.text and reason in caplog.text
    assert _same(got, _fresh_optimiser_reply(theta1))
    clear_caches()  # waits for the background write
    assert path.is_file()  # rebuilt by the round: the next one reads a good file
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _arrays(send(train, got, 3, fresh_process(ctx), **{"num-server-rounds": 3}))
    assert "refused" not in caplog.text


def test_a_message_that_fails_mid_round_leaves_the_previous_file_for_an_exact_retry(caplog):
    """AdamW never runs on the file: after a failure past the first step the file still holds
    round 1's moments, and the retry of round 2 equals a run without the failure."""
    failing = {"on": False}

    def data_fn(_ctx):
        def batch(i):
            if failing["on"] and i == 4:
                raise RuntimeError("data source went away")
            return BATCHES[i % len(BATCHES)]

        return batch

    from flwr_isoloco.clients import Runtime, make_diloco_train_handler

    kw = dict(train=TRAIN)
    train = with_node_state(make_diloco_train_handler(model_fn, data_fn, **kw), temp_dir=True)
    ctx = new_context()
    theta1 = _arrays(send(train, _theta0(), 1, ctx))
    failing["on"] = True
    with pytest.raises(RuntimeError, match="went away"):
        send(train, theta1, 2, ctx)
    failing["on"] = False
    with caplog.at_level(logging.WARNING):
        got = _arrays(send(train, theta1, 2, ctx))
    assert "refused" not in caplog.text
    ref_ctx = new_context()
    ref = make_diloco_train_handler(model_fn, data_fn, runtime=Runtime(cache_nodes=0), **kw)
    want = _arrays(send(ref, _arrays(send(ref, _theta0(), 1, ref_ctx)), 2, ref_ctx))
    assert _same(got, want)


def test_steps_that_are_not_counts_and_other_models_are_refused(tmp_path):
    model = model_fn()
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([q for _, q in named])
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    opt.step()
    opt.state[named[0][1]]["step"] = torch.tensor(1.5)
    n, p = sum(q.numel() for _, q in named), len(named)
    h = mf.store(opt, named, tmp_path / "m.moments", b"\x01" * 16)
    mf.wait_writes()
    with pytest.raises(mf.MomentsFileError, match="steps"):
        mf.read_verified(h, mf.names_digest(named), n, p)
    with pytest.raises(mf.MomentsFileError, match="other parameter names"):
        mf.read_verified(h, mf.names_digest(named[::-1]), n, p)
    with pytest.raises(mf.MomentsFileError, match="values"):
        mf.read_verified(h, mf.names_digest(named), n + 1, p)
