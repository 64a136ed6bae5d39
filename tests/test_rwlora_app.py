"""The rwlora_sentiment app: exact resume, hostile run config, and one real `flwr run` (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakegrid import FakeGrid

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "simulations" / "rwlora-sentiment"
sys.path.insert(0, str(APP))

from rwlora_sentiment.client_app import app as client_app  # noqa: E402
from rwlora_sentiment.server_app import CHECKPOINT, run_server  # noqa: E402
from rwlora_sentiment.task import load_config  # noqa: E402

from flwr_isoloco.checkpoint import load_checkpoint  # noqa: E402
from flwr_isoloco.runconfig import RunConfigError  # noqa: E402

torch.set_num_threads(1)

TINY = {
    "eval-every": 2,
    "strategy.local-steps": 1,
    "train.batch-size": 4,
    "data.max-examples": 24,
    "data.eval-examples": 16,
    "data.test-size": 200,
    "model.max-length": 24,
    "strategy.graph": "ring",
    "strategy.node-wait-s": 5.0,
}


def _run(tmp: Path, name: str, **over) -> tuple[Path, dict]:
    rc = {**TINY, "output-dir": str(tmp / name), **over}
    out = run_server(FakeGrid(client_app, num_nodes=3, run_config=rc), rc, settle_s=0.05)
    return out, json.loads((out / "results.json").read_text())


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.parametrize(
    "strategy, extra",
    [("rwlora", {"strategy.carry-optimizer-state": True}), ("gossip", {}), ("fedavg", {})],
)
def test_n_rounds_equal_half_resume_half_exactly(tmp_path, strategy, extra):
    over = {"strategy.name": strategy, **extra}
    full, res_full = _run(tmp_path, "full", **{"num-server-rounds": 4, **over})
    half, _ = _run(tmp_path, "half", **{"num-server-rounds": 2, **over})
    rest, res_rest = _run(
        tmp_path,
        "rest",
        **{"num-server-rounds": 4, "resume-from": str(half / CHECKPOINT), **over},
    )
    t_full, m_full = load_checkpoint(full / CHECKPOINT)
    t_rest, m_rest = load_checkpoint(rest / CHECKPOINT)
    a, b = _flat(t_full), _flat(t_rest)
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert m_full["round"] == m_rest["round"] == 4
    assert m_full["app-state"] == m_rest["app-state"]
    keys = ("round", "local-updates", "bytes-relayed", "bytes-p2p", "test-accuracy", "walk-vertex")
    keys += ("test-accuracy-vertex-mean", "test-loss-vertex-mean")
    rows = lambda res: [{k: r.get(k) for k in keys} for r in [res["initial"], *res["rounds"]]]  # noqa: E731
    assert rows(res_full) == rows(res_rest)
    assert res_rest["status"] == "completed" and len(res_rest["rounds"]) == 4  # rounds 1..4
    assert res_rest["initial"]["round"] == 0
    # byte accounting with the optimiser state carried (2 AdamW moments per adapter tensor, so
    # the state is 2 tokens T): hop 1 sends T down (no state yet) and 3T up; later hops 3T each
    # way. Relayed after 4 hops = 4T + 3 * 6T = 22T; peer-to-peer = T + 3 * 3T = 10T.
    if strategy == "rwlora":
        first, last = res_full["rounds"][0], res_full["rounds"][-1]
        token = first["bytes-p2p"]
        assert first["bytes-relayed"] == 4 * token
        assert last["bytes-relayed"] == 22 * token and last["bytes-p2p"] == 10 * token
        assert last["local-updates"] == 4
    if strategy == "fedavg":
        assert res_full["rounds"][-1]["local-updates"] == 4 * 3
    evals = [r for r in [res_full["initial"], *res_full["rounds"]] if "test-accuracy" in r]
    assert [r["round"] for r in evals] == [0, 2, 4]
    # gossip reports both the A/B-averaged adapter and the mean of each vertex's own adapter
    assert all(("test-accuracy-vertex-mean" in r) == (strategy == "gossip") for r in evals)
    if strategy == "gossip":
        assert all(0 <= r["test-accuracy-vertex-mean"] <= 1 for r in evals)
        assert evals[0]["test-accuracy-vertex-mean"] == evals[0]["test-accuracy"]  # same init


@pytest.mark.parametrize(
    "override, key",
    [
        ({"strategy.name": "sgd"}, "strategy.name"),
        ({"strategy.nme": "rwlora"}, "strategy.nme"),
        ({"train.lr": -0.1}, "train.lr"),
        ({"data.source": "/no/such/file.csv"}, "data.source"),
        ({"lora.target-modules": " , "}, "lora.target-modules"),
        ({"output-dir": "relative/dir"}, "output-dir"),
        ({"strategy.transition": "greedy"}, "strategy.transition"),
        ({"lora.r": 0}, "lora.r"),
        ({"strategy.carry-optimizer-state": True, "strategy.name": "gossip"}, "carry-optimizer"),
        ({"seed": 2**32}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"torch-threads": 100000}, "torch-threads"),
        ({"torch-threads": 0}, "torch-threads"),
        ({"strategy.max-empty-rounds": -1}, "strategy.max-empty-rounds"),
        ({"strategy.dead-after": -2}, "strategy.dead-after"),
        ({"strategy.dead-backoff": 0}, "strategy.dead-backoff"),
        ({"strategy.dead-backoff-max": 4}, "strategy.dead-backoff-max"),
    ],
)
def test_bad_run_config_is_named(override, key):
    with pytest.raises(RunConfigError, match=key.replace(".", r"\.")):
        load_config(override)


@pytest.mark.parametrize("graph", ["erdos_renyi:p=oops", "0-1,5-6", "/no/such/graph.txt"])
def test_bad_graph_spec_stops_before_training(tmp_path, graph):
    rc = {**TINY, "strategy.graph": graph, "output-dir": str(tmp_path)}
    grid = FakeGrid(client_app, num_nodes=3, run_config=rc)
    with pytest.raises(RunConfigError, match="strategy.graph"):
        run_server(grid, rc, settle_s=0.05)
    assert not [r for r in grid.log if r.message_type == "train"]


def test_resume_refuses_a_changed_setting(tmp_path):
    half, _ = _run(tmp_path, "half", **{"num-server-rounds": 1})
    with pytest.raises(RunConfigError, match="train.lr"):
        _run(
            tmp_path,
            "rest",
            **{"num-server-rounds": 2, "resume-from": str(half / CHECKPOINT), "train.lr": 0.5},
        )


@pytest.mark.slow
def test_real_flwr_run_simulation_completes(tmp_path):
    """`flwr run` of the app on a private SuperLink (Ray simulation, 3 SuperNodes). The same run
    checks issue 9, item 8 (a test of its own in test_app_exports.py before, a second run of
    the same app): the streamed log holds what the ServerApp prints; it builds the classifier
    with ``from_pretrained`` ("Loading weights" bar before) and saves the adapter ("Writing
    model shards" in the LM app before): no bar may remain."""
    out = tmp_path / "run"
    env = {**os.environ, "NUM_SUPERNODES": "3", "CPUS_PER_CLIENT": "1"}
    overrides = [
        "num-server-rounds=3",
        "eval-every=3",
        "strategy.local-steps=2",
        "train.batch-size=4",
        "data.max-examples=32",
        "data.eval-examples=32",
        "model.max-length=32",
        "strategy.graph='ring'",
    ]
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_app.sh"), str(APP), str(out), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["num-clients"] == 3
    rows = res["rounds"]
    assert res["initial"]["round"] == 0 and [r["round"] for r in rows] == [1, 2, 3]
    assert rows[-1]["local-updates"] == 3 * 2
    assert 0.0 <= rows[-1]["test-accuracy"] <= 1.0
    assert all(r["walk-vertex"] in (0, 1, 2) for r in rows)
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "visits.png").exists()
    assert (out / CHECKPOINT).exists()
    log = (out / "flwr-run.log").read_text()
    assert "rwlora-sentiment: done, 3 rounds in this run" in log
    for bar in ("Loading weights", "Writing model shards", "it/s]"):
        assert bar not in log, bar
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_pyproject_config_matches_schema_defaults():
    tomllib = pytest.importorskip("tomllib")

    from rwlora_sentiment.task import DEFAULTS

    from flwr_isoloco.runconfig import flatten

    app_cfg = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert flatten(app_cfg) == flatten(DEFAULTS)
    assert (APP / "README.md").read_text().count("`") > 2 * len(flatten(DEFAULTS))
    readme = (APP / "README.md").read_text()
    missing = [k for k in flatten(DEFAULTS) if f"`{k}`" not in readme]
    assert not missing, f"README.md does not document {missing}"


