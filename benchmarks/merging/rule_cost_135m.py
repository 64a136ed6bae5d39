"""Merge-rule cost at SmolLM2-135M shapes (``aggregation_bench.py --shapes 135m``).

SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, GQA k/v 192 x 576, tied embedding
49152 x 576 (134.5M parameters, 513 MiB fp32). M synthetic pseudo-gradients
(:func:`~flwr_isoloco.testing.synthetic.llama_delta`: a shared Gaussian part plus each worker's
own). Per case, interleaved repeat by repeat (machine load hits every case alike): time (median;
process CPU time with one thread, wall time otherwise) and peak extra RSS (VmHWM reset through
``/proc/self/clear_refs``, glibc told to ``mmap`` every allocation >= 64 KiB so freed tensors leave
the RSS at once; counts torch and LAPACK allocations). Ratios are to the memory pass (read every
entry of the M replies once) and to ``mean``, both measured in the same process. The per-shape
part times Iso-C by the SVD, the Gram eigendecomposition (as shipped, and forced in fp64) and
Newton-Schulz, and ``iso_c_matched`` (as shipped and by its SVD route), on the mean's matrices,
with their relative (Frobenius) error against the fp64 SVD and the fp32 SVD.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from flwr_isoloco import merging
from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, iso_c, merge
from flwr_isoloco.merging.robust import ROBUST_RULES, RobustMerge, resolve_robust
from flwr_isoloco.merging.rules import MergeRule, resolve_rule
from flwr_isoloco.merging.spill import SpillStore
from flwr_isoloco.merging.streaming import OrderFreeMean
from flwr_isoloco.testing.synthetic import llama_delta, llama_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

MIB = common.MIB
#: Cases: merge rules (``merge(rule, deltas)``), plus ``iso_c_svd`` (the SVD-only Iso-C, i.e. the
#: rule before the Gram path, in the same process), ``stream_<rule>`` (:class:`StreamingMerger`)
#: and ``round_<rule>``: what a server round computes at the defaults from round 2 on, the
#: replies folded into an :class:`OrderFreeMean` (fp64 double-double) and ``result(rule)``, key
#: by key (memory O(one tensor)); ``fold_<rule>``: the same with one accumulator for the whole
#: model, as :class:`~flwr_isoloco.merging.fold.RoundFold` holds it (memory 4 x the model);
#: ``robust_<name>``: a rule of :mod:`flwr_isoloco.merging.robust` with ``mean``;
#: ``spill_pass``: writing the replies to the spill store and reading them back once.
DEFAULT_CASES = (
    "memory_pass,mean,round_mean,stream_mean,iso_c,iso_c_svd,round_iso_c,stream_iso_c,"
    "iso_c_matched,round_iso_c_matched,iso_c_ns,ties,dare"
)


def smollm2_135m_shapes(layers: int = 30) -> dict[str, tuple[int, ...]]:
    """SmolLM2-135M's parameter shapes (tied embedding: no ``lm_head``)."""
    shapes = llama_shapes(576, layers, 49152, intermediate=1536)
    shapes.pop("lm_head.weight")
    for i in range(layers):
        for name in ("k_proj", "v_proj"):
            shapes[f"layers.{i}.self_attn.{name}.weight"] = (192, 576)
    return shapes


