"""Node state off the server's process (issue 18): ``with_node_state`` keeps a DiLoCo worker's
AdamW moments in its node-state file between rounds and only a handle in ``context.state``.

The worker is the real one on a tiny LLaMA (``tests/test_diloco_worker.py``'s helpers); the
reference for exactness is the same worker with its state kept in memory, and an independent
continuous AdamW run. Between rounds the Context goes through protobuf, as in deployment.
"""

from __future__ import annotations

import logging
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord
from test_diloco_worker import (
    ROUNDS,
    TRAIN,
    H,
    fresh_process,
    handler,
    model_fn,
    new_context,
    reference_continuous_adamw,
    send,
)

from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY, WORKER_STATE_KEY
from flwr_isoloco.clients.node_state import (
    HANDLE_KEY,
    STATE_DIR_KEY,
    file_digest,
    with_node_state,
)

torch.set_num_threads(1)


def _theta0():
    return {k: v.detach() for k, v in model_fn().state_dict().items()}


def _rounds(train, ctx, rounds=ROUNDS, before_round=None, **config):
    theta = _theta0()
    for rnd in range(1, rounds + 1):
        if before_round is not None:
            before_round(rnd, ctx)
        reply = send(train, theta, rnd, ctx, **config)
        assert not reply.has_error()
        theta = reply.content["arrays"].to_torch_state_dict()
        ctx = fresh_process(ctx)
    return theta, ctx


def test_state_lives_on_disk_and_the_run_is_bitwise_the_in_memory_one(tmp_path):
    mem, _ = _rounds(handler(), new_context())
    train = with_node_state(handler())
    seen = []

    def check(rnd, ctx):
        if rnd > 1:  # only the handle and the small records between rounds
            assert ADAMW_STATE_KEY not in ctx.state
            assert not any(isinstance(r, ArrayRecord) for r in ctx.state.values())
            assert ctx.state[WORKER_STATE_KEY]["data-cursor"] == (rnd - 1) * H
            h = ctx.state[HANDLE_KEY]
            assert h["round"] == rnd - 1 and h["digest"] == file_digest(Path(h["path"]))
            seen.append(len(pickle.dumps(ctx.state)))

    disk, ctx = _rounds(train, new_context(), before_round=check, **{STATE_DIR_KEY: str(tmp_path)})
    assert all(torch.equal(mem[k], disk[k]) for k in mem)
    ref = reference_continuous_adamw(ROUNDS * H)
    assert all(torch.allclose(disk[k], ref[k], rtol=0, atol=1e-7) for k in ref)
    # the state the server-side process holds is a few hundred bytes, the moments are not
    moments = 2 * 4 * sum(p.numel() for p in model_fn().parameters())
    assert seen and max(seen) < 2000 < moments
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "node-p0-r1.safetensors",
        "node-p0-r2.safetensors",
    ]


def _break_and_run(tmp_path, caplog, damage):
    """Round 1 offloads; ``damage(path)`` then spoils the file; round 2 must still reply."""
    train = with_node_state(handler())
    conf = {STATE_DIR_KEY: str(tmp_path)}
    ctx = new_context()
    theta = send(train, _theta0(), 1, ctx, **conf).content["arrays"].to_torch_state_dict()
    damage(tmp_path / "node-p0-r1.safetensors")
    ctx = fresh_process(ctx)
    with caplog.at_level(logging.WARNING):
        reply = send(train, theta, 2, ctx, **conf)
    assert not reply.has_error()
    # the data cursor (a small record, kept in memory) survived; the moments did not
    assert ctx.state[WORKER_STATE_KEY]["data-cursor"] == 2 * H
    assert "p0: cannot read its state back" in caplog.text
    return reply.content["arrays"].to_torch_state_dict(), theta


def _fresh_optimiser_round2(theta1):
    """Round 2 from ``theta1`` with an empty AdamW but the data cursor of round 1."""
    ctx = new_context()
    ctx.state[WORKER_STATE_KEY] = ConfigRecord({"data-cursor": H, "last-round": 1})
    return send(handler(), theta1, 2, ctx).content["arrays"].to_torch_state_dict()


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _replace_by_other_node(path):
    """A valid node-state file of the right name but someone else's state (e.g. a second node
    configured with the same partition): its digest is not the one this node wrote."""
    other = path.parent / "other"
    train = with_node_state(handler(replace(TRAIN, lr=5e-2)))
    send(train, _theta0(), 1, new_context(), **{STATE_DIR_KEY: str(other)})
    shutil.copy(other / "node-p0-r1.safetensors", path)
    shutil.rmtree(other)


def test_damaged_missing_or_replaced_file_costs_the_optimiser_not_the_reply(tmp_path, caplog):
    for i, damage in enumerate((_flip_byte, lambda p: p.unlink(), _replace_by_other_node)):
        caplog.clear()
        folder = tmp_path / str(i)
        got, theta1 = _break_and_run(folder, caplog, damage)
        want = _fresh_optimiser_round2(theta1)
        assert all(torch.equal(got[k], want[k]) for k in want), damage


