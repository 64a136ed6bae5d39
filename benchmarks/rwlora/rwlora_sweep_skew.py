"""The label-skew part of docs/results-rwlora.md: RW-LoRA variants under Dirichlet(0.5).

Used by ``rwlora_sweep_report.py`` (tables in the doc's marked block, the plot, and
``--best-variant``, which the background script calls after the screening).

- **Screening**: each variant once (ring, 8 clients, rank 8, seed 0, Dirichlet(0.5)) scored on
  the validation split (``eval_split`` ``val``: the clients' joined validation tails). The
  best variant has the highest *balanced* validation accuracy at the budget, ties broken by
  the mean of the last three evaluations, and must beat the paper's walk (:func:`best_variant`).
- **Result**: the best variant on the test split, every seed, next to the paper's walk,
  gossip and FedAvg-LoRA of the main sweep (same cells); cells not yet run say ``pending``.
- **Why**: per-class accuracy (each label's recall) along the walk, from the records'
  ``acc_class_<c>`` curve fields.
"""

from __future__ import annotations

import statistics
from typing import Any

CELL = ("method", "graph", "clients", "partition", "rank", "seed", "quick")
"""The fields that name a cell of the sweep; the sweep's key adds ``variant`` and
``eval_split``, the report's the inner ``lr`` before them."""
SKEW = "dirichlet-0.5"
SCREEN = dict(clients=8, rank=8, graph="ring", partition=SKEW, seed=0, eval_split="val")
SEEDS = (0, 1, 2)
GRAPHS = ("ring", "complete", "regular-3")
# an evaluation is "single-class" when some class's recall is below this: the token answers
# (almost) one label for every sentence
ONE_CLASS = 0.2
# a final balanced accuracy below this is "at chance": 0.5 plus about 3 standard errors of
# one accuracy on 1,000 test sentences (0.016 at 0.5)
CHANCE = 0.55


def _is(r: dict, lr: float, **where) -> bool:
    return r.get("lr") == lr and all(r.get(k) == v for k, v in where.items())


def screening(recs: list[dict], lr: float) -> list[dict]:
    """The screening records (RW-LoRA, :data:`SCREEN`), in record order."""
    return [r for r in recs if r["method"] == "rwlora" and _is(r, lr, **SCREEN)]


def balanced(c: dict) -> float:
    """Balanced accuracy of one evaluation: the mean of the per-class accuracies (recalls),
    0.5 for any constant predictor; the plain accuracy where no per-class field was recorded.
    (The validation split is not balanced: 56.7 % positive at seed 0, so a constant
    "positive" scores 0.567 in plain accuracy.)"""
    keys = [k for k in c if k.startswith("acc_class_")]
    return statistics.mean(c[k] for k in keys) if keys else c["acc"]


def _last3(r: dict) -> float:
    return statistics.mean(balanced(c) for c in r["curve"][-3:])


def _score(r: dict) -> tuple[float, float]:
    return (balanced(r["curve"][-1]), _last3(r))


def best_variant(recs: list[dict], lr: float, variants: list[str] | None = None) -> str | None:
    """The variant whose screening run has the highest balanced validation accuracy at the
    budget (then the mean over the last three evaluations), among ``variants`` (all screened
    if None); ``paper`` unless a variant beats the paper's walk strictly; None if none."""
    cand = [r for r in screening(recs, lr) if variants is None or r["variant"] in variants]
    if not cand:
        return None
    top = max(cand, key=_score)
    paper = [r for r in cand if r["variant"] == "paper"]
    if paper and _score(top) <= _score(paper[-1]):
        return "paper"
    return top["variant"]


def _class_cols(c: dict) -> str:
    keys = sorted(k for k in c if k.startswith("acc_class_"))
    return " / ".join(f"{c[k]:.3f}" for k in keys) if keys else "-"


