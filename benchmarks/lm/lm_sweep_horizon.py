"""The horizon study of ``benchmarks/lm/lm_sweep.py --protocol horizon``: its grids, how a cell's
outer and inner lrs are chosen from the tuning records, and the run order.

Question: do IsoLoCo's gains over DiLoCo, FedAvg and a tuned synchronous AdamW survive a longer
budget? Total inner steps ``T`` in :data:`lm_sweep_lib.HORIZONS` (H = 10, so T / 10 outer
steps), M in {1, 8, 32}, the combined corpus :data:`lm_sweep_lib.HORIZON_CORPORA`.

Tuning, all at M = 8 and seed 0, chosen on the validation split:

- **outer lr** (and momentum) at *every* T (``--tune``): :data:`GRIDS`, five lrs a factor sqrt(2)
  apart centred on the ``main`` protocol's M = 8 optimum at its momentum (0.8 won there for both
  momentum methods), then one probe at momentum :data:`MOMENTUM_PROBE` at the best lr, and the grid
  grows by sqrt(2) while the optimum is on its edge (``lm_sweep.extension``). The grid runs at the
  method's current inner lr (below), so it is rerun when that changes. Beyond ``T =``
  :data:`INNER_TUNE_HORIZON` (the longest horizon, whose runs cost the most) the grid is narrower
  (:func:`initial_grid`): three lrs, the optimum of the next shorter T and one step either side,
  extended the same way, so the optimum is still inside it; and the momentum probe is left out where
  it lost at every shorter T (:func:`probe_lost_before`).
- **inner lr** of the workers, once per method at ``T =`` :data:`INNER_TUNE_HORIZON`
  (``--tune-inner``): :data:`INNER_GRID` at the method's outer optimum found with the default
  inner lr, extended by a factor 2 while the optimum is on its edge. Used at every T.
- **dp-adamw** has no outer step: its peak lr is tuned at every T on :data:`GRIDS` (the
  factor-2 grid of ``benchmarks/lm/lm_inner_lr.py``).
- **fedavg** keeps its outer (1, 0); only its inner lr is tuned.
"""

from __future__ import annotations

import math
from typing import Any

import lm_sweep_lib as lib

TUNE_WORKERS = 8
INNER_TUNE_HORIZON = 600
QUICK_INNER_TUNE_HORIZON = 4  # --quick: H = 2, so 2 rounds
DEFAULT_INNER_LR = 3e-3  # the main protocol's inner lr (SIZES["main"])
INNER_GRID = (1.5e-3, 3e-3, 6e-3)
INNER_RATIO = 2.0
OUTER_RATIO = math.sqrt(2.0)
MOMENTUM_PROBE = 0.9
MAX_EXTENSIONS = 4
# method -> (initial lrs, momentum); dp-adamw: peak lrs (momentum None)
GRIDS: dict[str, tuple[list[float], float | None]] = {
    "diloco": ([0.125, 0.177, 0.25, 0.354, 0.5], 0.8),
    "isoloco": ([0.9, 1.27, 1.8, 2.55, 3.6], 0.8),
    "iso_c-sgd": ([2.8, 3.96, 5.6, 7.92, 11.2], 0.0),
    "dp-adamw": ([7.5e-4, 1.5e-3, 3e-3, 6e-3], None),
}
CENTRES = {"diloco": 0.25, "isoloco": 1.8, "iso_c-sgd": 5.6, "dp-adamw": 1.5e-3}  # main's optima
METHODS = ("fedavg", "diloco", "isoloco", "iso_c-sgd", "dp-adamw")
SEEDS = {1: (0, 1), 8: (0, 1, 2), 32: (0, 1)}  # 2 seeds per cell, 3 at M = 8


def _r3(x: float) -> float:
    return float(f"{x:.3g}")


def centre_out(method: str) -> list[float]:
    """The initial grid of ``method``, its centre (the ``main`` optimum) first, then outwards:
    with ``--grid-points 1`` every method runs at the old optimum first (a first comparison)."""
    c = CENTRES[method]
    return sorted(GRIDS[method][0], key=lambda x: (abs(math.log(x / c)), x))


def _ratio(method: str) -> float:
    return INNER_RATIO if method == "dp-adamw" else OUTER_RATIO


def _shorter(tuning: list[dict[str, Any]], method: str, horizon: int, quick: bool) -> list[int]:
    """Horizons shorter than ``horizon`` with :func:`grid_records` of ``method``, longest first."""
    ts = {r["horizon"] for r in tuning if r["method"] == method and r.get("horizon") is not None}
    return sorted(
        (t for t in ts if t < horizon and grid_records(tuning, method, t, quick)), reverse=True
    )


