"""Markdown tables from the lm_sweep results (stdout): tuning grids and the main cells.

    python benchmarks/lm/lm_sweep_report.py [--sweep benchmarks/results/lm_sweep.json]
        [--tuning benchmarks/results/lm_tuning.json] [--protocol main]

Main table: one row per (method, M) with the mean and sample standard deviation of the test
and validation losses over seeds, and every seed's test loss. Tuning table: one row per
(method, M, momentum), the validation loss at each outer lr; the optimum is marked ``*``.
Quick (``--quick``) records are ignored.

    python benchmarks/lm/lm_sweep_report.py --write-docs   # docs/results-lm.md block + docs/img plots

``--write-docs`` regenerates the horizon study's block (``lm_sweep_horizon_report.py``) and
the block between the ``lm_sweep_report`` markers of docs/results-lm.md: the main table at today's tuned values, the DiLoCo - IsoLoCo and
FedAvg - IsoLoCo gaps paired by seed, the merge rules at M = 8 and 32 ranked, the secondary
protocols next to their main cells, the change against M = 1, the tuning grids, and three
plots (test loss vs M with sd error bars, the gap vs M, tuning curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _load(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text()) if not r.get("quick")] if path.is_file() else []


def tuning_table(recs: list[dict]) -> str:
    """Validation loss per (method, M, momentum) row and outer-lr column; ``*`` = optimum."""
    out = []
    for method, m in sorted({(r["method"], r["workers"]) for r in recs}):
        group = [r for r in recs if r["method"] == method and r["workers"] == m]
        best = min(group, key=lambda r: r["val_loss"])
        lrs = sorted({r["outer_lr"] for r in group})
        out += [
            f"\n{method}, M = {m} (validation loss; * = optimum)\n",
            "| momentum | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---" * (len(lrs) + 1) + "|",
        ]
        for mu in sorted({r["outer_momentum"] for r in group}):
            cells = []
            for lr in lrs:
                r = next(
                    (r for r in group if r["outer_lr"] == lr and r["outer_momentum"] == mu), None
                )
                cells.append("" if r is None else f"{r['val_loss']:.4f}{'*' if r is best else ''}")
            out.append(f"| {mu:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main_table(recs: list[dict], protocol: str) -> str:
    """Mean +- sd over seeds of test and validation loss per (method, M)."""
    cells = defaultdict(list)
    for r in recs:
        if r["protocol"] == protocol:
            cells[(r["method"], r["workers"])].append(r)
    rows = [
        "| method | M | seeds | test loss mean | sd | val loss mean | outer lr / mu (source) | test per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (method, m), group in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        group.sort(key=lambda r: r["seed"])
        test = [r["test_loss"] for r in group]
        val = [r["val_loss"] for r in group]
        sd = f"{statistics.stdev(test):.4f}" if len(test) > 1 else "-"
        hp = {(r["outer_lr"], r["outer_momentum"], r.get("hp_source")) for r in group}
        hp_s = "; ".join(f"{lr} / {mu} ({src})" for lr, mu, src in sorted(hp, key=str))
        seeds = ", ".join(f"s{r['seed']}: {r['test_loss']:.4f}" for r in group)
        rows.append(
            f"| {method} | {m} | {len(group)} | {statistics.mean(test):.4f} | {sd} | "
            f"{statistics.mean(val):.4f} | {hp_s} | {seeds} |"
        )
    return "\n".join(rows)


def current_cells(recs: list[dict], tuning: list[dict], protocol: str = "main") -> list[dict]:
    """Records of ``protocol`` run at the outer values :func:`lm_sweep.tuned_hp` gives today
    (the M = 64 optimum for M >= 32 once it exists); earlier cells at other values are left out
    of the headline tables (they stay in the JSON)."""
    import lm_sweep

    out = []
    for r in recs:
        if r["protocol"] != protocol:
            continue
        hp = lm_sweep.tuned_hp(r["method"], r["workers"], tuning, False)
        if (r["outer_lr"], r["outer_momentum"]) == (hp["outer_lr"], hp["outer_momentum"]):
            out.append(r)
    return out


def _by_cell(recs: list[dict]) -> dict[tuple[str, int], dict[int, float]]:
    cells: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for r in recs:
        cells[(r["method"], r["workers"])][r["seed"]] = r["test_loss"]
    return cells


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def gap_table(recs: list[dict], base: str = "diloco", other: str = "isoloco") -> str:
    """``base - other`` test loss per M, paired by seed (mean, sd over the shared seeds)."""
    cells = _by_cell(recs)
    rows = [f"| M | seeds | {base} - {other} (mean) | sd | per seed |", "|---|---|---|---|---|"]
    for m in sorted({m for (_, m) in cells}):
        a, b = cells.get((base, m), {}), cells.get((other, m), {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        d = [a[s] - b[s] for s in seeds]
        mean, sd = _mean_sd(d)
        per = ", ".join(f"s{s}: {x:+.4f}" for s, x in zip(seeds, d, strict=True))
        rows.append(
            f"| {m} | {len(seeds)} | {mean:+.4f} | {'-' if sd is None else f'{sd:.4f}'} | {per} |"
        )
    return "\n".join(rows)


def versus_m1_table(recs: list[dict]) -> str:
    """Mean test loss at each M minus the method's mean at M = 1 (> 0: worse than one worker)."""
    cells = _by_cell(recs)
    methods = sorted({k for (k, _) in cells})
    ms = sorted({m for (_, m) in cells})
    rows = ["| method | " + " | ".join(f"M = {m}" for m in ms) + " |", "|---" * (len(ms) + 1) + "|"]
    for method in methods:
        base = cells.get((method, 1))
        if not base:
            continue
        b = statistics.mean(base.values())
        vals = [cells.get((method, m)) for m in ms]
        rows.append(
            f"| {method} | "
            + " | ".join(
                "" if v is None else f"{statistics.mean(v.values()) - b:+.4f}" for v in vals
            )
            + " |"
        )
    return "\n".join(rows)


