"""The DiLoCo worker's replies are bitwise the ones of the reference implementation.

The digests below are sha256 over every reply of a fixed run (each array's name, dtype, shape
and bytes, in name order, plus the reply's metrics), computed with the worker that serialised
everything through Flower's own ``ArrayRecord`` conversions and kept the AdamW moments in
``context.state``; the worker under test unpacks without copies, packs with one and, under
``with_node_state(temp_dir=True)``, keeps the moments in a file of the node written in the
background. Every fp32 path (cached, a fresh process per message, node-state files, the temp folder) gave that worker one
digest. They pin the numbers, not the speed: a change that alters one bit of one reply fails.

Floating-point results depend on the CPU's kernels, so the digests hold for the torch version
and machine architecture they were computed on (:data:`PINNED`); elsewhere the test is skipped
and ``test_worker_cache`` / ``test_diloco_worker`` (continuous-run and no-cache references)
still cover the numbers.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import replace

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto

from flwr_isoloco.clients import Runtime, TrainSettings, make_diloco_train_handler
from flwr_isoloco.clients.node_state import with_node_state
from flwr_isoloco.clients.worker_cache import clear_caches
from flwr_isoloco.models.hf import model_arrays
from flwr_isoloco.models.llama import build_llama, llama_config

torch.set_num_threads(1)

CFG = llama_config(
    vocab_size=48, hidden=16, layers=2, heads=4, kv_heads=2, max_seq_len=16, tie_embeddings=True
)
H, ROUNDS = 3, 3
PINNED = {"torch": "2.13.0+cpu", "machine": "x86_64"}
DIGESTS = {
    "fp32-cached": "a2c9246ac4d1c150a0ae03d013e7b730f7fdd8d97d5980c29a1eca0a674c779b",
    "fp32-fresh-process": "a2c9246ac4d1c150a0ae03d013e7b730f7fdd8d97d5980c29a1eca0a674c779b",
    "bf16-cached": "2f74b935eefe6b7f111168f6cc0a310b47bf0e40aceb16e20494549f9e871782",
    "delta-cached": "8a3b6d3f6896f34b1b5fa66877254f3e6c16e228c06265a08d11051359443274",
    "fp32-node-state-files": "a2c9246ac4d1c150a0ae03d013e7b730f7fdd8d97d5980c29a1eca0a674c779b",
    "fp32-temp-dir-cached": "a2c9246ac4d1c150a0ae03d013e7b730f7fdd8d97d5980c29a1eca0a674c779b",
    "fp32-temp-dir-fresh-process": "a2c9246ac4d1c150a0ae03d013e7b730f7fdd8d97d5980c29a1eca0a674c779b",
}


def _batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 48, (2, 9), generator=g) for _ in range(4)]


BATCHES = _batches()


TRAIN = TrainSettings(lr=3e-3, local_steps=H, num_server_rounds=ROUNDS, warmup_steps=2)


def _handler(train=TRAIN, **kw):
    return make_diloco_train_handler(
        lambda _ctx: build_llama(CFG, seed=0),
        lambda _ctx: lambda i: BATCHES[i % len(BATCHES)],
        train=train,
        **kw,
    )


def _context():
    FakeGrid({}, num_nodes=1)
    return Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})


def _digest_reply(h, reply) -> None:
    assert not reply.has_error(), reply.error
    for key in sorted(reply.content.array_records):
        rec = reply.content.array_records[key]
        for name in sorted(rec):
            arr = rec[name]
            h.update(f"{key}/{name}:{arr.dtype}:{tuple(arr.shape)}".encode())
            h.update(arr.numpy().tobytes())
    metrics = reply.content["metrics"]
    h.update(repr(sorted(metrics.items())).encode())


def _run(train, fresh: bool = False, **config) -> str:
    """sha256 of ``ROUNDS`` replies of ``train``; each message carries the previous reply's
    weights (a delta reply: theta - delta); ``fresh``: every message in a new process (context
    through protobuf, empty caches)."""
    h = hashlib.sha256()
    ctx = _context()
    theta = model_arrays(build_llama(CFG, seed=0))
    for rnd in range(1, ROUNDS + 1):
        msg = Message(
            RecordDict({"arrays": theta, "config": ConfigRecord({"server-round": rnd, **config})}),
            77,
            "train",
        )
        reply = train(msg, ctx)
        _digest_reply(h, reply)
        out = reply.content["arrays"]
        if reply.content.config_records.get("config", {}).get("payload") == "delta":
            old, d = theta.to_torch_state_dict(), out.to_torch_state_dict()
            theta = ArrayRecord({k: old[k] - d[k] for k in old})
        else:
            theta = ArrayRecord(out.to_torch_state_dict())
        if fresh:
            ctx = context_from_proto(context_to_proto(ctx))
            clear_caches()
    return h.hexdigest()


@pytest.fixture(autouse=True)
def _clean():
    clear_caches()
    yield
    clear_caches()


def _pinned() -> None:
    here = {"torch": torch.__version__, "machine": platform.machine()}
    if here != PINNED:
        pytest.skip(f"digests computed on {PINNED}, this is {here}")


@pytest.mark.parametrize("case", sorted(DIGESTS))
def test_replies_are_bitwise_the_reference(case, tmp_path, monkeypatch):
    _pinned()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_temp_dir under tmp_path
    if case == "fp32-cached":
        got = _run(_handler())
    elif case == "fp32-fresh-process":
        got = _run(_handler(), fresh=True)
    elif case == "bf16-cached":
        got = _run(_handler(runtime=Runtime(precision="bf16")))
    elif case == "delta-cached":
        got = _run(_handler(payload="delta"))
    elif case.startswith("fp32-temp-dir"):  # the moments in the node's moments file
        got = _run(with_node_state(_handler(), temp_dir=True), fresh=case.endswith("process"))
        assert list(tmp_path.rglob("adamw-p0-n77.moments"))
    else:
        got = _run(with_node_state(_handler(), default_dir=tmp_path), fresh=True)
    assert got == DIGESTS[case]


def test_the_digest_sees_one_changed_bit():
    """Control: the digest is not blind to the numbers (another lr, another digest)."""
    _pinned()
    a = _run(_handler())
    clear_caches()
    b = _run(_handler(replace(TRAIN, lr=3e-3 * (1 + 2**-20))))
    assert a != b and a == DIGESTS["fp32-cached"]