def initial_grid(
    tuning: list[dict[str, Any]], method: str, horizon: int, lr_in: float, quick: bool
) -> list[float]:
    """The first lrs to run at ``T = horizon``, centre first: :func:`centre_out` up to
    ``T =`` :data:`INNER_TUNE_HORIZON`; beyond it, the optimum c of the next shorter T (at
    ``lr_in``) and c / r, c * r (r = sqrt(2); dp-adamw: 2 on its peak lr)."""
    prev = _shorter(tuning, method, horizon, quick) if horizon > inner_horizon(quick) else []
    if not prev:
        return centre_out(method)
    if method == "dp-adamw":
        best = _best(grid_records(tuning, method, prev[0], quick))
        c = _inner(best)  # prev[0] has grid records, so best is not None
    else:
        best = outer_optimum(tuning, method, prev[0], lr_in, quick)
        c = None if best is None else best["outer_lr"]
    if c is None:  # no grid at ``lr_in`` there yet
        return centre_out(method)
    r = _ratio(method)
    return [c, _r3(c / r), _r3(c * r)]


def probe_lost_before(
    tuning: list[dict[str, Any]], method: str, horizon: int, lr_in: float, quick: bool
) -> bool:
    """True when ``T = horizon`` is beyond :data:`INNER_TUNE_HORIZON` and at every shorter T
    (at least one) the momentum probe at ``lr_in`` lost to that grid's best at the grid's
    momentum; a shorter T without a probe makes this False."""
    if horizon <= inner_horizon(quick):
        return False
    shorter = _shorter(tuning, method, horizon, quick)
    for t in shorter:
        recs = [r for r in grid_records(tuning, method, t, quick) if _inner(r) == lr_in]
        probe = [r for r in recs if r["outer_momentum"] == MOMENTUM_PROBE]
        base = _best([r for r in recs if r["outer_momentum"] != MOMENTUM_PROBE])
        if not probe or base is None or _best(probe)["val_loss"] <= base["val_loss"]:
            return False
    return bool(shorter)


def _inner(rec: dict[str, Any]) -> float:
    return rec.get("inner_lr", (rec.get("size") or {}).get("inner_lr"))


def grid_records(
    tuning: list[dict[str, Any]], method: str, horizon: int, quick: bool
) -> list[dict[str, Any]]:
    """Finite seed-0 M = 8 horizon records of ``method`` at ``T = horizon``."""
    return [
        r
        for r in tuning
        if r["method"] == method
        and r["protocol"] == "horizon"
        and r["workers"] == TUNE_WORKERS
        and r.get("seed") == 0
        and r["quick"] == quick
        and r.get("horizon") == horizon
        and math.isfinite(r.get("val_loss", math.nan))
    ]


