"""What the RW-LoRA sweep runs: its cells, their sizing, the app's run config per cell and the
planned cost (docs/results-rwlora.md, "Sweep protocol" and "Label skew"). Used by
``rwlora_sweep.py``, which runs the cells, keeps the records and resumes.

- every method runs the same number of local updates ``U`` (optimiser steps summed over
  clients: RW-LoRA ``K`` per hop, gossip / FedAvg ``n K`` per round);
- FedAvg does not use the graph: it runs once per (clients, partition, rank, seed), graph
  ``none``; the variants are RW-LoRA's (gossip and FedAvg run as ``paper``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rwlora_experiments as E  # noqa: E402  (sets sys.path and the offline env)

METHODS = ("rwlora", "gossip", "fedavg")
GRAPHS = {"complete": "complete", "ring": "ring", "regular-3": "random_regular:d=3"}
TARGETS = (0.65, 0.70, 0.75, 0.80)
# RW-LoRA variants (docs/results-rwlora.md, "Label skew"): sizing overrides (``local_steps``)
# and run-config keys of the app (flwr_isoloco/strategies/graph/rwlora_variants.py). ``paper`` is
# the paper's walk: no key added, so its run config is that of the first records.
VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {},
    "k1": {"local_steps": 1},
    "k2": {"local_steps": 2},
    "lrdecay8": {"strategy.lr-decay-hops": 8.0},
    "avg0.9": {"strategy.average-decay": 0.9},
    "avg0.95": {"strategy.average-decay": 0.95},
    "mom0.5": {"strategy.hop-momentum": 0.5},
    "tail1": {"strategy.tail-average-from": 1},
    # the AdamW state travels with the token (an option of the paper's code, not a new one)
    "carry": {"strategy.carry-optimizer-state": True},
    "carry-tail1": {"strategy.carry-optimizer-state": True, "strategy.tail-average-from": 1},
    "k2-tail1": {"local_steps": 2, "strategy.tail-average-from": 1},
    "k1-avg0.9": {"local_steps": 1, "strategy.average-decay": 0.9},
    "k2-avg0.9": {"local_steps": 2, "strategy.average-decay": 0.9},
    "lrdecay8-avg0.9": {"strategy.lr-decay-hops": 8.0, "strategy.average-decay": 0.9},
}
EVAL_SPLITS = ("test", "val")

# Sizing (docs/results-rwlora.md, "Sweep protocol").
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "updates": 320,
        "local_steps": 5,
        "batch_size": 8,
        "max_length": 48,
        "lr": 2e-3,
        "eval_examples": 1000,
        "max_examples": 0,
        "eval_every": 40,
        "gossip_eval_every": 160,
        "eval_split": "test",
        "per_class": False,
    },
    "quick": {
        "updates": 16,
        "local_steps": 2,
        "batch_size": 4,
        "max_length": 32,
        "lr": 2e-3,
        "eval_examples": 24,
        "max_examples": 48,
        "eval_every": 8,
        "gossip_eval_every": 8,
        "eval_split": "test",
        "per_class": False,
    },
}
QUICK_CLIENTS = 4
# Cost model of the plan (docs/results-rwlora.md), from the measured cell rwlora / ring / iid /
# seed 0 / 8 clients (Ray, load average 4.6 to 7.3 on the 2 shared cores): 299 s wall, of which
# 130 s for 9 evaluations of 1,000 sentences and 152 s for 64 hops of 5 updates.
COST = {"startup_s": 17.0, "eval_s_per_1000": 14.5, "update_s": 0.475}
# The planned suite: (methods, graphs, clients, partitions, ranks, seeds).
SUITES: dict[str, list[tuple]] = {
    "main": [(METHODS, tuple(GRAPHS), (8,), ("iid", "dirichlet-0.5"), (8,), (0, 1, 2))],
    "ranks": [(("rwlora", "gossip"), ("ring",), (8,), ("iid",), (2, 4, 8, 16), (0,))],
    "clients16": [(METHODS, ("ring",), (16,), ("iid",), (8,), (0,))],
}
SUITES["all"] = SUITES["main"] + SUITES["ranks"] + SUITES["clients16"]


def partition_keys(partition: str) -> dict[str, Any]:
    """``iid`` or ``dirichlet-<alpha>`` -> the app's ``data.partitioner`` / ``data.dirichlet-alpha``."""
    if partition == "iid":
        return {"data.partitioner": "iid"}
    name, _, alpha = partition.partition("-")
    if name == "dirichlet":
        try:
            a = float(alpha)
        except ValueError:
            a = -1.0
        if a > 0:
            return {"data.partitioner": "dirichlet", "data.dirichlet-alpha": a}
    raise ValueError(f"partition {partition!r}: expected 'iid' or 'dirichlet-<alpha>' (alpha > 0)")


def sizing(args) -> dict[str, Any]:
    """:data:`SIZES` (``quick`` or ``full``) with the CLI's budget / evaluation overrides."""
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in (
        "updates",
        "eval_every",
        "gossip_eval_every",
        "lr",
        "eval_split",
        "per_class",
        "eval_examples",
    ):
        if getattr(args, key, None) is not None:
            size[key] = getattr(args, key)
    return size


