"""Asynchronous DiLoCo / IsoLoCo rounds (issue 38): staleness weights, delayed Nesterov, the stale
bound, default-off, exact resume, refusals, and one real Ray run with nodes of unequal speed.

Federations run on :class:`ScriptedGrid`, a ``FakeGrid`` whose replies arrive in a fixed order
of nodes (``order``: the k-th reply to arrive is the task in flight of node ``order[k]``), so
every expected model is computed by hand or by :func:`reference_run`, an independent
implementation of the documented semantics in plain torch (fp64).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from outer_reference import assert_close, sync_rounds

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.checkpoint.spec import CheckpointError
from flwr_isoloco.merging.outer import OuterSGD
from flwr_isoloco.strategies import CentralDP, DiLoCo, IsoLoCo, LocalDP, ReplyChecks, Rounds
from flwr_isoloco.strategies.diloco.asynchronous_tasks import staleness_discount

torch.set_num_threads(1)

N_EX = [1, 1, 2]  # num-examples of partitions 0, 1, 2


def target(pid: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + pid)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def init_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def local(theta: dict[str, torch.Tensor], pid: int, _rnd: int = 0) -> dict[str, torch.Tensor]:
    """theta_i = theta + 0.5 (target_pid - theta): delta_i = 0.5 (theta - target_pid)."""
    t = target(pid)
    return {k: v + 0.5 * (t[k] - v) for k, v in theta.items()}


def train(msg: Message, ctx) -> Message:
    """:func:`local` as a ClientApp handler."""
    pid = int(ctx.node_config["partition-id"])
    new = local(msg.content["arrays"].to_torch_state_dict(), pid)
    metrics = MetricRecord({"num-examples": N_EX[pid], "train-loss": float(pid)})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class ScriptedGrid(FakeGrid):
    """Replies arrive in the order of ``order`` (partition ids); a pull of any other message
    returns nothing. ``taken`` counts the replies released."""

    def __init__(self, order: list[int], num_nodes: int = 3) -> None:
        super().__init__({"train": train}, num_nodes=num_nodes)
        self.order, self.taken = list(order), 0
        self.time_source = VirtualClock()

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            msg = self._pending.get(mid)
            if msg is None or self.taken >= len(self.order):
                continue
            if self.partition_of[msg.metadata.dst_node_id] != self.order[self.taken]:
                continue
            self.taken += 1
            out.extend(super().pull_messages([mid]))
        return out


def strategy(**kw) -> DiLoCo:
    """hold=0 unless given: every node is sent work the moment its reply is in (the semantics
    :func:`reference_run` writes out; the hold is tested on :class:`TimedGrid`)."""
    keys = ("replies_per_step", "max_staleness", "staleness", "momentum_every", "hold")
    rounds = {"hold": 0.0, **{k: kw.pop(k) for k in keys if k in kw}}
    base = dict(
        merge="mean",
        outer_lr=1.0,
        outer_momentum=0.0,
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(max_weight_ratio=None),
        rounds=Rounds(asynchronous=True, **rounds),
    )
    return DiLoCo(**{**base, **kw})


def run(s, order, steps, **kw):
    grid = ScriptedGrid(order)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=steps, **kw)
    return res, grid


def delta(theta, pid):
    t = target(pid)
    return {k: 0.5 * (theta[k].double() - t[k].double()) for k in theta}


# ----------------------------------------------------------------------------- hand computations
def test_staleness_weights_match_a_hand_computation():
    """K=2, order 0 1 | 2 1: step 1 merges two fresh replies; in step 2 node 2's reply trained
    from theta_0 (tau = 1, s = 1/sqrt 2) and node 1's from theta_1 (tau = 0):
    g_2 = (2 s delta_2(theta_0) + 1 delta_1(theta_1)) / (2 + 1) (rho times the weighted mean)."""
    s = strategy(replies_per_step=2)
    res, _ = run(s, [0, 1, 2, 1], 2)
    th0 = {k: v.double() for k, v in init_model().items()}
    d0, d1 = delta(th0, 0), delta(th0, 1)
    th1 = {k: th0[k] - (d0[k] + d1[k]) / 2 for k in th0}
    sd = 1 / math.sqrt(2)
    d2, d1b = delta(th0, 2), delta(th1, 1)
    th2 = {k: th1[k] - (2 * sd * d2[k] + d1b[k]) / 3 for k in th0}
    got = res.arrays.to_torch_state_dict()
    for k in th2:
        torch.testing.assert_close(got[k].double(), th2[k], rtol=1e-6, atol=1e-6)
    m2 = res.train_metrics_clientapp[2]
    assert m2["staleness-max"] == 1 and m2["staleness-mean"] == 0.5
    assert m2["staleness-scale"] == pytest.approx((2 * sd + 1) / 3)
    assert m2["replies-used"] == 2 and m2["replies-per-step"] == 2


def test_the_weight_bound_applies_to_tokens_before_the_discount():
    """max_weight_ratio=1: step 1 (no reference yet) bounds by its own median (1); in step 2
    node 2's n = 2 is clipped to 1 x the reference 1, then discounted: g_2 = (1 s delta_2 +
    1 delta_1) / (1 + 1); the next reference is the median of the raw token counts (2, 1)."""
    s = strategy(replies_per_step=2, checks=ReplyChecks(max_weight_ratio=1))
    res, _ = run(s, [0, 1, 2, 1], 2)
    th0 = {k: v.double() for k, v in init_model().items()}
    d0, d1 = delta(th0, 0), delta(th0, 1)
    th1 = {k: th0[k] - (d0[k] + d1[k]) / 2 for k in th0}
    sd = 1 / math.sqrt(2)
    d2, d1b = delta(th0, 2), delta(th1, 1)
    th2 = {k: th1[k] - (sd * d2[k] + d1b[k]) / 2 for k in th0}
    got = res.arrays.to_torch_state_dict()
    for k in th2:
        torch.testing.assert_close(got[k].double(), th2[k], rtol=1e-6, atol=1e-6)
    assert s.weight_reference == 1.5


def test_discount_formula():
    assert staleness_discount(0, 0.5) == 1.0
    assert staleness_discount(3, 0.5) == pytest.approx(0.5)
    assert staleness_discount(3, 0.0) == 1.0
    assert staleness_discount(1, 1.0) == pytest.approx(0.5)


def reference_run(order, steps, k, smax, a, lr, mu, nesterov, every, n=3, bad=()):
    """The documented semantics, independently: every node starts on version 0; a reply of
    staleness tau > smax is dropped (its node re-sent the newest model); else buffered with
    weight n_p s(tau); the K-th closes the step (g = sum w delta / sum n), and that node gets
    the new model; others get the newest model at once (also after a reply that fails its
    checks: arrival indices ``bad``). Outer step: delayed momentum."""
    theta = {k_: v.double() for k_, v in init_model().items()}
    versions = {0: theta}
    task = dict.fromkeys(range(n), 0)
    buf, b, acc, done = [], {}, {}, 0
    for i, p in enumerate(order):
        if done == steps:
            break
        v = task[p]
        tau = done - v
        if tau > smax or i in bad:
            task[p] = done
            continue
        buf.append((delta(versions[v], p), N_EX[p] * (1 + tau) ** -a, N_EX[p]))
        if len(buf) < k:
            task[p] = done
            continue
        g = {x: sum(w * d[x] for d, w, _ in buf) / sum(m for _, _, m in buf) for x in theta}
        buf, done = [], done + 1
        theta = dict(theta)
        for x in theta:
            acc[x] = acc.get(x, 0) + g[x]
            u = g[x] / every
            if done % every == 0:
                old = b.get(x, torch.zeros_like(g[x]))
                b[x] = mu * old + acc[x] / every
                u = u + mu * (b[x] if nesterov else old)
                acc[x] = 0
            theta[x] = theta[x] - lr * u
        versions[done] = theta
        task[p] = done
    return theta, done


ORDER = [0, 1, 2, 0, 0, 1, 0, 2, 1, 0, 0, 1, 2, 0, 1, 1, 0, 2, 0, 1, 0, 0, 2, 1] * 2


@pytest.mark.parametrize(
    "k,every,nesterov,smax",
    [(1, 3, True, 16), (2, 2, True, 1), (3, 1, True, 16), (2, 3, False, 16)],
)
def test_delayed_nesterov_run_matches_the_reference(k, every, nesterov, smax):
    """Whole asynchronous runs (buffers, staleness, the stale bound, delayed momentum over
    several periods) against :func:`reference_run`."""
    steps = 9
    s = strategy(
        replies_per_step=k,
        momentum_every=every,
        max_staleness=smax,
        outer_lr=0.7,
        outer_momentum=0.9,
        nesterov=nesterov,
    )
    res, _ = run(s, ORDER, steps)
    want, done = reference_run(ORDER, steps, k, smax, 0.5, 0.7, 0.9, nesterov, every)
    assert done == steps
    got = res.arrays.to_torch_state_dict()
    for x in want:
        torch.testing.assert_close(got[x].double(), want[x], rtol=1e-5, atol=1e-5)


def test_outer_delay_against_its_formula_and_the_period_identity():
    """OuterSGD(delay=N): plain steps g/N, the momentum once per N steps on the mean of their
    g; the period's total move equals one synchronous Nesterov step on that mean."""
    lr, mu, n = 0.7, 0.9, 3
    gen = torch.Generator().manual_seed(3)
    grads = [{"w": torch.randn(5, 4, generator=gen, dtype=torch.float64)} for _ in range(9)]
    theta = {"w": torch.randn(5, 4, generator=gen, dtype=torch.float64)}
    opt, sync = OuterSGD(lr, mu, True, delay=n), OuterSGD(lr, mu, True)
    p, q = dict(theta), dict(theta)
    b, acc = torch.zeros(5, 4, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        p = opt.step(p, g)
        acc = acc + g["w"]
        u = g["w"] / n
        if t % n == 0:
            b = mu * b + acc / n
            u = u + mu * b
            acc = torch.zeros_like(acc)
            mean = sum(x["w"] for x in grads[t - n : t]) / n
            q = sync.step(q, {"w": mean})
            torch.testing.assert_close(p["w"], q["w"], rtol=1e-12, atol=1e-12)
        theta = {"w": theta["w"] - lr * u}
        torch.testing.assert_close(p["w"], theta["w"], rtol=1e-12, atol=1e-12)
    assert opt.steps == 9 and not opt.accumulator  # emptied at the period's end
    with pytest.raises(ValueError, match="delay"):
        OuterSGD(0.7, 0.0, delay=2)
    assert "delay" not in OuterSGD(0.7, 0.9, True).state_dict()  # delay 1: today's state


# ----------------------------------------------------------------------------- composition
def test_a_reply_that_fails_its_checks_is_dropped_and_its_node_gets_new_work(caplog):
    """Node 1's second reply (arrival 5) carries a NaN: the reply checks drop it, named, the
    node is sent the newest model, and the run equals the reference without that reply."""
    s = strategy(replies_per_step=2, outer_lr=0.7, outer_momentum=0.9, momentum_every=2)
    grid = ScriptedGrid(ORDER)
    state = {"n": 0}

    def nan_on_second(reply):
        state["n"] += 1
        if state["n"] == 2:
            rec = reply.content["arrays"].to_torch_state_dict()
            rec["w"][0, 0] = float("nan")
            reply.content["arrays"] = ArrayRecord(rec)
        return reply

    grid.set_fault(1, nan_on_second)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=6)
    bad = [i for i, p in enumerate(ORDER) if p == 1][1]
    want, _ = reference_run(ORDER, 6, 2, 16, 0.5, 0.7, 0.9, True, 2, bad=(bad,))
    got = res.arrays.to_torch_state_dict()
    for x in want:
        torch.testing.assert_close(got[x].double(), want[x], rtol=1e-5, atol=1e-5)
    assert sum(m["replies-rejected"] for m in res.train_metrics_clientapp.values()) == 1
    assert any(f"node {grid.node_ids[1]}" in r.getMessage() for r in caplog.records)


