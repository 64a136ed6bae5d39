"""The chaos scenario (issue 39) on a real loopback deployment, shared by the CI test
(``tests/test_chaos_deployment.py``) and the benchmark (``benchmarks/faults/chaos.py``).

A TLS SuperLink with SuperNode authentication and ``--database <file>``, N SuperNodes (each its
own process), the LM app (IsoLoCo, a quorum) checkpointing every round, and a seeded fault
schedule:

- SuperNode SIGKILLs at three kinds of moment, each restarted ``down_s`` later (retrying until
  Flower lets the node back): ``training`` (a node whose ClientApp process is running, killed
  ``delay_s`` after the round began), ``upload`` (a node killed the moment its ClientApp
  process exits: the reply is in the SuperNode's hands, on its way to the SuperLink) and
  ``between`` (killed as soon as the previous round's row is in ``results.json``: the server
  is checkpointing and has not sent the next round). The moment is observed, not assumed: the
  event line says whether the victim had a ClientApp running when it died;
- coordinator faults after a given round's checkpoint: ``superlink`` (the coordinator's machine
  loses power: SuperLink, SuperExec and ServerApp SIGKILLed together; the SuperLink restarted
  with the same port and database) or ``serverapp`` (the ServerApp process alone SIGKILLed,
  the SuperLink staying up). Either way Flower does not restart the lost run; the operator
  stops it and starts the documented resume: a new ``flwr run`` with ``resume-from`` the last
  checkpoint. A run that ends with coordinator faults is followed by a resume of its final
  checkpoint (nothing left to run), whose exported model must equal the run's, bitwise.
"""

from __future__ import annotations

import json
import random
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from deploy_harness import LoopbackDeployment, loopback_deployment
from test_deployment import ISOLOCO_CONFIG

REPO = Path(__file__).resolve().parents[1]
ISOLOCO_APP = REPO / "simulations" / "isoloco-lm"
CHECKPOINT = "checkpoint.safetensors"
SEED = 39
NUM_NODES = 6
ROUNDS = 3
T0 = [0.0]  # the scenario's start (monotonic), for the event times it prints
SUPERLINK_AFTER_ROUND = 2  # the coordinator loses power once the round-2 checkpoint is on disk
PHASES = ("training", "upload", "between")
RESTART_S = 300.0  # a killed SuperNode must be back within this (Flower refuses it ~60 s)
SERVERAPP_WATCH_S = 90.0  # how long a ServerApp kill's run is watched before it is stopped

# The LM app at its smallest: a 1-layer LLaMA on Shakespeare, half the nodes per round, a
# round closes 2 s after 60 % of its replies are in (so a dead node never holds it up).
CONFIG = {
    **ISOLOCO_CONFIG,  # test_deployment's tiny LM app (model, data, 3 inner steps)
    "num-server-rounds": ROUNDS,
    "seed": SEED,
    "round-timeout": 120.0,
    "strategy.fraction-train": 0.5,
    "strategy.quorum": 0.6,
    "strategy.grace-s": 2.0,
}


@dataclass
class NodeKill:
    """A SuperNode SIGKILL once round ``after_round`` is in results.json (0: once the run
    started), at moment ``phase`` (``PHASES``); restarted ``down_s`` later. ``index`` is the
    victim for ``between``, and the preferred one for ``training`` (``delay_s`` into the round)
    and ``upload``, whose victim is whichever node is in that state (the next index that is)."""

    after_round: int
    index: int
    delay_s: float
    down_s: float
    phase: str = "training"


@dataclass
class CoordinatorFault:
    """``what`` (``superlink`` or ``serverapp``) SIGKILLed once round ``after_round``'s
    checkpoint is on disk."""

    after_round: int
    what: str


