"""DiLoCo / IsoLoCo strategies against FedAvg, hand computations and torch.optim.SGD.

Federations run in-process on ``tests/fakegrid.FakeGrid``. Clients are deterministic functions
of (theta, partition, round), so every expected model can be computed independently here.
"""

from __future__ import annotations

import math

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings, ReplyChecks

torch.set_num_threads(1)

WEIGHTS = [1, 1, 2]  # num-examples of partitions 0, 1, 2


def _target(pid: int, rnd: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * pid + rnd)
    return {k: torch.randn(shapes[k], generator=g) for k in sorted(shapes)}


def make_client(payload: str = "weights", dyadic: bool = False):
    """Train handler: theta_i = theta + 0.5 * (target_{pid,round} - theta) (dyadic: + k/8)."""

    def train(msg: Message, ctx) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        rnd = int(msg.content["config"]["server-round"])
        pid = int(ctx.node_config["partition-id"])
        if dyadic:
            new = {k: v + (pid + 1) * 0.125 * (-1) ** rnd for k, v in theta.items()}
        else:
            tgt = _target(pid, rnd, {k: tuple(v.shape) for k, v in theta.items()})
            new = {k: v + 0.5 * (tgt[k] - v) for k, v in theta.items()}
        content = RecordDict(
            {"metrics": MetricRecord({"num-examples": WEIGHTS[pid % 3], "train-loss": float(pid)})}
        )
        if payload == "delta":
            content["arrays"] = ArrayRecord({k: theta[k] - new[k] for k in theta})
            content["config"] = ConfigRecord({"payload": "delta"})
        else:
            content["arrays"] = ArrayRecord(new)
        return Message(content, reply_to=msg)

    def evaluate(msg: Message, ctx) -> Message:
        pid = int(ctx.node_config["partition-id"])
        metrics = MetricRecord({"num-examples": WEIGHTS[pid % 3], "eval-loss": float(pid)})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return {"train": train, "evaluate": evaluate}


def init_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}


def client_replies(theta: dict[str, torch.Tensor], rnd: int, n: int = 3):
    """(theta_i, w_i) the fake clients return, computed independently of Flower."""
    out = []
    for pid in range(n):
        tgt = _target(pid, rnd, {k: tuple(v.shape) for k, v in theta.items()})
        out.append(({k: v + 0.5 * (tgt[k] - v) for k, v in theta.items()}, WEIGHTS[pid % 3]))
    return out


def weighted_mean_delta(theta, replies):
    tot = sum(w for _, w in replies)
    return {k: sum(w * (theta[k] - t[k]) for t, w in replies) / tot for k in theta}