def test_an_error_reply_costs_only_that_task():
    """Node 2's first task raises: its node is idle until the next step sends it work again."""
    s = strategy(replies_per_step=2)
    grid = ScriptedGrid([2, 0, 1, 2, 0, 1, 2, 0])
    grid.set_fault(2, "raise", times=1)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=3)
    m = res.train_metrics_clientapp
    assert m[1]["replies-rejected"] == 1 and m[1]["replies-used"] == 2
    assert [m[r]["replies-used"] for r in (2, 3)] == [2, 2]
    assert sorted(res.train_metrics_clientapp) == [1, 2, 3]


def test_a_dead_node_is_named_by_its_task_and_a_run_of_bad_replies_stops(caplog):
    """A dead SuperNode's error comes from the SuperLink (src 1): it is named by the node its
    task went to. Nodes that only send NaN: each step closes empty after max(K, nodes) dropped
    replies, and the run stops at max_empty_rounds (3) with NoProgressError."""
    from flwr_isoloco.strategies.core.guard import NoProgressError

    s = strategy(replies_per_step=2)
    grid = ScriptedGrid([2, 0, 1, 2, 0, 1, 2, 0])
    grid.set_fault(2, "dead", times=1)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2)
    assert any(
        f"node {grid.node_ids[2]}: error reply (code 5)" in r.getMessage() for r in caplog.records
    )

    def nan(reply):
        rec = reply.content["arrays"].to_torch_state_dict()
        rec["b"][0] = float("nan")
        reply.content["arrays"] = ArrayRecord(rec)
        return reply

    s = strategy(replies_per_step=2)
    grid = ScriptedGrid([0, 1, 2] * 10)
    for p in range(3):
        grid.set_fault(p, nan)
    with pytest.raises(NoProgressError, match="3 consecutive rounds"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=10)
    assert grid.taken == 9  # three empty steps of max(K, nodes) = 3 dropped replies each


