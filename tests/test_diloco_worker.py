"""DiLoCo worker: H inner AdamW steps, state kept in context.state across rounds.

The model is a real (tiny) ``transformers`` LLaMA from ``flwr_isoloco.models.llama``.
Between rounds the node's Context is serialised to protobuf and back, as Flower does in
deployment mode where every message runs in a fresh process.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto

from flwr_isoloco.clients import (
    Pace,
    Runtime,
    TrainSettings,
    make_diloco_train_handler,
    make_distributed_train_handler,
    make_lm_evaluate_handler,
)
from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY, WORKER_STATE_KEY, inner_lr
from flwr_isoloco.models.llama import build_llama, llama_config
from flwr_isoloco.strategies import DiLoCo

torch.set_num_threads(1)

CFG = llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16)
H, ROUNDS, LR, WARM = 3, 2, 1e-2, 2
TRAIN = TrainSettings(lr=LR, local_steps=H, num_server_rounds=ROUNDS, warmup_steps=WARM)


def model_fn(_ctx=None):
    return build_llama(CFG, seed=0)


def make_batches(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(n)]


BATCHES = make_batches()


def data_fn(_ctx):
    return lambda i: BATCHES[i % len(BATCHES)]  # explicit order: batch i at inner step i


def handler(train=TRAIN, **kw):
    return make_diloco_train_handler(model_fn, data_fn, train=train, **kw)


def new_context(pid=0):
    FakeGrid({}, num_nodes=1)  # sets Flower's task identity so Messages can be built
    return Context(1, 77, {"partition-id": pid, "num-partitions": 1}, RecordDict(), {})


def fresh_process(ctx: Context) -> Context:
    return context_from_proto(context_to_proto(ctx))


def send(train, theta, rnd, ctx, **config):
    msg = Message(
        RecordDict(
            {"arrays": ArrayRecord(theta), "config": ConfigRecord({"server-round": rnd, **config})}
        ),
        77,
        "train",
    )
    return train(msg, ctx)


def schedule(s, total=ROUNDS * H, lr=LR, warm=WARM, r=0.1):
    """Independent restatement of the documented warm-up + cosine schedule."""
    if s < warm:
        return lr * (s + 1) / warm
    return lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))


def reference_continuous_adamw(steps, batches=BATCHES, lr_at=schedule, losses=None):
    """``steps`` plain fp32 ``torch.optim.AdamW`` steps (betas 0.9/0.95, wd 0.1, grad clip 1) on
    ``batches`` in order, step ``s`` at lr ``lr_at(s)``; the model's state dict after them (and
    each step's loss appended to ``losses``)."""
    model = model_fn()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
    )
    for s in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(s)
        batch = batches[s % len(batches)]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))
        if losses is not None:
            losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_schedule_matches_documented_formula():
    for s in range(ROUNDS * H):
        assert inner_lr(s, ROUNDS * H, LR, WARM, 0.1) == pytest.approx(schedule(s), rel=1e-12)
    assert inner_lr(ROUNDS * H, ROUNDS * H, LR, WARM, 0.1) == pytest.approx(0.1 * LR)


def test_adamw_state_survives_rounds_and_equals_one_continuous_run():
    train = handler()
    ctx = new_context()
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    for rnd in (1, 2):
        reply = send(train, theta, rnd, ctx)
        assert not reply.has_error()
        theta = reply.content["arrays"].to_torch_state_dict()
        steps = ctx.state[ADAMW_STATE_KEY].to_torch_state_dict()["step"]
        assert steps.numel() == len(list(model_fn().parameters()))
        assert bool((steps == rnd * H).all())
        assert ctx.state[WORKER_STATE_KEY]["data-cursor"] == rnd * H
        ctx = fresh_process(ctx)  # deployment: the next message runs in a new process
    ref = reference_continuous_adamw(ROUNDS * H)
    for k in ref:
        torch.testing.assert_close(theta[k], ref[k], rtol=0, atol=1e-7, msg=k)


