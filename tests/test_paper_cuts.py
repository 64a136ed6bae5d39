"""Issue 17's paper cuts, each pinned by a check that failed before its fix (in-process, on
the fake grid): the QUERY probe, the graph strategies' evaluation default, failing runs, the
resume config diff, the run-config pre-check, and the log nits."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord
from test_lifecycle import plain_app  # the quickstart-style ClientApp, no @app.query()

from flwr_isoloco.strategies import GossipLoRA, RWLoRA


def init_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 2), "b": torch.zeros(2)}


# ---------------------------------------------------------------- 1. one quiet QUERY probe
@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_no_query_handler_is_probed_once(cls, caplog):
    """Before: every node got the QUERY (4 failed ClientApp calls, one Flower traceback each
    on Ray). After: one node is probed and the warning names it, in one line."""
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = cls()
    with caplog.at_level(logging.INFO, logger="flwr"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    queries = [r for r in grid.log if r.message_type == "query"]
    assert [(r.node_id, r.outcome) for r in queries] == [(min(grid.node_ids), "raised")]
    assert s.vmap.by_node_order and s.vmap.node_of == dict(enumerate(sorted(grid.node_ids)))
    said = [r.getMessage() for r in caplog.records if "@app.query()" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"probe of node {min(grid.node_ids)}" in said[0]


# ---------------------------------------------------------------- 2. evaluation as FedAvg's
@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_graph_strategies_evaluate_by_default_as_fedavg(cls):
    """Before: fraction_evaluate defaulted to 0, so a swapped FedAvg app lost its federated
    evaluation (no evaluate message, evaluate_metrics_clientapp empty)."""
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = cls()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    assert s.fraction_evaluate == 1.0
    assert sorted(res.evaluate_metrics_clientapp) == [1, 2]
    evaluated = [r.node_id for r in grid.log if r.message_type == "evaluate"]
    assert sorted(evaluated) == sorted(grid.node_ids * 2)  # every node, every round
    # the metric is the weighted mean over the nodes of the model sent (independent sum)
    final = s.current_arrays().to_torch_state_dict()
    expected = float(sum(v.abs().sum() for v in final.values()))
    assert res.evaluate_metrics_clientapp[2]["eval-loss"] == pytest.approx(expected, rel=1e-6)


def test_rwlora_sentiment_keeps_server_side_evaluation_only():
    """The app evaluates server-side; its graph strategies pin the old fraction_evaluate=0."""
    import sys
    from pathlib import Path

    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1] / "simulations" / "rwlora-sentiment")
    )
    from rwlora_sentiment.task import build_strategy, load_config

    for name in ("rwlora", "gossip"):
        cfg = load_config({"strategy.name": name})
        assert build_strategy(cfg, 4).fraction_evaluate == 0.0


def test_demo_summary_lists_every_output_with_its_size(tmp_path):
    """Before: "demo: results in <out>  (results.json, loss.png, checkpoint.safetensors,
    model/)", a fixed list without node-state/ (the largest output). The real demo.sh runs
    here with run_app.sh replaced by a stub that writes a finished run's folder."""
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "demo.sh").write_text((repo / "scripts" / "demo.sh").read_text())
    (tmp_path / ".venv").symlink_to(repo / ".venv")
    results = {
        "initial": {"val-loss": 7.6},
        "rounds": [{"replies-used": 4, "val-loss": 4.5, "val-ppl": 90.0}],
        "config": {"strategy": {"name": "isoloco"}},
    }
    stub = f"""#!/usr/bin/env bash
set -e
mkdir -p "$2/node-state/0" "$2/model"
echo '{json.dumps(results)}' > "$2/results.json"
head -c 3000000 /dev/zero > "$2/node-state/0/moments.safetensors"
head -c 2000 /dev/zero > "$2/model/model.safetensors"
"""
    (tmp_path / "scripts" / "run_app.sh").write_text(stub)
    out = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert "validation loss 7.600 -> 4.500" in out.stdout
    assert last.startswith("demo: results in ") and " (3.0 MB): " in last, last
    n_json = len(json.dumps(results)) + 1  # echo's newline
    assert last.endswith(f"node-state/ 3.0 MB, model/ 2.0 kB, results.json {n_json} B"), last