def test_offload_false_and_no_folder_keep_the_state_in_memory(tmp_path):
    ctx = new_context()
    send(with_node_state(handler()), _theta0(), 1, ctx)  # no folder anywhere: unchanged
    assert isinstance(ctx.state[ADAMW_STATE_KEY], ArrayRecord) and HANDLE_KEY not in ctx.state
    assert not any(tmp_path.iterdir())
    ctx = new_context()
    send(
        with_node_state(handler(), offload=False),
        _theta0(),
        1,
        ctx,
        **{STATE_DIR_KEY: str(tmp_path)},
    )
    assert isinstance(ctx.state[ADAMW_STATE_KEY], ArrayRecord) and HANDLE_KEY not in ctx.state
    assert (tmp_path / "node-p0-r1.safetensors").is_file()


def test_default_dir_offloads_without_the_servers_key(tmp_path):
    mem, _ = _rounds(handler(), new_context())
    disk, ctx = _rounds(with_node_state(handler(), default_dir=tmp_path), new_context())
    assert all(torch.equal(mem[k], disk[k]) for k in mem)
    assert HANDLE_KEY in ctx.state and ADAMW_STATE_KEY not in ctx.state


def test_unwritable_folder_keeps_the_state_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    mem, _ = _rounds(handler(), new_context())
    with caplog.at_level(logging.WARNING):
        disk, ctx = _rounds(
            with_node_state(handler()), new_context(), **{STATE_DIR_KEY: str(blocker)}
        )
    assert "cannot save state" in caplog.text
    assert all(torch.equal(mem[k], disk[k]) for k in mem)  # nothing lost
    assert isinstance(ctx.state[ADAMW_STATE_KEY], ArrayRecord) and HANDLE_KEY not in ctx.state


def test_failed_round_keeps_the_handle(tmp_path):
    train = with_node_state(handler())
    conf = {STATE_DIR_KEY: str(tmp_path)}
    ctx = new_context()
    theta1 = send(train, _theta0(), 1, ctx, **conf).content["arrays"].to_torch_state_dict()
    handle = dict(ctx.state[HANDLE_KEY])
    bad = dict(theta1)
    bad.pop(next(iter(bad)))  # strict load fails inside the worker
    try:
        send(train, bad, 2, ctx, **conf)
    except (RuntimeError, ValueError):
        pass
    assert dict(ctx.state[HANDLE_KEY]) == handle and ADAMW_STATE_KEY not in ctx.state
    a = send(train, theta1, 2, fresh_process(ctx), **conf).content["arrays"].to_torch_state_dict()
    mem_ctx = new_context()
    send(handler(), _theta0(), 1, mem_ctx)
    b = send(handler(), theta1, 2, mem_ctx).content["arrays"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_temp_dir_keeps_the_state_on_disk_removed_with_the_run(tmp_path, monkeypatch, caplog):
    """``temp_dir=True`` and no folder configured (the LM app with ``checkpoint=false``): the
    node's state goes to this machine's private per-run folder (newest node-state file only;
    the AdamW moments in the worker's moments file there, context.state holding
    its handle), the run is bitwise the in-memory one, and :func:`remove_run_temp_dir` removes
    the folder."""
    import tempfile

    from flwr_isoloco.clients.node_state import remove_run_temp_dir, run_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mem, _ = _rounds(handler(), new_context())
    folder = run_temp_dir(1)  # makes the private parent only
    assert folder.parent.parent == tmp_path

    def check(rnd, ctx):
        if rnd > 1:
            assert not any(isinstance(r, ArrayRecord) for r in ctx.state.values())
            h = ctx.state[HANDLE_KEY]
            assert Path(h["path"]) == folder / f"node-p0-r{rnd - 1}.safetensors"
            moments = Path(ctx.state[ADAMW_STATE_KEY]["path"])  # the worker's moments file
            assert moments == folder / "adamw-p0-n77.moments"
            assert sorted(p.name for p in folder.iterdir()) == sorted(
                [Path(h["path"]).name, moments.name]
            )

    disk, ctx = _rounds(
        with_node_state(handler(), temp_dir=True), new_context(), before_round=check
    )
    assert all(torch.equal(mem[k], disk[k]) for k in mem)
    assert HANDLE_KEY in ctx.state and isinstance(ctx.state[ADAMW_STATE_KEY], ConfigRecord)
    assert (folder.parent.stat().st_mode & 0o777) == 0o700
    remove_run_temp_dir(1)
    assert not folder.exists()
    # a temp parent others can write is not trusted: the state stays in memory, the reply goes
    folder.parent.chmod(0o777)
    ctx = new_context()
    with caplog.at_level(logging.WARNING):
        reply = send(with_node_state(handler(), temp_dir=True), _theta0(), 1, ctx)
    assert not reply.has_error() and isinstance(ctx.state[ADAMW_STATE_KEY], ArrayRecord)
    assert "no private temp folder" in caplog.text and not folder.exists()