def test_a_state_in_the_per_parameter_layout_is_still_read():
    """A node state written in the per-parameter layout (``<param>.exp_avg`` ...) continues the
    run exactly as the flat layout does."""
    train = handler()
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    ctx = new_context()
    theta1 = send(train, theta, 1, ctx).content["arrays"].to_torch_state_dict()
    flat = ctx.state[ADAMW_STATE_KEY].to_torch_state_dict()
    named, off = {}, 0
    for i, (n, p) in enumerate(model_fn().named_parameters()):
        for m in ("exp_avg", "exp_avg_sq"):
            named[f"{n}.{m}"] = flat[m][off : off + p.numel()].reshape(p.shape)
        named[f"{n}.step"] = flat["step"][i : i + 1]
        off += p.numel()
    old = fresh_process(ctx)
    old.state[ADAMW_STATE_KEY] = ArrayRecord(named)
    a = send(train, theta1, 2, fresh_process(ctx)).content["arrays"].to_torch_state_dict()
    b = send(train, theta1, 2, old).content["arrays"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], theta1[k]) for k in a)


def test_losing_the_state_gives_a_different_model():
    """Control: the continuity test above would fail if state were not carried over."""
    train = handler()
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    for rnd in (1, 2):
        reply = send(train, theta, rnd, new_context())  # new, empty state each round
        theta = reply.content["arrays"].to_torch_state_dict()
    ref = reference_continuous_adamw(ROUNDS * H)
    assert max(float((theta[k] - ref[k]).abs().max()) for k in ref) > 1e-4


def test_reply_metrics_and_delta_payload():
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    w = send(handler(), theta, 1, new_context())
    d = send(handler(payload="delta"), theta, 1, new_context())
    m = w.content["metrics"]
    assert m["num-examples"] == H * 2 * 8  # H batches of B=2 rows, 8 predicted tokens each
    assert m["inner-steps"] == H and m["lr"] == pytest.approx(schedule(H - 1))
    assert d.content["config"]["payload"] == "delta"
    tw, td = w.content["arrays"].to_torch_state_dict(), d.content["arrays"].to_torch_state_dict()
    for k in theta:
        torch.testing.assert_close(td[k], theta[k] - tw[k], rtol=0, atol=0)


def test_sequence_data_is_visited_in_a_seeded_order_covering_every_batch():
    seen = []

    def loss_fn(model, batch):
        seen.append(int(batch[0, 0]))
        logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, 32), batch[:, 1:].reshape(-1)
        ), batch[:, 1:].numel()

    batches = [torch.full((1, 3), i) for i in range(4)]
    train = make_diloco_train_handler(
        model_fn,
        lambda c: batches,
        loss_fn=loss_fn,
        train=TrainSettings(local_steps=4, num_server_rounds=1),
    )
    send(train, {k: v.detach() for k, v in model_fn().state_dict().items()}, 1, new_context())
    assert sorted(seen) == [0, 1, 2, 3]


def test_bad_train_message_raises_clear_errors():
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    with pytest.raises(ValueError, match="server-round"):
        msg = Message(RecordDict({"arrays": ArrayRecord(theta)}), 77, "train")
        handler()(msg, new_context())
    with pytest.raises(ValueError, match="local-steps"):
        send(handler(), theta, 1, new_context(), **{"local-steps": "many"})


def test_evaluate_handler_token_weighted_loss():
    ev = make_lm_evaluate_handler(model_fn, lambda c: BATCHES[:3])
    theta = {k: v.detach() for k, v in model_fn().state_dict().items()}
    msg = Message(RecordDict({"arrays": ArrayRecord(theta)}), 77, "evaluate")
    m = ev(msg, new_context()).content["metrics"]
    model = model_fn()
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(
                model(input_ids=b[:, :-1]).logits.reshape(-1, 32),
                b[:, 1:].reshape(-1),
                reduction="sum",
            )
            for b in BATCHES[:3]
        ]
    expect = float(sum(losses)) / (3 * 16)
    assert m["num-examples"] == 48
    assert m["eval-loss"] == pytest.approx(expect, rel=1e-5)
    assert m["eval-ppl"] == pytest.approx(math.exp(expect), rel=1e-5)


def test_worker_under_diloco_on_fake_grid_lowers_eval_loss():
    train = handler(replace(TRAIN, lr=3e-2))
    ev = make_lm_evaluate_handler(model_fn, lambda c: BATCHES)
    grid = FakeGrid({"train": train, "evaluate": ev}, num_nodes=2)
    strat = DiLoCo(min_available_nodes=2)
    res = strat.start(
        grid=grid,
        initial_arrays=ArrayRecord(model_fn().state_dict()),
        num_rounds=ROUNDS,
        train_config=ConfigRecord({"num-server-rounds": ROUNDS}),
    )
    assert res.train_metrics_clientapp[ROUNDS]["replies-used"] == 2
    before = res.evaluate_metrics_clientapp[1]["eval-loss"]
    after = res.evaluate_metrics_clientapp[ROUNDS]["eval-loss"]
    assert after < before < math.log(32) + 0.5