def fault_schedule(
    seed: int,
    num_nodes: int = NUM_NODES,
    kills: int = 3,
    rounds: int = ROUNDS,
    superlink_after: int = SUPERLINK_AFTER_ROUND,
) -> list[NodeKill]:
    """``kills`` kills; victims (distinct), rounds, phases, moments and down times drawn from
    ``seed``. The phases cycle through ``PHASES`` (shuffled), so three kills see each once.
    Two thirds of the kills fall before round ``superlink_after``, a third after it."""
    rng = random.Random(seed)
    victims = rng.sample(range(num_nodes), kills)
    after = kills // 3
    moments = sorted(
        [rng.choice(range(superlink_after)) for _ in range(kills - after)]
        + [rng.choice(range(superlink_after, rounds)) for _ in range(after)]
    )
    phases = [PHASES[i % len(PHASES)] for i in range(kills)]
    rng.shuffle(phases)
    return [
        NodeKill(r, v, round(rng.uniform(0.0, 4.0), 2), round(rng.uniform(2.0, 8.0), 2), p)
        for r, v, p in zip(moments, victims, phases, strict=True)
    ]


def rounds_done(results: Path) -> int:
    try:
        return len(json.loads(results.read_text()).get("rounds", []))
    except (OSError, json.JSONDecodeError):
        return 0


def checkpoint_round(path: Path) -> int:
    from flwr_isoloco.checkpoint import CheckpointError, load_checkpoint

    try:
        return int(load_checkpoint(path)[1]["round"])
    except (CheckpointError, OSError, ValueError):
        return 0


