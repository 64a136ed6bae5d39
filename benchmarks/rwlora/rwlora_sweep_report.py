"""Tables and the plot of docs/results-rwlora.md from ``benchmarks/results/rwlora_sweep.json``.

    python benchmarks/rwlora/rwlora_sweep_report.py            # rewrite the tables in the doc + the plot
    python benchmarks/rwlora/rwlora_sweep_report.py --stdout   # print the tables only

Statistics over seeds: for "to target" columns, ``mean ± sd (k/n)`` over the ``k`` of ``n``
seeds that reached the target (``sd`` = sample standard deviation, ddof 1; one value: no
``±``; none: ``not reached (0/n)``). Final accuracy: ``mean ± sd`` over all seeds, at the
common budget of local updates (``budget_updates``). Gossip has two rows: the A/B-averaged
adapter and the mean of the vertices' own accuracies. A cell recorded twice counts once (the
last record). Quick records are ignored unless ``--quick``. The doc's tables live between the
markers ``<!-- rwlora-sweep:begin -->`` and ``<!-- rwlora-sweep:end -->``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rwlora_sweep_skew  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "rwlora_sweep.json"
DOC = ROOT / "docs" / "results-rwlora.md"
IMG = ROOT / "docs" / "img" / "rwlora_sweep_updates.png"
BEGIN, END = "<!-- rwlora-sweep:begin -->", "<!-- rwlora-sweep:end -->"
KEY = (*rwlora_sweep_skew.CELL, "lr", "variant", "eval_split")
SKEW_IMG = ROOT / "docs" / "img" / "rwlora_skew_updates.png"
DEFAULT_LR = 2e-3  # the sizing's inner lr (rwlora_sweep.SIZES); the main tables use it
# the screened variants, in the background script's order; their options from the sweep
SCREENED = ["paper", "avg0.9", "tail1", "carry", "k2", "mom0.5", "lrdecay8"]
VARIANT_OPTIONS = {
    "paper": {},
    "avg0.9": {"average-decay": 0.9},
    "avg0.95": {"average-decay": 0.95},
    "k1": {"local-steps": 1},
    "k2": {"local-steps": 2},
    "lrdecay8": {"lr-decay-hops": 8},
    "mom0.5": {"hop-momentum": 0.5},
    "tail1": {"tail-average-from": 1},
    "carry": {"carry-optimizer-state": 1},
    "carry-tail1": {"carry-optimizer-state": 1, "tail-average-from": 1},
    "k2-tail1": {"local-steps": 2, "tail-average-from": 1},
}
GRAPH_ORDER = {"complete": 0, "ring": 1, "regular-3": 2, "none": 3}
# (label, method, field suffix): gossip is scored two ways
SERIES = (
    ("RW-LoRA", "rwlora", ""),
    ("gossip, averaged adapter", "gossip", ""),
    ("gossip, mean of vertices", "gossip", "_vertex_mean"),
    ("FedAvg-LoRA", "fedavg", ""),
)


def load(path: Path, quick: bool = False) -> list[dict[str, Any]]:
    """Records of ``path`` (quick ones only with ``quick``), one per cell (the last); ``lr``
    (the inner lr, from the run config where a record predates the field) is part of the cell."""
    recs = json.loads(path.read_text()) if path.is_file() else []
    cells: dict[tuple, dict] = {}
    for r in recs:
        r.setdefault("lr", r.get("run_config", {}).get("train.lr"))
        r.setdefault("variant", "paper")  # records before the variants: the paper's walk
        r.setdefault("eval_split", "test")
        if bool(r.get("quick")) == quick:
            cells[tuple(r.get(k) for k in KEY)] = r
    return list(cells.values())


def stat(values: list[float | None], digits: int, reached: bool = True) -> str:
    """``mean ± sd (k/n)`` of the non-None values (see the module docstring)."""
    got = [v for v in values if v is not None]
    n, k = len(values), len(got)
    tail = f" ({k}/{n})" if reached else ""
    if not got:
        return f"not reached{tail}" if reached else "-"
    mean = f"{statistics.mean(got):.{digits}f}"
    if k == 1:
        return mean + tail
    return f"{mean} ± {statistics.stdev(got):.{digits}f}{tail}"


def targets_of(recs: list[dict]) -> list[str]:
    keys = {t for r in recs for t in r["updates_to_target"]}
    return sorted(keys, key=float)


def match(r: dict, where: dict) -> bool:
    """``r[k] == v`` for every item of ``where`` (``r[k] in v`` where ``v`` is a tuple)."""
    return all(r.get(k) in v if isinstance(v, tuple) else r.get(k) == v for k, v in where.items())


def groups(recs: list[dict], **where) -> dict[tuple, list[dict]]:
    """Records matching ``where``, grouped by (clients, partition, graph, rank, lr, method)."""
    out: dict[tuple, list[dict]] = {}
    for r in recs:
        if match(r, where):
            key = (r["clients"], r["partition"], r["graph"], r["rank"], r["lr"], r["method"])
            out.setdefault(key, []).append(r)
    order = {m: i for i, (_, m, _) in enumerate(SERIES)}
    return dict(
        sorted(
            out.items(),
            key=lambda kv: (
                kv[0][0],
                kv[0][1],
                GRAPH_ORDER.get(kv[0][2], 9),
                kv[0][3],
                kv[0][4],
                order.get(kv[0][5], 9),
            ),
        )
    )


def _rows(recs: list[dict], field: str, digits: int, lead: tuple[str, ...], **where) -> list[str]:
    targets = targets_of(recs)
    lines = []
    for key, grp in groups(recs, **where).items():
        clients, part, graph, rank, lr, method = key
        values = {
            "clients": str(clients),
            "partition": part,
            "graph": graph,
            "rank": str(rank),
            "lr": f"{lr:g}",
        }
        for label, m, suffix in SERIES:
            if m != method or (suffix and f"{field}{suffix}" not in grp[0]):
                continue
            cols = [stat([r[f"{field}{suffix}"].get(t) for r in grp], digits) for t in targets]
            acc = stat([r.get(f"final_acc{suffix}") for r in grp], 3, reached=False)
            lines.append(
                "| "
                + " | ".join([*(values[c] for c in lead), label, str(len(grp)), *cols, acc])
                + " |"
            )
    return lines


def table(recs: list[dict], field: str, digits: int, lead: tuple[str, ...], **where) -> str:
    """One Markdown table: a row per (lead columns, series); a column per target, then the
    final accuracy at the common budget."""
    targets = targets_of(recs)
    budget = sorted({r["budget_updates"] for r in recs if match(r, where)})
    head = [
        "| "
        + " | ".join(
            [
                *lead,
                "method",
                "seeds",
                *(f"to {t}" for t in targets),
                f"final acc at {'/'.join(map(str, budget))} updates",
            ]
        )
        + " |",
        "|" + "---|" * (len(lead) + 3 + len(targets)),
    ]
    return "\n".join(head + _rows(recs, field, digits, lead, **where))


def per_seed(recs: list[dict], **where) -> str:
    """Final accuracy of every seed (averaged adapter; gossip also the vertex mean)."""
    lines = [
        "| clients | partition | graph | rank | method | final acc per seed |",
        "|---|---|---|---|---|---|",
    ]
    for (clients, part, graph, rank, _lr, method), grp in groups(recs, **where).items():
        grp = sorted(grp, key=lambda r: r["seed"])
        cells = []
        for r in grp:
            own = r.get("final_acc_vertex_mean")
            cells.append(
                f"s{r['seed']}: {r['final_acc']:.3f}"
                + ("" if own is None else f" (vertices {own:.3f})")
            )
        lines.append(f"| {clients} | {part} | {graph} | {rank} | {method} | {', '.join(cells)} |")
    return "\n".join(lines)


def render(recs: list[dict]) -> str:
    """All tables of the doc as Markdown: the paper's walk on the test split first, then the
    label-skew variants (:mod:`rwlora_sweep_skew`)."""
    if not recs:
        return "_No sweep records yet._\n"
    skew = rwlora_sweep_skew.render(recs, DEFAULT_LR, SCREENED, VARIANT_OPTIONS)
    everything, recs = (
        recs,
        [r for r in recs if r["variant"] == "paper" and r["eval_split"] == "test"],
    )
    main = dict(clients=8, rank=8, lr=DEFAULT_LR)
    lead = ("partition", "graph")
    parts = [
        "#### Local updates to each target (8 clients, rank 8)\n",
        table(recs, "updates_to_target", 0, lead, **main),
        "\n#### MB relayed through the server to each target (8 clients, rank 8)\n",
        table(recs, "mb_relayed_to_target", 1, lead, **main),
        "\n#### MB peer-to-peer to each target (8 clients, rank 8)\n",
        table(recs, "mb_p2p_to_target", 1, lead, **main),
        "\n#### Final accuracy per seed (8 clients, rank 8)\n",
        per_seed(recs, **main),
        "\n#### LoRA rank (8 clients, ring, IID): local updates to each target\n",
        table(
            recs,
            "updates_to_target",
            0,
            ("rank",),
            clients=8,
            graph="ring",
            partition="iid",
            seed=0,
            lr=DEFAULT_LR,
        ),
        "\n#### 16 clients on the ring (IID, rank 8, seed 0) next to 8 clients: local updates\n",
        table(
            recs,
            "updates_to_target",
            0,
            ("clients", "graph"),
            partition="iid",
            rank=8,
            seed=0,
            graph=("ring", "none"),
            clients=(8, 16),
            lr=DEFAULT_LR,
        ),
    ]
    probe = dict(clients=8, graph="ring", rank=8)
    if any(match(r, probe) and r["lr"] != DEFAULT_LR for r in recs):
        parts += [
            "\n#### Inner learning rate (8 clients, ring, rank 8): local updates to each target\n",
            table(recs, "updates_to_target", 0, ("partition", "lr"), **probe),
        ]
    parts.append("\n" + skew)
    total = sum(r["wall_s"] for r in everything)
    parts.append(
        f"\nRecords: {len(everything)} runs, {total / 3600:.2f} h of run wall time in all.\n"
    )
    return "\n".join(p for p in parts if p) + "\n"


def write_doc(doc: Path, text: str) -> None:
    """Replace the marked block of ``doc`` with ``text`` (append the block if missing)."""
    old = doc.read_text() if doc.is_file() else ""
    block = f"{BEGIN}\n{text}{END}"
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    new = (
        pat.sub(lambda _: block, old)
        if pat.search(old)
        else old.rstrip("\n") + "\n\n" + block + "\n"
    )
    doc.write_text(new)


def plot(recs: list[dict], path: Path) -> Path | None:
    """Test accuracy vs local updates, 8 clients rank 8: a panel per (partition, graph), the
    seed mean as a line and the seeds' min..max as a band; gossip's vertex mean dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in recs if match(r, dict(clients=8, rank=8, lr=DEFAULT_LR))]
    parts = sorted({r["partition"] for r in sel})
    graphs = sorted({r["graph"] for r in sel if r["graph"] != "none"}, key=GRAPH_ORDER.get)
    if not parts or not graphs:
        return None
    fig, axes = plt.subplots(
        len(parts),
        len(graphs),
        figsize=(4.6 * len(graphs), 3.6 * len(parts)),
        squeeze=False,
        sharey=True,
    )
    for i, part in enumerate(parts):
        for j, graph in enumerate(graphs):
            ax = axes[i][j]
            for label, method, suffix in SERIES:
                grp = [
                    r
                    for r in sel
                    if r["partition"] == part
                    and r["method"] == method
                    and r["graph"] in (graph, "none")
                ]
                key = "acc_vertex_mean" if suffix else "acc"
                curves = [
                    [(c["updates"], c[key]) for c in r["curve"] if c.get(key) is not None]
                    for r in grp
                ]
                curves = [c for c in curves if c]
                if not curves:
                    continue
                label = f"{label} ({len(curves)} seeds)"
                rwlora_sweep_skew.plot_band(ax, curves, ls="--" if suffix else "-", label=label)
            ax.set_title(f"{graph}, {part}")
    panels = [ax for row in axes for ax in row]
    return rwlora_sweep_skew.finish_figure(fig, panels, "test accuracy", path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--img", type=Path, default=IMG)
    ap.add_argument("--skew-img", type=Path, default=SKEW_IMG)
    ap.add_argument("--quick", action="store_true", help="report the quick records instead")
    ap.add_argument("--stdout", action="store_true", help="print the tables; write nothing")
    ap.add_argument(
        "--best-variant",
        action="store_true",
        help="print the best screened variant (label skew, validation split) and exit",
    )
    ap.add_argument("--variants", nargs="+", default=None, help="with --best-variant: among these")
    args = ap.parse_args(argv)
    recs = load(args.results, args.quick)
    if args.best_variant:
        best = rwlora_sweep_skew.best_variant(recs, DEFAULT_LR, args.variants)
        if best is None:
            raise SystemExit("no screened variant recorded")
        print(best)
        return
    text = render(recs)
    if args.stdout:
        print(text)
        return
    write_doc(args.doc, text)
    plot([r for r in recs if r["variant"] == "paper" and r["eval_split"] == "test"], args.img)
    rwlora_sweep_skew.plot(recs, DEFAULT_LR, args.skew_img)
    print(f"[rwlora_sweep_report] {len(recs)} records -> {args.doc}, {args.img}")


if __name__ == "__main__":
    main()