def test_isoloco_with_a_robust_rule_per_buffer_and_the_divergence_guard():
    """IsoLoCo (Iso-C per buffer) with a trimmed mean over each buffer of K=3 replies and
    evaluate_fn after every outer step, the divergence guard watching it."""
    from flwr_isoloco.strategies import MultiKrum

    s = IsoLoCo(
        rounds=Rounds(asynchronous=True, replies_per_step=3),
        fraction_evaluate=0.0,
        min_train_nodes=3,
        min_available_nodes=3,
        robust=MultiKrum(f=0, select=2),
    )
    seen = []

    def evaluate_fn(rnd, arrays):
        seen.append(rnd)
        w = arrays.to_torch_state_dict()["w"]
        return MetricRecord({"loss": float(w.norm())})

    res, _ = run(s, ORDER, 4, evaluate_fn=evaluate_fn)
    assert seen == [0, 1, 2, 3, 4]
    assert all(res.train_metrics_clientapp[r]["robust-kept"] == 2 for r in (1, 2, 3, 4))
    assert all(torch.isfinite(v).all() for v in res.arrays.to_torch_state_dict().values())


def test_compressed_uploads_are_decoded_against_the_model_sent():
    """upload="int8": the request travels with every task; workers reply an int8 delta; the
    run stays within the codec's error of the plain run with the same arrival order (and is
    not that run: the int8 deltas were decoded), every reply used."""
    from flwr_isoloco.compression import compress
    from flwr_isoloco.compression.feedback import parse_request

    def int8_train(msg, ctx):
        req = parse_request(msg.content["config"])
        assert req is not None and req[0] == "int8"
        reply = train(msg, ctx)
        theta = msg.content["arrays"].to_torch_state_dict()
        new = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = compress({k: theta[k] - new[k] for k in theta}, "int8")
        reply.content["config"] = ConfigRecord({"payload": "delta"})
        return reply

    runs = []
    for upload in (None, "int8"):
        s = strategy(replies_per_step=2, upload=upload, outer_lr=0.7, outer_momentum=0.9)
        grid = ScriptedGrid(ORDER)
        if upload:
            grid.app = {"train": int8_train}
        res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=5)
        assert all(m["replies-rejected"] == 0 for m in res.train_metrics_clientapp.values())
        runs.append(res.arrays.to_torch_state_dict())
    plain, packed = runs
    diff = max(float((plain[k] - packed[k]).abs().max()) for k in plain)
    assert 0 < diff < 0.05