def wait_for(what: str, predicate, timeout: float, run=None, period: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if run is not None and not run.process.alive():
            raise AssertionError(f"run ended while waiting for {what}:\n{run.process.log_tail()}")
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def clientapps(dep: LoopbackDeployment) -> dict[int, dict[int, float]]:
    """Live SuperNode index -> {pid: start time} of its live ``flwr-clientapp`` processes (a
    ClientApp is a process per task; zombies, exited but not yet reaped, are left out)."""
    out: dict[int, dict[int, float]] = {}
    for info in dep.supernodes:
        if info.process is None or not info.process.alive():
            continue
        apps = out[info.index] = {}
        with suppress(psutil.Error):
            for child in psutil.Process(info.process.pid).children(recursive=True):
                with suppress(psutil.Error):
                    if "flwr-clientapp" in " ".join(child.cmdline()[:3]):
                        apps[child.pid] = child.create_time()
    return out


def training_nodes(dep: LoopbackDeployment, since: float = 0.0) -> set[int]:
    """SuperNodes with a ClientApp process started after ``since`` (wall clock): a task of the
    current run in hand. (A ClientApp of a stopped run can stay alive, idle, for good.)"""
    return {i for i, apps in clientapps(dep).items() if any(t > since for t in apps.values())}


def _pick(preferred: int, candidates: set[int]) -> int | None:
    """``preferred`` if a candidate, else the next candidate index after it (cyclically)."""
    if not candidates:
        return None
    return min(candidates, key=lambda i: (i < preferred, i))  # >= preferred first, then wrap


def _moment(
    dep, kill: NodeKill, down: set[int], since: float, timeout: float = 600.0
) -> tuple[int, str]:
    """Waits for the kill's moment and returns (victim, what was seen); ``down``: sites still
    coming back from an earlier kill (never chosen); ``since``: the current run's start."""
    up = set(range(len(dep.supernodes))) - down
    if kill.phase == "between":
        victim = _pick(kill.index, up)
        busy = victim in training_nodes(dep, since)
        return victim, "between rounds" + (" (a ClientApp still running)" if busy else "")
    deadline = time.monotonic() + timeout
    if kill.phase == "training":
        time.sleep(kill.delay_s)
        while time.monotonic() < deadline:
            victim = _pick(kill.index, training_nodes(dep, since) - down)
            if victim is not None:
                return victim, "training (its ClientApp running)"
            time.sleep(0.2)
    elif kill.phase == "upload":  # a ClientApp process that was there is gone: reply handed over
        before, t_before = clientapps(dep), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now, t_now = clientapps(dep), time.monotonic()
            finished = {i for i in now if i not in down and set(before.get(i, {})) - set(now[i])}
            if finished:
                return _pick(kill.index, finished), (
                    f"upload (its ClientApp exited within the last {t_now - t_before:.1f} s)"
                )
            before, t_before = now, t_now
    else:
        raise ValueError(f"unknown kill phase {kill.phase!r}; expected one of {PHASES}")
    victim = _pick(kill.index, up)
    return victim, f"{kill.phase} not seen in {timeout:.0f} s: killed idle"


def _restart_later(dep, index: int, kill: NodeKill, events: list[str], errors: list, down: set):
    """The site comes back ``down_s`` after the kill; Flower refuses it until the dead
    process's heartbeat window lapses, so the harness retries (``restart_supernode``)."""
    t_kill = time.monotonic()
    try:
        time.sleep(kill.down_s)
        starts = dep.restart_supernode(index, timeout=RESTART_S)
        events.append(
            f"{time.monotonic() - T0[0]:.0f} s: supernode-{index} online again "
            f"{time.monotonic() - t_kill:.0f} s after its kill ({starts} starts)"
        )
    except Exception as exc:  # reported by the caller's thread
        errors.append(exc)
    finally:
        down.discard(index)


@dataclass
class Driver:
    """Fires the SuperNode kills of one run at their moments; each restart in its own thread."""

    dep: LoopbackDeployment
    events: list[str]
    errors: list = field(default_factory=list)
    threads: list = field(default_factory=list)
    down: set = field(default_factory=set)
    phases_seen: list = field(default_factory=list)

    def drive(self, run, results: Path, kills: list[NodeKill], restored: int = 0) -> None:
        since = time.time()  # the run's ClientApps start after this
        for kill in kills:
            wait_for(
                f"round {kill.after_round}",
                # a resumed run holds its ``restored`` rounds from its start
                lambda k=kill: max(rounds_done(results), restored) >= k.after_round,
                600,
                run,
                period=0.1,
            )
            index, seen = _moment(self.dep, kill, self.down, since)
            self.down.add(index)
            self.dep.kill_supernode(index)
            self.phases_seen.append(seen)
            node = self.dep.supernodes[index].node_id
            self.events.append(
                f"{time.monotonic() - T0[0]:.0f} s: SIGKILL supernode-{index} (node {node}) "
                f"after round {kill.after_round}, {seen}"
            )
            thread = threading.Thread(
                target=_restart_later,
                args=(self.dep, index, kill, self.events, self.errors, self.down),
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)

    def join(self, strict: bool = True) -> list[str]:
        """Wait for the restarts; what failed (raised with ``strict``, else returned)."""
        for thread in self.threads:
            thread.join(timeout=RESTART_S + 60)
        failed = [repr(e) for e in self.errors]
        if any(t.is_alive() for t in self.threads):
            failed.append("a SuperNode restart never finished")
        assert not (strict and failed), failed
        return failed


def model_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    assert tensors, f"no model weights in {model_dir}"
    return tensors


@dataclass
class ChaosRun:
    """What one chaos scenario did (``run_chaos``). ``statuses``, ``results`` (results.json)
    and ``logs`` (the ServerApp log) have one entry per ``flwr run``: the first run, one resumed
    run per coordinator fault, then (with coordinator faults, once the last run completed) the
    resume of the final checkpoint."""

    events: list[str]
    statuses: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)  # rounds each resume took over
    checkpoint_unchanged: bool = True  # the lost runs' checkpoints, untouched by the resumes
    resumed_model_equal: bool | None = None  # final model == the final checkpoint's, bitwise
    node_kills: int = 0
    kill_moments: list[str] = field(default_factory=list)  # what each kill's victim was doing
    superlink_restarts: int = 0
    serverapp_kills: int = 0  # the ServerApp process alone
    node_starts: int = 0  # SuperNode starts the restarts took (Flower refuses early ones)
    # ClientApp processes still alive once every run ended: (SuperNode index, age s, RSS MB)
    orphan_clientapps: list = field(default_factory=list)
    restart_failures: list = field(default_factory=list)  # SuperNodes that did not come back
    setup_s: float = 0.0
    wall_s: float = 0.0

    @property
    def coordinator_faults(self) -> int:
        return self.superlink_restarts + self.serverapp_kills

    @property
    def final(self) -> dict:
        """results.json of the last training run (the verification resume excluded)."""
        return self.results[self.coordinator_faults]

    @property
    def training_logs(self) -> list[str]:
        return self.logs[: self.coordinator_faults + 1]


def coordinator_faults(superlink_after, serverapp_after) -> list[CoordinatorFault]:
    faults = [
        CoordinatorFault(r, what)
        for r, what in ((superlink_after, "superlink"), (serverapp_after, "serverapp"))
        if r is not None
    ]
    return sorted(faults, key=lambda f: f.after_round)


