"""Server memory against the number of workers M in a real Ray simulation.

Runs ``simulations/isoloco-lm`` through ``scripts/run_app.sh`` (NUM_SUPERNODES=M,
CPUS_PER_CLIENT=1) with a model of 51.0 MiB of fp32 arrays (``model.hidden=512
model.layers=4 model.heads=8 model.intermediate=1152``, vocabulary 2048: 13,373,952
parameters), 2 rounds of 1 inner step, and samples every 0.2 s with psutil:

- ``sim-peak-gb``: peak RSS of the ``flwr-simulation`` process (it runs the ServerApp and, in a
  simulation, holds every node's ``Context``), the larger of the sampled RSS and its ``VmHWM``;
- ``tree-peak-gb``: peak over the samples of the summed RSS of every process under the run
  (SuperLink, SuperExec, simulation, Ray; shared pages count once per process);
- ``round2-wall-s``: round 2's ``round-wall-s`` from the run's results.json.

For each strategy the peaks are fitted by least squares ``peak = a + slope * M``; ``slope`` is
given in units of the model's fp32 size (copies of the model per worker) with its R^2.
Strategies: ``diloco`` and ``isoloco`` at their defaults, ``ties`` (DiLoCo with
``strategy.merge='ties'``). A cell (label, strategy, M, size) already in the JSON for the same
code revision that completed (``status: "ok"``) is skipped, so an interrupted sweep resumes;
each attempt is appended to the JSON (re-read before writing), aborted ones too. While a run
is in flight the script watches the machine's available memory and stops the run (SIGTERM,
then SIGKILL, to the process groups of its SuperLink and SuperExec) if it drops under
``--min-free-gb`` (3): the cell is recorded with ``status: "aborted-low-memory"``
(``--retries N``: run it again, up to N times, each time once ``--wait-free-gb`` is
available). Each cell records the 1-minute load average at its
start and its mean and maximum during the run (other jobs may share the machine).

    # after (this checkout), one cell at a time, low priority:
    nice -n 10 .venv/bin/python benchmarks/memory/server_memory.py --label after --workers 4 16 64 128
    # before (the base code in another checkout, same script):
    git -C /work/main worktree add --detach /work/wt/base 67b95d5
    nice -n 10 .venv/bin/python benchmarks/memory/server_memory.py --label before --code-dir /work/wt/base --workers 4 16
    .venv/bin/python benchmarks/memory/server_memory.py --table       # the markdown table of the JSON
    .venv/bin/python benchmarks/memory/server_memory.py --quick --out /tmp/q.json   # M in {2, 4}, tiny model
    # TIES's round merge alone in one process (no Flower), row blocks vs every tensor at once:
    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/memory/server_memory.py --in-process --workers 4 16 64

At 135M (``--synthetic``): the LM app's ServerApp on SmolLM2-135M (``SYNTHETIC_SIZES``) with
benchmark-only workers that train nothing (``benchmarks/memory/apps/server_load/client_app.py``, put
into a temporary copy of the app by :func:`synthetic_app`); ``--rounds`` server rounds:

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/memory/server_memory.py --synthetic \
        --strategies isoloco --workers 4 16 64 --rounds 1 --cache-dir /abs/cache --wait-free-gb 12
    .venv/bin/python benchmarks/memory/server_memory.py --synthetic --compact

Writes ``benchmarks/results/server_memory.json`` (``--synthetic``: ``server_memory_135m.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from server_memory_report import GB, compact, fit, summarise, synthetic_table, table  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "server_memory.json"
STRATEGIES = {
    "diloco": ["strategy.name='diloco'"],
    "isoloco": ["strategy.name='isoloco'"],
    "ties": ["strategy.name='diloco'", "strategy.merge='ties'"],
}
# round-timeout: on 2 shared cores a round of 128 nodes takes longer than the default 600 s
COMMON = [
    "num-server-rounds=2",
    "train.local-steps=1",
    "train.warmup-steps=1",
    "round-timeout=3600.0",
]
SIZES = {
    # 13,373,952 parameters: 51.0 MiB of fp32 arrays
    "51MiB": ["model.hidden=512", "model.layers=4", "model.heads=8", "model.intermediate=1152"],
    # a few hundred KiB, for --quick
    "tiny": ["model.hidden=32", "model.layers=1", "model.heads=2", "train.batch-size=2",
             "train.seq-len=32", "data.val-tokens=1024"],
}  # fmt: skip
SYNTHETIC_CLIENT = REPO / "benchmarks" / "memory" / "apps" / "server_load" / "client_app.py"
# --synthetic: the LM app's ServerApp on a pretrained model, benchmark-only workers
# (apps/server_load/client_app.py). Server-side evaluation on 1,280 held-out tokens (2 batches
# of the app's own rows x seq; the batch, not their count, sets its memory) instead of 16,384
# (~90 s of CPU per evaluation at 135M); every other key at the app's defaults.
SYNTHETIC_SIZES = {
    "smollm2": ["model.name-or-path='smollm2'", "data.val-tokens=1280"],
    "tiny-synthetic": SIZES["tiny"],
}
OUT_SYNTHETIC = REPO / "benchmarks" / "results" / "server_memory_135m.json"


def model_bytes(size: str) -> int:
    """fp32 bytes of the model's arrays for a size preset (built as the app builds it)."""
    from flwr_isoloco.models.llama import build_llama, llama_config

    kw = {k.split("=")[0].split(".")[1]: int(k.split("=")[1]) for k in SIZES[size] if "model." in k}
    cfg = llama_config(
        vocab_size=2048,
        hidden=kw["hidden"],
        layers=kw["layers"],
        heads=kw["heads"],
        intermediate=kw.get("intermediate", 0),
    )
    return 4 * sum(t.numel() for t in build_llama(cfg, seed=0).state_dict().values())