def iso_c_hand(g: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return s.mean() * u @ vh


def run(strategy, rounds=3, n=3, client=None, init=None, grid=None):
    grid = grid or FakeGrid(client or make_client(), num_nodes=n)
    init = init or init_model()
    res = strategy.start(grid=grid, initial_arrays=ArrayRecord(init), num_rounds=rounds)
    return res, grid


def quiet(**kw):
    kw.setdefault("min_train_nodes", 1)
    kw.setdefault("min_evaluate_nodes", 1)
    kw.setdefault("min_available_nodes", 1)
    kw.setdefault("fraction_evaluate", 0.0)
    return kw


# --------------------------------------------------------------------------- FedAvg equivalence
def test_mean_lr1_mom0_is_fedavg_bitwise_on_dyadic_values():
    init = {"w": torch.arange(15.0).reshape(5, 3) / 8, "b": torch.tensor([0.5, -0.25, 1.0])}
    client = make_client(dyadic=True)
    fed, _ = run(FedAvg(**quiet()), client=client, init=init)
    dil, _ = run(
        DiLoCo(merge="mean", outer_lr=1.0, outer_momentum=0.0, **quiet()), client=client, init=init
    )
    a, b = fed.arrays.to_torch_state_dict(), dil.arrays.to_torch_state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_mean_lr1_mom0_is_fedavg_on_random_values():
    fed, _ = run(FedAvg(**quiet()))
    dil, _ = run(DiLoCo(merge="mean", outer_lr=1.0, outer_momentum=0.0, **quiet()))
    a, b = fed.arrays.to_torch_state_dict(), dil.arrays.to_torch_state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- hand computations
def test_one_isoloco_round_matches_svd_and_nesterov_by_hand():
    theta = init_model()
    strat = IsoLoCo(preset="isoloco-paper", **quiet())  # iso_c, 1.8, 0.8
    res, _ = run(strat, rounds=1)
    g = weighted_mean_delta(theta, client_replies(theta, 1))
    g["w"] = iso_c_hand(g["w"])  # 2-D: Iso-C; 1-D bias: plain mean
    # Nesterov, first step: b = g, u = g + mu*b
    expected = {k: theta[k] - 1.8 * (g[k] + 0.8 * g[k]) for k in theta}
    got = res.arrays.to_torch_state_dict()
    for k in theta:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge_name", ["mean", "iso_c"])
def test_rounds_match_torch_sgd_nesterov_on_merged_pseudo_gradients(merge_name):
    rounds, lr, mu = 4, 0.7, 0.9
    res, _ = run(
        DiLoCo(merge=merge_name, outer_lr=lr, outer_momentum=mu, nesterov=True, **quiet()),
        rounds=rounds,
    )
    params = {k: torch.nn.Parameter(v.clone()) for k, v in init_model().items()}
    opt = torch.optim.SGD(params.values(), lr=lr, momentum=mu, nesterov=True)
    for rnd in range(1, rounds + 1):
        theta = {k: p.detach().clone() for k, p in params.items()}
        g = weighted_mean_delta(theta, client_replies(theta, rnd))
        if merge_name == "iso_c":
            g["w"] = iso_c_hand(g["w"])
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    got = res.arrays.to_torch_state_dict()
    for k, p in params.items():
        torch.testing.assert_close(got[k], p.detach(), rtol=1e-5, atol=1e-5)


def test_orthogonalize_update_applies_iso_c_after_momentum():
    theta = init_model()
    strat = DiLoCo(
        merge="iso_c",
        merge_settings=MergeSettings(orthogonalize="update"),
        outer_lr=0.5,
        outer_momentum=0.9,
        **quiet(),
    )
    res, _ = run(strat, rounds=1)
    g = weighted_mean_delta(theta, client_replies(theta, 1))
    u = {k: g[k] + 0.9 * g[k] for k in g}
    u["w"] = iso_c_hand(u["w"])
    got = res.arrays.to_torch_state_dict()
    for k in theta:
        torch.testing.assert_close(got[k], theta[k] - 0.5 * u[k], rtol=1e-5, atol=1e-5)


def test_delta_payload_gives_the_same_model_as_weights():
    a, _ = run(DiLoCo(**quiet()))
    b, _ = run(DiLoCo(**quiet()), client=make_client(payload="delta"))
    for k, v in a.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(b.arrays.to_torch_state_dict()[k], v, rtol=1e-6, atol=1e-6)


def test_uniform_weighting():
    theta = init_model()
    res, _ = run(
        DiLoCo(
            outer_lr=1.0, outer_momentum=0.0, **quiet(), checks=ReplyChecks(weighting="uniform")
        ),
        rounds=1,
    )
    replies = [(t, 1) for t, _ in client_replies(theta, 1)]
    g = weighted_mean_delta(theta, replies)
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, theta[k] - g[k], rtol=1e-6, atol=1e-6)


def test_round_metrics_and_client_metric_mean():
    strat = DiLoCo(**quiet(fraction_evaluate=1.0))
    res, _ = run(strat, rounds=2)
    m = res.train_metrics_clientapp[2]
    assert m["replies-used"] == 3 and m["replies-rejected"] == 0 and m["replies-missing"] == 0
    assert m["aggregation-time-s"] >= 0
    # train-loss reported as pid by partitions 0,1,2 with weights 1,1,2: (0 + 1 + 4) / 4
    assert m["train-loss"] == pytest.approx(5 / 4)
    assert res.evaluate_metrics_clientapp[2]["eval-loss"] == pytest.approx(5 / 4)
    assert "num-examples" not in m


def test_server_round_sent_to_clients_counts_globally():
    seen = []
    client = make_client()
    inner = client["train"]

    def spy(msg, ctx):
        seen.append(int(msg.content["config"]["server-round"]))
        return inner(msg, ctx)

    strat = DiLoCo(**quiet())
    run(strat, rounds=2, n=1, client={"train": spy})
    assert seen == [1, 2] and strat.server_round == 2


def test_streaming_rules_do_not_call_full_merge(monkeypatch):
    import flwr_isoloco.merging.fold as mod  # the round merge lives in merging/

    def boom(*a, **k):
        raise AssertionError("full merge() called for a streaming rule")

    monkeypatch.setattr(mod, "merge", boom)
    res, _ = run(IsoLoCo(**quiet()), rounds=1)
    assert res.train_metrics_clientapp[1]["replies-used"] == 3


