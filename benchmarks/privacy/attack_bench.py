"""Attackers vs defences on the isoloco-lm app.

In-process Flower runs of the app's ServerApp (``run_server``) and ClientApp (the DiLoCo worker,
a small LLaMA on Shakespeare) on ``tests/fakegrid.FakeGrid`` (as ``tests/test_isoloco_lm_app.py``;
no Ray, so the grid of cells fits), 8 sites. The last ``f`` sites are attackers that collude
and see the honest updates of the round (the strongest, omniscient attacker). Each trains
honestly, then replaces its update ``d = theta - theta_i`` by:

- ``signflip``: ``-10 d``;
- ``noise``: Gaussian noise of norm ``10 ||d||``;
- ``alie`` ("a little is enough", Baruch et al. 2019): ``mu - z sigma`` (coordinate-wise mean
  and std of the honest updates), ``z = Phi^-1((n - s) / n)``, ``s = floor(n / 2 + 1) - f``
  (n = 8: z = 0 for f = 1, 0.319 for f = 2);
- ``maxweight``: ``-d`` reported with ``num-examples = 1e12`` (the largest weight allowed);
- ``edge``: the attack adapted to ``distance-filter``: ``m - R mu / ||mu||`` with ``m`` the
  honest updates' coordinate-wise median, ``mu`` their mean and ``R = 0.9 x 2 x`` the median
  distance of the honest updates to ``m`` (just inside the filter's default radius), reported
  with ``num-examples = 1e12``.

Defences: ``none`` (weight bound off), ``bound`` (``max-weight-ratio`` 5, the default), and each
robust rule on top of the bound. Per cell: the final validation loss and its difference with
the honest run without defence (same strategy, seed, size). Cells are appended to
``benchmarks/results/attack-<size>-<strategies>.json`` as they finish (done cells are skipped:
resumable; two invocations for two strategies can run side by side); the tables in
docs/strategies.md and docs/privacy.md are regenerated from all those files (``--table`` alone does only that).

    nice -n 10 python benchmarks/privacy/attack_bench.py --quick            # the headline grid
    nice -n 10 python benchmarks/privacy/attack_bench.py --defences median --attacks signflip  # full
    python benchmarks/privacy/attack_bench.py --table
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flwr_isoloco.merging.robust import ROBUST_OPTIONS, ROBUST_RULES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("tests", "simulations/isoloco-lm")
RESULTS = common.RESULTS  # attack-<size>-<strategies>.json, one per invocation
DOCS = {  # the docs whose attack table block is regenerated, and the grids each shows
    REPO / "docs" / "strategies.md": ("full", "headline", "quick"),
    REPO / "docs" / "privacy.md": ("full", "headline"),
}
BEGIN, END = "<!-- BEGIN ATTACK TABLE -->", "<!-- END ATTACK TABLE -->"
NODES = 8
ATTACKS = ("signflip", "noise", "alie", "maxweight", "edge")
EDGE_MARGIN = 0.9 * ROBUST_OPTIONS["distance-filter"]["factor"]  # just inside its default radius
DEFENCES = ("none", "bound", *ROBUST_RULES[1:])  # the weight bound alone, then each robust rule
OPTIONS = {
    "trim": "strategy.robust-trim",
    "f": "strategy.robust-f",
    "select": "strategy.robust-select",
    "factor": "strategy.robust-factor",
    "ratio": "strategy.max-weight-ratio",
}
"""``rule:option=value`` (e.g. ``multikrum:select=7``) runs a rule with that ``robust_options``;
``ratio`` sets the weight bound's ``max-weight-ratio`` (default 5; e.g. ``bound:ratio=1``)."""
FLOAT_OPTIONS = ("trim", "factor", "ratio")
STRATEGIES = ("isoloco", "diloco")
SIZES = {  # rounds, local steps and model per grid; "test" is the cheap one of the unit test
    "full": {"num-server-rounds": 20, "train.local-steps": 10, "model.hidden": 64},
    # full's 20 rounds at 2 local steps: what a shared 2-core machine affords
    "headline": {"num-server-rounds": 20, "train.local-steps": 2, "model.hidden": 64},
    "quick": {"num-server-rounds": 5, "train.local-steps": 4, "model.hidden": 64},
    "test": {"num-server-rounds": 2, "train.local-steps": 2, "model.hidden": 32},
}


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s ``z_max``: ``Phi^-1((n - s) / n)``, ``s = floor(n/2 + 1) - f``."""
    s = math.floor(n / 2 + 1) - f
    return statistics.NormalDist().inv_cdf((n - s) / n)


def attacked(kind: str, own, honest: list, f: int, seed: int):
    """The attacker's update (a dict of tensors) from its honest one and the honest updates."""
    import torch

    if kind == "signflip":
        return {k: -10.0 * v for k, v in own.items()}, None
    if kind == "maxweight":
        return {k: -v for k, v in own.items()}, 1e12
    if kind == "noise":
        g = torch.Generator().manual_seed(seed)
        z = {k: torch.randn(v.shape, generator=g) for k, v in own.items()}
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in own.values()))
        zn = math.sqrt(sum(float(v.double().pow(2).sum()) for v in z.values()))
        return {k: v * (10 * norm / zn) for k, v in z.items()}, None
    if kind == "alie":
        z = alie_z(NODES, f)
        out = {}
        for k in own:
            x = torch.stack([h[k].double() for h in honest])
            out[k] = (x.mean(0) - z * x.std(0, unbiased=False)).float()
        return out, None
    if kind == "edge":
        return edge(honest), 1e12
    raise ValueError(kind)


