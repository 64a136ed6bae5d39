"""The asynchronous LM study rerun with the hold (``Rounds.hold``) and the pulls of
``strategies/core/pull.py``: the same runs as :mod:`async_lm` (8 nodes, H = 10, 90 s budget,
every method at the LM app's tuned outer lr), recorded apart so the table puts each cell
before (``async_lm.json``, the code without the hold) and after side by side.

    python benchmarks/async/async_hold.py --queue --until 08:20   # the plan, resumable
    python benchmarks/async/async_hold.py --table                 # docs/strategies.md block

Records: ``benchmarks/results/async_hold.json``. Equal speeds compare against the synchronous
records of ``async_lm.json`` (the synchronous round's arithmetic did not change; its pulls did).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import async_lm  # noqa: E402
import common  # noqa: E402
from tasklog import busy_fraction  # noqa: E402

RECORDS = common.RESULTS / "async_hold.json"
SPREAD, SEEDS, METHODS = async_lm.SPREAD, async_lm.SEEDS, async_lm.METHODS


def plan() -> list[tuple[str, str, int, float]]:
    """Per seed: equal speeds (async), then 1x-4x (async, speed-scaled); then synchronous
    rounds and the quorum at 1x-4x, seed 0 (their pulls changed); then K = 2 with delayed
    Nesterov at 1x-4x."""
    out = []
    for seed in SEEDS:
        for method in METHODS:
            out.append((method, "async", seed, 1.0))
            out += [(method, mode, seed, SPREAD) for mode in ("async", "async-tb")]
    out += [(m, mode, 0, SPREAD) for mode in ("sync", "quorum") for m in METHODS]
    return out + [(m, "async-dn", seed, SPREAD) for seed in SEEDS for m in METHODS]


def _cells(records: list[dict[str, Any]], method: str, mode: str, spread: float) -> dict:
    return {
        r["seed"]: r
        for r in records
        if (r["method"], r["mode"], r["spread"]) == (method, mode, spread)
    }


def _losses(cells: dict, field: str) -> str:
    return ", ".join(f"{cells[s][field]:.4f}" for s in sorted(cells)) or "—"


def _delta(cells: dict, sync: dict) -> str:
    both = sorted(set(cells) & set(sync))
    return ", ".join(f"{cells[k]['final_loss'] - sync[k]['final_loss']:+.4f}" for k in both) or "—"


def steady_utilisation(rec: dict[str, Any]) -> float:
    """The least utilisation over the nodes after the first outer step (``[t_1, W]``): the
    first asynchronous step is a synchronous round (no task time is known yet), the rest is
    what a long run keeps. Nodes are told apart by their speed factor (spread > 1)."""
    t1, end = rec["curve"][1][0], rec["utilisation_window_s"]
    spans: dict[float, list[tuple[float, float]]] = {}
    for factor, _sent, start, stop, *_ in rec["task_log"]:
        if start is not None:
            spans.setdefault(factor, []).append((start, stop))
    for factor, sent in rec["unanswered"]:
        spans.setdefault(factor, []).append((sent, end))
    return min(busy_fraction(s, t1, end) for s in spans.values())


def table(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Equal speeds (loss at equal tokens, paired against synchronous rounds) and 1x-4x (loss
    at 90 s, min utilisation, turnaround), before and after, every seed."""
    lines = [
        "| method | equal speeds: sync, every seed | async before | Δ before | async after "
        "| Δ after |",
        common.rule(6),
    ]
    for m in METHODS:
        s = _cells(before, m, "sync", 1.0)
        b, a = _cells(before, m, "async", 1.0), _cells(after, m, "async", 1.0)
        lines.append(
            f"| {m} | {_losses(s, 'final_loss')} | {_losses(b, 'final_loss')} | {_delta(b, s)} "
            f"| {_losses(a, 'final_loss')} | {_delta(a, s)} |"
        )
    lines += [
        "",
        "| method | 1x-4x mode | val loss at 90 s before | after | min utilisation before "
        "| after | after, from step 2 | next task after a reply, median / p95 (s) "
        "| pull calls per node per s |",
        common.rule(9),
    ]
    for m in METHODS:
        for mode in ("sync", "quorum", "async", "async-dn", "async-tb"):
            b, a = _cells(before, m, mode, SPREAD), _cells(after, m, mode, SPREAD)
            if not a:
                continue
            turn = ", ".join(
                f"{a[k]['turnaround']['next_median_s']:.3f} / {a[k]['turnaround']['next_p95_s']:.3f}"
                for k in sorted(a)
            )
            rate = ", ".join(
                f"{a[k]['pull_calls'] / (a[k]['wall_s'] * a[k]['nodes']):.2f}" for k in sorted(a)
            )
            util = lambda c: ", ".join(f"{c[k]['min_utilisation']:.3f}" for k in sorted(c))  # noqa: E731
            lines.append(
                f"| {m} | {async_lm.LABELS[mode]} | {_losses(b, 'loss_at_budget')} "
                f"| {_losses(a, 'loss_at_budget')} | {util(b) or '—'} | {util(a)} "
                f"| {', '.join(f'{steady_utilisation(a[k]):.3f}' for k in sorted(a))} | {turn} "
                f"| {rate} |"
            )
    return "\n".join(lines)


def write_table() -> None:
    """docs/strategies.md's block: before (``async_lm.json``) and after."""
    text = table(common.load_records(async_lm.RECORDS), common.load_records(RECORDS))
    common.write_block(async_lm.DOC, "<!-- async-hold:begin -->", "<!-- async-hold:end -->", text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    async_lm.cli(argv, __doc__, plan(), RECORDS, __file__, write_table)


if __name__ == "__main__":
    main()