def _hp(r: dict) -> str:
    if r.get("outer_lr") is None:
        return f"- (peak lr {r['inner_lr']:g})" if r.get("inner_lr") else "-"
    return f"{r['outer_lr']:g} / {r['outer_momentum']:g}"


def ranked_table(recs: list[dict], workers: tuple[int, ...]) -> str:
    """The cells at the given M, best mean test loss first (the merge-rule comparison)."""
    cells = defaultdict(list)
    for r in recs:
        if r["workers"] in workers:
            cells[(r["workers"], r["method"])].append(r)
    rows = [
        "| M | method | outer lr / mu | seeds | test loss mean | sd | val loss mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for (m, method), group in sorted(
        cells.items(), key=lambda kv: (kv[0][0], statistics.mean(r["test_loss"] for r in kv[1]))
    ):
        test = [r["test_loss"] for r in group]
        mean, sd = _mean_sd(test)
        hp = "; ".join(sorted({_hp(r) for r in group}))
        rows.append(
            f"| {m} | {LABELS.get(method, method)} | {hp} | {len(group)} | {mean:.4f} | "
            f"{'-' if sd is None else f'{sd:.4f}'} | "
            f"{statistics.mean(r['val_loss'] for r in group):.4f} |"
        )
    return "\n".join(rows)


