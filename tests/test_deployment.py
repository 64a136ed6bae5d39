"""Loopback deployment tests: TLS SuperLink + authenticated SuperNodes on 127.0.0.1, `flwr run`.

Select alone with ``pytest -m deployment``. The real-app tests (IsoLoCo plain and with int8
uploads, RW-LoRA) and the quorum test share one deployment (3 SuperNodes, module scope); each
kill test SIGKILLs one SuperNode mid-run and restarts it after. Every process started is
stopped by PID, also when a test fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from deploy_harness import (
    LoopbackDeployment,
    ManagedProcess,
    format_run_config,
    loopback_deployment,
    stop_processes,
)

pytestmark = pytest.mark.deployment

REPO = Path(__file__).resolve().parents[1]
TINY_APP = REPO / "tests" / "deploy-app"
ISOLOCO_APP = REPO / "simulations" / "isoloco-lm"
RWLORA_APP = REPO / "simulations" / "rwlora-sentiment"

# Tiny but real: a 1-layer LLaMA on Shakespeare, 3 SuperNodes, 4 rounds of 3 inner steps.
ISOLOCO_CONFIG = {
    "num-server-rounds": 3,
    "round-timeout": 300.0,
    "strategy.name": "isoloco",
    "strategy.min-nodes": 2,
    "train.local-steps": 3,
    "train.batch-size": 4,
    "train.seq-len": 32,
    "train.warmup-steps": 1,
    "model.hidden": 32,
    "model.layers": 1,
    "model.heads": 2,
    "data.val-tokens": 1024,
}
# Tiny but real: LoRA r=4 on MiniLM, 3 hops of 2 steps on a complete graph of the 3 SuperNodes.
RWLORA_CONFIG = {
    "num-server-rounds": 3,
    "round-timeout": 300.0,
    "eval-every": 1000,
    "strategy.name": "rwlora",
    "strategy.num-clients": 3,
    "strategy.graph": "complete",
    "strategy.local-steps": 2,
    "lora.r": 4,
    "model.max-length": 32,
    "train.batch-size": 8,
    "data.max-examples": 600,
    "data.test-size": 200,
    "data.eval-examples": 64,
}
# Round timeout of the kill runs. A message to a SIGKILLed SuperNode gets an error reply once
# the SuperLink marks the node offline (~60 s: heartbeat 30 s, patience 2), so a longer timeout
# costs nothing; it must only exceed a normal round on a loaded 2-core machine (~60 s seen).
KILL_ROUND_TIMEOUT = 150.0

# Outcomes of the runs, so the kill tests can print themselves against the no-kill runs.
OUTCOMES: dict[str, dict] = {}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---------------------------------------------------------------- harness checks (no Flower)
def test_format_run_config_quotes_strings_and_rejects_quotes():
    text = format_run_config({"a": 1, "b": 0.5, "c": True, "output-dir": "/x/y"})
    assert text == "a=1 b=0.5 c=true output-dir='/x/y'"
    with pytest.raises(ValueError, match="'bad'"):
        format_run_config({"bad": "it's"})


def test_stop_processes_kills_descendants_in_other_sessions(tmp_path):
    """A child that detached into its own session (as SuperExec does) is still stopped."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(300)"
    )
    log = tmp_path / "p.log"
    popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc = ManagedProcess("parent", popen, log)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert _alive(child)
    stop_processes([proc], grace_s=2.0)
    assert popen.returncode is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_setup_failure_stops_the_started_superlink(tmp_path, monkeypatch):
    """If set-up fails after the SuperLink started, the context manager still stops it."""
    started: list[int] = []

    def boom(self, node_config):
        started.append(self.superlink.pid)
        raise RuntimeError("registration failed on purpose")

    monkeypatch.setattr(LoopbackDeployment, "add_supernode", boom)
    with pytest.raises(RuntimeError, match="on purpose"):
        with loopback_deployment(tmp_path / "dep", num_supernodes=1):
            pass
    assert started and not _alive(started[0])