def _set_train_metric(key, value):
    def corrupt(reply):
        rec = reply.content.metric_records.get("metrics") if reply.has_content() else None
        if rec is not None and reply.metadata.message_type == "train":
            rec[key] = value
        return reply

    return corrupt


@pytest.mark.parametrize(
    "key, value",
    [("local-steps", float("nan")), ("data-cursor", [1, 2]), ("partition-id", float("inf"))],
)
def test_hostile_client_metric_drops_the_reply_not_the_server(tmp_path, key, value):
    """B3: NaN / inf / a list in a metric the server reads crashed the ServerApp."""
    rc = {**TINY, "output-dir": str(tmp_path / "run"), "num-server-rounds": 4, "eval-every": 4}
    grid = FakeGrid(client_app, num_nodes=3, run_config=rc)
    grid.set_fault(1, _set_train_metric(key, value))
    out = run_server(grid, rc, settle_s=0.05)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    last = res["rounds"][-1]
    assert last["hop-failures-total"] >= 1  # vertex 1's hops were refused ...
    assert last["local-updates"] == 4  # ... and re-routed: every round trained elsewhere
    assert all(r.get("walk-vertex") != 1 for r in res["rounds"])
    _, meta = load_checkpoint(out / CHECKPOINT)
    assert "1" not in meta["app-state"]["cursors"]  # the bad reply's cursor was not recorded