def edge(honest: list) -> dict:
    """``m - R mu / ||mu||`` (module docstring): the reverse of the honest mean's direction, at
    distance ``R`` from the honest median."""
    import torch

    from flwr_isoloco.merging.robust import coordinate_median

    med = {k: coordinate_median([h[k].double() for h in honest]) for k in honest[0]}
    mu = {k: torch.stack([h[k].double() for h in honest]).mean(0) for k in honest[0]}
    r = [math.sqrt(sum(float((h[k].double() - med[k]).pow(2).sum()) for k in med)) for h in honest]
    nmu = math.sqrt(sum(float(v.pow(2).sum()) for v in mu.values()))
    big_r = EDGE_MARGIN * statistics.median(r)
    return {k: (med[k] - big_r * mu[k] / nmu).float() for k in med}


def attack_grid(base, attack: str, f: int, seed: int):
    """A FakeGrid whose last ``f`` nodes' train replies are replaced (module docstring)."""
    from flwr.app import ArrayRecord, MessageType

    class AttackGrid(base):
        def push_messages(self, messages):
            messages = list(messages)
            ids = list(super().push_messages(messages))
            for mid, m in zip(ids, messages, strict=True):
                if m.metadata.message_type == MessageType.TRAIN:
                    self._theta[mid] = m.content["arrays"].to_torch_state_dict()
            return ids

        def pull_messages(self, message_ids):
            """The replies asked for. The strategy pulls one id per call: the first pull of a
            train round takes every train reply of the round at once, attacks, and keeps the
            others for their own pull (so the attackers see all honest updates)."""
            ids = list(message_ids)
            rest = [m for m in ids if m not in self._ready]
            out = [self._ready.pop(m) for m in ids if m in self._ready]
            if not rest:
                return out
            if any(m in self._theta for m in rest):
                rest += [m for m in self._theta if m in self._pending and m not in rest]
            pulled = list(super().pull_messages(rest))
            train = [r for r in pulled if r.metadata.reply_to_message_id in self._theta]
            if attack != "honest" and train:
                self._attack(train)
            for r in pulled:
                mid = r.metadata.reply_to_message_id
                self._theta.pop(mid, None)
                if mid in ids:
                    out.append(r)
                else:
                    self._ready[mid] = r
            return out

        def _attack(self, train):
            bad = set(self.node_ids[NODES - f :])
            deltas = {}
            for r in train:
                if r.has_error():
                    continue
                theta = self._theta[r.metadata.reply_to_message_id]
                mine = r.content["arrays"].to_torch_state_dict()
                deltas[id(r)] = (theta, {k: theta[k] - mine[k] for k in theta})
            honest = [
                d
                for r in train
                if id(r) in deltas and r.metadata.src_node_id not in bad
                for d in [deltas[id(r)][1]]
            ]
            self.round += 1
            for r in train:
                if r.metadata.src_node_id in bad and id(r) in deltas:
                    theta, own = deltas[id(r)]
                    new, weight = attacked(attack, own, honest, f, seed * 1000 + self.round)
                    r.content["arrays"] = ArrayRecord({k: theta[k] - new[k] for k in theta})
                    if weight is not None:
                        r.content["metrics"]["num-examples"] = weight

    AttackGrid._theta, AttackGrid._ready, AttackGrid.round = {}, {}, 0
    return AttackGrid