def _best(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Lowest validation loss; ties: lower outer lr, lower momentum, lower inner lr."""

    def key(r: dict[str, Any]) -> tuple:
        return (r["val_loss"], r["outer_lr"] or 0, r["outer_momentum"] or 0, _inner(r))

    return min(recs, key=key) if recs else None


def edge(values: list[float], best: float) -> str | None:
    """``"low"``/``"high"`` if ``best`` is the smallest/largest of ``values`` (more than one)."""
    vals = sorted(set(values))
    if len(vals) < 2:
        return None
    return "low" if best == vals[0] else "high" if best == vals[-1] else None


def outer_optimum(
    tuning: list[dict[str, Any]], method: str, horizon: int, inner_lr: float, quick: bool
) -> dict[str, Any] | None:
    """Best outer point at ``T = horizon`` among the records run at ``inner_lr``."""
    recs = [r for r in grid_records(tuning, method, horizon, quick) if _inner(r) == inner_lr]
    return _best(recs)


def inner_horizon(quick: bool) -> int:
    """T at which the inner lr is tuned (:data:`INNER_TUNE_HORIZON`; tiny with ``--quick``)."""
    return QUICK_INNER_TUNE_HORIZON if quick else INNER_TUNE_HORIZON


def anchor(tuning: list[dict[str, Any]], method: str, quick: bool) -> tuple[float, float] | None:
    """Outer (lr, mu) at which the inner lr is tuned: FedAvg's fixed point, else the outer
    optimum at ``T =`` :data:`INNER_TUNE_HORIZON` with the default inner lr."""
    if method in lib.FIXED_HP:
        return lib.FIXED_HP[method]
    best = outer_optimum(tuning, method, inner_horizon(quick), DEFAULT_INNER_LR, quick)
    return None if best is None else (best["outer_lr"], best["outer_momentum"])


def inner_records(tuning: list[dict[str, Any]], method: str, quick: bool) -> list[dict]:
    """The inner-lr grid: records at the :func:`anchor` point, T = :func:`inner_horizon`."""
    point = anchor(tuning, method, quick)
    recs = grid_records(tuning, method, inner_horizon(quick), quick)
    return [r for r in recs if point and (r["outer_lr"], r["outer_momentum"]) == point]


def inner_lr(
    tuning: list[dict[str, Any]], method: str, horizon: int, quick: bool
) -> tuple[float, str, str | None]:
    """(inner lr, source, edge) of ``method``: dp-adamw its own optimum at ``horizon``; the
    others the inner-grid optimum once it has two or more lrs, else the default."""
    if method == "dp-adamw":
        best = _best(grid_records(tuning, method, horizon, quick))
        if best is None:
            return DEFAULT_INNER_LR, "default", None
        lrs = [_inner(r) for r in grid_records(tuning, method, horizon, quick)]
        src = f"tuned-T{horizon}-M8" if len(set(lrs)) > 1 else f"grid-centre-T{horizon}"
        return _inner(best), src, edge(lrs, _inner(best))
    recs = inner_records(tuning, method, quick)
    lrs = [_inner(r) for r in recs]
    if len(set(lrs)) < 2:
        return DEFAULT_INNER_LR, "default", None
    best = _best(recs)
    return _inner(best), f"tuned-T{inner_horizon(quick)}-M8", edge(lrs, _inner(best))


def cell_hp(tuning: list[dict[str, Any]], method: str, horizon: int, quick: bool) -> dict[str, Any]:
    """Outer (lr, mu) and inner lr of a horizon cell, with where each came from."""
    lr_in, src_in, edge_in = inner_lr(tuning, method, horizon, quick)
    hp = {"inner_lr": lr_in, "inner_lr_source": src_in, "inner_lr_on_edge": edge_in}
    if method == "dp-adamw":
        return {**hp, "outer_lr": None, "outer_momentum": None, "tuned": None, "hp_source": "n/a"}
    if method in lib.FIXED_HP:
        lr, mu = lib.FIXED_HP[method]
        return {**hp, "outer_lr": lr, "outer_momentum": mu, "tuned": None, "hp_source": "fixed"}
    best = outer_optimum(tuning, method, horizon, lr_in, quick)
    if best is None:
        lr, mu = lib.METHODS[method][2]
        return {**hp, "outer_lr": lr, "outer_momentum": mu, "tuned": False, "hp_source": "default"}
    recs = grid_records(tuning, method, horizon, quick)
    lrs = [
        r["outer_lr"]
        for r in recs
        if _inner(r) == lr_in and r["outer_momentum"] == best["outer_momentum"]
    ]
    grid = len(set(lrs)) > 1  # a single point (--grid-points 1) is not a tuned value
    return {
        **hp,
        "outer_lr": best["outer_lr"],
        "outer_momentum": best["outer_momentum"],
        "tuned": grid,
        "hp_source": f"tuned-T{horizon}-M8" if grid else f"grid-centre-T{horizon}",
        "tuned_on_edge": edge(lrs, best["outer_lr"]),
    }


def next_outer_point(recs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """One sqrt(2) step beyond the edge when the optimum is on it (per its momentum), else None."""
    best = _best(recs)
    if best is None:
        return None
    lrs = sorted({r["outer_lr"] for r in recs if r["outer_momentum"] == best["outer_momentum"]})
    side = "low" if best["outer_lr"] == lrs[0] else "high" if best["outer_lr"] == lrs[-1] else None
    if side is None:
        return None
    new = _r3(lrs[0] / OUTER_RATIO) if side == "low" else _r3(lrs[-1] * OUTER_RATIO)
    return new, best["outer_momentum"]


def next_inner_lr(lrs: list[float], best: float, ratio: float = INNER_RATIO) -> float | None:
    """One ``ratio`` step beyond the edge of ``lrs`` when ``best`` is on it, else None."""
    side = edge(lrs, best)
    if side is None:
        return None
    return _r3(min(lrs) / ratio) if side == "low" else _r3(max(lrs) * ratio)


# ----------------------------------------------------------------------------- running
def _grid_hp(outer_lr, mu, lr_in, source) -> dict[str, Any]:
    return {
        "outer_lr": outer_lr,
        "outer_momentum": mu,
        "inner_lr": lr_in,
        "tuned": None,
        "hp_source": source,
    }


def tune_outer(method: str, horizon: int, args, ensure_cell, load_records) -> None:
    """Outer grid (dp-adamw: peak-lr grid) at ``T = horizon``, M = 8, seed 0 (module doc)."""
    path, quick = args.tuning_file, args.quick

    def run(outer_lr, mu, lr_in, source):
        hp = _grid_hp(outer_lr, mu, lr_in, source)
        ensure_cell(method, TUNE_WORKERS, 0, hp, args, path, "horizon", horizon, grid=True)

    if method not in GRIDS:
        print(f"[lm_sweep] {method}: outer values fixed, nothing to tune at T = {horizon}")
        return
    tuning = load_records(path)
    lr_in = inner_lr(tuning, method, horizon, quick)[0]
    grid = initial_grid(tuning, method, horizon, lr_in, quick)
    points = grid[: args.grid_points]
    full = len(points) == len(grid)  # --grid-points N: only those, no extension
    if method == "dp-adamw":
        for lr in points:
            run(None, None, lr, "grid")
        for _ in range(MAX_EXTENSIONS if full else 0):
            lr_best, _, side = inner_lr(load_records(path), method, horizon, quick)
            recs = grid_records(load_records(path), method, horizon, quick)
            new = next_inner_lr([_inner(r) for r in recs], lr_best) if side else None
            if new is None:
                break
            run(None, None, new, "grid-extension")
        return
    mu = GRIDS[method][1]
    for lr in points:
        run(lr, mu, lr_in, "grid")
    probed = not mu or probe_lost_before(load_records(path), method, horizon, lr_in, quick)
    for _ in range(2 * MAX_EXTENSIONS + 1 if full else 0):
        recs = grid_records(load_records(path), method, horizon, quick)
        recs = [r for r in recs if _inner(r) == lr_in]
        point = next_outer_point(recs)
        if point is None and not probed:
            probed, best = True, _best(recs)
            point = (best["outer_lr"], MOMENTUM_PROBE)
        if point is None:
            break
        run(point[0], point[1], lr_in, "grid-extension")


def tune_inner(method: str, args, ensure_cell, load_records) -> None:
    """Inner-lr grid of ``method`` at its :func:`anchor` point (module doc)."""
    path, quick = args.tuning_file, args.quick
    horizon = inner_horizon(quick)
    if method == "dp-adamw":
        print("[lm_sweep] dp-adamw: its peak lr is tuned at every T by --tune")
        return
    point = anchor(load_records(path), method, quick)
    if point is None:
        raise SystemExit(f"tune {method}'s outer lr at T = {horizon} first (--tune)")
    for i, lr in enumerate([*INNER_GRID, *([None] * MAX_EXTENSIONS)]):
        if lr is None:
            recs = inner_records(load_records(path), method, quick)
            best = _best(recs)
            lr = next_inner_lr([_inner(r) for r in recs], _inner(best))
            if lr is None:
                break
        source = "inner-grid" if i < len(INNER_GRID) else "inner-grid-extension"
        hp = _grid_hp(point[0], point[1], lr, source)
        ensure_cell(method, TUNE_WORKERS, 0, hp, args, path, "horizon", horizon, grid=True)


def main(args, ensure_cell, load_records) -> None:
    """``lm_sweep.py --protocol horizon``: tune (``--tune`` / ``--tune-inner``) or run cells."""
    if args.tune:
        for horizon in args.horizon:
            for method in args.methods:
                tune_outer(method, horizon, args, ensure_cell, load_records)
    if args.tune_inner:
        for method in args.methods:
            tune_inner(method, args, ensure_cell, load_records)
    if args.tune or args.tune_inner:
        return
    failed = []
    for horizon in args.horizon:
        for m in args.workers:
            for method in args.methods:
                for seed in args.seeds:
                    hp = cell_hp(load_records(args.tuning_file), method, horizon, args.quick)
                    if args.inner_lr is not None:
                        hp.update(inner_lr=args.inner_lr, inner_lr_source="cli")
                    if method not in ("dp-adamw", *lib.FIXED_HP):
                        if args.outer_lr is not None:
                            hp.update(outer_lr=args.outer_lr, tuned=False, hp_source="cli")
                        if args.outer_momentum is not None:
                            hp.update(outer_momentum=args.outer_momentum, hp_source="cli")
                    try:
                        ensure_cell(method, m, seed, hp, args, args.out, "horizon", horizon)
                    except Exception:  # one broken cell must not stop the sweep
                        import traceback

                        traceback.print_exc()
                        failed.append((horizon, method, m, seed))
    if failed:
        raise SystemExit(f"[lm_sweep] cells failed (not recorded; rerun to retry): {failed}")
