"""A throw-away Flower deployment on 127.0.0.1: TLS, SuperNode authentication, N SuperNodes.

Every step calls the scripts in ``scripts/deploy/`` that ``docs/deployment.md`` shows, so the
guide's commands are the ones tested:

    with loopback_deployment(tmp_path, num_supernodes=3) as dep:
        run = dep.run_app(APP_DIR, {"num-server-rounds": 2, "output-dir": str(out)})
        assert run.status == "finished:completed", run.logs

Each process is started in its own session with its own ``FLWR_HOME``; teardown stops every
process the harness started (and their descendants, found while their parents still live) by
PID, also when the body raises. The CLI side gets its own ``FLWR_HOME`` with one connection.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts" / "deploy"
CONNECTION = "loopback"
IN_MEMORY = ":flwr-in-memory:"
"""``database`` for a SuperLink that keeps its state (and the messages' objects) in memory."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def base_env(flwr_home: Path | None = None) -> dict[str, str]:
    """Environment for every child: this venv first on PATH, offline, quiet, few threads."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        MKL_NUM_THREADS=env.get("MKL_NUM_THREADS", "1"),
        PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
    )
    env.pop("FLWR_HOME", None)
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def format_run_config(values: Mapping[str, object]) -> str:
    """Flower's ``--run-config`` string: TOML values, strings single-quoted, space-separated."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            if "'" in value or "\n" in value:
                raise ValueError(f"run config value for {key!r} cannot hold quotes: {value!r}")
            text = f"'{value}'"
        else:
            raise TypeError(f"run config value for {key!r} must be bool/int/float/str")
        parts.append(f"{key}={text}")
    return " ".join(parts)


@dataclass
class ManagedProcess:
    """One long-running process the harness started, with its log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    # pid -> start time: a recorded pid is signalled only while it is still that process
    # (pids are reused, and this machine is shared).
    descendants: dict[int, float] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember_descendants(self) -> None:
        """Record children (SuperExec, app processes) while the parent lives; they may detach."""
        with suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with suppress(psutil.Error):
                    self.descendants.setdefault(child.pid, child.create_time())

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


def _same_live_process(pid: int, create_time: float) -> bool:
    """True if ``pid`` still runs (not a zombie) and is the process that started then."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == create_time and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _recorded_alive(procs: list[ManagedProcess]) -> list[int]:
    found = {pid: t for p in procs for pid, t in p.descendants.items()}
    return sorted(pid for pid, t in found.items() if _same_live_process(pid, t))


def stop_processes(procs: list[ManagedProcess], grace_s: float = 5.0) -> None:
    """SIGTERM each process and its recorded descendants, then SIGKILL what is left; reap.

    Our own children are Popen objects (their pids cannot be reused before we reap them);
    descendants are checked against their recorded start time before each signal.
    """
    for proc in procs:
        proc.remember_descendants()
    _signal_pids([p.pid for p in procs if p.alive()] + _recorded_alive(procs), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    while _recorded_alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_pids([p.pid for p in procs if p.alive()] + _recorded_alive(procs), signal.SIGKILL)
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)


@dataclass
class SuperNodeInfo:
    """A SuperNode of the loopback federation."""

    index: int
    node_id: int
    node_config: str
    appio_port: int
    flwr_home: Path
    private_key: Path
    process: ManagedProcess | None = None


@dataclass
class RunOutcome:
    """What `scripts/deploy/run_app.sh` reported, plus the run's logs from `flwr log`."""

    run_id: int | None
    status: str
    returncode: int
    output: str
    logs: str
    wall_s: float


@dataclass
class RunningApp:
    """A `run_app.sh` in flight; `.wait()` gives its RunOutcome."""

    deployment: LoopbackDeployment
    process: ManagedProcess
    t0: float
    timeout: float

    def run_id(self) -> int | None:
        match = re.search(r"^run-id (\d+)$", self.process.log_tail(100_000), re.M)
        return int(match.group(1)) if match else None

    def wait(self) -> RunOutcome:
        try:
            self.process.popen.wait(timeout=self.timeout + 120)
        except subprocess.TimeoutExpired:
            stop_processes([self.process])
        wall = time.monotonic() - self.t0
        out = self.process.log_tail(100_000)
        status_match = re.search(r"^status (\S+)$", out, re.M)
        run_id = self.run_id()
        logs = self.deployment.run_logs(run_id) if run_id is not None else ""
        return RunOutcome(
            run_id=run_id,
            status=status_match.group(1) if status_match else "unknown",
            returncode=self.process.popen.returncode,
            output=out,
            logs=logs,
            wall_s=wall,
        )


class LoopbackDeployment:
    """SuperLink (TLS + SuperNode auth) and SuperNodes on 127.0.0.1, driven by the deploy scripts."""

    def __init__(
        self, root: Path, *, cwd: Path | None = None, database: str | Path | None = None
    ) -> None:
        self.root = root
        self.cert_dir = root / "certs"
        self.key_dir = root / "keys"
        self.cli_home = root / "cli-home"
        self.cwd = cwd or root
        self.port = 0
        self.superlink: ManagedProcess | None = None
        # The SuperLink's state file (runs, registered SuperNodes): a restart keeps it.
        # ``database`` overrides it: another file, or IN_MEMORY (a restart then loses it).
        self.database = root / "superlink.db" if database is None else database
        self.superlink_starts = 0
        self.supernodes: list[SuperNodeInfo] = []
        self._procs: list[ManagedProcess] = []
        self._starts: dict[str, int] = {}
        # Processes may be started from other threads (a SuperNode restart that retries);
        # once closed, nothing new starts, so nothing outlives close().
        self._lock = threading.Lock()
        self._closed = False

    # --- plumbing -------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _script(self, name: str, *args: str, timeout: float = 120.0) -> str:
        """Run one of the deploy scripts against the CLI's FLWR_HOME; return its stdout."""
        cmd = [str(SCRIPTS / name), *args]
        res = subprocess.run(
            cmd,
            env=base_env(self.cli_home),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
            )
        return res.stdout

    def _flwr_json(self, *args: str, timeout: float = 60.0) -> dict:
        res = subprocess.run(
            ["flwr", *args, "--format", "json"],
            env=base_env(self.cli_home),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError as err:
            raise RuntimeError(f"flwr {' '.join(args)}: no JSON: {res.stdout}{res.stderr}") from err

    def _start(self, name: str, cmd: list[str], flwr_home: Path) -> ManagedProcess:
        # A restarted process keeps its name and gets a new log (name.1.log, ...): the old
        # log is what the killed process wrote.
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the deployment is closed; {name} not started")
            count = self._starts.get(name, 0)
            self._starts[name] = count + 1
            log_path = self.root / (f"{name}.log" if count == 0 else f"{name}.{count}.log")
            flwr_home.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "wb")
            popen = subprocess.Popen(
                cmd,
                env=base_env(flwr_home),
                cwd=self.cwd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log_file.close()
            proc = ManagedProcess(name=name, popen=popen, log_path=log_path)
            self._procs.append(proc)
            return proc

    def _wait_for(self, what: str, predicate, timeout: float, procs=()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
            if predicate():
                return
            time.sleep(0.5)
        tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{tails}")

    # --- set-up steps (each one a script of the guide) -------------------------------------
    def make_certs(self) -> None:
        self._script("make_certs.sh", str(self.cert_dir), "127.0.0.1", "localhost")

    def start_superlink(self, timeout: float = 60.0) -> None:
        """Start the SuperLink on a free port with its state in ``self.database``."""
        self.port = free_port()
        self._launch_superlink(timeout)

    def _launch_superlink(self, timeout: float) -> None:
        self.superlink = self._start(
            "superlink",
            [
                str(SCRIPTS / "start_superlink.sh"),
                str(self.cert_dir),
                "127.0.0.1",
                str(self.port),
                str(self.database),
            ],
            self.root / "superlink-home",
        )
        self.superlink_starts += 1
        if self.superlink_starts == 1:  # a restart keeps the address: the CLI config stands
            self._script(
                "write_cli_config.sh", CONNECTION, self.address, str(self.cert_dir / "ca.crt")
            )
        self.wait_superlink(timeout)

    def wait_superlink(self, timeout: float = 60.0) -> None:
        """Wait until the SuperLink's Control API answers `flwr ls`."""
        assert self.superlink is not None

        def control_api_answers() -> bool:
            try:
                return bool(self._flwr_json("ls", CONNECTION, timeout=30).get("success"))
            except (RuntimeError, subprocess.TimeoutExpired):
                return False

        self._wait_for(
            "the SuperLink's Control API", control_api_answers, timeout, [self.superlink]
        )

    def add_supernode(self, node_config: str) -> SuperNodeInfo:
        """Create the node's key pair and register its public key (coordinating site's step)."""
        index = len(self.supernodes)
        name = f"supernode-{index}"
        self._script("make_supernode_keys.sh", str(self.key_dir), name)
        out = self._script(
            "register_supernode.sh", str(self.key_dir / f"{name}.pub"), CONNECTION, f"site-{index}"
        )
        match = re.search(r"SuperNode (\d+) registered", out)
        if match is None:
            raise RuntimeError(f"could not read the node id from: {out}")
        info = SuperNodeInfo(
            index=index,
            node_id=int(match.group(1)),
            node_config=node_config,
            appio_port=free_port(),
            flwr_home=self.root / f"{name}-home",
            private_key=self.key_dir / name,
        )
        self.supernodes.append(info)
        return info

    def unregister_supernode(self, info: SuperNodeInfo) -> None:
        """`scripts/deploy/unregister_supernode.sh`: the node's key may no longer connect."""
        self._script("unregister_supernode.sh", str(info.node_id), CONNECTION)

    def node_statuses(self) -> dict[int, str]:
        """Node id -> status (`registered`, `online`, `offline`, ...) from `flwr supernode ls`."""
        nodes = self._flwr_json("supernode", "ls", CONNECTION).get("nodes", [])
        return {int(n["node-id"]): str(n.get("status")) for n in nodes}

    def start_supernode(self, info: SuperNodeInfo) -> None:
        info.process = self._start(
            f"supernode-{info.index}",
            [
                str(SCRIPTS / "start_supernode.sh"),
                str(self.cert_dir / "ca.crt"),
                self.address,
                str(info.private_key),
                info.node_config,
                str(info.appio_port),
            ],
            info.flwr_home,
        )

    def online_node_ids(self) -> set[int]:
        return {node for node, status in self.node_statuses().items() if status == "online"}

    def wait_online(self, timeout: float = 90.0) -> None:
        want = {n.node_id for n in self.supernodes if n.process is not None and n.process.alive()}
        procs = [n.process for n in self.supernodes if n.process is not None]
        self._wait_for(
            f"{len(want)} SuperNodes online", lambda: want <= self.online_node_ids(), timeout, procs
        )

    # --- use --------------------------------------------------------------------------------
    def start_app(
        self, app_dir: Path, run_config: Mapping[str, object], timeout: float = 600.0
    ) -> RunningApp:
        """Start `scripts/deploy/run_app.sh` (submit, poll `flwr ls`) without waiting for it."""
        cmd = [
            str(SCRIPTS / "run_app.sh"),
            str(app_dir),
            CONNECTION,
            format_run_config(run_config),
            str(int(timeout)),
        ]
        log_path = self.root / f"run_app-{len(self._procs)}.log"
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(
                cmd,
                env=base_env(self.cli_home),
                cwd=self.cwd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = ManagedProcess(name="run_app", popen=popen, log_path=log_path)
        self._procs.append(proc)
        return RunningApp(self, proc, time.monotonic(), timeout)

    def run_app(
        self, app_dir: Path, run_config: Mapping[str, object], timeout: float = 600.0
    ) -> RunOutcome:
        """`scripts/deploy/run_app.sh`: submit, poll `flwr ls` until finished, fetch logs."""
        return self.start_app(app_dir, run_config, timeout).wait()

    def run_status(self, run_id: int) -> str:
        """The run's status from `flwr ls --run-id` (`running`, `finished:completed`, ...)."""
        runs = self._flwr_json("ls", CONNECTION, "--run-id", str(run_id)).get("runs", [])
        return str(runs[0]["status"]) if runs else "unknown"

    def stop_run(self, run_id: int) -> None:
        """`flwr stop <run-id>` (the guide's command to cancel a run)."""
        subprocess.run(
            ["flwr", "stop", str(run_id), CONNECTION],
            env=base_env(self.cli_home),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def run_logs(self, run_id: int) -> str:
        try:
            res = subprocess.run(
                ["flwr", "log", str(run_id), CONNECTION, "--show"],
                env=base_env(self.cli_home),
                cwd=self.cwd,
                capture_output=True,
                text=True,
                timeout=60,
            )
            return res.stdout + res.stderr
        except subprocess.TimeoutExpired:
            return "(flwr log timed out)"

    def kill_supernode(self, index: int) -> None:
        """SIGKILL one SuperNode and everything under it at once: a site that loses power."""
        proc = self.supernodes[index].process
        if proc is None:
            raise ValueError(f"SuperNode {index} was never started")
        proc.remember_descendants()
        _signal_pids([proc.pid, *_recorded_alive([proc])], signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)

    def kill_superlink(self, with_descendants: bool = False) -> list[int]:
        """SIGKILL the SuperLink process (a crash of the coordinator's service).

        By default only the SuperLink process itself is killed, as when it crashes or the
        out-of-memory killer picks it; its descendants (SuperExec, ServerApp processes) are
        left to live or die on their own. ``with_descendants=True`` kills them too at once
        (the coordinator's machine losing power). Returns the pids of the descendants it saw
        just before the kill, so a caller can check which of them outlived it.
        """
        proc = self.superlink
        if proc is None or not proc.alive():
            raise RuntimeError("the SuperLink is not running")
        proc.remember_descendants()
        children = _recorded_alive([proc])
        _signal_pids([proc.pid, *(children if with_descendants else [])], signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)
        return children

    def restart_superlink(self, timeout: float = 90.0) -> None:
        """Start the SuperLink again after a kill: same port, certificates and database.

        The port is reused as it is (a SIGKILLed process's listening socket is gone at
        once); SuperNodes keep retrying the same address and the CLI connection is unchanged.
        """
        if self.superlink is not None and self.superlink.alive():
            raise RuntimeError("the SuperLink is still running; kill_superlink() first")
        if not self.port:
            raise RuntimeError("the SuperLink was never started")
        deadline = time.monotonic() + 30
        while not _port_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._launch_superlink(timeout)

    def restart_supernode(self, index: int, timeout: float = 150.0, retry_s: float = 3.0) -> int:
        """Start a killed SuperNode again until it is online: same key (so the same node id),
        node config, ClientAppIo port and FLWR_HOME (a site that reboots). Returns the
        number of starts it took.

        Flower 1.42 refuses to activate a node id it still lists as online (the SuperNode
        exits with code 305, "[code: 2004] Failed to activate SuperNode"): a SIGKILLed node
        stays online until its heartbeat window lapses (2 x 30 s after its last heartbeat).
        So, like a site's service manager (systemd ``Restart=on-failure``), this starts it
        again every ``retry_s`` seconds after such an exit, for at most ``timeout`` seconds.
        """
        info = self.supernodes[index]
        if info.process is not None and info.process.alive():
            raise RuntimeError(f"SuperNode {index} is still running")
        deadline = time.monotonic() + timeout
        starts = 0
        while True:
            self.start_supernode(info)
            starts += 1
            proc = info.process
            assert proc is not None
            # The SuperLink listing the node as online proves nothing here (the killed
            # process's window); the new process logs its node id once it is activated.
            while proc.alive() and time.monotonic() < deadline:
                if f"SuperNode ID: {info.node_id}" in proc.log_tail(100_000):
                    return starts
                time.sleep(0.5)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"SuperNode {index} not online after {timeout}s and {starts} starts:\n"
                    f"{proc.log_tail()}"
                )
            time.sleep(retry_s)

    def close(self) -> None:
        """Stop every process this harness started (SuperNodes first, then the SuperLink)."""
        with self._lock:
            self._closed = True
        for proc in self._procs:
            proc.remember_descendants()
        stop_processes(list(reversed(self._procs)))

    def diagnostics(self) -> str:
        """The last lines of every process log (for assertion messages)."""
        return "\n".join(f"--- {p.name} (pid {p.pid})\n{p.log_tail(2500)}" for p in self._procs)


@contextmanager
def loopback_deployment(
    root: Path,
    num_supernodes: int = 3,
    node_configs: list[str] | None = None,
    cwd: Path | None = None,
    database: str | Path | None = None,
) -> Iterator[LoopbackDeployment]:
    """Certificates, a TLS SuperLink with SuperNode auth, N registered SuperNodes online.

    node_configs[i] is SuperNode i's ``--node-config`` (default
    ``partition-id=i num-partitions=N``). ``database``: the SuperLink's ``--database`` (default
    the file ``root/superlink.db``; :data:`IN_MEMORY` for Flower's in-memory state). Everything
    started is stopped on exit, also on error.
    """
    if node_configs is None:
        node_configs = [
            f"partition-id={i} num-partitions={num_supernodes}" for i in range(num_supernodes)
        ]
    if len(node_configs) != num_supernodes:
        raise ValueError(f"{len(node_configs)} node configs for {num_supernodes} SuperNodes")
    root.mkdir(parents=True, exist_ok=True)
    dep = LoopbackDeployment(root, cwd=cwd, database=database)
    try:
        dep.make_certs()
        dep.start_superlink()
        for cfg in node_configs:
            dep.add_supernode(cfg)
        for info in dep.supernodes:
            dep.start_supernode(info)
        dep.wait_online()
        yield dep
    finally:
        dep.close()