def test_an_upload_codec_the_clientapp_does_not_run_is_said_once(caplog):
    """upload="int8" with a plain ClientApp (fp32 weights back): after the first step one
    WARNING names upload_mod and the fix (the run goes on, every reply used); a worker that
    compresses (the step above's int8 replies) is not warned about."""
    import logging

    s = strategy(replies_per_step=2, upload="int8")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res = s.start(
            grid=ScriptedGrid(ORDER), initial_arrays=ArrayRecord(init_model()), num_rounds=3
        )
    said = [r.getMessage() for r in caplog.records if "upload_mod" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("upload='int8'") and "round 1" in said[0], said
    assert all(m["replies-rejected"] == 0 for m in res.train_metrics_clientapp.values())


def test_divergence_skip_puts_the_step_back_and_sends_no_work_from_the_skipped_model():
    """on_divergence="skip": step 2's loss blows up, its model is put back; the node whose reply
    closed step 2 is sent the restored model (at the next step), not the skipped one."""
    from flwr_isoloco.strategies import Divergence

    s = strategy(replies_per_step=2, divergence=Divergence(on_divergence="skip"))
    evaluated = []

    def evaluate_fn(rnd, arrays):
        evaluated.append((rnd, arrays.to_torch_state_dict()))
        return MetricRecord({"loss": 1e6 if rnd == 2 and len(evaluated) == 3 else 1.0})

    sent = []
    grid = ScriptedGrid(ORDER)
    push = grid.push_messages

    def record(msgs):
        msgs = list(msgs)
        sent.extend(m.content["arrays"].to_torch_state_dict() for m in msgs)
        return push(msgs)

    grid.push_messages = record
    res = s.start(
        grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=3, evaluate_fn=evaluate_fn
    )
    assert res.evaluate_metrics_serverapp[2]["diverged"] == 1
    assert [r for r, _ in evaluated] == [0, 1, 2, 2, 3]
    skipped, restored = evaluated[2][1], evaluated[3][1]
    assert all(torch.equal(restored[k], evaluated[1][1][k]) for k in restored)  # step 1's model
    assert not any(all(torch.equal(m[k], skipped[k]) for k in m) for m in sent)


# ----------------------------------------------------------------------------- stale, default off
def test_reply_beyond_max_staleness_is_dropped_and_named(caplog):
    """max_staleness 0, K=2, order 0 1 | 2 0 1 2: nodes 2 and 0 trained from theta_0 (node 0's
    second task was sent before step 1), so after step 1 both are one step old: dropped, named,
    re-sent theta_1; step 2 merges node 1's and node 2's fresh replies."""
    s = strategy(replies_per_step=2, max_staleness=0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res, grid = run(s, [0, 1, 2, 0, 1, 2], 2)
    m = res.train_metrics_clientapp[2]
    assert m["replies-stale"] == 2 and m["replies-rejected"] == 2 and m["replies-used"] == 2
    assert m["staleness-max"] == 0
    for pid in (0, 2):
        node = grid.node_ids[pid]
        assert any(
            f"node {node}" in r.getMessage() and "stale" in r.getMessage() for r in caplog.records
        )
    assert s.async_rounds.stale_total == 2
    th0 = {k: v.double() for k, v in init_model().items()}
    d0, d1 = delta(th0, 0), delta(th0, 1)
    th1 = {k: th0[k] - (d0[k] + d1[k]) / 2 for k in th0}
    d1b, d2b = delta(th1, 1), delta(th1, 2)
    th2 = {k: th1[k] - (d1b[k] + 2 * d2b[k]) / 3 for k in th0}
    got = res.arrays.to_torch_state_dict()
    for k in th2:
        torch.testing.assert_close(got[k].double(), th2[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"rounds": Rounds(asynchronous=False)}])
def test_default_off_is_the_synchronous_strategy(kw):
    """Default Rounds() / Rounds(asynchronous=False): synchronous DiLoCo with its documented defaults,
    against :func:`outer_reference.sync_rounds` (fp64): 3 rounds, every node's reply used,
    g = sum n_p delta_p / sum n_p (n = 1, 1, 2), Nesterov with lr 0.7, mu 0.9, no delay; no
    asynchronous state in the checkpoint."""
    s = DiLoCo(min_train_nodes=3, min_available_nodes=3, **kw)
    grid = FakeGrid({"train": train, "evaluate": _evaluate}, num_nodes=3)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=3)
    assert s.async_rounds is None and s.outer.delay == 1
    assert "async" not in s.state_dict()["meta"] and "versions" not in s.state_dict()["tensors"]
    want = sync_rounds(init_model(), local, 3, N_EX, lr=0.7, momentum=0.9, nesterov=True)
    assert_close(res.arrays.to_torch_state_dict(), want)


