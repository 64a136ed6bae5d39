"""The DiLoCo worker as a 2-rank gloo DDP group on the CPU against the one-process worker.

The reply, the metrics and the AdamW state written back must equal the one-process handler's on
the same global batches. The loss masks some targets (ignore index), so the two ranks' slices
hold different token counts: plain DDP averaging would then differ from the whole-batch
gradient, and only the token weighting (``token_weighted_loss``) makes the step equal.

Tolerance: 1e-5 (absolute, fp32 weights of order 0.1-1 that move by about 1e-2 per round).
The group adds the same fp32 numbers in another order (the split forward pass, the all-reduce,
the weighted sum of slice losses): differences of a few fp32 ulps (~1e-7) per step, which
AdamW's ``m / sqrt(v)`` can magnify in entries whose ``v`` is tiny. A wrong weighting, a
shifted batch or a lost AdamW state moves the weights by 1e-4 or more (asserted below for the
weighting).

The functions the ranks use are module-level: each rank is a fresh (spawned) process.
"""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flwr_isoloco.clients import Runtime, TrainSettings
from flwr_isoloco.clients.diloco_worker import (
    ADAMW_STATE_KEY,
    WORKER_STATE_KEY,
    make_diloco_train_handler,
)
from flwr_isoloco.clients.distributed import (
    DistributedWorkerError,
    _resolve_devices,
    make_distributed_train_handler,
    slice_batch,
    token_weighted_loss,
)
from flwr_isoloco.clients.node_state import HANDLE_KEY, with_node_state
from flwr_isoloco.models.llama import build_llama, llama_config

torch.set_num_threads(1)

CFG = llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16)
KW = dict(train=TrainSettings(lr=1e-2, local_steps=3, num_server_rounds=2, warmup_steps=1))
TOL = 1e-5


def model_fn(_ctx=None):
    return build_llama(CFG, seed=0)


def _batches(n=5, rows=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (rows, 9), generator=g) for _ in range(n)]


BATCHES = _batches()


def data_fn(_ctx):
    return BATCHES  # a sequence: the worker's seeded epoch order decides the batches


def masked_loss(model, batch):
    """Next-token loss over targets >= 8 only (a stand-in for padding / ignore-index)."""
    inputs, targets = batch[:, :-1], batch[:, 1:].clone()
    targets[targets < 8] = -100
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100
    )
    return loss, int((targets != -100).sum())


def failing_data_fn(ctx):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one cannot read its shard")
    return data_fn(ctx)


def stuck_data_fn(ctx):
    if os.environ.get("RANK") == "1":
        time.sleep(3600)  # a rank that never reaches the first collective
    return data_fn(ctx)


def killed_data_fn(ctx):
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    return data_fn(ctx)


def _context():
    FakeGrid({}, num_nodes=1)  # Flower's task identity, so Messages can be built
    return Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})


def _send(train, theta, rnd, ctx):
    content = RecordDict(
        {"arrays": ArrayRecord(theta), "config": ConfigRecord({"server-round": rnd})}
    )
    return train(Message(content, 77, "train"), ctx)


def _arrays(record) -> dict[str, torch.Tensor]:
    return record.to_torch_state_dict()


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---------------------------------------------------------------- fast: no processes started