# ---------------------------------------------------------------- 4. every differing key
def test_resume_refusal_lists_every_differing_key():
    """Before: only the first differing key ('seed') was named."""
    from flwr_isoloco.runconfig import RunConfigError, check_resumable

    saved = {"seed": 0, "train": {"lr": 0.003, "steps": 20}, "old": 1, "output-dir": "/a"}
    now = {"seed": 1, "train": {"lr": 0.001, "steps": 20}, "new": True, "output-dir": "/b"}
    with pytest.raises(RunConfigError) as err:
        check_resumable(saved, now, may_differ={"output-dir"}, source="/x/ck.safetensors")
    text = str(err.value)
    assert text.startswith("4 settings differ from the checkpoint's config (/x/ck.safetensors)")
    for part in (
        "run-config key 'new' = True is not in the checkpoint's config",
        "the checkpoint has key 'old' = 1, which this run does not know",
        "run-config key 'seed' = 1 differs from the checkpoint's 0",
        "run-config key 'train.lr' = 0.001 differs from the checkpoint's 0.003",
    ):
        assert part in text, (part, text)
    assert "output-dir" not in text and "steps" not in text


# ---------------------------------------------------------------- 6. log nits
def test_gossip_logs_one_replies_line_per_round(caplog):
    """Before: "gossip: 1 replies used, 0 rejected, 0 missing" once per vertex (4 a round)."""
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = GossipLoRA(fraction_evaluate=0.0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=3, timeout=5)
    lines = [r.getMessage() for r in caplog.records if "replies used" in r.getMessage()]
    assert lines == [
        f"gossip (round {r}): 4 replies used, 0 rejected, 0 missing" for r in (1, 2, 3)
    ]


def test_gossip_replies_line_counts_rejected_and_missing(caplog):
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = GossipLoRA(fraction_evaluate=0.0)
    s.setup(grid, timeout=5)
    nodes = sorted(grid.node_ids)
    grid.set_fault(nodes[1], "timeout", times=1)
    grid.set_fault(nodes[2], "raise", times=1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1, timeout=5)
    lines = [r.getMessage() for r in caplog.records if "replies used" in r.getMessage()]
    assert lines == ["gossip (round 1): 2 replies used, 1 rejected, 1 missing"]


@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_deferred_graph_summary_reads_as_a_sentence(cls, caplog):
    """Before: "graph: n = connected nodes vertices, ? edges"."""
    with caplog.at_level(logging.INFO, logger="flwr"):
        cls().summary()
        cls("ring", num_vertices=4, **({"lazy": True} if cls is RWLoRA else {})).summary()
    text = caplog.text
    assert "n = connected nodes vertices" not in text and "?" not in text
    assert "'complete' on the connected nodes (one vertex per node" in text
    assert "4 vertices, 4 edges" in text


def test_periodic_walk_warning_names_the_run_config_key():
    """Before: "...; use lazy=True" (the Python argument only)."""
    from flwr_isoloco.graphs import PeriodicWalkWarning

    with pytest.warns(PeriodicWalkWarning) as seen:
        RWLoRA("ring", num_vertices=4)
    text = str(seen[0].message)
    assert "RWLoRA(lazy=True)" in text and "strategy.lazy=true" in text


# ---------------------------------------------------------------- 3. a failing run says so
def _tiny_spec(build):
    """An app for the runner: DiLoCo on the plain ClientApp, server-side evaluation."""
    from flwr_isoloco.apprunner import AppSpec
    from flwr_isoloco.runconfig import read_run_config

    defaults = {
        "num-server-rounds": 3,
        "rounds-this-run": 0,
        "output-dir": "",
        "resume-from": "",
        "round-timeout": 5.0,
        "checkpoint": False,
        "torch-threads": 0,
    }
    return AppSpec(
        name="tiny",
        label="tiny",
        load_config=lambda rc: read_run_config(rc, defaults),
        nodes=lambda cfg: (3, True, 5.0),
        build=build,
    )


def _tiny_run(evaluate):
    from flwr_isoloco.apprunner import AppRun
    from flwr_isoloco.strategies import DiLoCo

    return AppRun(
        strategy=DiLoCo(min_available_nodes=3, fraction_evaluate=0.0),
        initial_arrays=ArrayRecord(init_model()),
        evaluate=evaluate,
        row=lambda r, tm, em: {**em},
        summary=lambda row: f"loss {row.get('loss')}",
    )


def test_app_whose_strategy_refuses_its_arguments_ends_failed(tmp_path, caplog):
    """Before: the TypeError left no results.json at all (the run's folder was empty)."""
    import json

    from flwr_isoloco.apprunner import run_app

    def build(cfg, nodes):
        return RWLoRA(fraction_fit=0.5)

    grid = FakeGrid(plain_app(), num_nodes=3, seed=1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        with pytest.raises(TypeError, match="unexpected keyword argument 'fraction_fit'"):
            run_app(_tiny_spec(build), grid, {"output-dir": str(tmp_path)}, settle_s=0.0)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "failed" and res["rounds"] == [] and res["app"] == "tiny"
    assert res["error"] == "TypeError: RWLoRA() got an unexpected keyword argument 'fraction_fit'"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"tiny: failed: {res['error'].split(': ', 1)[1]}"], errors


