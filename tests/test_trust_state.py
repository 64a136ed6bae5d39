"""State a strategy must carry across a resume or put back on a skipped round (issue 34, item 5):
the empty-round streak, the evaluation sampler, the weight bound's reference weight and the
adaptive DP clipping norm."""

from __future__ import annotations

import math

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from rwlora_helpers import HANDLERS, init_adapter
from test_lifecycle import init_model, plain_app

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.checkpoint.spec import CheckpointError
from flwr_isoloco.strategies import AdaptiveClipping, CentralDP, DiLoCo, GossipLoRA, Rounds
from flwr_isoloco.strategies.core.guard import NoProgressError
from flwr_isoloco.strategies.core.lifecycle import set_divergence_guard

torch.set_num_threads(1)


def _start(s, grid, rounds, initial, evaluate_fn=None):
    return s.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial),
        num_rounds=rounds,
        timeout=5,
        evaluate_fn=evaluate_fn,
    )


def _through_file(s, tmp_path):
    sd = s.state_dict()
    save_checkpoint(tmp_path / "c.safetensors", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "c.safetensors")
    return {"tensors": tensors, "meta": meta}


def _eval_nodes(grid) -> list[list[int]]:
    """Partition ids sent an EVALUATE message, per evaluation round (a run of consecutive
    EVALUATE messages in the grid's log)."""
    rounds: list[list[int]] = []
    last = None
    for rec in grid.log:
        if rec.message_type == "evaluate":
            if last != "evaluate":
                rounds.append([])
            rounds[-1].append(grid.partition_of[rec.node_id])
        last = rec.message_type
    return [sorted(v) for v in rounds]


# ----------------------------------------------------------------------- empty-round streak
def test_diloco_checkpoints_its_empty_round_streak(tmp_path):
    """Two empty rounds, a checkpoint, a resume: the third empty round in a row stops the run."""

    def dead_grid():
        g = FakeGrid(plain_app(), num_nodes=3)
        for n in g.node_ids:
            g.set_fault(n, "raise")
        return g

    kw = dict(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    first = DiLoCo(**kw, rounds=Rounds(max_empty_rounds=3))
    _start(first, dead_grid(), 2, init_model())
    state = _through_file(first, tmp_path)
    assert state["meta"]["empty_streak"] == 2
    second = DiLoCo(**kw, rounds=Rounds(max_empty_rounds=3))
    second.load_state_dict(state)
    with pytest.raises(NoProgressError, match="3 consecutive rounds"):
        _start(second, dead_grid(), 5, init_model())
    assert second.server_round == 3


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_hostile_empty_streak_is_refused(bad):
    s = DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    _start(s, FakeGrid(plain_app(), num_nodes=3), 1, init_model())
    sd = s.state_dict()
    sd["meta"]["empty_streak"] = bad
    with pytest.raises(CheckpointError, match="empty_streak"):
        DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0).load_state_dict(sd)


# ----------------------------------------------------------------------- evaluation sampling
def test_diloco_resumed_run_evaluates_the_same_nodes(tmp_path):
    kw = dict(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.4, seed=7)
    full_grid = FakeGrid(plain_app(), num_nodes=5)
    _start(DiLoCo(**kw), full_grid, 6, init_model())
    first = DiLoCo(**kw)
    first_grid = FakeGrid(plain_app(), num_nodes=5)
    _start(first, first_grid, 3, init_model())
    second = DiLoCo(**kw)
    second.load_state_dict(_through_file(first, tmp_path))
    second_grid = FakeGrid(plain_app(), num_nodes=5)  # same ids: DiLoCo draws by node-id order
    _start(second, second_grid, 6, init_model())
    assert _eval_nodes(first_grid) + _eval_nodes(second_grid) == _eval_nodes(full_grid)