def kill_serverapp(dep: LoopbackDeployment) -> list[int]:
    """SIGKILL the ``flwr-serverapp`` processes under the SuperLink (the SuperLink, its
    SuperExec and the SuperNodes stay up): a crash of the ServerApp alone."""
    victims = []
    with suppress(psutil.Error):
        for child in psutil.Process(dep.superlink.pid).children(recursive=True):
            with suppress(psutil.Error):
                if "flwr-serverapp" in " ".join(child.cmdline()[:3]):
                    child.kill()
                    victims.append(child.pid)
    if not victims:
        raise RuntimeError("no flwr-serverapp process under the SuperLink to kill")
    return victims


def _coordinator_fault(dep, fault: CoordinatorFault, chaos: ChaosRun) -> None:
    t0 = T0[0]
    if fault.what == "superlink":
        descendants = dep.kill_superlink(with_descendants=True)
        chaos.events.append(
            f"{time.monotonic() - t0:.0f} s: SIGKILL SuperLink + {len(descendants)} "
            f"descendants after round {fault.after_round}"
        )
        dep.restart_superlink()
        chaos.superlink_restarts += 1
        # The SuperNodes that were up reconnect with their node ids (a site still coming
        # back from its own kill joins when Flower lets it: its restart thread retries).
        steady = {n.node_id for n in dep.supernodes if n.process.alive()}
        wait_for("the SuperNodes to reconnect", lambda: steady <= dep.online_node_ids(), 90)
        chaos.events.append(
            f"{time.monotonic() - t0:.0f} s: restart SuperLink (same port, certs, database); "
            f"{len(steady)} SuperNodes back"
        )
    elif fault.what == "serverapp":
        pids = kill_serverapp(dep)
        chaos.serverapp_kills += 1
        chaos.events.append(
            f"{time.monotonic() - t0:.0f} s: SIGKILL ServerApp alone (pid {pids}) after round "
            f"{fault.after_round}"
        )
    else:
        raise ValueError(f"unknown coordinator fault {fault.what!r}")


def _lost_run(dep, run_id: int, fault: CoordinatorFault, events: list[str]) -> None:
    """Stop the lost run if Flower still lists it running. After a ServerApp kill, first watch
    for ``SERVERAPP_WATCH_S`` whether Flower ends the run by itself (what it does is logged)."""
    t_kill = time.monotonic()
    status = dep.run_status(run_id)
    if fault.what == "serverapp":
        while status == "running" and time.monotonic() - t_kill < SERVERAPP_WATCH_S:
            time.sleep(2.0)
            status = dep.run_status(run_id)
        events.append(
            f"{time.monotonic() - T0[0]:.0f} s: Flower lists the run {status} "
            f"{time.monotonic() - t_kill:.0f} s after the ServerApp's kill"
        )
    if status == "running":
        dep.stop_run(run_id)