def parse_defence(defence: str) -> tuple[str, dict]:
    """``(rule, run-config keys)`` of ``rule[:option=value,...]``; ``ValueError`` if unknown."""
    rule, _, opts = defence.partition(":")
    if rule not in DEFENCES:
        raise ValueError(f"unknown defence {rule!r} (allowed: {DEFENCES})")
    keys = {}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        if k not in OPTIONS or rule == "none" or (rule == "bound" and k != "ratio"):
            raise ValueError(f"unknown option {k!r} of defence {rule!r} (allowed: {list(OPTIONS)})")
        keys[OPTIONS[k]] = float(v) if k in FLOAT_OPTIONS else int(v)
    return rule, keys


def _defence_arg(defence: str) -> str:
    try:
        parse_defence(defence)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return defence


def defence_order(names) -> list[str]:
    """The defences in :data:`DEFENCES` order, each rule's option variants after it."""
    return sorted(set(names), key=lambda d: (DEFENCES.index(parse_defence(d)[0]), d))


def run_config(strategy: str, defence: str, seed: int, size: str, out: Path, cache: Path) -> dict:
    rule, options = parse_defence(defence)
    rc = {
        **SIZES[size],
        "seed": seed,
        "output-dir": str(out),
        "checkpoint": False,
        "strategy.name": strategy,
        "strategy.min-nodes": NODES,
        "strategy.max-weight-ratio": 0.0 if rule == "none" else 5.0,
        "strategy.robust": rule if rule not in ("none", "bound") else "none",
        **options,
        "train.warmup-steps": 2,
        "model.heads": 2,
        "data.val-tokens": 4096,
        "data.cache-dir": str(cache),
    }
    return rc


def lean_spec():
    """The app's ``SPEC`` without the per-round loss plot and the final export: neither is
    read by the table, and neither feeds back into training (same losses bit for bit)."""
    from dataclasses import replace

    from isoloco_lm import server_app

    def build(cfg, nodes):
        return replace(server_app.SPEC.build(cfg, nodes), plot=None, export=None)

    return replace(server_app.SPEC, build=build)


@functools.lru_cache(maxsize=8)
def _client_config(items: tuple, node: bool):
    from isoloco_lm import task

    return task.load_config(dict(items), node=node)


@contextlib.contextmanager
def lean_client():
    """The ClientApp validates its run config (omegaconf) on every message; every node of a
    cell has the same one, so it is validated once per distinct config (a pure function).
    The patch lasts for one cell only: other runs in the process see the real function."""
    from isoloco_lm import client_app

    real = client_app.load_config

    def cached(rc, *, node=False):
        return _client_config(tuple(sorted(dict(rc).items())), node)

    client_app.load_config = cached
    try:
        yield
    finally:
        client_app.load_config = real


_RUN_IDS = itertools.count(os.getpid() * 10_000 + 1)


