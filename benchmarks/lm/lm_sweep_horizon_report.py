"""Tables and the plot of the horizon study (``lm_sweep.py --protocol horizon``) from whatever
cells exist, every missing one marked pending; called by ``lm_sweep_report.py --write-docs``.

    python benchmarks/lm/lm_sweep_horizon_report.py            # markdown to stdout
    python benchmarks/lm/lm_sweep_report.py --write-docs       # also the docs block + plot

A cell is (method, T, M, seed) at the outer and inner lr that ``lm_sweep_horizon.cell_hp``
gives today; records at other values (stale after a retune) stay in the JSON but not in the
tables. Seed-0 M = 8 cells come from the tuning grid when it holds that point. Differences are
paired by seed: ``a - b`` over the seeds both cells have (mean, sample sd, every seed).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_sweep_horizon as hz  # noqa: E402
import lm_sweep_lib as lib  # noqa: E402

WORKERS = (1, 8, 32)
BEGIN, END = "<!-- lm_horizon_report:begin -->", "<!-- lm_horizon_report:end -->"
PAIRS = (  # (a, b, what a - b > 0 means)
    ("diloco", "isoloco", "IsoLoCo ahead of DiLoCo"),
    ("isoloco", "dp-adamw", "IsoLoCo behind synchronous AdamW"),
    ("fedavg", "diloco", "DiLoCo's momentum ahead of FedAvg"),
)


def current(cells: list[dict], tuning: list[dict]) -> dict[tuple, dict]:
    """(method, T, M, seed) -> record at today's tuned values (cells file first)."""
    out: dict[tuple, dict] = {}
    for r in [*cells, *tuning]:
        if r.get("protocol") != "horizon" or r.get("quick"):
            continue
        hp = hz.cell_hp(tuning, r["method"], r["horizon"], False)
        want = (hp["outer_lr"], hp["outer_momentum"], hp["inner_lr"])
        if (r["outer_lr"], r["outer_momentum"], hz._inner(r)) != want:
            continue
        src = {k: hp[k] for k in ("hp_source", "inner_lr_source")}  # today's, not the grid's
        out.setdefault((r["method"], r["horizon"], r["workers"], r["seed"]), {**r, **src})
    return out


def planned() -> list[tuple]:
    """Every (method, T, M, seed) the study plans."""
    return [
        (m, t, w, s) for t in lib.HORIZONS for w in WORKERS for m in hz.METHODS for s in hz.SEEDS[w]
    ]


def _fmt_sd(xs: list[float]) -> str:
    return f"{statistics.stdev(xs):.4f}" if len(xs) > 1 else "-"