def _evaluate(msg: Message, ctx) -> Message:
    return Message(RecordDict({"m": MetricRecord({"num-examples": 1, "loss": 1.0})}), reply_to=msg)


def test_the_plain_keyword_is_refused_and_settings_are_checked():
    s = IsoLoCo(rounds=Rounds(asynchronous=True), fraction_evaluate=0.0)
    assert s.rounds.asynchronous and s.async_rounds is not None
    for cls in (DiLoCo, IsoLoCo):
        with pytest.raises(TypeError, match=r"use \w+\(rounds=Rounds\(asynchronous=True\)\)"):
            cls(asynchronous=True, fraction_evaluate=0.0)
    with pytest.raises(ValueError, match="asynchronous rounds only"):
        Rounds(replies_per_step=4)
    with pytest.raises(ValueError, match="quorum"):
        Rounds(asynchronous=True, quorum=2)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"privacy": CentralDP(clipping_norm=1.0, noise_multiplier=1.0)}, "accountant"),
        ({"privacy": LocalDP(clipping_norm=1.0, noise_multiplier=1.0)}, "accountant"),
        ({"download": "int8"}, "download"),
    ],
)
def test_what_does_not_compose_is_refused(kw, match):
    with pytest.raises(ValueError, match=f"asynchronous rounds: .*{match}"):
        DiLoCo(rounds=Rounds(asynchronous=True), **{"fraction_evaluate": 0.0, **kw})