# --------------------------------------------------------------------------- state / resume
@pytest.mark.parametrize("kind", ["diloco", "isoloco"])
def test_resume_from_checkpoint_is_exact(tmp_path, kind):
    def make():
        cls = IsoLoCo if kind == "isoloco" else DiLoCo
        return cls(fraction_train=0.67, seed=3, **{k: v for k, v in quiet().items()})

    full, _ = run(make(), rounds=4, n=3)

    first = make()
    grid = FakeGrid(make_client(), num_nodes=3)
    run(first, rounds=2, grid=grid)
    sd = first.state_dict()
    save_checkpoint(tmp_path / "ckpt.safetensors", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "ckpt.safetensors")
    second = make()
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.server_round == 2
    rest, _ = run(
        second, rounds=4, grid=grid, init={k: v for k, v in sd["tensors"]["theta"].items()}
    )
    a, b = full.arrays.to_torch_state_dict(), rest.arrays.to_torch_state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert second.server_round == 4
    # num_rounds is the total: a strategy that has done them all runs nothing more
    done, _ = run(second, rounds=4, grid=grid, init=init_model())
    assert second.server_round == 4
    for k in a:
        assert torch.equal(done.arrays.to_torch_state_dict()[k], a[k]), k


def test_load_state_dict_rejects_other_merge_rule():
    a = DiLoCo(**quiet())
    run(a, rounds=1)
    with pytest.raises(ValueError, match="merge"):
        IsoLoCo(**quiet()).load_state_dict(a.state_dict())


def test_state_dict_before_start_is_an_error():
    with pytest.raises(ValueError, match="no global model"):
        DiLoCo().state_dict()


# --------------------------------------------------------------------------- construction
def test_isoloco_defaults_and_fast_switch():
    s = IsoLoCo()  # the "dropin" preset (tests/test_isoloco_presets.py)
    assert (s.merge_name, s.outer.lr, s.outer.momentum, s.outer.nesterov) == (
        "iso_c_matched",
        0.5,
        0.9,
        True,
    )
    s = IsoLoCo(preset="isoloco-paper")
    assert (s.merge_name, s.outer.lr, s.outer.momentum, s.outer.nesterov) == (
        "iso_c",
        1.8,
        0.8,
        True,
    )
    assert IsoLoCo(preset="isoloco-paper", merge="iso_c_ns").merge_name == "iso_c_ns"
    with pytest.raises(
        TypeError, match="use IsoLoCo\\(preset='isoloco-paper', merge='iso_c_ns'\\)"
    ):
        IsoLoCo(fast=True)  # merge="iso_c_ns" says it
    d = DiLoCo()
    assert (d.merge_name, d.outer.lr, d.outer.momentum, d.outer.nesterov) == (
        "mean",
        0.7,
        0.9,
        True,
    )


def test_from_run_config_reads_documented_keys():
    cfg = {
        "strategy.name": "diloco",  # the app's own key: ignored
        "strategy.merge": "ties",
        "strategy.outer-lr": 0.5,
        "strategy.outer-momentum": 0,
        "strategy.nesterov": False,
        "strategy.fraction-train": 0.5,
        "strategy.prune-fraction": 0.2,
        "strategy.max-norm-ratio": 10.0,
        "model.hidden": 64,  # another section: ignored
    }
    s = DiLoCo.from_run_config(cfg)
    assert s.merge_name == "ties" and s.merge_options == {"prune_fraction": 0.2}
    assert (s.outer.lr, s.outer.momentum, s.outer.nesterov) == (0.5, 0.0, False)
    assert s.fraction_train == 0.5 and s.train_validator.max_norm_ratio == 10.0
    with pytest.raises(ValueError, match="strategy.fast = true is iso_c_ns"):
        IsoLoCo.from_run_config({"strategy.fast": True})  # under "dropin": refused
    iso = IsoLoCo.from_run_config({"strategy.fast": True, "strategy.preset": "isoloco-paper"})
    assert iso.merge_name == "iso_c_ns" and iso.outer.lr == 1.8


def test_nan_in_math_is_not_possible_with_momentum_zero_nesterov_true():
    # nesterov=True with mu=0 must not be an error: plain SGD (DiLoCo(mean, 1, 0) == FedAvg)
    s = DiLoCo(outer_lr=1.0, outer_momentum=0.0, nesterov=True)
    assert s.outer.nesterov is False and math.isclose(s.outer.lr, 1.0)