def test_gossip_resumed_run_evaluates_the_same_vertices(tmp_path):
    """The graph strategies' FederatedEvaluation generator is in the checkpoint, and it draws
    vertices (not node ids, which are new after a restart)."""

    def gossip():
        return GossipLoRA("complete", num_vertices=5, fraction_evaluate=0.4, min_evaluate_nodes=1)

    full_grid = FakeGrid(HANDLERS, num_nodes=5)
    _start(gossip(), full_grid, 6, init_adapter())
    first, first_grid = gossip(), FakeGrid(HANDLERS, num_nodes=5)
    _start(first, first_grid, 3, init_adapter())
    state = _through_file(first, tmp_path)
    assert len(state["meta"]["eval_rng"][1]) == 625
    second, second_grid = gossip(), FakeGrid(HANDLERS, num_nodes=5, seed=3)
    second.load_state_dict(state)
    _start(second, second_grid, 6, init_adapter())
    assert _eval_nodes(first_grid) + _eval_nodes(second_grid) == _eval_nodes(full_grid)


@pytest.mark.parametrize("bad", [[3, [1, 2], None], [3, "x" * 625, None], "rng", [3]])
def test_hostile_eval_rng_is_refused(bad, tmp_path):
    s = GossipLoRA("complete", num_vertices=3, min_evaluate_nodes=1)
    _start(s, FakeGrid(HANDLERS, num_nodes=3), 1, init_adapter())
    sd = s.state_dict()
    sd["meta"]["eval_rng"] = bad
    with pytest.raises(CheckpointError, match="eval_rng"):
        GossipLoRA("complete", num_vertices=3).load_state_dict(sd)


# ----------------------------------------------------------------------- divergence "skip"
def _growing_weights_app() -> ClientApp:
    """Replies whose ``num-examples`` grow tenfold each round (10^r + partition id)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        theta = msg.content["arrays"].to_torch_state_dict()
        new = {k: 0.5 * v + (pid + 1) * 0.25 for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": 10**rnd + pid})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return app


class _Losses:
    def __init__(self, losses):
        self.losses, self.calls = list(losses), 0

    def __call__(self, rnd, arrays):
        self.calls += 1
        return MetricRecord({"loss": self.losses[self.calls - 1]})


def test_skip_restores_the_weight_reference():
    s = DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    set_divergence_guard(s, "skip")
    seen = {}
    s.on_round_end = lambda rnd, *_: seen.setdefault(rnd, s.weight_reference)
    # round 2 diverges (nan) and is skipped; its re-evaluation gives 0.9
    _start(
        s,
        FakeGrid(_growing_weights_app(), num_nodes=3),
        2,
        init_model(),
        _Losses([1.0, 0.9, math.nan, 0.9]),
    )
    assert seen[1] == 11.0  # median of 10, 11, 12
    assert seen[2] == 11.0  # not 101: the skipped round's weights do not bound round 3


def test_skip_restores_the_adaptive_clipping_norm():
    kw = dict(
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=0.0,
        privacy=CentralDP(
            noise_multiplier=0.5,
            clipping_norm=0.05,  # every update is clipped: C grows each released round
            seed=0,
            adaptive=AdaptiveClipping(quantile=0.5, count_std=1.0),
        ),
    )
    s = DiLoCo(**kw)
    set_divergence_guard(s, "skip")
    norms = {}
    s.on_round_end = lambda rnd, *_: norms.setdefault(rnd, s.dp.c)
    _start(
        s, FakeGrid(plain_app(), num_nodes=3), 2, init_model(), _Losses([1.0, 0.9, math.nan, 0.9])
    )
    assert norms[1] != 0.05  # round 1 moved C
    assert norms[2] == norms[1]  # the skipped round 2 did not
    assert s.dp.accountant.num_releases == 2  # but its release stays accounted


def test_dead_weights_fn_is_gone():
    """``DiLoCo._weights_fn`` was never called (TrainRound keeps the merge weights)."""
    assert not hasattr(DiLoCo, "_weights_fn")