def revision(code_dir: Path) -> str:
    """``HEAD`` of ``code_dir``, with ``+dirty`` when tracked files differ from it."""
    git = ["git", "-C", str(code_dir)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    status = [*git, "status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results"]
    dirty = subprocess.run(status, capture_output=True, text=True)  # results: written by runs
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _is_sim(p: psutil.Process) -> bool:
    try:
        return any("flwr-simulation" in part for part in p.cmdline()[:2])
    except psutil.Error:
        return False


def _hwm(p: psutil.Process) -> int:
    try:
        text = Path(f"/proc/{p.pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def stop(root: psutil.Process) -> None:
    """Stop a run: SIGTERM to every process group under ``root`` (the SuperLink leads one, the
    SuperExec another), then SIGKILL to what is left after 20 s. Signalling run_app.sh alone is
    not enough: bash runs its trap only once the foreground ``flwr run`` has returned."""
    own = os.getpgid(0)
    procs = _tree(root)[1:]
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups - {own}:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM:
            psutil.wait_procs(procs, timeout=20)


def watch(proc: subprocess.Popen, min_free: float, period: float = 0.2) -> dict:
    """Sample the run's process tree until it exits; stop it if memory runs low."""
    root = psutil.Process(proc.pid)
    sim_peak = tree_peak = 0
    aborted = False
    sim: psutil.Process | None = None
    loads: list[float] = []
    while proc.poll() is None:
        loads.append(os.getloadavg()[0])
        total = 0
        for p in _tree(root):
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            if sim is None and _is_sim(p):
                sim = p
            if sim is not None and p.pid == sim.pid:
                sim_peak = max(sim_peak, rss, _hwm(p))
        tree_peak = max(tree_peak, total)
        if not aborted and psutil.virtual_memory().available < min_free * GB:
            aborted = True
            print(f"server_memory: available memory under {min_free} GB: stopping the run")
            stop(root)
        time.sleep(period)
    load = {"load-mean": round(sum(loads) / len(loads), 1), "load-max": round(max(loads), 1)}
    return {"sim-peak-gb": sim_peak / GB, "tree-peak-gb": tree_peak / GB, "aborted": aborted,
            **(load if loads else {})}  # fmt: skip


def lm_app_dir(code_dir: Path) -> Path:
    """``code_dir``'s LM app folder: ``simulations/isoloco-lm``, or ``simulations/isoloco_lm`` in a
    checkout from before the app folders were renamed for Flower Hub (``--code-dir`` of a
    ``before`` revision)."""
    new = code_dir / "simulations" / "isoloco-lm"
    return new if new.is_dir() else code_dir / "simulations" / "isoloco_lm"


def synthetic_app(dest: Path, code_dir: Path) -> Path:
    """``simulations/isoloco-lm`` copied under ``dest`` with the benchmark-only ClientApp
    (``benchmarks/memory/apps/server_load/client_app.py``) as its ``clientapp``; the ServerApp, its
    config schema and defaults are the app's own, unchanged."""
    app = dest / "isoloco-lm-server-load"
    ignore = shutil.ignore_patterns("__pycache__", "*.png")
    shutil.copytree(lm_app_dir(code_dir), app, ignore=ignore)
    client = code_dir / SYNTHETIC_CLIENT.relative_to(REPO)
    shutil.copy(client, app / "isoloco_lm" / "synthetic_client.py")
    toml = app / "pyproject.toml"
    old = 'clientapp = "isoloco_lm.client_app:app"'
    if old not in toml.read_text():
        raise SystemExit(f"server_memory: {toml} does not name {old!r}")
    toml.write_text(toml.read_text().replace(old, 'clientapp = "isoloco_lm.synthetic_client:app"'))
    return app


def _read_results(out: Path, cell: dict) -> None:
    """The run's per-round columns from its results.json, into ``cell``."""
    try:
        res = json.loads((out / "results.json").read_text())
        rounds = res.get("rounds", [])
        cell["run-status"] = res.get("status")
        cell["round2-wall-s"] = rounds[1]["round-wall-s"] if len(rounds) > 1 else None
        for k in ("replies-used", "replies-rejected", "replies-missing", "round-wall-s",
                  "aggregation-time-s", "wait-s", "eval-time-s", "spill-bytes"):  # fmt: skip
            cell[k] = [r.get(k) for r in rounds]
        cell["val-loss"] = rounds[-1].get("val-loss") if rounds else None
        cell["model-parameters"] = res.get("model-parameters")
    except (OSError, ValueError, KeyError, IndexError):
        cell["run-status"] = "no results.json"


def run_cell(
    code_dir: Path,
    strategy: str,
    m: int,
    size: str,
    min_free: float,
    synthetic: bool = False,
    rounds: int = 2,
    extra: list[str] | None = None,
) -> dict:
    """One run of ``M = m`` nodes; ``synthetic``: the LM app's ServerApp with the
    benchmark-only workers (:func:`synthetic_app`) on ``SYNTHETIC_SIZES[size]``."""
    out = Path(tempfile.mkdtemp(prefix=f"server-memory-{strategy}-{m}-"))
    env = {**os.environ, "NUM_SUPERNODES": str(m), "CPUS_PER_CLIENT": "1"}
    env["PYTHONPATH"] = str(code_dir)
    app = synthetic_app(out, code_dir) if synthetic else lm_app_dir(code_dir)
    common = [c for c in COMMON if not c.startswith("num-server-rounds=")]
    sizes = SYNTHETIC_SIZES if synthetic else SIZES
    cmd = [str(code_dir / "scripts" / "run_app.sh"), str(app), str(out / "run")]
    cmd += [f"num-server-rounds={rounds}", *common, *sizes[size], *STRATEGIES[strategy]]
    cmd += extra or []
    t0 = time.time()
    with open(out.parent / f"{out.name}.log", "w") as log:
        # cwd: Ray's workers put the driver's working folder on sys.path, so from another
        # checkout's folder they would import that checkout's flwr_isoloco
        proc = subprocess.Popen(cmd, env=env, cwd=code_dir, stdout=log, stderr=subprocess.STDOUT)
        try:
            peaks = watch(proc, min_free)
        except BaseException:
            stop(psutil.Process(proc.pid))
            raise
    cell = {"wall-s": round(time.time() - t0, 1), "returncode": proc.returncode, **peaks}
    _read_results(out / "run", cell)
    ok = proc.returncode == 0 and cell.get("run-status") == "completed"
    ok = ok and cell.get("replies-used") == [m] * rounds  # every node answered: the model moved
    cell["status"] = "aborted-low-memory" if peaks["aborted"] else ("ok" if ok else "failed")
    if cell["status"] == "ok":
        shutil.rmtree(out, ignore_errors=True)  # node-state files: up to 2 x M x 2 x model
        (out.parent / f"{out.name}.log").unlink(missing_ok=True)
    else:
        cell["log"] = str(out.parent / f"{out.name}.log")
        shutil.rmtree(out / "run" / "node-state", ignore_errors=True)
    return cell


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"cells": []}


def wait_for_memory(gb: float, period: float = 10.0) -> float:
    """Available GB once it is at least ``gb`` (polls; other jobs may share the machine)."""
    while (free := psutil.virtual_memory().available / GB) < gb:
        time.sleep(period)
    return free


def measure(args, code_dir: Path, strategy: str, m: int, size: str, rev: str, model: int) -> dict:
    """One cell (a run), after waiting for ``--wait-free-gb``; aborted cells are kept too."""
    free = wait_for_memory(args.wait_free_gb)
    load = os.getloadavg()[0]
    print(f"server_memory: {args.label} {strategy} M={m} ({size}, {rev}), {free:.1f} GB free")
    synthetic = size in SYNTHETIC_SIZES
    extra = [f"data.cache-dir='{args.cache_dir}'"] if synthetic and args.cache_dir else []
    cell = run_cell(code_dir, strategy, m, size, args.min_free_gb, synthetic, args.rounds, extra)
    if synthetic and cell.get("model-parameters"):
        model = 4 * cell["model-parameters"]  # fp32 arrays of the pretrained model
    cell = {"workers": "synthetic" if synthetic else "trained", "label": args.label, "strategy": strategy, "M": m, "size": size,
            "revision": rev, "code-dir": str(code_dir), "model-bytes": model,
            "free-gb-at-start": round(free, 1), "load-at-start": round(load, 1), **cell}  # fmt: skip
    print("server_memory: " + json.dumps(cell))
    return cell


def probe(m: int, rows: bool) -> dict:
    """TIES's round merge in this process, no Flower: M fake replies (seeded N(0, 1e-3) deltas
    of the 51 MiB model's shapes) spilled by a RoundFold, then merged. Peak RSS over the
    baseline (sampled every 10 ms) while spilling and while merging; ``rows=False`` merges as
    before the row-block form (every worker's tensor read at once), the same-process baseline."""
    import dataclasses
    import threading

    import torch

    from flwr_isoloco.merging.fold import RoundFold, RoundMerge
    from flwr_isoloco.merging.rules import MERGE_RULES
    from flwr_isoloco.models.llama import build_llama, llama_config

    torch.set_num_threads(1)
    cfg = llama_config(vocab_size=2048, hidden=512, layers=4, heads=8, intermediate=1152)
    theta = dict(build_llama(cfg, seed=0).state_dict())

    class Reply:
        def __init__(self, i: int) -> None:
            self.node_id = i

        def update(self, th):
            g = torch.Generator().manual_seed(self.node_id)
            return {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in th.items()}

        def release(self) -> None:
            pass

    me, phase, peaks = psutil.Process(), ["idle"], {}

    def sample() -> None:
        while phase[0] != "done":
            peaks[phase[0]] = max(peaks.get(phase[0], 0), me.memory_info().rss)
            time.sleep(0.01)

    rule = MERGE_RULES["ties"] if rows else dataclasses.replace(MERGE_RULES["ties"], rows=None)
    threading.Thread(target=sample, daemon=True).start()
    time.sleep(0.2)
    base = me.memory_info().rss
    replies = [Reply(i) for i in range(m)]
    with RoundFold(RoundMerge(rule, "ties", {}), theta, 1, spill=True) as fold:
        phase[0] = "spill"
        for r in replies:
            fold.add(r, 1.0)
        phase[0] = "merge"
        t0 = time.perf_counter()
        fold.finish(replies, lambda r: 1.0, lambda r, why: None)
        merge_s = time.perf_counter() - t0
    phase[0] = "done"
    return {"M": m, "rows": rows, "spill-peak-mib": (peaks["spill"] - base) / 2**20,
            "merge-peak-mib": (peaks["merge"] - base) / 2**20, "merge-s": merge_s,
            "load-at-start": os.getloadavg()[0]}  # fmt: skip


def in_process(workers: list[int], out: Path) -> None:
    """:func:`probe` for each M, rows and not, each in a fresh process; appended to ``out``
    under ``in-process``, with the slope of the merge peak in model copies per worker."""
    data = load(out)
    for m in workers:
        for rows in (False, True):
            cmd = [sys.executable, __file__, "--probe", str(m)] + ([] if rows else ["--dense"])
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
            if res.returncode != 0:
                raise SystemExit(res.stderr)
            cell = {"revision": revision(REPO), **json.loads(res.stdout.splitlines()[-1])}
            print("server_memory: in-process " + json.dumps(cell))
            data = load(out)
            data.setdefault("in-process", []).append(cell)
            out.write_text(json.dumps(data, indent=1) + "\n")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="e.g. before | after")
    ap.add_argument(
        "--code-dir", type=Path, default=REPO, help="checkout whose app and package run"
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64, 128])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--quick", action="store_true", help="M in {2, 4}, tiny model")
    ap.add_argument("--min-free-gb", type=float, default=3.0)
    ap.add_argument(
        "--wait-free-gb", type=float, default=0.0, help="start a cell only with this much available"
    )
    ap.add_argument("--retries", type=int, default=0, help="reruns of a cell stopped for memory")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default {OUT.name}, or {OUT_SYNTHETIC.name} with --synthetic",
    )
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="SmolLM2-135M on the LM app's "
        "ServerApp with benchmark-only workers (apps/server_load/client_app.py)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="server rounds per run")
    ap.add_argument(
        "--cache-dir",
        default="",
        help="--synthetic: data.cache-dir (the converted "
        "GGUF and the tokenised corpus; default the app's)",
    )
    ap.add_argument("--table", action="store_true", help="print the JSON's markdown table only")
    ap.add_argument("--compact", action="store_true", help="the docs' table (peak GB per M)")
    ap.add_argument("--in-process", action="store_true", help="TIES's merge alone, no Flower")
    ap.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    return ap


