"""The DiLoCo worker on tied-embedding models and with gradient accumulation (micro-batch)."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flwr_isoloco.clients import Runtime, TrainSettings, make_diloco_train_handler
from flwr_isoloco.clients.diloco_worker import _accumulate, next_token_loss
from flwr_isoloco.models.hf import model_arrays, shared_tensors
from flwr_isoloco.models.llama import build_llama, llama_config

torch.set_num_threads(1)
CFG = llama_config(vocab_size=48, hidden=16, layers=1, heads=2, max_seq_len=16, tie_embeddings=True)


def _batches(n=4, rows=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (rows, 9), generator=g) for _ in range(n)]


BATCHES = _batches()


def _grads(micro):
    model = build_llama(CFG, seed=0)
    named = [(n, p) for n, p in model.named_parameters()]
    loss, n = _accumulate(model, named, BATCHES[0], next_token_loss, micro)
    return loss, n, {k: p.grad.clone() for k, p in named}


@pytest.mark.parametrize("micro", [1, 4])  # 4 splits 6 rows into 4 + 2: unequal pieces
def test_accumulated_gradient_equals_the_full_batch(micro):
    loss0, n0, g0 = _grads(0)
    loss1, n1, g1 = _grads(micro)
    assert n1 == n0 == 6 * 8
    assert abs(float(loss1) - float(loss0)) < 1e-6
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7)


def _send(train, arrays, ctx):
    FakeGrid({}, num_nodes=1)
    cfg = ConfigRecord({"server-round": 1, "num-server-rounds": 1, "local-steps": 2})
    msg = Message(RecordDict({"arrays": arrays, "config": cfg}), 77, "train")
    return train(msg, ctx)


def _reply(**kw):
    train = make_diloco_train_handler(
        lambda ctx: build_llama(CFG, seed=5),
        lambda ctx: BATCHES,
        train=TrainSettings(lr=1e-2, warmup_steps=0),
        **kw,
    )
    FakeGrid({}, num_nodes=1)
    ctx = Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
    return _send(train, model_arrays(build_llama(CFG, seed=0)), ctx)


def test_tied_model_travels_once_and_micro_batches_give_the_same_step():
    full = _reply().content.array_records["arrays"].to_torch_state_dict()
    assert "lm_head.weight" not in full and "model.embed_tokens.weight" in full
    assert shared_tensors(build_llama(CFG)) == {"lm_head.weight": "model.embed_tokens.weight"}
    micro = (
        _reply(runtime=Runtime(micro_batch=2)).content.array_records["arrays"].to_torch_state_dict()
    )
    # 2 AdamW steps of lr 1e-2 from gradients equal to fp32 rounding; Adam's first step is
    # ~lr * sign(g), so a near-zero gradient entry moves by up to ~1e-2 * its rounding ratio
    for k in full:
        torch.testing.assert_close(micro[k], full[k], rtol=1e-4, atol=1e-4)


def test_a_message_with_the_tie_sent_twice_differently_is_refused():
    arrays = build_llama(CFG, seed=0).state_dict()
    arrays["lm_head.weight"] = arrays["lm_head.weight"] + 1.0
    train = make_diloco_train_handler(lambda ctx: build_llama(CFG, seed=5), lambda ctx: BATCHES)
    ctx = Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
    with pytest.raises(ValueError, match="different values"):
        _send(train, ArrayRecord(arrays), ctx)


def test_bad_micro_batch_is_refused():
    with pytest.raises(ValueError, match="micro_batch"):
        Runtime(micro_batch=-1)