def loss_table(cur: dict[tuple, dict]) -> str:
    """Mean test loss per (T, M) row and method column, ``(seeds done / planned)``; then one
    row per existing cell with its values and every seed."""
    rows = ["| T | M | " + " | ".join(hz.METHODS) + " |", "|---" * (2 + len(hz.METHODS)) + "|"]
    detail = [
        "| T | M | method | seeds | test loss mean | sd | outer lr / mu | inner lr | test per seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in lib.HORIZONS:
        for w in WORKERS:
            cells = []
            for m in hz.METHODS:
                need = hz.SEEDS[w]
                got = [cur[(m, t, w, s)] for s in need if (m, t, w, s) in cur]
                if not got:
                    cells.append(f"pending (0/{len(need)})")
                    continue
                test = [r["test_loss"] for r in got]
                cells.append(f"{statistics.mean(test):.4f} ({len(got)}/{len(need)})")
                r0 = got[0]
                hp = (
                    "-"
                    if r0["outer_lr"] is None
                    else f"{r0['outer_lr']:g} / {r0['outer_momentum']:g}"
                )
                per = ", ".join(f"s{r['seed']}: {r['test_loss']:.4f}" for r in got)
                detail.append(
                    f"| {t} | {w} | {m} | {len(got)}/{len(need)} | {statistics.mean(test):.4f} | "
                    f"{_fmt_sd(test)} | {hp} ({r0.get('hp_source', '')}) | {hz._inner(r0):g} "
                    f"({r0.get('inner_lr_source', '')}) | {per} |"
                )
            rows.append(f"| {t} | {w} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\nCells that exist:\n\n" + "\n".join(detail)


def pair(cur: dict[tuple, dict], a: str, b: str, t: int, w: int) -> list[tuple[int, float]]:
    """(seed, test_a - test_b) over the planned seeds both cells have."""
    return [
        (s, cur[(a, t, w, s)]["test_loss"] - cur[(b, t, w, s)]["test_loss"])
        for s in hz.SEEDS[w]
        if (a, t, w, s) in cur and (b, t, w, s) in cur
    ]


def gap_table(cur: dict[tuple, dict]) -> str:
    head = " | ".join(f"{a} - {b}" for a, b, _ in PAIRS)
    rows = [f"| M | T | {head} |", "|---" * (2 + len(PAIRS)) + "|"]
    for w in WORKERS:
        for t in lib.HORIZONS:
            cells = []
            for a, b, _ in PAIRS:
                d = pair(cur, a, b, t, w)
                if not d:
                    cells.append("pending")
                    continue
                xs = [x for _, x in d]
                per = ", ".join(f"s{s}: {x:+.3f}" for s, x in d)
                n = f"{len(d)}/{len(hz.SEEDS[w])}"
                cells.append(f"{statistics.mean(xs):+.4f} (sd {_fmt_sd(xs)}; {n} seeds: {per})")
            rows.append(f"| {w} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tuning_table(tuning: list[dict]) -> str:
    """Validation loss of every grid point, per (method, T, inner lr, momentum); * = optimum."""
    out = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in tuning:
        if r.get("protocol") == "horizon" and not r.get("quick") and r.get("seed") == 0:
            groups[(r["method"], r["horizon"])].append(r)
    for (method, t), recs in sorted(groups.items()):
        best = hz._best(recs)
        dp = method == "dp-adamw"
        xs = sorted({hz._inner(r) if dp else r["outer_lr"] for r in recs})
        label = "peak lr" if dp else "lr"
        out += [
            f"\n{method}, T = {t}, M = 8 (validation loss; * = best of the grid)\n",
            "| inner lr / momentum | " + " | ".join(f"{label} {x:g}" for x in xs) + " |",
            "|---" * (len(xs) + 1) + "|",
        ]
        rows = sorted({(hz._inner(r), r["outer_momentum"]) for r in recs}, key=str)
        for inner, mu in [("-", None)] if dp else rows:
            cells = []
            for x in xs:
                hit = [
                    r
                    for r in recs
                    if (hz._inner(r) == x if dp else (r["outer_lr"] == x and hz._inner(r) == inner))
                    and (dp or r["outer_momentum"] == mu)
                ]
                cells.append(
                    "" if not hit else f"{hit[0]['val_loss']:.4f}{'*' if hit[0] is best else ''}"
                )
            name = "-" if dp else f"{inner:g} / {mu:g}"
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) if out else "(no tuning cell yet)"


def cost_table(cells: list[dict], tuning: list[dict]) -> str:
    """Measured wall time per run (not copied), by (T, M, method kind), with load averages."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in [*cells, *tuning]:
        if (
            r.get("protocol") == "horizon"
            and not r.get("quick")
            and "copied_from" not in r
            and "wall_s" in r
        ):
            kind = "dp-adamw (in process)" if r["method"] == "dp-adamw" else "Flower (Ray)"
            groups[(r["horizon"], r["workers"], kind)].append(r)
    rows = [
        "| T | M | kind | runs | wall s mean | min | max | load avg at start (range) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (t, w, kind), recs in sorted(groups.items()):
        ws = [r["wall_s"] for r in recs]
        la = [r.get("load_avg_start", float("nan")) for r in recs]
        rows.append(
            f"| {t} | {w} | {kind} | {len(recs)} | {statistics.mean(ws):.0f} | {min(ws):.0f} | "
            f"{max(ws):.0f} | {min(la):.1f}-{max(la):.1f} |"
        )
    return "\n".join(rows)


def plot_gap(cur: dict[tuple, dict], path: Path) -> None:
    """DiLoCo - IsoLoCo and IsoLoCo - DP-AdamW vs T per M (mean, sd bars); hollow markers:
    fewer seeds than planned; pending (T, M) points, if any, listed under the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    pending, partial_any = [], False
    for (a, b, _), style in zip(PAIRS[:2], ("-", "--"), strict=True):
        for w, color in zip(WORKERS, ("C0", "C1", "C2"), strict=True):
            pts = []
            for t in lib.HORIZONS:
                d = [x for _, x in pair(cur, a, b, t, w)]
                if not d:
                    pending.append(f"{a}-{b} M={w} T={t}")
                    continue
                sd = statistics.stdev(d) if len(d) > 1 else 0.0
                pts.append((t, statistics.mean(d), sd, len(d) < len(hz.SEEDS[w])))
            if not pts:
                continue
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                color=color,
                ls=style,
                capsize=3,
                label=f"{a} - {b}, M = {w}",
            )
            for t, y, _, partial in pts:
                partial_any = partial_any or partial
                ax.plot(t, y, "o", color=color, mfc="white" if partial else color)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(list(lib.HORIZONS))
    ax.set_xlabel("total inner steps T (H = 10: T / 10 outer steps)")
    ax.set_ylabel("test-loss difference (nats/token)")
    title = "paired by seed; bars: sd over seeds"
    ax.set_title(title + ("; hollow: fewer seeds than planned" if partial_any else ""), fontsize=8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    if pending:
        fig.text(0.01, 0.005, ("pending: " + "; ".join(pending))[:400], fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.08 if pending else 0, 1, 1))
    save_figure(fig, path)
    plt.close(fig)


def report(cells: list[dict], tuning: list[dict], img_dir: Path, img_rel: str) -> str:
    cur = current(cells, tuning)
    plot_gap(cur, img_dir / "lm_horizon_gap.png")
    plan = planned()
    done = sum(k in cur for k in plan)
    runs = [r for r in cells + tuning if not r.get("quick") and "copied_from" not in r]
    wall = sum(r.get("wall_s", 0.0) for r in runs if r.get("protocol") == "horizon")
    return "\n".join(
        [
            BEGIN,
            "<!-- generated by `python benchmarks/lm/lm_sweep_report.py --write-docs`; do not edit -->",
            f"Cells at today's tuned values: {done} of {len(plan)} planned; records: "
            f"{len(tuning)} tuning, {len(cells)} cells; run wall time so far {wall / 3600:.2f} h.",
            "",
            "#### Test loss per cell (pending = not run yet)",
            "",
            loss_table(cur),
            "",
            "#### Differences vs the horizon, paired by seed (test loss)",
            "",
            "a - b > 0: " + "; ".join(f"`{a} - {b}` > 0 = {m}" for a, b, m in PAIRS) + ".",
            "",
            gap_table(cur),
            "",
            f"![gap vs horizon per M]({img_rel}/lm_horizon_gap.png)",
            "",
            "#### Tuning grids (M = 8, seed 0, validation split)",
            tuning_table(tuning),
            "",
            "#### Measured cost per run",
            "",
            cost_table(cells, tuning),
            END,
        ]
    )


def main() -> None:
    import json

    res = HERE.parent / "results"

    def load(name):
        p = res / name
        return json.loads(p.read_text()) if p.is_file() else []

    cells, tuning = load("lm_horizon.json"), load("lm_horizon_tuning.json")
    cur = current(cells, tuning)
    print(loss_table(cur) + "\n\n" + gap_table(cur) + "\n" + tuning_table(tuning))


if __name__ == "__main__":
    main()
