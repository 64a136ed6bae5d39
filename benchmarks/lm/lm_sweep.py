"""IsoLoCo vs DiLoCo and the merge rules from 1 to 128 workers: a resumable sweep.

Each cell (method, protocol, M, seed, outer lr, outer momentum, H, rounds) is one real Flower
simulation (Ray) of the project's DiLoCo strategy family and DiLoCo worker, except
``dp-adamw`` (synchronous data-parallel AdamW on the same tokens, an in-process loop without
Flower). Protocol and sizing: ``benchmarks/lm/lm_sweep_lib.py`` and docs/results-lm.md
("Sweep protocol"). Every finished run is appended at once to the JSON list ``--out``; a cell
already there is skipped, so an interrupted sweep continues where it stopped.

    python benchmarks/lm/lm_sweep.py --methods isoloco diloco --workers 4 16 --seeds 0 1 2 --out runs.json
    python benchmarks/lm/lm_sweep.py --tune --methods isoloco diloco          # grid at M = 8, seed 0
    python benchmarks/lm/lm_sweep.py --tune --methods isoloco --workers 64    # 3 lrs around the M = 8 optimum
    python benchmarks/lm/lm_sweep.py --quick ...                              # tiny, for the tests

Outer values: ``--outer-lr`` / ``--outer-momentum`` if given; else the tuned optimum from the
tuning file (the M = 64 optimum for M >= 32 when there is one, else the M = 8 one); else the
fallback of ``METHODS`` in the library, recorded as ``"tuned": false, "hp_source": "default"``.

Protocol ``horizon`` (``lm_sweep_horizon.py`` holds its tuning rules) writes to
``lm_horizon.json`` / ``lm_horizon_tuning.json`` unless ``--out`` / ``--tuning-file`` say::

    python benchmarks/lm/lm_sweep.py --protocol horizon --tune --horizon 200 600 --methods isoloco
    python benchmarks/lm/lm_sweep.py --protocol horizon --tune-inner --methods isoloco   # at T = 600
    python benchmarks/lm/lm_sweep.py --protocol horizon --horizon 600 --workers 1 8 32 --seeds 0 1
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import common  # noqa: E402
import lm_sweep_horizon as hz  # noqa: E402
import lm_sweep_lib as lib  # noqa: E402
from lm_sweep_records import (  # noqa: E402, F401  (re-exported: lm_inner_lr, rwlora_sweep, tests)
    KEY_FIELDS,
    append_record,
    cell_key,
    find_cell,
    find_twin,
    load_records,
    same_run_methods,
)

REPO = common.REPO
RESULTS = common.RESULTS / "lm_sweep.json"
TUNING = common.RESULTS / "lm_tuning.json"
HORIZON_RESULTS = common.RESULTS / "lm_horizon.json"
HORIZON_TUNING = common.RESULTS / "lm_horizon_tuning.json"
RATIO = math.sqrt(2.0)  # grid spacing, and the step of each automatic extension
MAX_EXTENSIONS = 4
TUNE_WORKERS = 8
# initial tuning grids: (outer lrs, momenta); diloco also gets (1, 0) = FedAvg
GRIDS: dict[str, tuple[list[float], list[float]]] = {
    "diloco": ([0.25, 0.35, 0.5, 0.7, 1.0], [0.8, 0.9]),
    "isoloco": ([0.9, 1.3, 1.8, 2.5, 3.5], [0.8, 0.9]),
    "diloco-sgd": ([0.7, 1.0, 1.4, 2.0], [0.0]),
    "iso_c-sgd": ([1.0, 1.4, 2.0, 2.8], [0.0]),
    "ties": ([0.7, 1.0, 1.4, 2.0], [0.0]),
    "dare": ([0.7, 1.0, 1.4, 2.0], [0.0]),
    "tsv_m": ([0.7, 1.0, 1.4, 2.0], [0.0]),
    "iso_cts": ([0.7, 1.0, 1.4, 2.0], [0.0]),
}
EXTRA_POINTS = {"diloco": [(1.0, 0.0)]}


def _round3(x: float) -> float:
    return float(f"{x:.3g}")


# ----------------------------------------------------------------------------- tuned values
def grid_records(
    tuning: list[dict[str, Any]], method: str, workers: int, quick: bool
) -> list[dict]:
    return [
        r
        for r in tuning
        if r["method"] == method
        and r["workers"] == workers
        and r["protocol"] == "main"
        and r["quick"] == quick
        and r.get("seed") == 0
        and math.isfinite(r.get("val_loss", math.nan))
    ]


def best_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Lowest validation loss (ties: lower lr, then lower momentum)."""
    if not records:
        return None
    return min(records, key=lambda r: (r["val_loss"], r["outer_lr"], r["outer_momentum"]))


