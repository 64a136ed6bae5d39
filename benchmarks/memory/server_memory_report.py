"""The tables and fits of ``benchmarks/memory/server_memory.py``'s JSON (``--table``, ``--compact``).

A fit is least squares ``peak = a + slope * M`` over a (label, strategy, size) group's completed
cells, ``slope`` given in copies of the model's fp32 size per worker, with its R^2.
"""

from __future__ import annotations

GB = 1e9


def fit(cells: list[dict], key: str, model: int) -> dict | None:
    """Least squares ``peak = a + slope * M``; slope in model copies per worker, with R^2."""
    pts = [(c["M"], c[key] * GB) for c in cells if c.get("status") == "ok"]
    if len({m for m, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(m for m, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((m - mx) ** 2 for m, _ in pts)
    slope = sum((m - mx) * (y - my) for m, y in pts) / sxx
    a = my - slope * mx
    ss_tot = sum((y - my) ** 2 for _, y in pts)
    ss_res = sum((y - a - slope * m) ** 2 for m, y in pts)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"slope-model-copies": slope / model, "intercept-gb": a / GB, "r2": r2, "points": n}


def summarise(data: dict) -> None:
    """Refit every (label, strategy, size) group of ``data`` in place."""
    groups: dict[tuple, list[dict]] = {}
    for c in data["cells"]:
        groups.setdefault((c["label"], c["strategy"], c["size"]), []).append(c)
    data["fits"] = []
    for (label, strategy, size), cells in sorted(groups.items()):
        model = cells[0]["model-bytes"]
        row = {"label": label, "strategy": strategy, "size": size}
        for key in ("sim-peak-gb", "tree-peak-gb"):
            row[key] = fit(cells, key, model)
        data["fits"].append(row)


def table(data: dict) -> str:
    lines = ["| label | strategy | M | simulation process peak RSS | whole process tree | round 2 wall | load avg | status |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cells = sorted(data["cells"], key=lambda c: (c["size"], c["label"], c["strategy"], c["M"]))
    for c in cells:
        r2, load = c.get("round2-wall-s"), c.get("load-mean")
        lines.append(
            f"| {c['label']} | {c['strategy']} | {c['M']} | {c['sim-peak-gb']:.2f} GB | "
            f"{c['tree-peak-gb']:.2f} GB | {'-' if r2 is None else f'{r2:.0f} s'} | "
            f"{'-' if load is None else load} | {c['status']} |"
        )
    lines += ["", "| label | strategy | slope, simulation (model copies / worker) | R^2 | slope, tree | R^2 |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for f in data.get("fits", []):
        s, t = f["sim-peak-gb"], f["tree-peak-gb"]
        if s is None or t is None:
            continue
        lines.append(
            f"| {f['label']} | {f['strategy']} | {s['slope-model-copies']:.2f} | {s['r2']:.3f} | "
            f"{t['slope-model-copies']:.2f} | {t['r2']:.3f} |"
        )
    return "\n".join(lines)


def compact(data: dict) -> str:
    """The docs' table: per (label, strategy), each M's newest completed cell as ``simulation /
    tree`` peak GB (or why it has none), and the fitted slopes in model copies per worker."""
    groups: dict[tuple, dict[int, dict]] = {}
    for c in data["cells"]:
        if c["size"] != "51MiB":
            continue
        row = groups.setdefault((c["label"], c["strategy"]), {})
        if c["status"] == "ok" or row.get(c["M"], {}).get("status") != "ok":
            row[c["M"]] = c
    ms = sorted({m for row in groups.values() for m in row})
    fits = {(f["label"], f["strategy"]): f for f in data.get("fits", []) if f["size"] == "51MiB"}
    lines = ["| code | strategy | " + " | ".join(f"M = {m}" for m in ms)
             + " | slope, simulation (tree) |", "|---|---|" + "---|" * (len(ms) + 1)]  # fmt: skip
    for (label, strategy), row in sorted(groups.items()):
        cells = []
        for m in ms:
            c = row.get(m)
            if c is None:
                cells.append("-")
            elif c["status"] == "ok":
                cells.append(f"{c['sim-peak-gb']:.2f} / {c['tree-peak-gb']:.2f}")
            elif c.get("run-status") == "completed":  # ran, but not every node's reply in time
                used = " + ".join(str(u) for u in c["replies-used"])
                cells.append(f"{c['sim-peak-gb']:.2f} / {c['tree-peak-gb']:.2f} "
                             f"({used} of {c['M']} replies: round timeout)")  # fmt: skip
            else:
                cells.append(
                    f"{c['status']} ({c['sim-peak-gb']:.1f} / {c['tree-peak-gb']:.1f} so far)"
                )
        f = fits.get((label, strategy), {})
        sim, tree = f.get("sim-peak-gb"), f.get("tree-peak-gb")
        slope = (
            "-"
            if not sim or not tree
            else (
                f"{sim['slope-model-copies']:.2f} ({tree['slope-model-copies']:.2f}), {sim['points']} points"
            )
        )
        lines.append(f"| {label} | {strategy} | " + " | ".join(cells) + f" | {slope} |")
    probes = data.get("in-process", [])
    if probes:
        lines += ["", "| TIES merge in one process | M | merge peak over baseline | merge s | load |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for c in sorted(probes, key=lambda c: (not c["rows"], c["M"])):
            how = "row blocks" if c["rows"] else "every tensor at once (before)"
            lines.append(f"| {how} | {c['M']} | {c['merge-peak-mib']:.0f} MiB | "
                         f"{c['merge-s']:.1f} | {c['load-at-start']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def synthetic_table(data: dict) -> str:
    """The docs' table of ``--synthetic`` cells: per M, peak GB of the simulation process / the
    tree, round walls, the server's own time, replies used, load; then the fitted slopes."""
    lines = ["| strategy | M | simulation / tree peak | in model copies | round wall s | server s "
             "(aggregation-time-s) | replies used | load mean | status |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cells = [c for c in data["cells"] if c.get("workers") == "synthetic"]
    for c in sorted(cells, key=lambda c: (c["strategy"], c["M"])):
        gb = c["model-bytes"] / GB or float("nan")
        walls = " + ".join(f"{w:.0f}" for w in c.get("round-wall-s") or [])
        agg = " + ".join(f"{a:.0f}" for a in c.get("aggregation-time-s") or [] if a is not None)
        used = " + ".join(str(u) for u in c.get("replies-used") or [])
        lines.append(
            f"| {c['strategy']} | {c['M']} | {c['sim-peak-gb']:.2f} / {c['tree-peak-gb']:.2f} GB"
            f" | {c['sim-peak-gb'] / gb:.1f} / {c['tree-peak-gb'] / gb:.1f} | {walls or '-'} | "
            f"{agg or '-'} | {used or '-'} | {c.get('load-mean', '-')} | {c['status']} |"
        )
    sizes = {c["size"] for c in cells}  # the synthetic presets these cells ran
    for f in data.get("fits", []):
        sim, tree = f["sim-peak-gb"], f["tree-peak-gb"]
        if f["size"] in sizes and sim and tree:
            lines.append(f"\nslope ({f['strategy']}, {sim['points']} points): "
                         f"{sim['slope-model-copies']:.3f} model copies per worker in the "
                         f"simulation process (R^2 {sim['r2']:.3f}), "
                         f"{tree['slope-model-copies']:.3f} for the tree (R^2 {tree['r2']:.3f})")  # fmt: skip
    return "\n".join(lines)