def test_secagg_is_refused():
    from flwr_isoloco.strategies.diloco.secagg import use_secagg

    s = strategy(replies_per_step=2)
    with pytest.raises(ValueError, match="secagg: not supported with asynchronous rounds"):
        use_secagg(s, num_shares=3, reconstruction_threshold=2)  # refused when set, not at round 1
    assert s.secagg is None


# ----------------------------------------------------------------------------- checkpoints
def test_resume_mid_run_is_bitwise_the_uninterrupted_run(tmp_path):
    """Checkpoint after step 3 (tasks in flight from older versions), resume on a new grid
    whose arrival order continues the script: the model after step 7 is the same bits."""
    kw = dict(replies_per_step=2, momentum_every=2, outer_lr=0.7, outer_momentum=0.9)
    saved = {}

    def hook(rnd, arrays, tm, em):
        if rnd == 3:
            sd = s1.state_dict()
            save_checkpoint(tmp_path / "ck", sd["tensors"], sd["meta"])
            saved["taken"] = g1.taken - s1.async_rounds.carried  # carried: sent again

    s1 = strategy(**kw)
    g1 = ScriptedGrid(ORDER)
    full = s1.start(
        grid=g1, initial_arrays=ArrayRecord(init_model()), num_rounds=7, on_round_end=hook
    )
    tensors, meta = load_checkpoint(tmp_path / "ck")
    assert meta["async"]["tasks"] and "versions" in tensors  # old versions were in flight
    s2 = strategy(**kw)
    s2.load_state_dict({"tensors": tensors, "meta": meta}, reference=init_model())
    g2 = ScriptedGrid(ORDER[saved["taken"] :])
    rest = s2.start(grid=g2, initial_arrays=ArrayRecord(init_model()), num_rounds=7)
    a, b = full.arrays.to_torch_state_dict(), rest.arrays.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(rest.train_metrics_clientapp) == [4, 5, 6, 7]


def test_checkpoint_modes_and_settings_must_match(tmp_path):
    s = strategy(replies_per_step=2)
    run(s, ORDER, 2)
    sd = s.state_dict()
    with pytest.raises(CheckpointError, match="asynchronous"):
        DiLoCo(min_train_nodes=3, outer_lr=1.0, outer_momentum=0.0).load_state_dict(sd)
    with pytest.raises(CheckpointError, match=r"async\.buffer.*Rounds\.replies_per_step"):
        strategy(replies_per_step=3).load_state_dict(sd)
    sync = DiLoCo(min_train_nodes=3, outer_lr=1.0, outer_momentum=0.0)
    sync.start(
        grid=FakeGrid({"train": train, "evaluate": _evaluate}, num_nodes=3),
        initial_arrays=ArrayRecord(init_model()),
        num_rounds=1,
    )
    with pytest.raises(CheckpointError, match="synchronous"):
        strategy(replies_per_step=2).load_state_dict(sync.state_dict())