def on_edge(records: list[dict[str, Any]], best: dict[str, Any]) -> str | None:
    """``"low"``/``"high"`` if the optimum's lr is the smallest/largest tried at its momentum."""
    lrs = sorted({r["outer_lr"] for r in records if r["outer_momentum"] == best["outer_momentum"]})
    if best["outer_lr"] == lrs[0]:
        return "low"
    if best["outer_lr"] == lrs[-1]:
        return "high"
    return None


def tuned_hp(
    method: str, workers: int, tuning: list[dict[str, Any]], quick: bool
) -> dict[str, Any]:
    """Outer (lr, momentum) for a cell and where they came from (see module docstring)."""
    if method == "dp-adamw":
        return {"outer_lr": None, "outer_momentum": None, "tuned": None, "hp_source": "n/a"}
    if method in lib.FIXED_HP:
        lr, mu = lib.FIXED_HP[method]
        return {"outer_lr": lr, "outer_momentum": mu, "tuned": None, "hp_source": "fixed"}
    for m in (64, TUNE_WORKERS) if workers >= 32 else (TUNE_WORKERS,):
        recs = grid_records(tuning, method, m, quick)
        best = best_of(recs)
        if best is not None:
            return {
                "outer_lr": best["outer_lr"],
                "outer_momentum": best["outer_momentum"],
                "tuned": True,
                "hp_source": f"tuned-M{m}",
                "tuned_on_edge": on_edge(recs, best),
            }
    lr, mu = lib.METHODS[method][2]
    return {"outer_lr": lr, "outer_momentum": mu, "tuned": False, "hp_source": "default"}


# ----------------------------------------------------------------------------- one cell
def cell_size(protocol: str, workers: int, hp: dict[str, Any], args, horizon=None) -> dict:
    """The cell's sizing; ``horizon`` cells take T and the hp's ``inner_lr``."""
    if protocol != "horizon":
        return lib.protocol_size(protocol, workers, args.quick, args.inner_steps)
    return lib.protocol_size(protocol, workers, args.quick, None, horizon, hp.get("inner_lr"))


def run_cell(
    method: str, workers: int, seed: int, hp: dict[str, Any], args, protocol: str, size: dict
) -> dict:
    load0 = os.getloadavg()
    t0 = time.time()
    if method == "dp-adamw":
        out = lib.run_dp_adamw(workers, seed, size)
    else:
        out = lib.run_flower(
            method,
            workers,
            seed,
            hp["outer_lr"],
            hp["outer_momentum"],
            size,
            protocol=protocol,
            ray_address=args.ray_address,
            num_cpus=args.num_cpus,
            model_cache=not args.no_model_cache,
        )
    merge_rule, momentum, _ = lib.METHODS[method]
    return {
        "method": method,
        "protocol": protocol,
        "workers": workers,
        "seed": seed,
        "outer_lr": hp["outer_lr"],
        "outer_momentum": hp["outer_momentum"],
        "nesterov": bool(momentum or (hp["outer_momentum"] or 0) > 0),
        "merge": merge_rule,
        "inner_steps": size["inner_steps"],
        "rounds": size["rounds"],
        "horizon": size["rounds"] * size["inner_steps"],
        "inner_lr": size["inner_lr"],
        "global_batch": size["global_batch"],
        "seq_len": size["seq_len"],
        "tokens": lib.num_rows(size) * size["seq_len"],
        "val_loss": out["val_loss"],
        "test_loss": out["test_loss"],
        "wall_s": out["wall_s"],
        "val_curve": out["val_curve"],
        "round_s": out.get("round_s"),
        **{k: v for k, v in hp.items() if k not in ("outer_lr", "outer_momentum")},
        "quick": bool(args.quick),
        "flower": method != "dp-adamw",
        "ray_address": args.ray_address,
        "model_cache": not args.no_model_cache,
        "size": size,
        "model_params": sum(p.numel() for p in lib.build_model(size, 0).parameters()),
        **{
            k: out[k]
            for k in (
                "data_key",
                "corpora",
                "train_rows",
                "train_tokens",
                "val_tokens",
                "test_tokens",
            )
        },
        "load_avg_start": load0[0],
        "load_avg_end": os.getloadavg()[0],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "cpu_count": os.cpu_count(),
        "sweep_version": lib.SWEEP_VERSION,
    }