def test_seed_at_the_top_of_its_range_trains(tmp_path):
    """B5: a large seed must not overflow a generator; the run must train, not just finish."""
    out, res = _run(tmp_path, "big", **{"seed": 2**32 - 1, "num-server-rounds": 2})
    assert res["status"] == "completed"
    assert res["rounds"][-1]["local-updates"] == 2 and res["rounds"][-1]["hop-failures-total"] == 0


def test_run_that_uses_no_reply_stops_with_an_error(tmp_path):
    """B5: every reply dropped -> NoProgressError after strategy.max-empty-rounds, status failed."""
    from flwr_isoloco.strategies.core.guard import NoProgressError

    rc = {**TINY, "output-dir": str(tmp_path / "run"), "num-server-rounds": 6, "eval-every": 6}
    grid = FakeGrid(client_app, num_nodes=3, run_config=rc)
    for node in range(3):
        grid.set_fault(node, _set_train_metric("local-steps", -5))
    with pytest.raises(NoProgressError, match="3 consecutive rounds"):
        run_server(grid, rc, settle_s=0.05)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "failed" and "max-empty-rounds=3" in res["error"]
    assert res["initial"]["round"] == 0 and [r["round"] for r in res["rounds"]] == [1, 2, 3]
    assert res["rounds"][-1]["local-updates"] == 0


def test_gossip_scores_equal_vertex_adapters_once(tmp_path, monkeypatch):
    """Round 0: every vertex holds the initial adapter, so it is scored once, not per vertex
    (the values are the same: evaluation is deterministic)."""
    from rwlora_sentiment import server_app

    calls = []
    real = server_app.classifier.evaluate

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(server_app.classifier, "evaluate", counting)
    _, res = _run(tmp_path, "g", **{"strategy.name": "gossip", "num-server-rounds": 1})
    # round 0: the average + one for the 3 identical vertex adapters; round 1: 1 + 3 distinct
    assert len(calls) <= 2 + 4, len(calls)
    assert res["initial"]["test-accuracy-vertex-mean"] == pytest.approx(
        res["initial"]["test-accuracy"], abs=0.02
    )


class _LateClock:
    """The fake grid's virtual clock, except that while nodes are still hidden a sleep lasts
    what it says (a registration is an event the virtual clock cannot jump to)."""

    def __init__(self, grid: _LateGrid, inner) -> None:
        self.grid, self.inner = grid, inner

    def monotonic(self) -> float:
        return self.inner.monotonic()

    def sleep(self, seconds: float) -> None:
        if self.grid._hidden > 0:
            self.inner.now += seconds
        else:
            self.inner.sleep(seconds)


class _LateGrid(FakeGrid):
    """Nodes that register only after the ServerApp has asked a few times (as in simulation)."""

    def __init__(self, *args, hidden_polls: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self._hidden = hidden_polls
        self.time_source = _LateClock(self, self.time_source)

    def get_node_ids(self):
        if self._hidden > 0:
            self._hidden -= 1
            return []
        return super().get_node_ids()


def test_resume_of_a_finished_run_waits_for_its_clients_and_exports(tmp_path, monkeypatch):
    """A checkpoint already holding every round trains nothing, but the graph strategy still
    needs one vertex per client: the runner waits for them instead of building on 0 nodes."""
    monkeypatch.setattr("flwr_isoloco.strategies.core.nodes.POLL_S", 0.01)
    done, _ = _run(tmp_path, "done", **{"num-server-rounds": 2})
    rc = {**TINY, "num-server-rounds": 2, "output-dir": str(tmp_path / "again")}
    rc["resume-from"] = str(done / CHECKPOINT)
    out = run_server(_LateGrid(client_app, num_nodes=3, run_config=rc), rc, settle_s=0.05)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["num-clients"] == 3
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert (out / "adapter" / "adapter_config.json").exists()