def _measure(fn) -> tuple[object, float, float | None]:
    """(result, seconds, peak extra MiB above the RSS before the call)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        base = common.status_mib("VmRSS")
    except OSError:
        base = None
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    out = fn()
    seconds = clock() - start
    peak = common.status_mib("VmHWM")
    extra = None if base is None or peak is None else max(0.0, peak - base)
    return out, seconds, extra


def _memory_pass(deltas):
    total = 0.0
    for d in deltas:
        for t in d.values():
            total += float(t.sum())
    return total


_ISO_C_SVD = MergeRule(
    "iso_c_svd",
    lambda ds, ws, key="": iso_c(merging.rules.weighted_mean(ds, ws), method="svd"),
    lambda g: iso_c(g, method="svd"),
)


def load_base(path: str | Path):
    """The ``flwr_isoloco/merging`` package of another checkout (e.g. ``git archive`` of the base
    commit), imported as ``base_merging``: ``base_<rule>`` cases run its ``merge`` in this process
    on the same deltas (the package imports nothing else from flwr_isoloco)."""
    import importlib.util

    init = Path(path) / "flwr_isoloco" / "merging" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "base_merging", init, submodule_search_locations=[str(init.parent)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["base_merging"] = mod
    spec.loader.exec_module(mod)
    return mod


_BASE = None


def _case(name: str, deltas):
    if name.startswith("base_"):
        rest = name[len("base_") :]
        if rest.startswith(("round_", "fold_")):  # the base code's order-free accumulator
            return _fold_case(rest, deltas, _BASE.streaming.OrderFreeMean)
        return lambda: _BASE.merge(rest, deltas)
    if name == "memory_pass":
        return lambda: _memory_pass(deltas)
    if name.startswith(("round_", "fold_")):
        return _fold_case(name, deltas, OrderFreeMean)
    if name.startswith("stream_"):

        def run():
            merger = StreamingMerger(name[len("stream_") :])
            for d in deltas:
                merger.add(d)
            return merger.result()

        return run
    if name.startswith("robust_"):
        return _robust_case(name[len("robust_") :], deltas)
    if name == "spill_pass":
        return lambda: _spill_pass(deltas)
    rule = _ISO_C_SVD if name == "iso_c_svd" else name
    return lambda: merge(rule, deltas)


def _fold_case(name: str, deltas, accumulator):
    """``round_<rule>``: key by key, one accumulator per tensor (memory O(one tensor));
    ``fold_<rule>``: one accumulator for the whole model, as RoundFold holds it."""
    kind, rule = name.split("_", 1)
    groups = [[k] for k in deltas[0]] if kind == "round" else [list(deltas[0])]

    def run():
        out = {}
        for keys in groups:
            acc = accumulator()
            for d in deltas:
                acc.add({k: d[k] for k in keys})
            out.update(acc.result(rule, device="cpu"))
            acc.release()
        return out

    return run


def _robust_case(robust: str, deltas):
    """A robust rule as a strategy round calls it (:meth:`RobustMerge.merge` over the round's
    deltas, rule ``mean``, unit weights), reading the deltas from memory (the strategies read
    them from the spill store: add ``spill_pass``)."""
    rule = resolve_rule("mean")
    name, opts = resolve_robust(robust, None, rule)
    keys = list(deltas[0])

    def run():
        return RobustMerge(name, opts).merge(
            rule, {"device": "cpu"}, keys, lambda i, k: deltas[i][k], [1.0] * len(deltas)
        )

    return run


def _spill_pass(deltas):
    """What a spilling round adds: write each delta to the spill store, read every tensor of
    every delta back once."""
    total = 0.0
    with SpillStore() as store:
        entries = [store.put(d) for d in deltas]
        for key in deltas[0]:
            for e in entries:
                total += float(store.get(e, key).sum())
    return total


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def bench_cases(deltas, cases: list[str], repeats: int, checkpoint=None) -> dict:
    """Every case, ``repeats`` times, interleaved; ``checkpoint(partial)`` after each case."""
    times: dict[str, list[float]] = {c: [] for c in cases}
    peaks: dict[str, float] = {c: 0.0 for c in cases}
    for rep in range(repeats):
        for c in cases:
            out, sec, extra = _measure(_case(c, deltas))
            del out
            times[c].append(sec)
            peaks[c] = max(peaks[c], extra or 0.0)
            print(f"  rep {rep} {c:13s} {sec:8.2f}s  peak extra {extra or 0:7.0f} MiB", flush=True)
            if checkpoint is not None:
                checkpoint(_summary(times, peaks))
    return _summary(times, peaks)


def _summary(times: dict[str, list[float]], peaks: dict[str, float]) -> dict:
    med = {c: statistics.median(ts) for c, ts in times.items() if ts}
    out = {"median_s": med, "all_s": times, "peak_extra_mib": peaks}
    if "memory_pass" in med:
        out["over_memory_pass"] = {c: m / med["memory_pass"] for c, m in med.items()}
    if "mean" in med:
        out["over_mean"] = {c: m / med["mean"] for c, m in med.items()}
    return out


def _shape_methods() -> dict:
    """Per-shape methods: Iso-C by SVD / Gram route as shipped / Gram in fp64 forced (whatever
    the bounds say: what the near-square matrices would cost) / Newton-Schulz, and
    ``iso_c_matched`` as shipped and by its SVD route; each with its exact fp64 reference."""
    from flwr_isoloco.merging import iso_range, polar

    polar_mod = sys.modules[polar.__module__]

    def matched_svd(g):
        u, s, vh, k = iso_range._range_svd(g, None, "iso_c_matched")
        return (u[:, :k] * (torch.linalg.vector_norm(s) / k**0.5)) @ vh[:k]

    methods = {
        "svd": ("iso_c", lambda g: iso_c(g, method="svd")),
        "gram": ("iso_c", lambda g: iso_c(g, method="gram")),
        "newton_schulz": ("iso_c", lambda g: iso_c(g, method="newton_schulz")),
        "matched_svd": ("matched", matched_svd),
        "matched": ("matched", iso_range.iso_c_matched),
    }
    forced = getattr(polar_mod, "_gram_apply", None)
    if forced is not None and hasattr(polar_mod, "sym_product"):  # this version's signature
        methods["gram64_forced"] = (
            "iso_c",
            lambda g: forced(g, torch.float64, float("inf"), "mean").float(),
        )
    return methods


def bench_shapes(mean: dict[str, torch.Tensor], repeats: int) -> list[dict]:
    """Iso-C (and iso_c_matched) of the mean by each method, one matrix per distinct shape."""
    seen: dict[tuple[int, ...], str] = {}
    for key, t in mean.items():
        if t.ndim == 2 and tuple(t.shape) not in seen:
            seen[tuple(t.shape)] = key
    count = {s: sum(1 for t in mean.values() if tuple(t.shape) == s) for s in seen}
    methods = _shape_methods()
    rows = []
    for shape, key in seen.items():
        g = mean[key]
        u, sval, vh = torch.linalg.svd(g.double(), full_matrices=False)
        exact = {"iso_c": (u * sval.mean()) @ vh}
        exact["matched"] = exact["iso_c"] * float(sval.square().mean().sqrt() / sval.mean())
        del u, vh
        svd32 = {"iso_c": iso_c(g, method="svd"), "matched": methods["matched_svd"][1](g)}
        row = {"shape": list(shape), "example": key, "count_in_model": count[shape]}
        row["kappa"] = float(sval[0] / sval[-1]) if sval[-1] > 0 else float("inf")
        row["rel_err_svd32_vs_fp64"] = _rel(svd32["iso_c"], exact["iso_c"])
        for method, (kind, fn) in methods.items():
            ts = []
            for _ in range(repeats):
                res, sec, _ = _measure(lambda fn=fn, g=g: fn(g))
                ts.append(sec)
            row[f"{method}_s"] = statistics.median(ts)
            row[f"{method}_rel_err_vs_fp64"] = _rel(res, exact[kind])
            row[f"{method}_rel_err_vs_svd32"] = _rel(res, svd32[kind])
        rows.append(row)
        print(
            f"  {shape!s:14s} x{count[shape]:<3d} kappa {row['kappa']:9.3g}"
            + "".join(
                f"  {m} {row[m + '_s'] * 1e3:7.1f}ms err {row[m + '_rel_err_vs_fp64']:.1e}"
                for m in methods
            ),
            flush=True,
        )
    return rows


def run(args, save=lambda report: None) -> dict:
    layers = 4 if args.quick else 30
    shapes = smollm2_135m_shapes(layers)
    if args.quick:  # a small vocabulary as well: a quick check of the script, not a measurement
        shapes["embed_tokens.weight"] = (4096, 576)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    cases = args.cases.split(",")
    global _BASE
    _BASE = load_base(args.base) if getattr(args, "base", None) else None
    for c in cases:
        if c.startswith("base_") and _BASE is None:
            raise SystemExit(f"case {c!r} needs --base")
        if c.startswith("robust_"):
            if c[len("robust_") :] not in ROBUST_RULES[1:]:
                raise SystemExit(f"unknown case {c!r}")
        elif c not in ("memory_pass", "iso_c_svd", "spill_pass"):
            rule = c[len("base_") :] if c.startswith("base_") else c
            if rule.startswith(("stream_", "round_", "fold_")):
                rule = rule.split("_", 1)[1]
            if rule not in MERGE_RULES:
                raise SystemExit(f"unknown case {c!r}")
    print(f"{params / 1e6:.1f}M parameters ({len(shapes)} tensors), M = {args.workers}")
    tiny = [llama_delta(llama_shapes(16, 1, 64), i) for i in range(2)]
    for rule in MERGE_RULES:  # one-time library initialisation is nobody's memory
        merge(rule, tiny)
    t0 = time.perf_counter()
    deltas = [llama_delta(shapes, i) for i in range(args.workers)]
    prep = time.perf_counter() - t0
    report = {
        "what": "merge-rule cost at SmolLM2-135M shapes, synthetic pseudo-gradients",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": str(Path(merging.__file__).parent),
        "base_code": str(Path(_BASE.__file__).parent) if _BASE is not None else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load-avg-at-start": os.getloadavg(),
        },
        "parameters": params,
        "model_mib_fp32": params * 4 / MIB,
        "workers": args.workers,
        "repeats": args.repeats,
        "prep_s": prep,
        "time_method": "median of repeats; process CPU time with one thread, else wall time",
        "memory_method": "peak RSS above the RSS before the call (VmHWM reset via "
        "/proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536); inputs not counted",
    }

    def checkpoint(partial):  # a stopped run keeps what it measured
        report["cases"] = partial
        report["partial"] = True
        save(report)

    report["cases"] = bench_cases(deltas, cases, args.repeats, checkpoint)
    report["partial"] = False
    if not args.no_shapes:
        print("per shape: Iso-C of the mean by method")
        report["shapes"] = bench_shapes(merge("mean", deltas), args.repeats)
    report["load-avg-at-end"] = os.getloadavg()
    save(report)
    med = report["cases"]["median_s"]
    print(f"{'case':13s} {'median s':>9s} {'x mem':>7s} {'x mean':>7s} {'peak MiB':>9s}")
    for c in med:
        print(
            f"{c:13s} {med[c]:9.2f} {report['cases'].get('over_memory_pass', {}).get(c, 0):7.2f}"
            f" {report['cases'].get('over_mean', {}).get(c, 0):7.2f}"
            f" {report['cases']['peak_extra_mib'][c]:9.0f}"
        )
    return report
