"""Merge-rule benchmark on LLaMA-shaped pseudo-gradients (CPU).

Three parts, each printed as a table and written to ``benchmarks/results/merge_bench.json``:

1. ``ns``: Iso-C fast mode (``iso_c_ns``) against exact Iso-C (SVD) on every distinct 2-D shape
   of a LLaMA-style model (hidden 1024, 4 layers, vocab 8192), for two kinds of
   pseudo-gradient-like input (Adam steps on least squares; low rank plus noise): relative
   Frobenius error, Newton-Schulz steps taken, time (median of repeats, SVD and NS interleaved),
   and the whole model's 2-D time (sum over its matrices) as a ratio ns / svd.
2. ``rules``: every rule on a full LLaMA-shaped model for M in {2, 8, 32} workers: time (median of
   repeats), peak extra memory, ratio to plain averaging in the same run, and for iso_c_ns its
   relative error against iso_c on each matrix.
3. ``streaming``: peak extra memory of StreamingMerger (mean, iso_c) folding M = 2 and M = 32
   deltas one at a time; it must not grow with M.

Memory is the peak resident set size above the level just before the call: Linux ``VmHWM`` after
resetting it through ``/proc/self/clear_refs``, with glibc told to ``mmap`` every allocation of
64 KiB or more (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the RSS at once and the next
case starts from a true baseline. It counts every allocation (torch, LAPACK workspaces), not
only live tensors. Inputs that exist before the call are not counted.

Usage: ``python benchmarks/merging/merge_bench.py [--quick] [--threads 2] [--out PATH]``.
The default run takes about 3-4 minutes on 2 idle cores; ``--quick`` about 40 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

MMAP_THRESHOLD = "65536"

if __name__ == "__main__" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
    # glibc reads this at start-up only: re-exec so freed tensors go back to the OS at once.
    # Passive OpenMP waits: on a shared, oversubscribed machine spinning threads make every
    # small op 10x slower and would distort the comparison.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import torch  # noqa: E402

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, iso_c, merge  # noqa: E402
from flwr_isoloco.merging.polar import _newton_schulz  # noqa: E402
from flwr_isoloco.testing.synthetic import (  # noqa: E402
    adam_pseudo_gradient,
    llama_delta,
    llama_shapes,
    low_rank_plus_noise,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

RESULTS = common.RESULTS / "merge_bench.json"
MIB = common.MIB


# ---- measurement helpers ----------------------------------------------------------------


class PeakMemory:
    """Peak RSS (MiB) above the RSS at entry; ``None`` where /proc is not available."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.base = common.status_mib("VmRSS")
        except OSError:
            self.base = None
        self.extra_mib = None
        return self

    def __exit__(self, *exc) -> None:
        peak = common.status_mib("VmHWM")
        if self.base is not None and peak is not None:
            self.extra_mib = max(0.0, peak - self.base)