def test_slice_batch_gives_each_rank_its_rows_and_refuses_uneven_splits():
    batch = torch.arange(4 * 3).reshape(4, 3)
    parts = [slice_batch(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(parts), batch) and parts[1][0, 0] == 6
    nested = slice_batch({"ids": batch, "pair": (batch, batch + 1)}, 1, 2)
    assert torch.equal(nested["ids"], batch[2:]) and torch.equal(nested["pair"][1], batch[2:] + 1)
    with pytest.raises(ValueError, match="multiple of world_size"):
        slice_batch(batch[:3], 0, 2)
    with pytest.raises(ValueError, match="tensors"):
        slice_batch("text", 0, 2)


def test_token_weighted_average_is_the_whole_batch_gradient_when_slices_differ_in_tokens():
    model, batch, w = model_fn(), BATCHES[0], 2
    whole, n_all = masked_loss(model, batch)
    whole.backward()
    want = [p.grad.clone() for p in model.parameters()]
    slices = [masked_loss(model, slice_batch(batch, r, w)) for r in range(w)]
    counts = [n for _, n in slices]
    assert counts[0] != counts[1] and sum(counts) == n_all  # the case the weighting exists for
    loss_sum = sum(float(loss.detach()) * n for loss, n in slices)

    def averaged(weighted: bool) -> list[torch.Tensor]:
        model.zero_grad()
        for loss, n in slices:
            if weighted:
                loss, total = token_weighted_loss(loss, n, loss_sum, n_all, w)
                assert total == n_all and float(loss.detach()) == pytest.approx(
                    float(whole), rel=1e-6
                )
            (loss / w).backward(retain_graph=True)  # DDP's average over the ranks
        return [p.grad.clone() for p in model.parameters()]

    err = max(float((g - h).abs().max()) for g, h in zip(averaged(True), want, strict=True))
    plain = max(float((g - h).abs().max()) for g, h in zip(averaged(False), want, strict=True))
    print(f"max |averaged - whole-batch grad|: token-weighted {err:.1e}, plain DDP {plain:.1e}")
    assert err < 1e-6 < 1e-4 < plain  # plain DDP averaging is measurably wrong here


def test_options_are_refused_before_any_process_starts():
    make = make_distributed_train_handler
    with pytest.raises(ValueError, match="world_size"):
        make(model_fn, data_fn, world_size=0)
    with pytest.raises(ValueError, match="devices lists 1"):
        make(model_fn, data_fn, world_size=2, devices=["cpu"])
    with pytest.raises(ValueError, match="nccl"):
        make(model_fn, data_fn, world_size=2, devices=["cpu", "cpu"], backend="nccl")
    with pytest.raises(ValueError, match="devices="):
        make(model_fn, data_fn, world_size=2, device="cpu")
    with pytest.raises(ValueError, match="devices="):
        make(model_fn, data_fn, world_size=2, runtime=Runtime(device="cpu"))
    with pytest.raises(ValueError, match="payload"):
        make(model_fn, data_fn, world_size=2, payload="grad")
    with pytest.raises(ValueError, match="model_fn must be picklable"):
        make(lambda ctx: model_fn(), data_fn, world_size=2)


def test_default_devices_are_one_gpu_per_rank_and_too_few_gpus_are_refused(monkeypatch):
    assert _resolve_devices(2, None, None) == (["cpu", "cpu"], "gloo")  # no GPU visible here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert _resolve_devices(2, None, None) == (["cuda:0", "cuda:1"], "nccl")
    assert _resolve_devices(2, "gloo", ["cuda:2", "cuda:0"]) == (["cuda:2", "cuda:0"], "gloo")
    with pytest.raises(ValueError, match="sees 3.*num-gpus"):
        _resolve_devices(4, None, None)
    with pytest.raises(ValueError, match="two ranks on one GPU"):
        _resolve_devices(2, None, ["cuda:1", "cuda:1"])
    with pytest.raises(ValueError, match="only 3 CUDA devices"):
        _resolve_devices(2, None, ["cuda:0", "cuda:3"])
    with pytest.raises(ValueError, match="all 'cpu' or all"):
        _resolve_devices(2, None, ["cpu", "cuda:0"])


# ------------------------------------------------------- gloo group: 2 spawned ranks on the CPU


def _one_process_and_group(micro_batch: int):
    """Round 2 from a node state holding round 1's AdamW moments, one process vs 2 ranks."""
    kw = dict(KW, loss_fn=masked_loss, runtime=Runtime(micro_batch=micro_batch))
    theta = model_fn().state_dict()
    ctx = _context()
    one = make_diloco_train_handler(model_fn, data_fn, **kw)
    theta1 = _arrays(_send(one, theta, 1, ctx).content.array_records["arrays"])
    ctx_one, ctx_group = ctx, copy.deepcopy(ctx)
    group = make_distributed_train_handler(model_fn, data_fn, world_size=2, backend="gloo", **kw)
    start = time.perf_counter()
    reply_group = _send(group, theta1, 2, ctx_group)
    seconds = time.perf_counter() - start
    reply_one = _send(one, theta1, 2, ctx_one)
    return theta1, (reply_one, ctx_one), (reply_group, ctx_group), seconds


def _assert_same(theta1, one, group):
    (r1, c1), (r2, c2) = one, group
    new1, new2 = (_arrays(r.content.array_records["arrays"]) for r in (r1, r2))
    moved, off = _max_diff(new1, theta1), _max_diff(new1, new2)
    print(f"round moved the weights by {moved:.1e}; group vs one process {off:.1e}")
    assert moved > 1e-3 and off < TOL
    m1, m2 = r1.content.metric_records["metrics"], r2.content.metric_records["metrics"]
    assert m1["num-examples"] == m2["num-examples"] and m1["lr"] == m2["lr"]
    assert m2["train-loss"] == pytest.approx(m1["train-loss"], rel=1e-6)
    assert dict(c1.state[WORKER_STATE_KEY]) == dict(c2.state[WORKER_STATE_KEY])
    s1, s2 = _arrays(c1.state[ADAMW_STATE_KEY]), _arrays(c2.state[ADAMW_STATE_KEY])
    s1.pop("cache-token", None)  # the one-process worker's cache tag; the ranks keep no cache
    assert _max_diff(s1, s2) < TOL


def test_two_gloo_ranks_reply_as_one_process_on_the_same_global_batches():
    theta1, one, group, seconds = _one_process_and_group(micro_batch=0)
    _assert_same(theta1, one, group)
    print(f"2-rank gloo message: {seconds:.2f} s (spawn, imports, rendezvous, 3 steps)")


@pytest.mark.slow
def test_two_gloo_ranks_with_micro_batches_reply_as_one_process():
    theta1, one, group, _ = _one_process_and_group(micro_batch=1)
    _assert_same(theta1, one, group)


def test_a_rank_that_raises_fails_the_message_in_the_parent_without_hanging():
    train = make_distributed_train_handler(
        model_fn, failing_data_fn, world_size=2, backend="gloo", timeout_s=60, **KW
    )
    ctx = _context()
    start = time.perf_counter()
    with pytest.raises(DistributedWorkerError, match="rank 1 of 2") as err:
        _send(train, model_fn().state_dict(), 1, ctx)
    assert "rank one cannot read its shard" in str(err.value)
    assert time.perf_counter() - start < 50  # the other rank was ended, not waited for
    assert ADAMW_STATE_KEY not in ctx.state  # nothing written back from a failed group


@pytest.mark.slow
def test_a_stuck_rank_times_out_and_a_killed_rank_is_named():
    ctx, theta = _context(), model_fn().state_dict()
    # timeout_s: long enough for the spawned ranks to start (imports, rendezvous), no longer
    # (the test waits it out); the group gives up after it whichever side times out first
    stuck = make_distributed_train_handler(
        model_fn, stuck_data_fn, world_size=2, backend="gloo", timeout_s=10, **KW
    )
    start = time.perf_counter()
    with pytest.raises(DistributedWorkerError, match="timeout|Timed out|timed out"):
        _send(stuck, theta, 1, ctx)
    assert time.perf_counter() - start < 40  # timeout_s and the clean-up, not an hour
    killed = make_distributed_train_handler(
        model_fn, killed_data_fn, world_size=2, backend="gloo", timeout_s=60, **KW
    )
    with pytest.raises(DistributedWorkerError, match="(?s)rank 1 of 2 failed.*SIGKILL.*killed"):
        _send(killed, theta, 1, ctx)
    assert not ctx.state  # nothing written back from a failed group


@pytest.mark.slow
def test_two_group_rounds_through_node_state_files_match_two_one_process_rounds(tmp_path):
    """The group's own AdamW state, kept in a node-state file between rounds, restores round 2."""
    finals = []
    for group in (False, True):
        kw = dict(KW, loss_fn=masked_loss)
        train = (
            make_distributed_train_handler(model_fn, data_fn, world_size=2, **kw)
            if group
            else make_diloco_train_handler(model_fn, data_fn, **kw)
        )
        train = with_node_state(train, default_dir=tmp_path / str(group))
        ctx, theta = _context(), model_fn().state_dict()
        for rnd in (1, 2):
            theta = _arrays(_send(train, theta, rnd, ctx).content.array_records["arrays"])
        assert HANDLE_KEY in ctx.state  # the records waited in the file, not in the Context
        finals.append(theta)
    assert _max_diff(finals[0], model_fn().state_dict()) > 1e-3
    assert _max_diff(*finals) < TOL