def test_app_that_crashes_mid_run_keeps_its_rounds_and_ends_failed(tmp_path):
    """Before: results.json kept saying "running" (rounds 1..2 in it) after the crash."""
    import json

    from flwr_isoloco.apprunner import run_app

    def evaluate(server_round, arrays):
        if server_round == 3:
            raise RuntimeError("evaluator crashed")
        w = arrays.to_torch_state_dict()["w"]
        return {"loss": float(w.abs().sum())}

    grid = FakeGrid(plain_app(), num_nodes=3, seed=1)
    spec = _tiny_spec(lambda cfg, nodes: _tiny_run(evaluate))
    with pytest.raises(RuntimeError, match="evaluator crashed"):
        run_app(spec, grid, {"output-dir": str(tmp_path)}, settle_s=0.0)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "failed" and res["error"] == "RuntimeError: evaluator crashed"
    assert [r["round"] for r in res["rounds"]] == [1, 2]


# ---------------------------------------------------------------- 5. run config checked first
REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_precheck_runs_the_apps_own_value_checks():
    """Before: run_app.sh checked key names only; a bad value (or type) was found by the
    ServerApp after the simulation had started."""
    from flwr_isoloco.runconfig import precheck_app_config

    lm = REPO_ROOT / "simulations" / "isoloco-lm"
    assert precheck_app_config(lm, {"strategy.name": "diloco", "train.lr": 1}) == []
    from flwr_isoloco.merging import MERGE_RULES

    assert "iso_c" in MERGE_RULES and "median" not in MERGE_RULES
    assert precheck_app_config(lm, {"strategy.merge": "median"}) == [
        "run-config key 'strategy.merge' has bad value 'median': unknown merge rule; expected "
        f"'' or one of {sorted(MERGE_RULES)}"
    ]
    # keys that depend on each other, as the app's load_config checks them
    (problem,) = precheck_app_config(lm, {"strategy.name": "fedavg", "strategy.merge": "ties"})
    assert "conflicts with strategy.name 'fedavg'" in problem
    assert precheck_app_config(lm, {"train.lr": "fast", "seed": 1.5}) == [  # every one
        "run-config key 'train.lr' has value 'fast' of type str; expected float (declared 0.003)",
        "run-config key 'seed' has value 1.5 of type float; expected int (declared 0)",
    ]
    sentiment = REPO_ROOT / "simulations" / "rwlora-sentiment"
    (problem,) = precheck_app_config(sentiment, {"strategy.name": "walk"})
    assert problem.startswith("run-config key 'strategy.name' has bad value 'walk'")


def test_precheck_never_imports_a_plain_flower_app():
    """A user's ServerApp may load data at import: only its declared types are checked."""
    import sys

    from flwr_isoloco.runconfig import precheck_app_config

    app = REPO_ROOT / "examples" / "quickstart-swap"
    before = set(sys.modules)
    assert precheck_app_config(app, {"lr": 1, "local-epochs": 3}) == []
    assert precheck_app_config(app, {"local-epochs": 2.0}) == [
        "run-config key 'local-epochs' has value 2.0 of type float; expected int (declared 2)"
    ]
    assert not {m for m in set(sys.modules) - before if m.startswith("quickstart_swap")}


@pytest.mark.slow
def test_plain_app_whose_strategy_refuses_its_arguments_is_failed_in_flwr_ls(tmp_path):
    """A plain Flower app (examples/quickstart-swap) with ``RWLoRA(fraction_fit=0.5)``, run by
    ``flwr run`` on Ray: Flower ends it ``finished:failed``, and run_app.sh exits 1."""
    import json
    import shutil
    import subprocess

    app = tmp_path / "app"
    shutil.copytree(REPO_ROOT / "examples" / "quickstart-swap", app)
    server = app / "quickstart_swap" / "server_app.py"
    line = "    strategy = FedAvg(fraction_evaluate=0.5)\n"
    assert server.read_text().count(line) == 1
    server.write_text(server.read_text().replace(line, "    strategy = RWLoRA(fraction_fit=0.5)\n"))
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "run_app.sh"), str(app), str(out)],
        capture_output=True,
        text=True,
        timeout=420,
        env={**__import__("os").environ, "NUM_SUPERNODES": "2"},
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((out / "run_app.json").read_text())["status"] == "finished:failed"
    log = (out / "flwr-run.log").read_text()
    assert "TypeError: RWLoRA() got an unexpected keyword argument 'fraction_fit'" in log