def test_warmup_longer_than_the_run_is_refused_before_training():
    """issue 9, item 8: warm-up W > num-server-rounds * local-steps would never reach the peak."""
    ctx = new_context()
    theta = model_fn().state_dict()
    with pytest.raises(ValueError, match=r"warmup-steps 7 is longer than the run: .* = 6 inner"):
        send(handler(), theta, 1, ctx, **{"warmup-steps": 7})
    assert ADAMW_STATE_KEY not in ctx.state and WORKER_STATE_KEY not in ctx.state
    send(handler(), theta, 1, ctx, **{"warmup-steps": ROUNDS * H})  # exactly the run: allowed
    assert ctx.state[WORKER_STATE_KEY]["data-cursor"] == H


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "old,value,use",
    [
        ("lr", 0.01, "train=TrainSettings(lr=0.01)"),
        ("local_steps", 5, "train=TrainSettings(local_steps=5)"),
        ("time_budget_s", 2.0, "train=TrainSettings(time_budget_s=2.0)"),
        ("device", "cpu", "runtime=Runtime(device='cpu')"),
        ("cache_nodes", 0, "runtime=Runtime(cache_nodes=0)"),
        ("emulated_slowdown", 2.0, "pace=Pace(slowdown=2.0)"),
        ("emulated_step_s", 0.1, "pace=Pace(step_s=0.1)"),
    ],
)
def test_an_old_keyword_is_refused_naming_the_new_spelling(old, value, use):
    group = {"world_size": 2}
    for make, extra in ((make_diloco_train_handler, {}), (make_distributed_train_handler, group)):
        if extra and old == "device":
            continue  # the group takes devices=[...]: test_worker_distributed
        name = make.__name__
        with pytest.raises(TypeError, match=rf"^{name}\({old}=.*: use {name}\({re.escape(use)}\)$"):
            make(model_fn, data_fn, **extra, **{old: value})


def test_settings_are_checked_when_built_and_shown_by_what_differs():
    assert repr(TrainSettings()) == "TrainSettings()" and repr(Runtime()) == "Runtime()"
    assert (
        repr(TRAIN) == "TrainSettings(lr=0.01, local_steps=3, num_server_rounds=2, warmup_steps=2)"
    )
    assert (
        repr(Runtime(precision=" BF16", cache_nodes=0))
        == "Runtime(precision='bf16', cache_nodes=0)"
    )
    for bad, match in (
        (dict(local_steps=0), "TrainSettings.local_steps must be an int >= 1"),
        (dict(num_server_rounds=True), "TrainSettings.num_server_rounds must be an int"),
        (dict(lr=float("nan")), "TrainSettings.lr must be a finite number"),
        (dict(min_lr_ratio=1.5), r"TrainSettings.min_lr_ratio must be in \[0, 1\]"),
        (dict(betas=(0.9, 1.0)), r"TrainSettings.betas must be in \[0, 1\)"),
        (dict(betas=0.9), "TrainSettings.betas must be a pair"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainSettings(**bad)
    for bad, match in (
        (dict(state_layout="tree"), "Runtime.state_layout must be 'flat' or 'named'"),
        (dict(micro_batch=-1), "Runtime.micro_batch must be an int >= 0"),
        (dict(gradient_checkpointing=1), "Runtime.gradient_checkpointing must be True or False"),
    ):
        with pytest.raises(ValueError, match=match):
            Runtime(**bad)
    with pytest.raises(TypeError, match="train must be a TrainSettings"):
        make_diloco_train_handler(model_fn, data_fn, train={"lr": 0.1})
    with pytest.raises(TypeError, match="pace must be a Pace or None"):
        make_diloco_train_handler(model_fn, data_fn, pace=2.0)
    with pytest.raises(ValueError, match="payload must be 'weights' or 'delta'"):
        make_diloco_train_handler(model_fn, data_fn, payload="grad")
    assert make_diloco_train_handler(model_fn, data_fn, pace=Pace()).__name__ == "train"