# ---------------------------------------------------------------- the tiny FedAvg app
def test_tiny_fedavg_app_over_tls_with_node_auth(tmp_path):
    """The harness end to end: 3 authenticated SuperNodes, 2 FedAvg rounds, results written;
    an unregistered SuperNode key is refused; everything stops, also when the body raises."""
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with loopback_deployment(tmp_path / "dep", num_supernodes=3) as dep:
            run = dep.run_app(TINY_APP, {"num-server-rounds": 2, "output-dir": str(out)}, 300)
            assert run.status == "finished:completed", run.output + run.logs + dep.diagnostics()
            assert run.returncode == 0
            # Node authentication: a key the coordinator unregistered cannot join.
            intruder = dep.add_supernode("partition-id=3 num-partitions=4")
            assert dep.node_statuses()[intruder.node_id] == "registered"
            dep.unregister_supernode(intruder)
            dep.start_supernode(intruder)
            assert intruder.process.popen.wait(timeout=120) != 0, intruder.process.log_tail()
            statuses = dep.node_statuses()
            assert statuses[intruder.node_id] == "unregistered", statuses
            assert dep.online_node_ids() == {n.node_id for n in dep.supernodes[:3]}, statuses
            # `flwr stop` cancels a run; run_app.sh then reports it and exits non-zero.
            long_run = dep.start_app(TINY_APP, {"num-server-rounds": 1000, "output-dir": str(out)})
            deadline = time.monotonic() + 120
            while long_run.run_id() is None or dep.run_status(long_run.run_id()) != "running":
                assert time.monotonic() < deadline, long_run.process.log_tail()
                time.sleep(1)
            dep.stop_run(long_run.run_id())
            stopped = long_run.wait()
            assert stopped.status == "finished:stopped", stopped.output
            assert stopped.returncode != 0
            pids = [p.pid for p in dep._procs]
            raise KeyboardInterrupt  # teardown must still stop everything
    assert pids and not any(_alive(pid) for pid in pids)
    results = json.loads((out / "results.json").read_text())
    assert results["num-server-rounds"] == 2
    assert sorted(results["train_metrics"]) == ["1", "2"]
    # The fit improved: round-2 loss below round-1 loss (both averaged over the 3 nodes).
    assert results["train_metrics"]["2"]["train_loss"] < results["train_metrics"]["1"]["train_loss"]


# ---------------------------------------------------------------- the real apps
@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    for app in (ISOLOCO_APP, RWLORA_APP):
        if not (app / "pyproject.toml").exists():
            pytest.skip(f"{app} is not there yet")
    root = tmp_path_factory.mktemp("realapps")
    # As at a real site: each SuperNode keeps the app's node state on its own disk.
    node_configs = [
        f"partition-id={i} num-partitions=3 state-dir='{root / f'node-{i}-state'}'"
        for i in range(3)
    ]
    with loopback_deployment(root, num_supernodes=3, node_configs=node_configs) as dep:
        yield dep


def _restore_all_nodes(dep: LoopbackDeployment) -> None:
    for info in dep.supernodes:
        if info.process is None or not info.process.alive():
            dep.start_supernode(info)
    dep.wait_online()