def _timed(fn):
    """(result, seconds). With one thread the seconds are this process's CPU time, which other
    jobs on a shared machine do not inflate; with more threads, wall-clock time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    out = fn()
    return out, clock() - start


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


# ---- part 1: Newton-Schulz accuracy and speed per matrix -------------------------------


def bench_ns(hidden: int, layers: int, vocab: int, repeats: int) -> dict:
    shapes = llama_shapes(hidden, layers, vocab)
    counts: dict[tuple[int, int], int] = {}
    for shape in shapes.values():
        if len(shape) == 2:
            key = (max(shape), min(shape))  # NS and SVD cost the same for a matrix and its T
            counts[key] = counts.get(key, 0) + 1
    rows = []
    makers = {"adam": adam_pseudo_gradient, "lowrank": low_rank_plus_noise}
    for kind, make in makers.items():
        for (m, n), count in counts.items():
            g = make(m, n, seed=1)
            s = torch.linalg.svdvals(g)
            exact = iso_c(g)
            svd_t, ns_t = [], []
            for _ in range(repeats):
                _, t = _timed(lambda g=g: iso_c(g))
                svd_t.append(t)
                fast, t = _timed(lambda g=g: iso_c(g, method="newton_schulz"))
                ns_t.append(t)
            _, steps = _newton_schulz(g, None, **_ns_defaults())
            row = {
                "kind": kind,
                "shape": [m, n],
                "count_in_model": count,
                "smin_over_smax": float(s[-1] / s[0]),
                "ns_steps": steps,
                "rel_error": _rel(fast, exact),
                "svd_s": statistics.median(svd_t),
                "ns_s": statistics.median(ns_t),
            }
            row["ratio_ns_svd"] = row["ns_s"] / row["svd_s"]
            rows.append(row)
            print(
                f"  {kind:8s} {m:5d}x{n:<5d} x{count:<3d} smin/smax {row['smin_over_smax']:.1e}"
                f"  steps {steps:2d}  err {row['rel_error']:.2e}  svd {row['svd_s']:6.2f}s"
                f"  ns {row['ns_s']:6.2f}s  ratio {row['ratio_ns_svd']:.2f}",
                flush=True,
            )
    model = {}
    for kind in makers:
        svd_total = sum(r["svd_s"] * r["count_in_model"] for r in rows if r["kind"] == kind)
        ns_total = sum(r["ns_s"] * r["count_in_model"] for r in rows if r["kind"] == kind)
        model[kind] = {"svd_s": svd_total, "ns_s": ns_total, "ratio_ns_svd": ns_total / svd_total}
        print(
            f"  model ({kind}): all 2-D matrices svd {svd_total:.1f}s ns {ns_total:.1f}s"
            f" ratio {ns_total / svd_total:.2f}"
        )
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "repeats": repeats,
        "worst_rel_error": max(r["rel_error"] for r in rows),
        "matrices": rows,
        "model": model,
    }


def _ns_defaults() -> dict:
    opts = MERGE_RULES["iso_c_ns"].options
    return {"lower": opts["ns_lower"], "tol": opts["ns_tol"], "max_steps": opts["ns_max_steps"]}


# ---- part 2: every rule, M workers -------------------------------------------------------


def bench_rules(hidden: int, layers: int, vocab: int, workers: list[int], repeats: int) -> dict:
    shapes = llama_shapes(hidden, layers, vocab)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    model_mib = params * 4 / MIB
    print(
        f"  model: hidden {hidden}, {layers} layers, vocab {vocab}: {params / 1e6:.1f}M params,"
        f" {model_mib:.0f} MiB fp32"
    )
    # warm-up: one-time library initialisation must not count as a rule's memory
    tiny = [llama_delta(llama_shapes(16, 1, 64), i) for i in range(2)]
    for rule in MERGE_RULES:
        merge(rule, tiny)
    cases = []
    for num in workers:
        deltas = [llama_delta(shapes, i) for i in range(num)]
        outputs = {}
        for rule in MERGE_RULES:
            times, peak = [], 0.0
            for _ in range(repeats):
                with PeakMemory() as mem:
                    out, t = _timed(lambda rule=rule, deltas=deltas: merge(rule, deltas))
                times.append(t)
                peak = max(peak, mem.extra_mib or 0.0)
                if t > 5.0:  # slow case: one run is enough
                    break
            if rule in ("iso_c", "iso_c_ns"):
                outputs[rule] = out
            del out
            cases.append(
                {
                    "rule": rule,
                    "workers": num,
                    "time_s": statistics.median(times),
                    "repeats": len(times),
                    "peak_extra_mib": peak,
                    "peak_extra_over_model": peak / model_mib,
                }
            )
        base = next(c for c in cases if c["rule"] == "mean" and c["workers"] == num)
        errs = {
            k: _rel(outputs["iso_c_ns"][k], outputs["iso_c"][k])
            for k, s in shapes.items()
            if len(s) == 2
        }
        for c in cases:
            if c["workers"] == num:
                c["time_over_mean"] = c["time_s"] / base["time_s"]
                if c["rule"] == "iso_c_ns":
                    c["rel_error_vs_iso_c"] = errs
                    c["worst_rel_error_vs_iso_c"] = max(errs.values())
        del deltas, outputs
    print(
        f"  {'rule':9s} {'M':>3s} {'time s':>8s} {'x mean':>7s} {'peak MiB':>9s}"
        f" {'x model':>8s}  note"
    )
    for c in cases:
        note = ""
        if "worst_rel_error_vs_iso_c" in c:
            note = f"worst matrix err vs iso_c {c['worst_rel_error_vs_iso_c']:.2e}"
        print(
            f"  {c['rule']:9s} {c['workers']:3d} {c['time_s']:8.3f} {c['time_over_mean']:7.1f}"
            f" {c['peak_extra_mib']:9.1f} {c['peak_extra_over_model']:8.2f}  {note}"
        )
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "params": params,
        "model_mib_fp32": model_mib,
        "cases": cases,
    }


# ---- part 3: streaming memory ------------------------------------------------------------


def bench_streaming(hidden: int, layers: int, vocab: int, workers: list[int]) -> dict:
    shapes = llama_shapes(hidden, layers, vocab)
    model_mib = sum(torch.Size(s).numel() for s in shapes.values()) * 4 / MIB
    rows = []
    for rule in ("mean", "iso_c"):
        for num in workers:
            with PeakMemory() as mem:
                merger = StreamingMerger(rule)
                start = time.perf_counter()
                for i in range(num):
                    merger.add(llama_delta(shapes, i))
                result = merger.result()
                elapsed = time.perf_counter() - start
            del merger, result
            rows.append(
                {
                    "rule": rule,
                    "workers": num,
                    "peak_extra_mib": mem.extra_mib,
                    "peak_extra_over_model": (mem.extra_mib or 0.0) / model_mib,
                    "time_s_incl_generation": elapsed,
                }
            )
            print(
                f"  streaming {rule:6s} M={num:3d}: peak extra {mem.extra_mib:8.1f} MiB"
                f" = {rows[-1]['peak_extra_over_model']:.2f} x model ({model_mib:.0f} MiB)",
                flush=True,
            )
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "model_mib_fp32": model_mib,
        "note": "peak includes the one delta being generated and the fp32 result",
        "cases": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    parser.add_argument(
        "--parts",
        default="ns,rules,streaming",
        help="comma-separated subset of ns,rules,streaming; other parts already in --out are kept",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"ns", "rules", "streaming"}:
        parser.error(f"unknown part in --parts {args.parts!r}")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        cfg = {"ns": (512, 4, 8192, 1), "rules": (128, 4, 8192, [2, 8], 1), "stream": (128, 4)}
    else:
        cfg = {"ns": (1024, 4, 8192, 3), "rules": (256, 4, 8192, [2, 8, 32], 3), "stream": (256, 4)}
    started = time.perf_counter()
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.update(
        {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "time_method": "median of repeats; process CPU time when threads == 1 (immune to "
            "other jobs on a shared machine), wall-clock time otherwise",
            "memory_method": "peak RSS above the RSS before the call (VmHWM reset via "
            "/proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536)",
        }
    )
    if "ns" in parts:
        h, layers, vocab, reps = cfg["ns"]
        print(f"[1] iso_c_ns vs iso_c per matrix (hidden {h}, {layers} layers, vocab {vocab})")
        report["ns"] = bench_ns(h, layers, vocab, reps)
    if "rules" in parts:
        h, layers, vocab, workers, reps = cfg["rules"]
        print(f"[2] rules, M in {workers}")
        report["rules"] = bench_rules(h, layers, vocab, workers, reps)
    if "streaming" in parts:
        h, layers = cfg["stream"]
        print("[3] streaming memory, M = 2 vs 32")
        report["streaming"] = bench_streaming(h, layers, 8192, [2, 32])
    report["total_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.out)
    print(f"wrote {args.out} in {report['total_s']:.0f}s")
    return report


if __name__ == "__main__":
    main()