def ensure_cell(
    method, workers, seed, hp, args, path: Path, protocol="main", horizon=None, **extra
) -> dict:
    """Run the cell unless it is in ``path`` (then return that record); append it at once."""
    size = cell_size(protocol, workers, hp, args, horizon)
    key = (
        method,
        protocol,
        workers,
        seed,
        hp["outer_lr"],
        hp["outer_momentum"],
        size["inner_steps"],
        size["rounds"],
        bool(args.quick),
        size["inner_lr"],
        tuple(size.get("corpora") or lib.DATA["corpora"]),
    )
    done = find_cell(load_records(path), key)
    if done is not None:
        print(f"[lm_sweep] skip (done): {dict(zip(KEY_FIELDS, key, strict=False))}", flush=True)
        return done
    twin = find_twin(key, [args.tuning_file, args.out])
    if twin is not None:  # the same computation already ran (e.g. a grid point): reuse it
        rec = {
            **{k: v for k, v in twin.items() if k not in ("grid", "note", "copied_from")},
            "method": method,
            "protocol": protocol,
            **extra,
            "copied_from": {k: twin.get(k) for k in ("method", "hp_source", "started_utc")},
        }
        rec.update({k: v for k, v in hp.items() if k not in ("outer_lr", "outer_momentum")})
        rec.update(horizon=size["rounds"] * size["inner_steps"], inner_lr=size["inner_lr"])
        append_record(path, rec)
        print(
            f"[lm_sweep] {method} M={workers} seed={seed}: reused the identical run "
            f"{rec['copied_from']}",
            flush=True,
        )
        return rec
    rec = {**run_cell(method, workers, seed, hp, args, protocol, size), **extra}
    append_record(path, rec)
    print(
        f"[lm_sweep] {method} {protocol} T={rec['horizon']} M={workers} seed={seed} "
        f"lr={hp['outer_lr']} mu={hp['outer_momentum']} inner={rec['inner_lr']}: val {rec['val_loss']:.4f} test {rec['test_loss']:.4f} "
        f"({rec['wall_s']:.1f} s)",
        flush=True,
    )
    return rec


# ----------------------------------------------------------------------------- tuning
def initial_grid(method: str, workers: int, tuning: list[dict], quick: bool) -> list[tuple]:
    """The grid's first points: :data:`GRIDS` at M = 8; at other M, 3 lrs (optimum x {1/r, 1, r})
    around the M = 8 optimum, at its momentum."""
    if workers == TUNE_WORKERS:
        lrs, mus = GRIDS[method]
        return [(lr, mu) for mu in mus for lr in lrs] + EXTRA_POINTS.get(method, [])
    best = best_of(grid_records(tuning, method, TUNE_WORKERS, quick))
    if best is None:
        raise SystemExit(f"tune {method} at M = {TUNE_WORKERS} first (no grid records yet)")
    lr, mu = best["outer_lr"], best["outer_momentum"]
    return [(_round3(lr / RATIO), mu), (lr, mu), (_round3(lr * RATIO), mu)]


def extension(records: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Next grid point if the optimum lies on the grid's edge (one step of RATIO out), else None."""
    best = best_of(records)
    if best is None:
        return None
    edge = on_edge(records, best)
    if edge is None:
        return None
    lrs = sorted({r["outer_lr"] for r in records if r["outer_momentum"] == best["outer_momentum"]})
    new = _round3(lrs[0] / RATIO) if edge == "low" else _round3(lrs[-1] * RATIO)
    return new, best["outer_momentum"]


def tune(method: str, workers: int, args) -> None:
    path = args.tuning_file
    for lr, mu in initial_grid(method, workers, load_records(path), args.quick):
        ensure_cell(
            method,
            workers,
            0,
            {"outer_lr": lr, "outer_momentum": mu, "tuned": None, "hp_source": "grid"},
            args,
            path,
            grid=True,
        )
    for _ in range(MAX_EXTENSIONS):
        point = extension(grid_records(load_records(path), method, workers, args.quick))
        if point is None:
            break
        print(f"[lm_sweep] {method} M={workers}: optimum on the grid's edge, adding lr {point[0]}")
        ensure_cell(
            method,
            workers,
            0,
            {
                "outer_lr": point[0],
                "outer_momentum": point[1],
                "tuned": None,
                "hp_source": "grid-extension",
            },
            args,
            path,
            grid=True,
        )
    best = best_of(grid_records(load_records(path), method, workers, args.quick))
    print(
        f"[lm_sweep] {method} M={workers} optimum: lr {best['outer_lr']} "
        f"mu {best['outer_momentum']} val {best['val_loss']:.4f}",
        flush=True,
    )


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--methods", nargs="+", default=["isoloco", "diloco"], choices=list(lib.METHODS)
    )
    ap.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=None,
        help="M values (default: 8 with --tune, else 1 8 32 128)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="default: lm_sweep.json (horizon: lm_horizon.json)"
    )
    ap.add_argument(
        "--tuning-file",
        type=Path,
        default=None,
        help="default: lm_tuning.json (horizon: lm_horizon_tuning.json)",
    )
    ap.add_argument("--outer-lr", type=float, default=None)
    ap.add_argument("--outer-momentum", type=float, default=None)
    ap.add_argument("--protocol", default="main", choices=lib.PROTOCOLS)
    ap.add_argument(
        "--inner-steps", type=int, default=None, help="H (only with --protocol h-sweep)"
    )
    ap.add_argument(
        "--horizon",
        nargs="+",
        type=int,
        default=None,
        help="total inner steps T (only with --protocol horizon)",
    )
    ap.add_argument(
        "--inner-lr", type=float, default=None, help="inner lr (horizon only; default: tuned)"
    )
    ap.add_argument("--tune", action="store_true", help="run the tuning grid (seed 0)")
    ap.add_argument(
        "--grid-points",
        type=int,
        default=None,
        help="horizon --tune: only the first N points of each grid (centre first), no extension",
    )
    ap.add_argument(
        "--tune-inner",
        action="store_true",
        help=f"horizon: tune the inner lr at T = {hz.INNER_TUNE_HORIZON} (M = 8, seed 0; "
        "after --tune there)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizing (tests)")
    ap.add_argument(
        "--ray-address", default=None, help="existing Ray cluster (e.g. auto, host:6379)"
    )
    ap.add_argument("--num-cpus", type=int, default=None, help="local Ray CPUs (default: all)")
    ap.add_argument(
        "--no-model-cache",
        action="store_true",
        help="build the model anew for every message (for the overhead measurement)",
    )
    return ap