def run_cell(strategy, attack, f, defence, seed, size, cache: Path, extra=None) -> dict:
    """One run; ``extra`` run-config keys override the size's (e.g. a smaller corpus)."""
    from fakegrid import FakeGrid
    from isoloco_lm import client_app

    from flwr_isoloco.apprunner import run_app
    from flwr_isoloco.clients.node_state import remove_run_temp_dir

    out = Path(tempfile.mkdtemp(prefix=f"attack-{strategy}-{attack}{f}-{defence}-"))
    rc = {**run_config(strategy, defence, seed, size, out, cache), **(extra or {})}
    grid_cls = attack_grid(FakeGrid, attack, f, seed)
    # A run id of this process and cell: the nodes' state files live in a per-run temp folder,
    # and FakeGrid's default id is shared by every in-process run on the machine.
    run_id = next(_RUN_IDS)
    grid = grid_cls({"train": client_app.train}, num_nodes=NODES, run_config=rc, run_id=run_id)
    t0 = time.perf_counter()
    try:
        with lean_client():
            res_dir = run_app(lean_spec(), grid, rc, run_id, settle_s=0.0)
        res = json.loads((res_dir / "results.json").read_text())
    finally:
        remove_run_temp_dir(run_id)
        shutil.rmtree(out, ignore_errors=True)
    return {
        "strategy": strategy,
        "attack": attack,
        "f": f,
        "defence": defence,
        "seed": seed,
        "size": size,
        "status": res["status"],
        "val_loss": [r["val-loss"] for r in res["rounds"]],
        "replies_used": [r["replies-used"] for r in res["rounds"]],
        **_kept(res["rounds"]),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _kept(rounds: list[dict]) -> dict:
    """``robust_kept``: per round, the updates a choosing rule merged (absent for the others)."""
    kept = [r.get("robust-kept") for r in rounds]
    return {"robust_kept": kept} if any(k is not None for k in kept) else {}


def _key(r: dict) -> tuple:
    return (r["strategy"], r["attack"], r["f"], r["defence"], r["seed"], r["size"])


def final(r: dict) -> float:
    v = r["val_loss"][-1] if r["val_loss"] else None
    return float("inf") if v is None or not math.isfinite(v) else float(v)


GOAL = {0: 0.02, 1: 0.05, 2: 0.15}  # the most a defence may cost in loss, by f (thresholds)


def table(records: list[dict], size: str) -> str:
    """Final loss minus the honest run without defence (same seed), one table per strategy:
    rows attack x f (and honest), columns the defences run. With several seeds a cell is
    ``mean ± sd (seed 0 / seed 1 / ...)``; the threshold lines use the worst seed."""
    recs = [r for r in records if r["size"] == size]
    lines = []
    for st in [s for s in STRATEGIES if any(r["strategy"] == s for r in recs)]:
        mine = [r for r in recs if r["strategy"] == st]
        base = {
            r["seed"]: final(r) for r in mine if r["attack"] == "honest" and r["defence"] == "none"
        }
        if not base:
            continue
        seeds = sorted(base)
        defences = defence_order(r["defence"] for r in mine)
        lines += [
            f"**{st}** ({size}: {SIZES[size]['num-server-rounds']} rounds x "
            f"{SIZES[size]['train.local-steps']} local steps, seeds {seeds}; honest run without "
            "defence: final val loss " + " / ".join(f"{base[s]:.4f}" for s in seeds) + ")",
            "",
            "| attack | f | " + " | ".join(defences) + " |",
            "|---|---|" + "---:|" * len(defences),
        ]
        diffs = {}  # (attack, f, defence) -> {seed: loss difference}
        for r in mine:
            if r["seed"] in base:
                k = (r["attack"], r["f"], r["defence"])
                diffs.setdefault(k, {})[r["seed"]] = final(r) - base[r["seed"]]
        for a, f in [("honest", 0)] + [(a, f) for a in ATTACKS for f in (1, 2)]:
            cells = [_cells(diffs.get((a, f, d)), seeds) for d in defences]
            lines.append(f"| {a} | {f} | " + " | ".join(cells) + " |")
        for f in (1, 2):  # the worst attack per defence (mean over seeds), and how many ran
            worst = []
            for d in defences:
                got = [
                    statistics.mean(diffs[a, f, d].values()) for a in ATTACKS if (a, f, d) in diffs
                ]
                n = f" ({len(got)}/{len(ATTACKS)})" if 0 < len(got) < len(ATTACKS) else ""
                worst.append(_cell(max(got) if got else None) + n)
            lines.append(f"| **worst** | {f} | " + " | ".join(worst) + " |")
        lines += ["", *goal_lines(diffs, defences, seeds), ""]
    return "\n".join(lines)


ISSUE_ATTACKS = ATTACKS[:4]  # the thresholds' attacks; edge (adapted to distance-filter) is ours


def goal_lines(diffs: dict, defences: list[str], seeds: list[int]) -> list[str]:
    """Per defence with an honest run: the thresholds (:data:`GOAL`) on the worst seed and
    the worst of the four attacks they were set for (:data:`ISSUE_ATTACKS`), how much of the
    grid that covers, then the worst ``edge`` cell apart."""
    out = []
    for d in defences:
        if d == "none" or ("honest", 0, d) not in diffs:
            continue
        parts = []
        for f in (0, 1, 2):
            keys = [("honest", 0, d)] if f == 0 else [(a, f, d) for a in ISSUE_ATTACKS]
            got = [(v, k[0], s) for k in keys if k in diffs for s, v in diffs[k].items()]
            if not got:
                continue
            v, a, s = max(got)
            n_att = len({k for k in keys if k in diffs})
            n_cells = len(got)
            what = "honest" if f == 0 else f"f = {f}"
            ok = "yes" if v <= GOAL[f] else "**no**"
            cover = "" if f == 0 else f", {n_att}/{len(ISSUE_ATTACKS)} attacks"
            parts.append(
                f"{what} <= {GOAL[f]}: {ok} (worst {_cell(v)}, {a} seed {s}; {n_cells} runs{cover})"
            )
        edge = [
            f"f = {f} {_cell(max(diffs['edge', f, d].values()))}"
            for f in (1, 2)
            if ("edge", f, d) in diffs
        ]
        if edge:
            parts.append("edge (worst seed): " + ", ".join(edge))
        out.append(f"- bounds with `{d}`: " + "; ".join(parts))
    return out


def _cells(by_seed: dict | None, seeds: list[int]) -> str:
    if not by_seed:
        return ""
    vals = [by_seed[s] for s in seeds if s in by_seed]
    if len(seeds) == 1:
        return _cell(vals[0])
    mean = statistics.mean(vals)
    sd = statistics.stdev(vals) if len(vals) > 1 and all(map(math.isfinite, vals)) else None
    each = " / ".join(_cell(by_seed.get(s)) or "-" for s in seeds)
    spread = "" if sd is None else f" ± {sd:.3f}"
    return f"{_cell(mean)}{spread} ({each})"


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:+.3f}" if math.isfinite(v) else "diverged"


