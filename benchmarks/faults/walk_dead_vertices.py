"""RW-LoRA's walk with dead vertices: visit frequencies against the live target, relays.

Drives the product's ``RWLoRA`` strategy on the in-process fake grid (tests/fakegrid.py; the
client is the tests' deterministic stand-in, so only the walk matters), seeded, and compares
with the walk-level rule used before dead-vertex handling (renormalise the row around the
failed vertex, ``RandomWalk.step(exclude=...)``). Prints Markdown tables (docs/rwlora.md).

    nice -n 10 .venv/bin/python benchmarks/faults/walk_dead_vertices.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("tests")

from fakegrid import FakeGrid  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from rwlora_helpers import HANDLERS, init_adapter  # noqa: E402

from flwr_isoloco.graphs import (  # noqa: E402
    RandomWalk,
    build_graph,
    stationary_distribution,
    total_variation,
    transition_matrix,
)
from flwr_isoloco.strategies import RWLoRA  # noqa: E402

IRREG = "0-1,0-2,0-3,0-4,1-2,3-4,4-5,5-6"  # hub 0 (cut vertex), pendant 6 on vertex 5


def flaky(rate: float, seed: int):
    """A fault that turns a reply into an error-free but NaN update with probability ``rate``."""
    rng = random.Random(seed)

    def corrupt(reply):
        if reply.metadata.message_type == "train" and rng.random() < rate:
            rec = reply.content.array_records["arrays"]
            bad = {k: torch.full(a.shape, float("nan")) for k, a in rec.items()}
            reply.content["arrays"] = ArrayRecord(bad)
        return reply

    return corrupt


def strategy_run(graph, n, rounds, seed, fault_vertex, fault, **kw):
    s = RWLoRA(graph, num_vertices=n, seed=seed, fraction_evaluate=0.0, **kw)
    grid = FakeGrid(HANDLERS, num_nodes=n)
    s.setup(grid, timeout=5)
    grid.set_fault(fault_vertex, fault)
    t0 = time.perf_counter()
    s.start(grid=grid, initial_arrays=ArrayRecord(init_adapter()), num_rounds=rounds, timeout=5)
    counts = np.array([s.visit_counts().get(v, 0) for v in range(n)], dtype=float)
    return s, counts, time.perf_counter() - t0


def fmt(freqs) -> str:
    return " ".join(f"{x:.3f}" for x in freqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--ring-steps", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ring-only", action="store_true", help="only the 8-ring table")
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    G = build_graph(IRREG)
    T, seed = args.steps, args.seed

    if not args.ring_only:
        irregular(G, T, seed)
    ring(args.ring_steps, seed)


def irregular(G, T: int, seed: int) -> None:
    print(f"## Hub share on {IRREG} ({T} steps, seed {seed}; uniform = {1 / 7:.3f})\n")
    print("| transition | exact hub share | measured | TV from uniform |\n|---|---|---|---|")
    for kind in ("simple", "metropolis"):
        P = transition_matrix(G, kind)
        walk = RandomWalk(P, seed=seed)
        c = np.bincount([walk.step() for _ in range(T)], minlength=7)
        exact = stationary_distribution(P)[0]
        print(
            f"| {kind} | {exact:.3f} | {c[0] / T:.3f} | {total_variation(c, np.full(7, 1 / 7)):.3f} |"
        )

    print(f"\n## Dead vertices on {IRREG} (Metropolis, uniform target, {T} rounds, seed {seed})\n")
    print("| dead | rule | visit frequencies 0..6 | TV from live target | relays | failed hops |")
    print("|---|---|---|---|---|---|")
    for dead, start in ((0, 6), (5, 6)):
        live = [v for v in range(7) if v != dead]
        target = np.zeros(7)
        target[live] = 1 / 6
        P = transition_matrix(G, "metropolis")
        old = RandomWalk(P, seed=seed, start=start)
        path = [old.step(exclude=[dead]) for _ in range(T)]
        moved = [v for v in path if v is not None]
        c_old = np.bincount(moved, minlength=7) if moved else np.zeros(7)
        tv_old = total_variation(c_old, target) if moved else float("nan")
        print(
            f"| {dead} | before: renormalise around it, from {start} | {fmt(c_old / max(1, len(moved)))}"
            f" | {tv_old:.3f} | - | - |"
        )
        s, c, wall = strategy_run(IRREG, 7, T, seed, dead, "dead", start_vertex=start)
        print(
            f"| {dead} | now: RWLoRA, live graph + relays, from {start} | {fmt(c / c.sum())}"
            f" | {total_variation(c, target):.3f} | {s.relays} | {s.failures} |"
        )
        print(f"<!-- {wall:.0f} s -->")


def ring(R: int, seed: int) -> None:
    print(f"\n## Lazy 8-ring, vertex 3 failing with probability f (RWLoRA, {R} rounds)\n")
    print(
        "| f | visit frequencies 0..7 | TV from uniform | TV from uniform on the other 7 | failed hops |"
    )
    print("|---|---|---|---|---|")
    for f in (0.0, 0.3, 1.0):
        fault = "dead" if f == 1.0 else flaky(f, seed)
        s, c, _ = strategy_run("ring", 8, R, seed, 3, fault, lazy=True)
        live = np.full(8, 1 / 7)
        live[3] = 0
        print(
            f"| {f} | {fmt(c / c.sum())} | {total_variation(c, np.full(8, 1 / 8)):.3f}"
            f" | {total_variation(c, live):.3f} | {s.failures} |"
        )


if __name__ == "__main__":
    main()