def protocols_table(sweep: list[dict], tuning: list[dict]) -> str:
    """Secondary-protocol cells (at the main protocol's tuned outer values) next to the main
    cell of the same method, M and seed: test loss and the difference (protocol - main)."""
    main = {(r["method"], r["workers"], r["seed"]): r for r in current_cells(sweep, tuning)}
    rows = [
        "| protocol | M | H | rounds | method | seed | test loss | main test loss | protocol - main |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    protos = sorted({r["protocol"] for r in sweep} - {"main"})
    cells = [r for p in protos for r in current_cells(sweep, tuning, p)]
    for r in sorted(
        cells, key=lambda r: (r["protocol"], r["inner_steps"], r["workers"], r["method"], r["seed"])
    ):
        ref = main.get((r["method"], r["workers"], r["seed"]))
        ref_s = "" if ref is None else f"{ref['test_loss']:.4f}"
        diff = "" if ref is None else f"{r['test_loss'] - ref['test_loss']:+.4f}"
        rows.append(
            f"| {r['protocol']} | {r['workers']} | {r['inner_steps']} | {r['rounds']} | "
            f"{LABELS.get(r['method'], r['method'])} | {r['seed']} | {r['test_loss']:.4f} | "
            f"{ref_s} | {diff} |"
        )
    return "\n".join(rows)


def _axes(figsize: tuple[float, float]):
    """A new (figure, axes) on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def _save(fig, ax, path: Path, legend_size: int, outside: bool = False) -> None:
    """Grid, legend (right of the axes with ``outside``), layout; written atomically with
    mode 0644; figure closed."""
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    ax.grid(alpha=0.3)
    if outside:
        ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_loss_vs_m(recs: list[dict], path: Path) -> None:
    """Test loss vs M per method (mean over seeds, error bars = sd; single seeds as dots)."""
    cells = _by_cell(recs)
    fig, ax = _axes((8.6, 4.2))
    for method in sorted({k for (k, _) in cells}):
        ms = sorted(m for (k, m) in cells if k == method)
        stats = [_mean_sd(list(cells[(method, m)].values())) for m in ms]
        ax.errorbar(
            ms,
            [x for x, _ in stats],
            yerr=[sd or 0.0 for _, sd in stats],
            marker="o",
            capsize=3,
            label=LABELS.get(method, method),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers M (same tokens, same global batch)")
    ax.set_ylabel("test loss (nats/token)")
    _save(fig, ax, path, legend_size=8, outside=True)


def plot_gap(recs: list[dict], path: Path) -> None:
    """DiLoCo - IsoLoCo test-loss gap vs M (paired by seed; error bars = sd)."""
    cells = _by_cell(recs)
    fig, ax = _axes((6.0, 3.8))
    for base, style in (("diloco", "o-"), ("fedavg", "s--")):
        pts = []
        for m in sorted({m for (_, m) in cells}):
            a, b = cells.get((base, m), {}), cells.get(("isoloco", m), {})
            d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
            if d:
                pts.append((m, *_mean_sd(d)))
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] or 0.0 for p in pts],
                fmt=style,
                capsize=3,
                label=f"{LABELS[base]} - IsoLoCo",
            )
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers M")
    ax.set_ylabel("test-loss gap (nats/token)")
    _save(fig, ax, path, legend_size=8)


def plot_tuning(tuning: list[dict], path: Path) -> None:
    """Validation loss vs outer lr per (method, M, momentum): the tuning curves."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in tuning:
        if r["protocol"] == "main":
            groups[(r["method"], r["workers"], r["outer_momentum"])].append(r)
    fig, ax = _axes((6.4, 4.2))
    for (method, m, mu), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        group.sort(key=lambda r: r["outer_lr"])
        ax.plot(
            [r["outer_lr"] for r in group],
            [r["val_loss"] for r in group],
            marker="o",
            label=f"{LABELS.get(method, method)}, M = {m}, momentum {mu:g}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("outer learning rate")
    ax.set_ylabel("validation loss (tuning split)")
    _save(fig, ax, path, legend_size=7)


LABELS = {
    "fedavg": "FedAvg (mean, lr 1)",
    "diloco": "DiLoCo (mean + Nesterov)",
    "isoloco": "IsoLoCo (Iso-C + Nesterov)",
    "diloco-sgd": "DiLoCo-SGD (mean, no momentum)",
    "iso_c-sgd": "Iso-C SGD (no momentum)",
    "ties": "TIES",
    "dare": "DARE",
    "tsv_m": "TSV-M",
    "iso_cts": "Iso-CTS",
    "dp-adamw": "data-parallel AdamW",
}
BEGIN, END = "<!-- lm_sweep_report:begin -->", "<!-- lm_sweep_report:end -->"


def with_tuned_reference(main: list[dict], inner_lr: list[dict]) -> list[dict]:
    """``main`` with its ``dp-adamw`` cells replaced by the best record of the reference line's
    own lr grid (benchmarks/lm/lm_inner_lr.py, chosen on validation), when there is one."""
    if not inner_lr:
        return main
    best = min(inner_lr, key=lambda r: r["val_loss"])
    ref = {**best, "protocol": "main", "outer_lr": None, "outer_momentum": None}
    return [r for r in main if r["method"] != "dp-adamw"] + [ref]


def report(
    sweep: list[dict],
    tuning: list[dict],
    img_dir: Path,
    img_rel: str,
    inner_lr: list[dict] | None = None,
) -> str:
    """The generated block of docs/results-lm.md (tables + plot links) from the JSON."""
    main = with_tuned_reference(current_cells(sweep, tuning), inner_lr or [])
    plot_loss_vs_m(main, img_dir / "lm_sweep_loss_vs_m.png")
    plot_gap(main, img_dir / "lm_sweep_gap.png")
    plot_tuning(tuning, img_dir / "lm_sweep_tuning.png")
    wall = sum(r.get("wall_s", 0.0) for r in sweep + tuning if "copied_from" not in r)
    return "\n".join(
        [
            BEGIN,
            "<!-- generated by `python benchmarks/lm/lm_sweep_report.py --write-docs`; do not edit -->",
            f"Records: {len(tuning)} tuning, {len(sweep)} sweep; compute so far "
            f"{wall / 3600:.2f} h of wall time (runs copied from a twin not counted).",
            "",
            "### Main protocol: test loss (at today's tuned values)",
            "",
            main_table(main, "main"),
            "",
            f"![test loss vs M]({img_rel}/lm_sweep_loss_vs_m.png)",
            "",
            "### DiLoCo - IsoLoCo gap (paired by seed)",
            "",
            gap_table(main),
            "",
            "FedAvg - IsoLoCo:",
            "",
            gap_table(main, "fedavg"),
            "",
            f"![gap vs M]({img_rel}/lm_sweep_gap.png)",
            "",
            "### Merge rules at M = 8 and M = 32 (best first; no-momentum rules at their own tuned lr)",
            "",
            ranked_table(main, (8, 32)),
            "",
            "### Beyond the paper: other protocols (main protocol's tuned outer values)",
            "",
            protocols_table(sweep, tuning),
            "",
            "### Change against M = 1 (mean test loss)",
            "",
            versus_m1_table(main),
            "",
            "### Tuning grids",
            tuning_table(tuning),
            "",
            f"![tuning curves]({img_rel}/lm_sweep_tuning.png)",
            END,
        ]
    )


def write_docs(
    doc: Path, block: str, begin: str = BEGIN, end: str = END, heading: str = "Sweep results"
) -> None:
    """Replace the generated block of ``doc`` between ``begin`` and ``end`` (appended once,
    under ``heading``, if the markers are missing)."""
    text = doc.read_text()
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", type=Path, default=RESULTS / "lm_sweep.json")
    ap.add_argument("--tuning", type=Path, default=RESULTS / "lm_tuning.json")
    ap.add_argument("--protocol", default="main")
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help="regenerate the tables and plots of docs/results-lm.md",
    )
    args = ap.parse_args()
    sweep, tuning = _load(args.sweep), _load(args.tuning)
    if args.write_docs:
        repo = RESULTS.parents[1]
        block = report(
            sweep, tuning, repo / "docs" / "img", "img", _load(RESULTS / "lm_inner_lr.json")
        )
        write_docs(repo / "docs" / "results-lm.md", block)
        print(block)
        import lm_sweep_horizon_report as hrep

        hblock = hrep.report(
            _load(RESULTS / "lm_horizon.json"),
            _load(RESULTS / "lm_horizon_tuning.json"),
            repo / "docs" / "img",
            "img",
        )
        write_docs(
            repo / "docs" / "results-lm.md", hblock, hrep.BEGIN, hrep.END, "Horizon study results"
        )
        print(hblock)
        return
    print("## Tuning grid\n" + tuning_table(tuning))
    print(f"\n## Cells, protocol {args.protocol}\n\n" + main_table(sweep, args.protocol))


if __name__ == "__main__":
    main()