def parse_args(argv=None):
    """The CLI's arguments with the protocol's defaults filled in; every (M, T) sizing checked
    (:func:`lm_sweep_lib.protocol_size`) before any cell runs."""
    args = _parser().parse_args(argv)
    horizon = args.protocol == "horizon"
    if args.out is None:
        args.out = HORIZON_RESULTS if horizon else RESULTS
    if args.tuning_file is None:
        args.tuning_file = HORIZON_TUNING if horizon else TUNING
    tuning = args.tune or args.tune_inner
    if args.workers is None:
        args.workers = [TUNE_WORKERS] if tuning else ([1, 8, 32] if horizon else [1, 8, 32, 128])
    if args.tune and args.protocol not in ("main", "horizon"):
        raise SystemExit("--tune runs on the main or the horizon protocol")
    if args.tune_inner and not horizon:
        raise SystemExit("--tune-inner is for --protocol horizon")
    if horizon and args.horizon is None:
        args.horizon = [hz.inner_horizon(args.quick)] if args.tune_inner else list(lib.HORIZONS)
    if tuning and horizon and args.workers != [TUNE_WORKERS]:
        raise SystemExit(f"the horizon protocol tunes at M = {TUNE_WORKERS} only")
    for m in args.workers:
        for t in args.horizon or [None]:
            try:
                if horizon:
                    lib.protocol_size(args.protocol, m, args.quick, None, t, args.inner_lr)
                else:
                    lib.protocol_size(
                        args.protocol, m, args.quick, args.inner_steps, t, args.inner_lr
                    )
            except ValueError as exc:
                raise SystemExit(f"M = {m}: {exc}") from None
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.protocol == "horizon":
        hz.main(args, ensure_cell, load_records)
        return
    if args.tune:
        for method in args.methods:
            if method not in GRIDS:
                print(f"[lm_sweep] {method} has nothing to tune; skipped", flush=True)
                continue
            for m in args.workers:
                tune(method, m, args)
        return
    failed = []
    for m in args.workers:  # M-major: a comparison of the methods at each M comes early
        for method in args.methods:
            for seed in args.seeds:
                hp = tuned_hp(method, m, load_records(args.tuning_file), args.quick)
                if method not in ("dp-adamw", *lib.FIXED_HP):
                    if args.outer_lr is not None:
                        hp.update(outer_lr=args.outer_lr, tuned=False, hp_source="cli")
                    if args.outer_momentum is not None:
                        hp.update(outer_momentum=args.outer_momentum, tuned=False, hp_source="cli")
                try:
                    ensure_cell(method, m, seed, hp, args, args.out, protocol=args.protocol)
                except Exception:  # one broken cell must not stop the sweep; nothing recorded
                    traceback.print_exc()
                    failed.append((method, m, seed))
    if failed:
        raise SystemExit(f"[lm_sweep] cells failed (not recorded; rerun to retry): {failed}")


if __name__ == "__main__":
    main()