def _wait_for_rounds(results_path: Path, n: int, run, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not run.process.alive():
            raise AssertionError(f"run ended before round {n}:\n{run.process.log_tail()}")
        try:
            if len(json.loads(results_path.read_text()).get("rounds", [])) >= n:
                return
        except (OSError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no round {n} in {results_path} after {timeout}s")


def _isoloco_summary(results: dict) -> dict:
    rounds = results["rounds"]
    return {
        "rounds": len(rounds),
        "replies-used": [r["replies-used"] for r in rounds],
        "replies-not-used": sum(r["replies-missing"] + r["replies-rejected"] for r in rounds),
        "final-val-loss": rounds[-1]["val-loss"],
    }


def test_isoloco_over_tls_with_int8_uploads_survives_a_supernode_sigkill(deployment, tmp_path):
    """One real run of the LM app over TLS with compressed uploads
    (``strategy.upload-codec='int8'``): round 1 uses all 3 nodes, its bytes-up about a quarter
    of its bytes-down (int8 codes + one fp32 scale per tensor), and every SuperNode keeps its
    optimiser state in its own --node-config state-dir. Then SuperNode 2 is SIGKILLed: the run
    completes on the 2 survivors, results.json records the lost replies, the model still
    learns and a checkpoint is written."""
    _restore_all_nodes(deployment)
    out = tmp_path / "isoloco-kill"
    config = {
        **ISOLOCO_CONFIG,
        "round-timeout": KILL_ROUND_TIMEOUT,
        "output-dir": str(out),
        "strategy.upload-codec": "int8",
    }
    try:
        run = deployment.start_app(ISOLOCO_APP, config, 600)
        _wait_for_rounds(out / "results.json", 1, run)
        deployment.kill_supernode(2)
        outcome = run.wait()
        assert outcome.status == "finished:completed", (
            outcome.output + outcome.logs + deployment.diagnostics()
        )
        results = json.loads((out / "results.json").read_text())
        assert results["status"] == "completed"
        n = ISOLOCO_CONFIG["num-server-rounds"]
        assert [r["round"] for r in results["rounds"]] == list(range(1, n + 1))
        used = [r["replies-used"] for r in results["rounds"]]
        lost = [r["replies-rejected"] + r["replies-missing"] for r in results["rounds"]]
        # Round 1 before the kill: all 3. Round 2: the dead node's reply is lost (an error
        # reply once the SuperLink marks it offline, or a timeout), the merge uses the other 2.
        # Later rounds: 2 merged (the dead node is either not sampled or lost again).
        assert used[0] == 3 and lost[0] == 0, (used, lost)
        assert used[1] == 2 and lost[1] == 1, (used, lost)
        assert all(u == 2 for u in used[2:]), (used, lost)
        first = results["rounds"][0]
        ratio = first["bytes-up"] / first["bytes-down"]  # both over the same 3 nodes
        assert 0.24 < ratio < 0.3, ratio
        assert results["rounds"][-1]["val-loss"] < results["initial"]["val-loss"]
        assert (out / "checkpoint.safetensors").exists()
        for i in range(3):  # each SuperNode saved its optimiser state in its own state-dir
            assert list((deployment.root / f"node-{i}-state").glob(f"node-p{i}-r*.safetensors"))
        summary = _isoloco_summary(results)
        OUTCOMES["isoloco-kill"] = {**summary, "wall-s": round(outcome.wall_s, 1)}
        print("\nisoloco (int8 uploads) with SuperNode 2 SIGKILLed after round 1:", summary)
    finally:
        _restore_all_nodes(deployment)


def _rwlora_summary(results: dict) -> dict:
    rounds = results["rounds"]
    hops = [r for r in rounds if r["round"] > 0]
    final = next(r for r in reversed(rounds) if "test-accuracy" in r)
    return {
        "rounds": len(hops),
        "walk": [r.get("walk-vertex") for r in hops],
        "failed-replies": sum(r.get("failed-replies", 0) for r in hops),
        "hop-failures-total": hops[-1].get("hop-failures-total", 0),
        "final-test-accuracy": final["test-accuracy"],
        "final-test-loss": final["test-loss"],
    }


def test_rwlora_run_over_tls(deployment, tmp_path):
    out = tmp_path / "rwlora"
    run = deployment.run_app(RWLORA_APP, {**RWLORA_CONFIG, "output-dir": str(out)}, 900)
    assert run.status == "finished:completed", run.output + run.logs + deployment.diagnostics()
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed"
    n = RWLORA_CONFIG["num-server-rounds"]
    assert [r["round"] for r in results["rounds"]] == list(range(1, n + 1))
    summary = _rwlora_summary(results)
    # One vertex per hop, each a partition-id of a SuperNode; simple walk: no self-loops.
    assert all(v in (0, 1, 2) for v in summary["walk"]), summary
    assert all(a != b for a, b in zip(summary["walk"], summary["walk"][1:], strict=False)), summary
    assert summary["failed-replies"] == 0 and summary["hop-failures-total"] == 0
    assert 0.0 <= summary["final-test-accuracy"] <= 1.0
    assert (out / "checkpoint.safetensors").exists()
    OUTCOMES["rwlora"] = {**summary, "wall-s": round(run.wall_s, 1)}
    print("\nrwlora no-kill:", OUTCOMES["rwlora"])


def test_rwlora_token_survives_a_supernode_sigkill(deployment, tmp_path):
    """SIGKILL, after hop 1, the SuperNode the walk visits next (known from the no-kill run with
    the same seed): that hop fails, the token moves on from the last good copy, the run
    completes and results.json counts the failure."""
    _restore_all_nodes(deployment)
    walk = OUTCOMES.get("rwlora", {}).get("walk", [])
    victim = walk[1] if len(walk) > 1 else 2  # SuperNode i has partition-id i
    out = tmp_path / "rwlora-kill"
    config = {**RWLORA_CONFIG, "round-timeout": KILL_ROUND_TIMEOUT, "output-dir": str(out)}
    try:
        run = deployment.start_app(RWLORA_APP, config, 900)
        _wait_for_rounds(out / "results.json", 1, run)  # hop 1 done
        deployment.kill_supernode(victim)
        outcome = run.wait()
        assert outcome.status == "finished:completed", (
            outcome.output + outcome.logs + deployment.diagnostics()
        )
        results = json.loads((out / "results.json").read_text())
        assert results["status"] == "completed"
        n = RWLORA_CONFIG["num-server-rounds"]
        assert [r["round"] for r in results["rounds"]] == list(range(1, n + 1))
        summary = _rwlora_summary(results)
        assert summary["hop-failures-total"] >= 1, summary
        assert summary["failed-replies"] >= 1, summary
        # After the kill no hop lands on the dead vertex (a failed hop re-routes).
        assert victim not in summary["walk"][1:], summary
        OUTCOMES["rwlora-kill"] = {**summary, "victim": victim, "wall-s": round(outcome.wall_s, 1)}
        print(f"\nrwlora with SuperNode {victim} SIGKILLed after hop 1:", OUTCOMES["rwlora-kill"])
        if "rwlora" in OUTCOMES:
            print("rwlora no-kill:                              ", OUTCOMES["rwlora"])
    finally:
        _restore_all_nodes(deployment)


# ---------------------------------------------------------------- quorum + grace window
QUORUM_APP = REPO / "tests" / "deploy-quorum-app"


def test_quorum_and_grace_window_over_tls(deployment, tmp_path):
    """3 SuperNodes, partition 2 answers each round only after the server closed it (a marker
    file: late by construction at any load); quorum 2, grace 1 s, 5 rounds: every round closes
    without it, its late replies are discarded, never merged (the model is the 2-node FedAvg). Runs on the real apps' deployment (its extra state-dir is unused here)."""
    _restore_all_nodes(deployment)
    out = tmp_path / "out"
    run = deployment.run_app(QUORUM_APP, {"output-dir": str(out)}, 300)
    assert run.status == "finished:completed", run.output + run.logs + deployment.diagnostics()
    results = json.loads((out / "results.json").read_text())
    for r in ("1", "2", "3", "4", "5"):
        m = results["train_metrics"][r]
        assert (m["replies-used"], m["replies-late"], m["replies-arrived"]) == (2, 1, 2), m
    # partitions 0, 1 (weights 1, 2): theta_r = theta_{r-1} + mean_w(0.125 (p+1) (-1)^r)
    step = (1 * 0.125 + 2 * 0.25) / 3
    want = sum(step * (-1) ** r for r in range(1, 6))
    assert results["final_params"] == pytest.approx([want, want], abs=1e-6)
    assert results["discarded_rounds"], "the straggler's reply arrived in no later round"
