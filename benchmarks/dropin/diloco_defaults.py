"""DiLoCo()'s outer step on the drop-in tables: the paper's values against a small grid.

The tables ``IsoLoCo()``'s ``"dropin"`` preset was measured on, run by the functions of the
scripts that made them (in-process on the fake grid, ``tests/fakegrid.py``):

- ``bn``, ``cnn``, ``mlp``: ``examples/digits`` with ``model="cnn-bn"`` / ``"cnn"`` / ``"mlp"``,
  4 nodes, 10 rounds, IID and Dirichlet(0.5) shards (:func:`isoloco_dropin.run_digits`; the
  tables of ``isoloco_dropin.py --bn`` and ``--sweep --extra``);
- ``skew-cancer``, ``skew-digits``: ``label_skew.py``'s breast-cancer MLP (Adam, 5 nodes, 15
  rounds) and digits CNN (4 nodes, 10 rounds) on label-sorted and Dirichlet(0.1) shards
  (:func:`label_skew.run_cancer`, :func:`label_skew.run_digits`).

Each cell (table, shards, seed) is run with every strategy of :data:`GRID` for seeds 0-2 (the
seed picks the shards, the model's initialisation and the strategy's seed), once evaluated on a
validation split (``split="validation"``: the digits app's 288 held-out training images, the
breast-cancer app's 107 held-out training rows; the nodes train on the rest, the test rows are
not touched) and once on the test split as the tables report it (final accuracy).

The grid: the mean merge with Nesterov momentum 0.9 at outer lr 0.7 (the DiLoCo paper's values,
``DiLoCo()`` today), 0.5 (``IsoLoCo()``'s ``"dropin"`` step), 0.35 and 0.25 (so that a best lr
below 0.5 is not at the grid's edge) and 1.0 (above the paper's, so that 0.7 is not the edge
either); momentum 0.5 (Nesterov) at lr 0.7, between DiLoCo's momentum and none; and FedAvg's
step through DiLoCo (lr 1.0, momentum 0: the mean itself, merged in DiLoCo's digest order),
beside Flower's FedAvg, the reference.

The choice rule, applied to the validation split only (:func:`choose`): fewest cells (of 30)
below FedAvg - 0.01 seed-paired (the bar ``IsoLoCo()``'s preset was held to), then the highest
mean over the 10 (table, shards) means, among the candidates with an outer momentum
(``choice``). As first written the rule also took lr 1.0 / momentum 0; that candidate is
FedAvg's update and passes the first criterion by construction, so after the first validation
results it was set aside (``choice_with_fedavg_step`` keeps the rule as first written). The
lr 1.0 / 0.9 and 0.7 / 0.5 points were added at the same time, on those validation results,
because the best mean sat at the grid's edge. The test split is reported for every strategy,
never used for the choice.

    PYTHONPATH=. .venv/bin/python benchmarks/dropin/diloco_defaults.py            # ~18 min, 1 core
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/diloco_defaults.py --section more_seeds \
        --seeds 3 4 5 --only FedAvg 'DiLoCo()' 'DiLoCo(outer_lr=0.5)' \
        'DiLoCo(outer_lr=0.7, outer_momentum=0.5)'                                # ~9 min
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/diloco_defaults.py --docs     # block only

The second command is the closest three candidates of the first on seeds 3-5, recorded apart
(``more_seeds``) and pooled with seeds 0-2 (``pooled_summary``, ``pooled_choice``): the
validation choice between lr 0.5 and 0.7 was one cell on seeds 0-2.

``--tables``, ``--only``, ``--splits`` run a part and merge it into the record
(``benchmarks/results/diloco_defaults.json``); ``--docs`` writes the block between the
``diloco_defaults`` markers of docs/strategies.md from the record (no run).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("benchmarks/dropin")

import isoloco_dropin as dropin  # noqa: E402  (puts examples/digits and tests on the path)
import label_skew  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flwr_isoloco.strategies import DiLoCo  # noqa: E402

OUT = common.RESULTS / "diloco_defaults.json"
DOCS = common.REPO / "docs" / "strategies.md"
BEGIN, END = "<!-- diloco_defaults:begin -->", "<!-- diloco_defaults:end -->"
SEEDS = (0, 1, 2)
SPLITS = ("validation", "test")
TOL = 0.01

# name -> (factory, outer lr, outer momentum, column header); FedAvg first (the reference)
GRID: dict[str, tuple[Callable[[], object], float | None, float | None, str]] = {
    "FedAvg": (lambda: FedAvg(), None, None, "FedAvg"),
    "DiLoCo(outer_lr=1.0)": (lambda: DiLoCo(outer_lr=1.0), 1.0, 0.9, "1.0 / 0.9"),
    "DiLoCo()": (lambda: DiLoCo(), 0.7, 0.9, "`DiLoCo()` 0.7 / 0.9"),
    "DiLoCo(outer_lr=0.5)": (lambda: DiLoCo(outer_lr=0.5), 0.5, 0.9, "0.5 / 0.9"),
    "DiLoCo(outer_lr=0.35)": (lambda: DiLoCo(outer_lr=0.35), 0.35, 0.9, "0.35 / 0.9"),
    "DiLoCo(outer_lr=0.25)": (lambda: DiLoCo(outer_lr=0.25), 0.25, 0.9, "0.25 / 0.9"),
    "DiLoCo(outer_lr=0.7, outer_momentum=0.5)": (
        lambda: DiLoCo(outer_lr=0.7, outer_momentum=0.5),
        0.7,
        0.5,
        "0.7 / 0.5",
    ),
    "DiLoCo(outer_lr=1.0, outer_momentum=0.0)": (
        lambda: DiLoCo(outer_lr=1.0, outer_momentum=0.0),
        1.0,
        0.0,
        "1.0 / 0",
    ),
}


def _digits(model: str) -> Callable[..., dict]:
    def run(factory, part, seed, split):
        return dropin.run_digits(factory, part, seed, 10, model=model, split=split)

    return run


def _skew(app: str) -> Callable[..., dict]:
    run_app, rounds = label_skew.APPS[app]
    return lambda factory, part, seed, split: run_app(factory, part, seed, rounds, split=split)


# key -> (row label, shards, runner(factory, shards, seed, split))
TABLES: dict[str, tuple[str, tuple[str, ...], Callable[..., dict]]] = {
    "bn": ("digits BatchNorm CNN", ("iid", "dirichlet"), _digits("cnn-bn")),
    "cnn": ("digits CNN", ("iid", "dirichlet"), _digits("cnn")),
    "mlp": ("digits MLP", ("iid", "dirichlet"), _digits("mlp")),
    "skew-cancer": ("label skew: breast-cancer MLP (Adam)", label_skew.PARTS, _skew("cancer")),
    "skew-digits": ("label skew: digits CNN", label_skew.PARTS, _skew("digits")),
}
PART_NAMES = {
    "iid": "IID",
    "dirichlet": "Dir(0.5)",
    "sorted": "label-sorted",
    "dir0.1": "Dir(0.1)",
}


def run_grid(
    splits, tables, names, seeds, out: dict, save: Callable[[], None], keep: tuple[str, ...] = ()
) -> None:
    """Every cell into ``out[split][table][shards][name][seed]``, saved after each table; the
    strategies in ``keep`` are run only where the record lacks their cell (the reference, kept
    when candidates are added: Flower's FedAvg does not repeat exactly on the fake grid)."""
    for split in splits:
        for key in tables:
            _, parts, run = TABLES[key]
            for part in parts:
                for seed in seeds:
                    for name in names:
                        have = out.get(split, {}).get(key, {}).get(part, {}).get(name, {})
                        if name in keep and str(seed) in have:
                            continue
                        t0 = time.perf_counter()
                        acc = run(GRID[name][0], part, seed, split)["final"]
                        cell = out.setdefault(split, {}).setdefault(key, {}).setdefault(part, {})
                        cell.setdefault(name, {})[str(seed)] = acc
                        print(
                            f"[{split} {key} {part} s{seed}] {name}: {acc:.3f} "
                            f"({time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
            save()


def _cells(res: dict):
    """(table, shards, cells) in :data:`TABLES` order, where the record has them."""
    for key, (_, parts, _) in TABLES.items():
        for part in parts:
            if part in res.get(key, {}):
                yield key, part, res[key][part]


def stats(res: dict) -> dict:
    """Per (table, shards, strategy): mean, sd (n - 1), min, max over the seeds."""
    out: dict = {}
    for key, part, cells in _cells(res):
        for name, by_seed in cells.items():
            v = list(by_seed.values())
            out.setdefault(key, {}).setdefault(part, {})[name] = {
                "mean": statistics.mean(v),
                "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
                "min": min(v),
                "max": max(v),
            }
    return out


def summary(res: dict) -> dict:
    """Per strategy: cells below FedAvg - TOL (seed-paired), the worst paired margin, and the
    mean over the (table, shards) means."""
    out: dict = {}
    for name in GRID:
        below, margins, means = [], [], []
        for key, part, cells in _cells(res):
            if name not in cells:
                continue
            means.append(statistics.mean(cells[name].values()))
            for seed, fed in cells["FedAvg"].items():
                got = cells[name].get(seed)
                if got is None:
                    continue
                margins.append(got - fed)
                if got < fed - TOL:
                    below.append(f"{key} {part} s{seed}: {got:.3f} < FedAvg {fed:.3f}")
        if means:
            out[name] = {
                "cells": len(margins),
                "below_fedavg": below,
                "worst_margin": min(margins),
                "mean_of_means": statistics.mean(means),
            }
    return out


def choose(val: dict, momentum_only: bool = True) -> str:
    """The rule (module doc) on the validation summary, among the DiLoCo candidates with an
    outer momentum (``momentum_only``; False: every candidate, lr 1.0 / momentum 0 included)."""
    cands = {
        n: s
        for n, s in val.items()
        if n != "FedAvg" and (not momentum_only or (GRID[n][2] or 0.0) > 0)
    }
    return min(cands, key=lambda n: (len(cands[n]["below_fedavg"]), -cands[n]["mean_of_means"]))


def _table(saved: dict, split: str) -> list[str]:
    st, sm = saved["stats"][split], saved["summary"][split]
    names = [n for n in GRID if n in sm]
    lines = [
        "| table | shards | " + " | ".join(GRID[n][3] for n in names) + " |",
        common.rule(len(names) + 2),
    ]
    for key, part, _ in _cells(saved[split]):
        row = st[key][part]
        vals = " | ".join(
            f"{row[n]['mean']:.3f} +- {row[n]['sd']:.3f}" if n in row else "-" for n in names
        )
        lines.append(f"| {TABLES[key][0]} | {PART_NAMES[part]} | {vals} |")
    lines.append(
        f"| cells below FedAvg - {TOL} | | "
        + " | ".join(
            "-" if n == "FedAvg" else f"{len(sm[n]['below_fedavg'])} of {sm[n]['cells']}"
            for n in names
        )
        + " |"
    )
    lines.append(
        "| worst margin over FedAvg (paired) | | "
        + " | ".join("-" if n == "FedAvg" else f"{sm[n]['worst_margin']:+.3f}" for n in names)
        + " |"
    )
    lines.append(
        "| mean of the rows | | "
        + " | ".join(f"{sm[n]['mean_of_means']:.3f}" for n in names)
        + " |"
    )
    return lines


def docs_block(saved: dict) -> str:
    """The block between :data:`BEGIN` and :data:`END` of docs/strategies.md, from the record."""
    seeds = ", ".join(str(s) for s in saved["config"]["seeds"])
    lines = [
        f"Final accuracy, mean +- sd over seeds {seeds}; columns: outer lr / momentum "
        "(Nesterov wherever there is momentum), all with the mean merge "
        "(`benchmarks/results/diloco_defaults.json`, per seed there).",
        "",
    ]
    for split, title in (("validation", "Validation split (the choice)"), ("test", "Test split")):
        if split in saved.get("stats", {}):
            lines += [f"{title}:", "", *_table(saved, split), ""]
    more = saved.get(MORE)
    if more and "summary" in more:
        names = [n for n in GRID if n in more["summary"].get("validation", {})]
        seeds = ", ".join(str(s) for s in more["seeds"])
        lines += [
            f"Seeds {seeds} for the closest candidates (`{MORE}` in the record), and all six "
            f"seeds pooled: cells below FedAvg - {TOL}, and the mean of the rows:",
            "",
            "| split, seeds | " + " | ".join(GRID[n][3] for n in names) + " |",
            common.rule(len(names) + 1),
        ]
        rows = [(f"{s}, {seeds}", more["summary"][s]) for s in SPLITS if s in more["summary"]]
        rows += [
            (f"{s}, all", saved["pooled_summary"][s])
            for s in SPLITS
            if s in saved.get("pooled_summary", {})
        ]
        for label, sm in rows:
            vals = " | ".join(
                f"{sm[n]['mean_of_means']:.3f}"
                if n == "FedAvg"
                else f"{len(sm[n]['below_fedavg'])} of {sm[n]['cells']}, "
                f"{sm[n]['mean_of_means']:.3f}"
                for n in names
            )
            lines.append(f"| {label} | {vals} |")
        lines.append("")
    choice = saved.get("choice")
    if choice:
        first = saved.get("choice_with_fedavg_step", choice)
        lines.append(
            f"The rule (3 seeds, fewest validation cells below FedAvg - {TOL}, then the highest "
            f"mean, among the steps with momentum) picks `{choice}` (lr {GRID[choice][1]}, "
            f"momentum {GRID[choice][2]})"
            + (
                f"; with lr 1.0 / momentum 0 (FedAvg's update) among them it picks `{first}`"
                if first != choice
                else ""
            )
            + (
                f"; on all six seeds of the closest candidates, `{saved['pooled_choice']}`."
                if "pooled_choice" in saved
                else "."
            )
        )
    return "\n".join(lines).rstrip()


def write_docs(saved: dict, doc: Path = DOCS) -> None:
    common.write_block(doc, BEGIN, END, docs_block(saved))
    print(f"wrote the diloco_defaults block of {doc}")


MORE = "more_seeds"
"""The section of the record with seeds 3-5 for the closest candidates (``--section``)."""


def pooled(out: dict, section: str = MORE) -> dict:
    """The cells of the 3-seed grid and of ``section`` together (the strategies ``section``
    ran, every seed of both), per split."""
    more = out.get(section, {})
    res: dict = {}
    for split in [s for s in SPLITS if s in out and s in more]:
        for key, part, cells in _cells(more[split]):
            for name, by_seed in cells.items():
                both = {**out[split][key][part].get(name, {}), **by_seed}
                res.setdefault(split, {}).setdefault(key, {}).setdefault(part, {})[name] = both
    return res


def finish(out: dict) -> None:
    """The derived fields of the record: stats, summary and the choice (and, where the record
    has :data:`MORE`, the summary and choice of every seed pooled)."""
    out["stats"] = {s: stats(out[s]) for s in SPLITS if s in out}
    out["summary"] = {s: summary(out[s]) for s in SPLITS if s in out}
    if "validation" in out["summary"]:
        out["choice"] = choose(out["summary"]["validation"])
        out["choice_with_fedavg_step"] = choose(out["summary"]["validation"], momentum_only=False)
    both = pooled(out)
    if "validation" in both:
        out["pooled_summary"] = {s: summary(both[s]) for s in both}
        out["pooled_choice"] = choose(out["pooled_summary"]["validation"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    ap.add_argument("--only", nargs="+", default=list(GRID), help="strategy names of GRID")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--section",
        default="",
        help="record the run under this key of the record (its own splits, stats, summary and "
        "choice; e.g. more seeds for a close choice), not in the 3-seed tables",
    )
    ap.add_argument("--docs", action="store_true", help="write --out's block into the docs")
    args = ap.parse_args()
    if args.docs:
        saved = json.loads(args.out.read_text())
        print(docs_block(saved))
        write_docs(saved)
        return
    unknown = [n for n in args.only if n not in GRID]
    if unknown:
        ap.error(f"unknown strategies {unknown}; GRID has {list(GRID)}")
    keep: tuple[str, ...] = ()
    if "FedAvg" not in args.only:  # the paired reference of every cell, run where missing
        args.only.insert(0, "FedAvg")
        keep = ("FedAvg",)
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.WARNING)
    out: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    out["config"] = {
        "seeds": sorted(
            set(out.get("config", {}).get("seeds", []))
            | (set() if args.section else set(args.seeds))
        ),
        "tables": {k: {"label": v[0], "shards": list(v[1])} for k, v in TABLES.items()},
        "rounds": {"bn": 10, "cnn": 10, "mlp": 10, "skew-cancer": 15, "skew-digits": 10},
        "grid": {n: {"outer_lr": g[1], "outer_momentum": g[2]} for n, g in GRID.items()},
        "rule": f"validation: fewest cells below FedAvg - {TOL} (seed-paired), then the "
        "highest mean of the (table, shards) means, among the candidates with an outer "
        "momentum ('choice'; 'choice_with_fedavg_step': lr 1.0 / momentum 0 included, the "
        "rule as first written); test never used for the choice",
        "torch_threads": 1,
    }
    runs = out.setdefault("runs", [])  # every run merged into the record, in order
    this = {
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/dropin/diloco_defaults.py "
        + " ".join(f"'{a}'" if " " in a or "(" in a else a for a in sys.argv[1:]),
        "commit": dropin.code_version(),
        "strategies": args.only,
        "tables": args.tables,
        "splits": args.splits,
        "seeds": args.seeds,
        "section": args.section or None,
    }
    runs.append(this)

    target = out.setdefault(args.section, {}) if args.section else out

    def save() -> None:
        if args.section:
            target["seeds"] = sorted(set(target.get("seeds", [])) | set(args.seeds))
            finish(target)
        finish(out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")

    t0 = time.perf_counter()
    run_grid(args.splits, args.tables, args.only, args.seeds, target, save, keep)
    this["wall_s"] = round(time.perf_counter() - t0)
    save()
    print(docs_block(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