def write_table(records: list[dict], docs: dict[Path, tuple[str, ...]] | None = None) -> None:
    """Each doc's block between ``BEGIN`` and ``END``: the grids it names (strategies.md every
    grid, privacy.md the 20-round ones)."""
    for doc, sizes in (docs or DOCS).items():
        parts = [table(records, s) for s in sizes]
        text = doc.read_text()
        head, rest = text.split(BEGIN)
        _, tail = rest.split(END)
        body = "\n".join(p for p in parts if p) or "(no results yet)\n"
        doc.write_text(head + BEGIN + "\n" + body + END + tail)


def cells(args) -> list[tuple]:
    """The cells to run, honest ones first (the cost of each defence without attack)."""
    out = []
    for seed in args.seeds:
        for st in args.strategies:
            out += [(st, "honest", 0, d, seed) for d in args.honest_defences]
        for d in args.defences:
            for st in args.strategies:
                out += [(st, a, f, d, seed) for a in args.attacks for f in args.f]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument(
        "--attacks", nargs="*", default=list(ATTACKS), choices=ATTACKS, help="none: honest only"
    )
    ap.add_argument("--defences", nargs="+", default=list(DEFENCES), type=_defence_arg)
    ap.add_argument("--honest-defences", nargs="+", default=None, type=_defence_arg)
    ap.add_argument("--f", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    ap.add_argument("--seeds", nargs="+", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="5 rounds, 1 seed")
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "attack-bench-cache"
    )
    ap.add_argument("--table", action="store_true", help="only regenerate the doc tables")
    args = ap.parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    if args.seeds is None:
        args.seeds = [0] if size not in ("full", "headline") else [0, 1, 2]
    if args.honest_defences is None:
        args.honest_defences = args.defences
    if args.out is None:
        tag = "-".join(args.strategies)
        if args.defences != list(DEFENCES):
            tag += "-" + "-".join(args.defences)
        args.out = RESULTS / f"attack-{size}-{tag}.json"
    args.out = args.out.resolve()  # a relative --out into results/ still skips its done cells
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    if not args.table:
        import torch

        torch.set_num_threads(1)
        have = {_key(r) for r in done + (load_all() if args.out.parent == RESULTS else [])}
        base_cells = {(st, "honest", 0, "none", s) for st in args.strategies for s in args.seeds}
        todo = sorted(base_cells) + [c for c in cells(args) if c not in base_cells]
        for st, a, f, d, seed in todo:
            if (st, a, f, d, seed, size) in have:
                continue
            rec = run_cell(st, a, f, d, seed, size, args.cache)
            print(json.dumps(rec), flush=True)
            done.append(rec)
            have.add(_key(rec))
            common.save_json(args.out, done)
    if args.out.parent == RESULTS:
        write_table(load_all())
    else:
        print(table(done, size))


def load_all() -> list[dict]:
    """Every cell in ``benchmarks/results/attack-*.json``."""
    out = []
    for p in sorted(RESULTS.glob("attack-*.json")):
        out += common.load_records(p)
    return out


if __name__ == "__main__":
    main()