def cells(
    methods, graphs, clients, partitions, ranks, seeds, variants=("paper",)
) -> list[dict[str, Any]]:
    """Cells in run order: seed-major (a full comparison at seed 0 comes first); FedAvg once
    per (clients, partition, rank, seed) with graph ``none``; the variants are RW-LoRA's
    (gossip and FedAvg run as ``paper``)."""
    out: list[dict[str, Any]] = []
    for seed in seeds:
        for n in clients:
            for part in partitions:
                for rank in ranks:
                    for method in methods:
                        for graph in graphs if method != "fedavg" else ["none"]:
                            for variant in variants if method == "rwlora" else ["paper"]:
                                cell = dict(
                                    method=method,
                                    graph=graph,
                                    clients=n,
                                    partition=part,
                                    rank=rank,
                                    seed=seed,
                                    variant=variant,
                                )
                                if cell not in out:
                                    out.append(cell)
    return out


def variant_sizing(cell: dict[str, Any], size: dict[str, Any]) -> dict[str, Any]:
    """``size`` with the cell's variant's sizing overrides (``local_steps``)."""
    extra = VARIANTS[cell.get("variant", "paper")]
    return {**size, **{k: v for k, v in extra.items() if "." not in k}}


def run_config(cell: dict[str, Any], size: dict[str, Any], threads: int) -> dict[str, Any]:
    """The app's run config for one cell (via ``rwlora_experiments.run_config``): ``U`` updates
    for every method, evaluation every ``eval_every`` updates (``gossip_eval_every`` for gossip,
    whose evaluation scores every vertex's adapter too); the variant's keys; ``size``'s
    ``eval_split`` / ``per_class`` add ``data.eval-split`` / ``eval-per-class`` when not the
    defaults (so the first records' run configs still match)."""
    size = variant_sizing(cell, size)
    method, n, k = cell["method"], cell["clients"], size["local_steps"]
    per_round = k if method == "rwlora" else n * k
    every = size["gossip_eval_every"] if method == "gossip" else size["eval_every"]
    every = max(every, per_round)  # at most once per round
    for what, x in (("updates", size["updates"]), ("eval spacing", every)):
        if x % per_round:
            raise ValueError(
                f"{method}, {n} clients: {what} {x} is not a multiple of the "
                f"{per_round} local updates of one round"
            )
    ns = types.SimpleNamespace(
        clients=n,
        local_steps=k,
        rw_updates=size["updates"],
        gossip_updates=size["updates"],
        fedavg_updates=size["updates"],
        eval_every_updates=every,
        seed=cell["seed"],
        threads=threads,
        transition="metropolis",
        rank=cell["rank"],
        max_length=size["max_length"],
        lr=size["lr"],
        batch_size=size["batch_size"],
        eval_examples=size["eval_examples"],
        max_examples=size["max_examples"],
    )
    graph = GRAPHS["complete" if cell["graph"] == "none" else cell["graph"]]  # unused by fedavg
    rc = E.run_config(ns, method, graph, Path("/unused"))
    rc.update(
        {"strategy.num-clients": n, "strategy.lazy": False, **partition_keys(cell["partition"])}
    )
    rc.update({k: v for k, v in VARIANTS[cell.get("variant", "paper")].items() if "." in k})
    if size.get("eval_split", "test") != "test":
        rc["data.eval-split"] = size["eval_split"]
    if size.get("per_class"):
        rc["eval-per-class"] = True
    return rc


def estimate_s(cell: dict[str, Any], size: dict[str, Any], ray_cpus: int = 2) -> float:
    """Planned wall seconds of one cell: start-up + evaluations + training, with :data:`COST`.
    Evaluations: rounds 0, every ``eval-every``-th and the last, each scoring 1 adapter
    (gossip: the average and the ``n`` vertices' own). Training: ``U`` updates one client at
    a time (RW-LoRA), or ``ceil(n / ray_cpus) K`` update times per round (clients in parallel)."""
    rc = run_config(cell, size, 1)
    size = variant_sizing(cell, size)
    rounds, every, n = rc["num-server-rounds"], rc["eval-every"], cell["clients"]
    points = 1 + rounds // every + (1 if rounds % every else 0)
    per_point = n + 1 if cell["method"] == "gossip" else 1
    evals = points * per_point * COST["eval_s_per_1000"] * size["eval_examples"] / 1000
    if cell["method"] == "rwlora":
        train = size["updates"] * COST["update_s"]
    else:
        train = rounds * -(-n // ray_cpus) * size["local_steps"] * COST["update_s"]
    return COST["startup_s"] + evals + train


def planned_cells(args) -> list[dict[str, Any]]:
    groups = (
        SUITES[args.suite]
        if args.suite
        else [
            (
                args.methods,
                args.graphs,
                args.clients,
                args.partitions,
                args.ranks,
                args.seeds,
                args.variants,
            )
        ]
    )
    out: list[dict[str, Any]] = []
    for g in groups:
        out += [c for c in cells(*g) if c not in out]
    return out[args.shard_index :: args.shard_count]