def sweep(args, data: dict) -> dict:
    """Every (strategy, M) cell not yet measured ``ok`` at this revision, each attempt appended to
    ``args.out`` at once (re-read first); exits 1 once a cell is stopped for memory
    ``--retries + 1`` times."""
    if args.synthetic:
        size = "tiny-synthetic" if args.quick else "smollm2"
    else:
        size = "tiny" if args.quick else "51MiB"
    workers = [2, 4] if args.quick else args.workers
    code_dir = args.code_dir.resolve()
    rev = revision(code_dir)
    model = model_bytes("tiny" if size == "tiny-synthetic" else size) if size != "smollm2" else 0
    for strategy in args.strategies:
        for m in workers:
            key = (args.label, strategy, m, size, rev)
            if any((c["label"], c["strategy"], c["M"], c["size"], c["revision"]) == key
                   and c["status"] == "ok" for c in data["cells"]):  # fmt: skip
                print(f"server_memory: {key} already measured; skipped")
                continue
            for _ in range(args.retries + 1):
                cell = measure(args, code_dir, strategy, m, size, rev, model)
                data = load(args.out)  # appended to what is there now
                data["cells"].append(cell)
                summarise(data)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(data, indent=1) + "\n")
                if cell["status"] != "aborted-low-memory":
                    break
            else:
                print("server_memory: stopped: low memory")
                sys.exit(1)
    return data


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.out is None:
        args.out = OUT_SYNTHETIC if args.synthetic else OUT
    if args.probe:
        print(json.dumps(probe(args.probe, rows=not args.dense)))
        return
    if args.in_process:
        in_process(args.workers, args.out)
        return
    data = load(args.out)
    if args.table:
        print(table(data))
        return
    if args.compact:
        print(synthetic_table(data) if args.synthetic else compact(data))
        return
    print(table(sweep(args, data)))


if __name__ == "__main__":
    main()