def run_chaos(
    tmp_path: Path,
    *,
    seed: int = SEED,
    num_nodes: int = NUM_NODES,
    config: dict | None = None,
    kills: list[NodeKill] | None = None,
    superlink_after: int | None = SUPERLINK_AFTER_ROUND,
    serverapp_after: int | None = None,
    on_up=None,
    strict: bool = True,
) -> ChaosRun:
    """The scenario: ``num_nodes`` SuperNodes, the LM app with ``config``, the SuperNode
    ``kills`` (default: ``fault_schedule(seed)``; ``[]`` for none), the coordinator faults
    after rounds ``superlink_after`` / ``serverapp_after`` (``None``: none), each followed by
    stopping the lost run and the documented resume, then a resume of the final checkpoint to
    compare the exported model. ``on_up(dep)`` is called once the deployment is up. ``strict``:
    a SuperNode that does not come back raises (else it is recorded in ``restart_failures``)."""
    config = {**CONFIG, "seed": seed, **(config or {})}
    kills = fault_schedule(seed) if kills is None else kills
    faults = coordinator_faults(superlink_after, serverapp_after)
    t0 = T0[0] = time.monotonic()
    root = tmp_path / "dep"
    node_configs = [
        f"partition-id={i} num-partitions={num_nodes} state-dir='{root / f'node-{i}-state'}'"
        for i in range(num_nodes)
    ]
    chaos = ChaosRun(events=[], node_kills=len(kills))
    lost: list[tuple[Path, bytes]] = []  # each lost run's checkpoint, as the resume found it
    with loopback_deployment(root, num_supernodes=num_nodes, node_configs=node_configs) as dep:
        chaos.setup_s = time.monotonic() - t0
        if on_up is not None:
            on_up(dep)
        driver = Driver(dep, chaos.events)
        resume: dict = {}
        restored = 0
        for i, fault in enumerate([*faults, None]):
            out = tmp_path / f"run-{'abcdefgh'[i]}"
            lo = faults[i - 1].after_round if i else 0
            hi = fault.after_round if fault is not None else float("inf")
            limit = 600 + 150 * int(config["num-server-rounds"])  # run_app.sh's wait
            run = dep.start_app(ISOLOCO_APP, {**config, **resume, "output-dir": str(out)}, limit)
            driver.drive(
                run, out / "results.json", [k for k in kills if lo <= k.after_round < hi], restored
            )
            if fault is None:
                outcome = run.wait()
                log_text = outcome.logs
            else:
                ckpt = out / CHECKPOINT
                wait_for(
                    f"the round-{fault.after_round} checkpoint",
                    lambda c=ckpt, r=fault.after_round: checkpoint_round(c) >= r,
                    1200,
                    run,
                )
                run_id = run.run_id()
                _coordinator_fault(dep, fault, chaos)
                lost.append((ckpt, ckpt.read_bytes()))
                # Flower lost the run (no ServerApp, it is not restarted); the operator stops it.
                _lost_run(dep, run_id, fault, chaos.events)
                outcome = run.wait()
                log_text = dep.run_logs(run_id)
                restored = checkpoint_round(ckpt)
                chaos.restored.append(restored)
                resume = {"resume-from": str(ckpt)}
            chaos.events.append(f"{time.monotonic() - t0:.0f} s: run {out.name} {outcome.status}")
            chaos.statuses.append(outcome.status)
            chaos.logs.append(log_text)
            chaos.results.append(json.loads((out / "results.json").read_text()))
        if faults and chaos.statuses[-1] == "finished:completed":
            _verify_resume(dep, config, out, tmp_path / "run-verify", chaos)
        chaos.checkpoint_unchanged = all(p.read_bytes() == b for p, b in lost)
        chaos.restart_failures = driver.join(strict)  # every killed site came back
        chaos.orphan_clientapps = _orphans(dep)
        chaos.kill_moments = driver.phases_seen
        chaos.node_starts = sum(dep._starts.get(f"supernode-{i}", 1) - 1 for i in range(num_nodes))
    chaos.wall_s = time.monotonic() - t0
    for i, text in enumerate(chaos.logs):  # for a failure's post-mortem
        (tmp_path / f"run-{i}.log").write_text(text)
    print("\nchaos events:", *chaos.events, sep="\n  ")
    return chaos


def _orphans(dep: LoopbackDeployment, settle_s: float = 3.0) -> list[tuple[int, float, float]]:
    """ClientApp processes alive when no run is left: the tasks of stopped runs that Flower
    started and never ended (the SuperNode ignores a stopped run's message, its ClientApp
    waits)."""
    time.sleep(settle_s)
    out = []
    for index, apps in clientapps(dep).items():
        for pid, started in apps.items():
            with suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss / 2**20
                out.append((index, round(time.time() - started, 1), round(rss, 1)))
    return out


def _verify_resume(dep, config: dict, last: Path, out: Path, chaos: ChaosRun) -> None:
    """Resume the final checkpoint: nothing is left to run, the model is exported from the
    restored state; it must equal the last run's export bitwise."""
    final_ckpt = str(last / CHECKPOINT)
    run = dep.run_app(
        ISOLOCO_APP, {**config, "output-dir": str(out), "resume-from": final_ckpt}, 300
    )
    chaos.events.append(
        f"{time.monotonic() - T0[0]:.0f} s: resume of the final checkpoint {run.status}"
    )
    chaos.statuses.append(run.status)
    chaos.logs.append(run.logs)
    chaos.results.append(json.loads((out / "results.json").read_text()))
    if run.status == "finished:completed":
        a, b = model_tensors(last / "model"), model_tensors(out / "model")
        chaos.resumed_model_equal = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