def screening_table(recs: list[dict], lr: float, planned: list[str], options: dict) -> str:
    rows = {r["variant"]: r for r in screening(recs, lr)}
    best = best_variant(recs, lr)
    lines = [
        "| variant | options | val acc at budget | balanced acc at budget | balanced, mean of "
        "last 3 | best acc | per class at budget (neg / pos) | MB P2P per hop | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in dict.fromkeys([*planned, *rows]):
        opt = ", ".join(f"{k}={x:g}" for k, x in options.get(v, {}).items()) or "-"
        r = rows.get(v)
        if r is None:
            lines.append(f"| {v} | {opt} | pending | | | | | | |")
            continue
        hops = sum(r["visit_counts"].values()) if r.get("visit_counts") else None
        per_hop = r["curve"][-1]["mb_p2p"] / hops if hops else float("nan")
        mark = " **(best)**" if v == best else ""
        lines.append(
            f"| {v}{mark} | {opt} | {r['final_acc']:.3f} | {balanced(r['curve'][-1]):.3f}"
            f" | {_last3(r):.3f} | {r['best_acc']:.3f}"
            f" | {_class_cols(r['curve'][-1])} | {per_hop:.3f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def _cell(recs, lr, method, variant, graph, part, seed) -> dict | None:
    where = dict(clients=8, rank=8, partition=part, seed=seed, eval_split="test")
    where.update(graph="none" if method == "fedavg" else graph, variant=variant)
    got = [r for r in recs if r["method"] == method and _is(r, lr, **where)]
    return got[-1] if got else None


def finalists(recs: list[dict], lr: float) -> list[str]:
    """The best screened variant and every other variant with test-split records (finals),
    the paper's walk excluded."""
    tested = [
        r["variant"]
        for r in recs
        if r["method"] == "rwlora" and _is(r, lr, clients=8, rank=8, eval_split="test")
    ]
    out = dict.fromkeys([best_variant(recs, lr), *tested])
    return [v for v in out if v not in (None, "paper")]


def result_table(recs: list[dict], lr: float, variants: list[str]) -> str:
    """Final test accuracy per seed: the variants vs paper's walk vs gossip vs FedAvg."""
    series = [
        *((f"RW-LoRA, {v}", "rwlora", v, "final_acc") for v in variants),
        ("RW-LoRA, paper's walk", "rwlora", "paper", "final_acc"),
        ("gossip, averaged adapter", "gossip", "paper", "final_acc"),
        ("gossip, mean of vertices", "gossip", "paper", "final_acc_vertex_mean"),
        ("FedAvg-LoRA", "fedavg", "paper", "final_acc"),
    ]
    lines = [
        "| partition | graph | method | "
        + " | ".join(f"seed {s}" for s in SEEDS)
        + " | mean ± sd |",
        "|---|---|---|" + "---|" * (len(SEEDS) + 1),
    ]
    for part in (SKEW, "iid"):
        for graph in GRAPHS:
            for label, method, variant, field in series:
                vals = []
                for s in SEEDS:
                    r = _cell(recs, lr, method, variant, graph, part, s)
                    vals.append(None if r is None else r.get(field))
                if (all(v is None for v in vals) and variant not in variants) or (
                    method == "fedavg" and graph != GRAPHS[0]  # no graph: shown once
                ):
                    continue
                cells = ["pending" if v is None else f"{v:.3f}" for v in vals]
                got = [v for v in vals if v is not None]
                if not got:
                    summary = "pending"
                elif len(got) == 1:
                    summary = f"{got[0]:.3f} (1 seed)"
                else:
                    summary = f"{statistics.mean(got):.3f} ± {statistics.stdev(got):.3f}"
                    summary += f" ({len(got)} seeds)" if len(got) < len(SEEDS) else ""
                g = "none" if method == "fedavg" else graph
                lines.append(f"| {part} | {g} | {label} | {' | '.join(cells)} | {summary} |")
    return "\n".join(lines)


def holds_line(recs: list[dict], lr: float, variants: list[str]) -> str:
    """Per variant, its test cells under skew (every graph and seed): how many end with a
    final balanced accuracy of at least :data:`CHANCE`, and which end below (at chance)."""
    lines = []
    for v in variants:
        runs = {(g, s): _cell(recs, lr, "rwlora", v, g, SKEW, s) for g in GRAPHS for s in SEEDS}
        ds = {k: class_dynamics(r) for k, r in runs.items() if r is not None}
        bal = {
            k: d["final_balanced"] for k, d in ds.items() if d and d["final_balanced"] is not None
        }
        if not bal:
            continue
        up = [b for b in bal.values() if b >= CHANCE]
        low = ", ".join(f"{g} s{s} {b:.3f}" for (g, s), b in bal.items() if b < CHANCE)
        lines.append(
            f"- `{v}`: final balanced test accuracy >= {CHANCE:g} in {len(up)} of {len(bal)}"
            " cells under Dirichlet(0.5)"
            + (f" (lowest {min(up):.3f})" if up else "")
            + (f"; at chance (< {CHANCE:g}): {low}" if low else "")
            + "."
        )
    return "\n".join(lines)


def bytes_line(recs: list[dict], lr: float, variants: list[str]) -> str:
    """MB sent up to the budget (the last evaluation of the first recorded test cell on the
    ring, skew then IID, per series): what each variant costs in communication."""
    series = [*((f"RW-LoRA, {v}", "rwlora", v) for v in variants)]
    series += [("RW-LoRA, paper's walk", "rwlora", "paper"), ("gossip", "gossip", "paper")]
    parts = []
    for label, method, variant in series:
        r = next(
            (
                x
                for part in (SKEW, "iid")
                for s in SEEDS
                if (x := _cell(recs, lr, method, variant, "ring", part, s)) is not None
            ),
            None,
        )
        c = {} if r is None else r["curve"][-1]
        if "mb_p2p" in c and "mb_relayed" in c:
            hops = sum((r.get("visit_counts") or {}).values()) if method == "rwlora" else 0
            parts.append(
                f"{label} {c['mb_p2p']:.1f} MB P2P / {c['mb_relayed']:.1f} MB relayed"
                + (f" ({hops} hops)" if hops else "")
            )
    return "- Bytes for the 320 updates (ring): " + "; ".join(parts) + "." if parts else ""


def compute_line(recs: list[dict], lr: float) -> str:
    """Run wall time of this section's runs (the records' ``wall_s``): the screening runs
    (validation split) and the variants' test-split finals, with the load-average range."""
    scr = screening(recs, lr)
    fin = [
        r
        for r in recs
        if r["method"] == "rwlora"
        and r["variant"] != "paper"
        and _is(r, lr, clients=8, rank=8, eval_split="test")
    ]
    runs = scr + fin
    if not runs:
        return ""
    loads = [r[k] for r in runs for k in ("load_avg_start", "load_avg_end") if k in r]
    span = f", load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""
    per = {}
    for r in fin:
        per.setdefault(r["variant"], []).append(r["wall_s"])
    each = "; ".join(
        f"{v} {len(w)} runs, {sum(w):,.0f} s, {min(w):.0f}-{max(w):.0f} s each"
        for v, w in per.items()
    )
    return (
        f"- Compute for this section (records' `wall_s`): {sum(r['wall_s'] for r in runs):,.0f} s"
        f" = screening {len(scr)} runs, {sum(r['wall_s'] for r in scr):,.0f} s + finals"
        f" {len(fin)} runs, {sum(r['wall_s'] for r in fin):,.0f} s ({each}){span}."
    )


def class_curve_table(recs: list[dict], lr: float, variants: list[str]) -> str:
    """Per-class accuracy along the walk (screening records: ring, seed 0, validation)."""
    rows = {r["variant"]: r for r in screening(recs, lr)}
    have = [v for v in variants if v in rows]
    if not have:
        return "_pending_"
    lines = [
        "| updates | " + " | ".join(f"{v}: acc (neg / pos)" for v in have) + " |",
        "|---|" + "---|" * len(have),
    ]
    n = min(len(rows[v]["curve"]) for v in have)
    for i in range(n):
        c0 = rows[have[0]]["curve"][i]
        cols = [
            f"{rows[v]['curve'][i]['acc']:.3f} ({_class_cols(rows[v]['curve'][i])})" for v in have
        ]
        lines.append(f"| {c0['updates']} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _recalls(c: dict) -> list[float]:
    return [c[k] for k in sorted(k for k in c if k.startswith("acc_class_"))]


def test_shares(recs: list[dict], lr: float) -> dict[int, float]:
    """Positive share of each seed's test set (the test set depends on the seed only), from
    any per-class test evaluation whose recalls differ: ``acc = r0 + p (r1 - r0)``."""
    out: dict[int, float] = {}
    for r in recs:
        if r.get("eval_split") != "test" or r.get("lr") != lr:
            continue
        for c in r["curve"]:
            rec = _recalls(c)
            if len(rec) == 2 and abs(rec[1] - rec[0]) > 0.3:
                n = r.get("test_examples") or 1000
                out[r["seed"]] = round((c["acc"] - rec[0]) / (rec[1] - rec[0]) * n) / n
    return out


def class_dynamics(r: dict, share: float | None = None) -> dict | None:
    """Per-class recall along one run, evaluations after round 0 (the initial adapter is the
    same for every variant): ``n`` of them, ``one_class`` = how many have some class's recall
    below :data:`ONE_CLASS`, ``steps`` (text per evaluation), ``final_balanced``. A run that
    recorded no per-class field counts the evaluations whose accuracy equals a constant
    answer's (``share`` or ``1 - share``, the test set's positive share, within half a
    sentence): then ``final_balanced`` is None and ``constant`` True. None if neither."""
    evals = [c for c in r["curve"] if c["updates"] > 0]
    if evals and all(_recalls(c) for c in evals):
        return dict(
            n=len(evals),
            one_class=sum(min(_recalls(c)) < ONE_CLASS for c in evals),
            final_balanced=balanced(evals[-1]),
            constant=False,
            steps=", ".join(
                f"{c['updates']}: " + " / ".join(f"{x:.2f}" for x in _recalls(c)) for c in evals
            ),
        )
    if not evals or share is None:
        return None
    tol = 0.5 / (r.get("test_examples") or 1000)
    words = []
    for c in evals:
        a = c["acc"]
        words.append(
            "pos" if abs(a - share) <= tol else "neg" if abs(a - 1 + share) <= tol else f"{a:.3f}"
        )
    return dict(
        n=len(evals),
        one_class=sum(w in ("pos", "neg") for w in words),
        final_balanced=None,
        constant=True,
        steps=", ".join(f"{c['updates']}: {w}" for c, w in zip(evals, words, strict=True)),
    )


def _dynamics_runs(recs: list[dict], lr: float, variants: list[str]) -> list[tuple]:
    """(variant, split, seed, dynamics or None, worst) for the ring under skew: the screening
    run (validation, seed 0) and every test seed; ``worst`` marks the test seed with the
    lowest final accuracy."""
    shares = test_shares(recs, lr)
    out = []
    for v in variants:
        scr = [r for r in screening(recs, lr) if r["variant"] == v]
        out.append((v, "val", 0, class_dynamics(scr[-1]) if scr else None, False))
        test = {s: _cell(recs, lr, "rwlora", v, "ring", SKEW, s) for s in SEEDS}
        got = {s: r for s, r in test.items() if r is not None}
        worst = min(got, key=lambda s: got[s]["final_acc"]) if len(got) > 1 else None
        for s in SEEDS:
            d = None if test[s] is None else class_dynamics(test[s], shares.get(s))
            out.append((v, "test", s, d if test[s] is not None else None, s == worst))
    return out


def class_dynamics_table(recs: list[dict], lr: float, variants: list[str]) -> str:
    """Per-class recall at every evaluation after round 0, ring, Dirichlet(0.5): screening run
    and test seeds of each variant; how many evaluations are single-class ("pos" / "neg": a
    run without per-class fields whose accuracy equals the constant answer's)."""
    lines = [
        f"| variant | split | seed | single-class evaluations (a recall < {ONE_CLASS:g}) "
        "| recall neg / pos at each evaluation (updates: ...) | final balanced acc |",
        "|---|---|---|---|---|---|",
    ]
    for v, split, seed, d, worst in _dynamics_runs(recs, lr, variants):
        tag = f"{seed} (worst)" if worst else str(seed)
        if d is None:
            lines.append(f"| {v} | {split} | {tag} | pending | | |")
            continue
        one = f"{d['one_class']}/{d['n']}" + (" (constant answer's acc)" if d["constant"] else "")
        bal = "-" if d["final_balanced"] is None else f"{d['final_balanced']:.3f}"
        lines.append(f"| {v} | {split} | {tag} | {one} | {d['steps']} | {bal} |")
    return "\n".join(lines)


def class_dynamics_summary(recs: list[dict], lr: float, variants: list[str]) -> str:
    """One line per variant: single-class evaluations summed over its test seeds, on the ring
    and on every graph under skew."""
    shares = test_shares(recs, lr)
    lines = []
    for v in variants:
        parts = []
        for graphs, where in ((("ring",), "ring"), (GRAPHS, "all three graphs")):
            ds = [
                class_dynamics(r, shares.get(s))
                for g in graphs
                for s in SEEDS
                if (r := _cell(recs, lr, "rwlora", v, g, SKEW, s)) is not None
            ]
            ds = [d for d in ds if d is not None]
            if ds:
                one, n = sum(d["one_class"] for d in ds), sum(d["n"] for d in ds)
                parts.append(f"{where} {one}/{n} ({len(ds)} runs)")
        if parts:
            lines.append(f"- `{v}`, test split: single-class evaluations {', '.join(parts)}.")
    if shares:
        got = ", ".join(f"seed {s} {p:.3f}" for s, p in sorted(shares.items()))
        lines.append(
            f"- Test sets' positive share (from the per-class records): {got}; a run without "
            "per-class fields counts as single-class where its accuracy equals a constant "
            "answer's (the share or 1 - share, within half a sentence)."
        )
    return "\n".join(lines)


def render(recs: list[dict], lr: float, planned: list[str], options: dict) -> str:
    best = best_variant(recs, lr)
    finals = finalists(recs, lr)
    shown = list(dict.fromkeys(["paper", *([best] if best else []), *finals]))
    return "\n".join(
        [
            "#### Label skew: screening of the RW-LoRA variants (ring, Dirichlet(0.5), seed 0, "
            "validation split)\n",
            screening_table(recs, lr, planned, options),
            "\n#### Label skew: per-class accuracy along the walk (same runs, validation split)\n",
            class_curve_table(recs, lr, shown),
            "\n#### Label skew: per-class recall along the walk, ring, Dirichlet(0.5) "
            "(screening run and every test seed)\n",
            class_dynamics_table(recs, lr, shown),
            "",
            class_dynamics_summary(recs, lr, shown),
            f"\n#### Label skew: variants ({', '.join(finals) or 'pending'}; best on validation: "
            f"{best or 'pending'}) vs the paper's walk vs gossip vs FedAvg-LoRA, final test "
            "accuracy at 320 updates (8 clients, rank 8)\n",
            result_table(recs, lr, finals),
            "",
            holds_line(recs, lr, finals),
            bytes_line(recs, lr, finals),
            compute_line(recs, lr),
            "",
        ]
    )


def plot(recs: list[dict], lr: float, path) -> Any:
    """Three panels: the screening's validation curves; test accuracy vs updates under skew on
    the ring (seed mean, min..max band) for the paper's walk, the best variant, gossip; the
    per-class accuracy of the paper's walk and the best variant (validation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scr = screening(recs, lr)
    if not scr:
        return None
    best = best_variant(recs, lr)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.0))
    for r in scr:
        axes[0].plot(
            [c["updates"] for c in r["curve"]],
            [c["acc"] for c in r["curve"]],
            marker="o",
            ms=2.5,
            lw=2.2 if r["variant"] == best else 1.0,
            label=r["variant"],
        )
    axes[0].set_title("screening: ring, Dirichlet(0.5), seed 0 (validation)")
    series = [
        ("rwlora", "paper", "acc", "RW-LoRA, paper's walk"),
        ("gossip", "paper", "acc", "gossip, averaged"),
    ]
    finals = finalists(recs, lr)
    series[:0] = [("rwlora", v, "acc", f"RW-LoRA, {v}") for v in finals]
    for method, variant, key, label in series:
        grp = [_cell(recs, lr, method, variant, "ring", SKEW, s) for s in SEEDS]
        curves = [[(c["updates"], c[key]) for c in r["curve"]] for r in grp if r is not None]
        if not curves:
            continue
        plot_band(axes[1], curves, label=f"{label} ({len(curves)} seeds)")
    axes[1].set_title("ring, Dirichlet(0.5): test accuracy, before / after")
    for r in scr:
        if r["variant"] not in ("paper", best, *finals):
            continue
        keys = sorted(k for k in r["curve"][-1] if k.startswith("acc_class_"))
        for k, ls in zip(keys, ("-", "--"), strict=False):
            axes[2].plot(
                [c["updates"] for c in r["curve"]],
                [c[k] for c in r["curve"]],
                ls=ls,
                marker="o",
                ms=2.5,
                label=f"{r['variant']}, class {k.rsplit('_', 1)[1]}",
            )
    axes[2].set_title("per-class accuracy along the walk (validation)")
    return finish_figure(fig, axes, "accuracy", path)


def plot_band(ax, curves: list[list[tuple[float, float]]], **style) -> None:
    """The seeds' mean of ``curves`` (each a list of (updates, accuracy), cut to the shortest:
    the same schedule for every seed of a cell) as a line, their min..max as a band."""
    n = min(len(c) for c in curves)
    xs = [p[0] for p in curves[0][:n]]
    ys = [[c[t][1] for c in curves] for t in range(n)]
    (line,) = ax.plot(xs, [statistics.mean(y) for y in ys], marker="o", ms=2.5, **style)
    mins, maxs = [min(y) for y in ys], [max(y) for y in ys]
    ax.fill_between(xs, mins, maxs, alpha=0.15, color=line.get_color())


def finish_figure(fig, axes, ylabel: str, path):
    """Every panel's axis labels, grid and legend; the figure saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    for ax in axes:
        ax.set_xlabel("local updates (all clients)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out