# ----------------------------------------------------------------------------- real Flower
@pytest.mark.slow
def test_ray_nodes_of_unequal_speed_never_wait_for_the_slowest():
    """A real Ray simulation (benchmarks/async/async_bench.py --quick): 3 nodes whose tasks take
    0.2 s, 1.1 s and 2 s, K = 2, 10 outer steps. Every node's reply enters the model, the fast
    node does several times the slow node's tasks, and no node's gap between two tasks comes
    near the slow node's task time (synchronous rounds make node 0 wait ~1.8 s each round); the
    first step, a synchronous round of its K = 2 (the hold), waits for the 1.1 s node once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "async"))
    import async_bench

    s = async_bench.main(["--quick"])["asynchronous"]
    nodes = s["nodes"]
    assert sorted(int(r) for r in s["metrics"]) == list(range(1, 11))
    assert all(nodes[p]["tasks"] >= 1 for p in nodes)  # the slow node contributes too
    assert nodes[0]["tasks"] >= 3 * nodes[2]["tasks"]
    # the first step holds every node (no task time known yet): node 0 waits once for the
    # 1.1 s node's reply, never for the slow node's; after that no gap nears half its task time
    assert all(nodes[p]["max_gap_s"] < 1.8 for p in nodes)
    assert all(nodes[p]["max_gap_after_first_s"] < 1.0 for p in nodes)


@pytest.mark.parametrize(
    "spoil,match",
    [
        (
            lambda t, m: t["versions"][next(iter(t["versions"]))]["w"].fill_(float("nan")),
            "non-finite",
        ),
        (lambda t, m: t["versions"].update({"999": t["theta"]}), "not a kept version"),
        (lambda t, m: m["async"].update(tasks=[[1, 2, 3]]), "tasks"),
        (lambda t, m: m["async"].update(max_staleness=3), "max_staleness"),
    ],
)
def test_a_hostile_asynchronous_checkpoint_is_refused_before_anything_is_set(spoil, match):
    s = strategy(replies_per_step=2)
    run(s, ORDER, 3)
    sd = s.state_dict()
    tensors = {
        "theta": {k: v.clone() for k, v in sd["tensors"]["theta"].items()},
        "outer": sd["tensors"]["outer"],
        "versions": {
            v: {k: t.clone() for k, t in m.items()} for v, m in sd["tensors"]["versions"].items()
        },
    }
    meta = {**sd["meta"], "async": dict(sd["meta"]["async"])}
    assert tensors["versions"]
    spoil(tensors, meta)
    fresh = strategy(replies_per_step=2)
    with pytest.raises(CheckpointError, match=match):
        fresh.load_state_dict({"tensors": tensors, "meta": meta})
    assert fresh.theta is None and fresh.server_round == 0


def test_run_config_keys():
    rc = {
        "strategy.asynchronous": True,
        "strategy.async-replies-per-step": 3,
        "strategy.max-staleness": 4,
        "strategy.async-staleness": 1.0,
        "strategy.momentum-every": 2,
        "strategy.fraction-evaluate": 0.0,
    }
    s = IsoLoCo.from_run_config(rc)
    r = s.rounds
    assert (r.asynchronous, r.replies_per_step, r.max_staleness, r.staleness) == (True, 3, 4, 1.0)
    assert r.momentum_every == 2 and s.outer.delay == 2 and s.async_rounds is not None
    rc0 = {**rc, "strategy.async-replies-per-step": 0}
    assert DiLoCo.from_run_config(rc0).rounds.replies_per_step is None
    assert DiLoCo.from_run_config({}).async_rounds is None
    with pytest.raises(ValueError, match="strategy.async-replies-per-step apply to asynchronous"):
        DiLoCo.from_run_config({"strategy.async-replies-per-step": 3})
    with pytest.raises(ValueError, match="strategy.quorum"):
        DiLoCo.from_run_config({**rc, "strategy.quorum": 0.5})
    assert DiLoCo.from_run_config({**rc, "strategy.fraction-evaluate": 1.0}).async_rounds
