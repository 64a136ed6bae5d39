"""The bytes-vs-loss frontier of ``comm_frontier.py`` on a model whose sparseloco tiles are real.

``comm_frontier.py`` ran on the 0.53M LM of width 96: no weight dimension is a multiple of 64, so
sparseloco's tiles were 48 x 48 and 64 x 48 (2.1-2.8 % of the entries kept at k = 64, not the
1.56 % of a 64 x 64 tile; docs/compression.md). This study repeats it on the smallest LLaMA of
the LM sweep whose weight matrices all have both dimensions multiples of 64 and >= 256
(:data:`MODEL`, checked by :func:`model_shapes` before every run): vocab 1024 (the study's
tokenised data, the same as ``comm_frontier``'s), hidden 256, 4 heads of 64, MLP width 704 (the
LLaMA rule 8/3 x 256 = 682.7 rounded up to a multiple of 64; the sweep's rounding to 8 gives
688 = 43 x 16, 16-row tiles), 2 layers (the LM app's default depth), untied: 2,131,200
parameters; every 2-D tensor is cut into 64 x 64 tiles (1-D norm weights go whole).

Protocol: ``comm_frontier``'s (``run_one``: the LM horizon protocol of
``benchmarks/lm/lm_sweep_lib.py``, combined corpora, M = 8, H = 10, inner lr 3e-3, Flower in a
Ray simulation on :data:`NUM_CPUS` CPU; bytes from the ``count_bytes()`` of every message),
with the model above and T = :data:`HORIZON` = 800 inner steps (80 rounds, 102,400 distinct
training rows of the 138,240 that fit without repeating one). Both fp32 methods must end well
below the bigram reference (:func:`bigram_loss`: add-one counts of the training split's token
pairs, ``p(b | a) = (n_ab + 1) / (n_a + V)``, scored on the same windows as the model's loss;
4.1802 nats on test, 4.1369 on validation). At the old study's T = 600 fp32 DiLoCo did not
clearly: seed 0 ended at test 4.0129 (lr 0.177) and 4.0603 (lr 0.25), 0.17 and 0.12 nats
below the bigram, its validation loss crossing the bigram's only in round 37 of 60 (the 0.53M model
crossed in round 29 and ended at 3.93); those two runs are kept in
``comm_frontier64_t600.json``. At the horizon study's rate (DiLoCo -0.27 nats from T = 600 to
1,080, about 0.46 per unit of ln T) T = 800 should end ~0.3 below the bigram; measured,
fp32 DiLoCo lr 0.177 seed 0 ends at test 3.8317, 0.35 below, its validation loss crossing the
bigram's in round 36 of 80.

Points (:data:`CONFIGS`), each at its own outer lr: seed 0 on 3 lrs a factor sqrt(2) apart
around :func:`centre` (``comm_frontier.CENTRES`` of the method and outer optimiser; the same
grid for fp32 and int4), an optimum on the grid's edge adds a point beyond it, selected on the
validation loss; then seeds 1 and 2 at the optimum for every fp32 configuration and for every
point whose seed-0 validation loss at its optimum is within :data:`SEED_BAR` (0.05 nats) of its
method's :func:`reference` (the best-tuned fp32 outer optimiser). Test loss (a split never used
to choose) is reported.

- fp32 DiLoCo (Nesterov 0.8) and fp32 IsoLoCo (Nesterov 0.8): the references;
- int4 both ways (uploads with error feedback, decay 0.95; the downloads ``Q(theta - B)``);
- sparseloco (chunk 4096, k 64, bits 2, ef_decay 0.95) both ways, downloads re-compressed by
  the server, outer momentum 0 (SparseLoCo's; IsoLoCo's m0 variant as in comm_frontier);
- ``diloco-sl64exact-m0``: sparseloco uploads, SparseLoCo's own combine
  (``merge="sparseloco"``) and exact sparse downloads (``Codec("exact")``: the nodes take the
  server's step from the round's sparse uploads), outer momentum 0, lr centred at 1.0
  (SparseLoCo's). The queue runs it once the library has it (:func:`exact_available`);
- ``diloco-fp32-m0`` (:data:`CONTROL`): fp32 DiLoCo with sparseloco-exact's outer optimiser
  (momentum 0, lr centred at 1.0), so a difference between sparseloco-exact and fp32 DiLoCo
  can be split into the outer optimiser's share and the compression's;
- ``diloco-int4-m0-both`` (:data:`INT4_M0`): int4 both ways under the control's optimiser, since
  the control ends below fp32 DiLoCo with Nesterov.

Queue order (:data:`PLAN`): first the pair that decides the 25x question (fp32 DiLoCo and
sparseloco-exact, the only point near 25x that may keep the loss: tuning, then seeds), then
IsoLoCo's fp32 reference, int4 and sparseloco-both tuning, then their seeds, the control,
int4 at momentum 0 last. The next run is a function of the records alone (and
of whether the exact downloads exist), so ``--queue`` resumes where it stopped.

Budget (:data:`RUN_S`, measured on the first runs): ~15 s of CPU a round (the 8 nodes' 10
inner steps of 16 x 64 tokens at ~0.14 s each, the server's evaluation on 16,384 tokens and
the merge; the wall time was 20-23 s a round with the 2 cores shared at load 5-10, 12.8 s at
the least), so one run of 80 rounds is ~20 min of one core (31 min of wall time at load 7-9). The study: ~33 runs (fp32 2 x 3 + seeds 4 + an edge
point, int4 2 x 3 + seeds 4, sparseloco both ways 2 x 3 + edge points, sparseloco-exact 3 +
seeds 2 if within the bar), ~11 hours of one core in all (~14 hours of wall time on the shared
machine), over several sessions: above the 6-10 hours aimed at, the price of a horizon past
the bigram stage (T = 600 would be ~8 hours). As run: 52 runs, 20.8 hours of one core (the
8-lr grid of sparseloco-exact, and the control and int4 at momentum 0 added to the plan).

    python benchmarks/compression/frontier64.py --queue --until 11:25   # the study (resumes)
    python benchmarks/compression/frontier64.py --queue --configs diloco-sl64exact-m0 --until 11:25
                                           # a second queue beside the first, on other points
    python benchmarks/compression/frontier64.py --status                # done, best, next
    python benchmarks/compression/frontier64.py --table                 # docs table and plot
    python benchmarks/compression/frontier64.py --bigram                # the reference loss
    python benchmarks/compression/frontier64.py --check-imports         # the code a run uses
    python benchmarks/compression/frontier64.py --quick                 # tiny, in process

Records: ``benchmarks/results/comm_frontier64.json`` (or ``--records PATH`` /
``$FRONTIER64_RECORDS``; one per run, appended at once; a rerun skips a recorded key
``config|lr|seed``), the bigram reference ``comm_frontier64_bigram.json`` next to it. Run from
a separate git worktree, every run checks that ``flwr_isoloco``, the sweep and this script come
from that checkout, in this process and in a Ray worker (:func:`check_imports`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("benchmarks/compression", "benchmarks/lm")
import comm_frontier as CF  # noqa: E402
import lm_sweep_lib as L  # noqa: E402

RECORDS = Path(os.environ.get("FRONTIER64_RECORDS") or common.RESULTS / "comm_frontier64.json")
QUICK_RECORDS = common.RESULTS / "comm_frontier64_quick.json"
MODEL = {"hidden": 256, "layers": 2, "heads": 4, "intermediate": 704}
"""On top of the sweep's main size (vocab 1024, seq_len 64, global batch 128)."""
QUICK_MODEL = {"hidden": 64, "layers": 1, "heads": 1, "intermediate": 64}
"""--quick: every dimension still a multiple of 64 (64 x 64 tiles), 0.16M parameters."""
MIN_DIM = 256
HORIZON = 800  # T inner steps, 80 rounds of H = 10 (module doc: why not comm_frontier's 600)
NUM_CPUS = 1  # the Ray simulation's CPUs: a run is timed and budgeted on one core
RUN_S = 1200  # one run's seconds on one core: 80 rounds x ~15 s (module doc)
SEED_BAR = 0.05  # nats of seed-0 validation loss above fp32 within which a point gets seeds
EXACT = "diloco-sl64exact-m0"
EXACT_METHOD = "diloco-sparseloco"  # the sweep's method key of SparseLoCo's combine
SL64 = {"chunk": 4096, "k": 64, "bits": 2}
CONTROL = "diloco-fp32-m0"  # sparseloco-exact's outer optimiser (momentum 0) without compression
INT4_M0 = "diloco-int4-m0-both"  # int4 both ways under the control's outer optimiser

CONFIGS: dict[str, dict[str, Any]] = {
    **{
        n: CF.CONFIGS[n]
        for n in (
            "diloco-fp32-nesterov",
            "isoloco-fp32-nesterov",
            "diloco-int4-nesterov-both",
            "isoloco-int4-nesterov-both",
            "diloco-sl64-m0-both",
            "isoloco-sl64-m0-both",
            CONTROL,
            INT4_M0,
        )
    },
    EXACT: {"method": "diloco", "codec": "sl64", "opt": "m0", "down": "exact"},
}
"""name -> method, codec, outer optimiser, download (comm_frontier's, plus 'exact')."""
NESTEROV_REFERENCE = {"diloco": "diloco-fp32-nesterov", "isoloco": "isoloco-fp32-nesterov"}
"""The method's fp32 reference while no other fp32 configuration of it is tuned (:func:`reference`)."""
PLAN: list[tuple[str, list[str]]] = [
    ("tune", ["diloco-fp32-nesterov"]),
    ("tune", [EXACT]),
    ("seeds", ["diloco-fp32-nesterov", EXACT]),
    ("tune", ["isoloco-fp32-nesterov"]),
    ("tune", ["diloco-int4-nesterov-both", "isoloco-int4-nesterov-both"]),
    ("tune", ["diloco-sl64-m0-both", "isoloco-sl64-m0-both"]),
    ("seeds", ["isoloco-fp32-nesterov"]),
    ("seeds", ["diloco-int4-nesterov-both", "isoloco-int4-nesterov-both"]),
    ("seeds", ["diloco-sl64-m0-both", "isoloco-sl64-m0-both"]),
    ("tune", [CONTROL]),
    ("seeds", [CONTROL]),
    ("tune", [INT4_M0]),
    ("seeds", [INT4_M0]),
]
"""("tune", names): seed 0 over the lr grid; ("seeds", names): seeds 1, 2 at the optimum of
every fp32 configuration and of the points within :data:`SEED_BAR` of their method's
:func:`reference`. :data:`CONTROL` late: it tells whether sparseloco-exact's lead over fp32
DiLoCo is its outer optimiser's; then int4 both ways under that optimiser."""


def size64(quick: bool = False) -> dict[str, Any]:
    """``comm_frontier``'s run size (``--quick``: its tiny one) at T = :data:`HORIZON` with this
    study's model (:data:`MODEL`)."""
    if quick:
        return {**CF.run_size(True), **QUICK_MODEL}
    size = L.protocol_size("horizon", CF.WORKERS, horizon=HORIZON, inner_lr=CF.INNER_LR)
    return {**size, **MODEL}


def check_records(path: Path, quick: bool) -> None:
    """SystemExit if ``path`` holds a run of another horizon (a key names no horizon)."""
    want = size64(quick)
    want = want["rounds"] * want["inner_steps"]
    other = [r["key"] for r in common.load_records(path) if r["horizon"] != want]
    if other:
        raise SystemExit(f"{path}: runs of another horizon than T = {want}: {other[:3]}")


def model_shapes(size: dict[str, Any], min_dim: int = MIN_DIM) -> dict[str, Any]:
    """Build the model of ``size``; ValueError unless every 2-D weight has both dimensions
    multiples of 64 and ``>= min_dim`` and sparseloco cuts it into 64 x 64 tiles. Returns the
    parameter count and the distinct 2-D shapes."""
    from flwr_isoloco.compression.lowbit import tiling

    model = L.build_model(size, 0)
    shapes = {}
    for name, p in model.state_dict().items():
        if p.dim() != 2:
            continue
        tile = tiling(tuple(p.shape), SL64["chunk"])[2:]
        if any(d % 64 or d < min_dim for d in p.shape) or tile != (64, 64):
            raise ValueError(f"{name} {tuple(p.shape)}: sparseloco tiles {tile}, not 64 x 64")
        shapes[name] = list(p.shape)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "shapes_2d": sorted({tuple(s) for s in shapes.values()}),
        "tensors_2d": len(shapes),
    }


# ----------------------------------------------------------------------------- configurations
def centre(name: str) -> float:
    """The lr grid's centre: comm_frontier's fp32 preset of the method and outer optimiser
    (DiLoCo Nesterov 0.25, IsoLoCo Nesterov 1.8, DiLoCo m0 1.0 = SparseLoCo's, IsoLoCo m0 3.96)."""
    cfg = CONFIGS[name]
    return CF.CENTRES[(cfg["method"], cfg["opt"])]


def codecs_of(name: str) -> dict[str, Any]:
    """The strategy's ``upload`` / ``download`` arguments of configuration ``name``."""
    from flwr_isoloco.strategies import Codec

    if CONFIGS[name]["down"] != "exact":
        return CF.codecs_of(name)
    return {
        "upload": Codec("sparseloco", **SL64, ef_decay=CF.UPLOAD_EF_DECAY),
        "download": Codec("exact"),
    }


def run_cfg(name: str) -> dict[str, Any]:
    """``CONFIGS[name]``, with the sweep's method for SparseLoCo's combine where it needs it."""
    cfg = dict(CONFIGS[name])
    if cfg["down"] == "exact":
        L.METHODS.setdefault(EXACT_METHOD, ("sparseloco", True, (1.0, 0.0)))
        cfg["lm_method"] = EXACT_METHOD
    return cfg


def exact_available() -> bool:
    """Whether this checkout builds ``DiLoCo(merge="sparseloco", download=Codec("exact"))``."""
    from flwr_isoloco.strategies import DiLoCo

    try:
        DiLoCo(merge="sparseloco", outer_momentum=0.0, **codecs_of(EXACT))
    except (ValueError, TypeError, KeyError):
        return False
    return True


# ----------------------------------------------------------------------------- the queue
def best_val(name: str, done: dict[str, dict[str, Any]]) -> tuple[float | None, float | None]:
    """(val-optimal lr, its seed-0 validation loss), (None, None) until the grid is in."""
    todo, best = CF.tuning(name, done, 3, centre(name))
    if todo or best is None:
        return None, None
    return best, done[CF.key(name, best, 0)]["val_loss"]


def fp32_of(name: str, same_optimiser: bool = False) -> list[str]:
    """The fp32 configurations of ``name``'s method (``same_optimiser``: and outer optimiser)."""
    cfg = CONFIGS[name]
    return [
        n
        for n, c in CONFIGS.items()
        if c["codec"] == "fp32"
        and c["method"] == cfg["method"]
        and (not same_optimiser or c["opt"] == cfg["opt"])
    ]


def reference(name: str, done: dict[str, dict[str, Any]]) -> str:
    """The fp32 configuration ``name`` is held against: of its method's fp32 configurations
    (outer optimiser Nesterov 0.8 or momentum 0), the tuned one with the lowest seed-0
    validation loss at its optimum; :data:`NESTEROV_REFERENCE` while none is tuned."""
    tuned = {n: v for n in fp32_of(name) if (v := best_val(n, done)[1]) is not None}
    if not tuned:
        return NESTEROV_REFERENCE[CONFIGS[name]["method"]]
    return min(tuned, key=tuned.__getitem__)


def gets_seeds(name: str, done: dict[str, dict[str, Any]]) -> bool:
    """An fp32 configuration (a candidate reference), or a point whose optimum is within
    :data:`SEED_BAR` of its :func:`reference`'s."""
    if CONFIGS[name]["codec"] == "fp32":
        return True
    _, v = best_val(name, done)
    _, r = best_val(reference(name, done), done)
    return v is not None and r is not None and v <= r + SEED_BAR


def next_run(done: dict[str, dict[str, Any]], only: list[str] | None = None, exact: bool = True):
    """The next (config, lr, seed, phase) of :data:`PLAN` not yet recorded, or None;
    ``exact``: whether the sparseloco-exact configuration can run (else it is passed over)."""
    for what, names in PLAN:
        for name in names:
            if (only and name not in only) or (name == EXACT and not exact):
                continue
            todo, best = CF.tuning(name, done, 3, centre(name))
            if what == "tune" and todo:
                return name, todo[0], 0, "tune"
            if what == "seeds" and best is not None and gets_seeds(name, done):
                for s in (1, 2):
                    if CF.key(name, best, s) not in done:
                        return name, best, s, "seed"
    return None


# ----------------------------------------------------------------------------- one run
def check_imports(ray_worker: bool = True) -> dict[str, str]:
    """The files of ``flwr_isoloco``, the sweep, ``comm_frontier`` and ``common`` here and (if
    ``ray_worker``) in a Ray worker started as Flower's Ray backend starts them (its
    ``PYTHONPATH`` is this process's ``sys.path``); RuntimeError unless all are in this
    checkout (``common.REPO``)."""
    import flwr_isoloco

    def files() -> dict[str, str]:
        import comm_frontier
        import common as c
        import lm_sweep_lib

        import flwr_isoloco as f

        return {
            m.__name__: str(Path(m.__file__).resolve()) for m in (f, lm_sweep_lib, comm_frontier, c)
        }

    seen = {"driver": {**files(), "flwr_isoloco": str(Path(flwr_isoloco.__file__).resolve())}}
    if ray_worker:
        import ray

        ray.init(
            num_cpus=1,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
        )
        try:
            seen["ray_worker"] = ray.get(ray.remote(files).remote())
        finally:
            ray.shutdown()
    root = str(common.REPO.resolve())
    for where, fs in seen.items():
        for mod, f in fs.items():
            if not f.startswith(root + os.sep):
                raise RuntimeError(f"{where}: {mod} imported from {f}, not from {root}")
    return {f"{w}:{m}": f for w, fs in seen.items() for m, f in fs.items()}


def run_one(name: str, lr: float, seed: int, phase: str, quick: bool = False) -> dict[str, Any]:
    """``comm_frontier.run_one`` with this study's size, configuration and codecs; the record
    adds the model's shapes and where the code came from."""
    size = size64(quick)
    model = model_shapes(size, 64 if quick else MIN_DIM)
    imports = check_imports(ray_worker=False)
    rec = CF.run_one(
        name,
        lr,
        seed,
        phase,
        quick,
        size=size,
        cfg=run_cfg(name),
        codecs=codecs_of(name),
        num_cpus=NUM_CPUS,
    )
    times = L.RESULT.get("times", [])  # evaluate_fn's clock, rounds 0..R: a round's wall time
    rec["round_s"] = [b - a for a, b in zip(times, times[1:], strict=False)]
    rec.update(study="frontier64", model={**MODEL, "vocab": size["vocab"], **model})
    rec["imports"] = imports
    return rec


def one(name: str, lr: float, seed: int, phase: str, quick: bool, path: Path | None = None):
    """``comm_frontier.one`` with this study's run and records."""
    check_records(path or (QUICK_RECORDS if quick else RECORDS), quick)
    CF.one(
        name,
        lr,
        seed,
        phase,
        quick,
        path=path or (QUICK_RECORDS if quick else RECORDS),
        run=run_one,
    )


def queue(until: str | None, only: list[str] | None, quick: bool, path: Path) -> None:
    """``comm_frontier.queue`` over :func:`next_run`, each run a ``--one`` subprocess of this
    script; the imports checked in a Ray worker first."""
    check_records(path, quick)
    if not quick:
        for k, f in check_imports().items():
            print(f"imports {k}: {f}", flush=True)
    exact = exact_available()
    print(
        f"queue: sparseloco-exact {'available' if exact else 'not in this checkout: passed over'}"
    )
    CF.queue(
        until,
        only,
        quick,
        path=path,
        pick=lambda done: next_run(done, only, exact),
        script=str(Path(__file__).resolve()),
        extra=("--records", str(path)),
    )


# ----------------------------------------------------------------------------- the reference
def bigram_loss(size: dict[str, Any]) -> dict[str, Any]:
    """Add-one bigram of the training split, ``p(b | a) = (n_ab + 1) / (n_a + V)`` with
    ``n_ab`` the count of the pair (a, b) among consecutive training tokens, scored as the
    model's loss (``lm_sweep_lib.eval_loss``: next-token loss inside the same windows of
    ``seq_len + 1`` over the first ``eval_tokens`` tokens of validation and test)."""
    import numpy as np
    import torch

    from flwr_isoloco.data.text import eval_batches

    splits = L.load_splits(size)
    v = size["vocab"]
    tr = splits.train.astype(np.int64)
    counts = np.bincount(tr[:-1] * v + tr[1:], minlength=v * v).reshape(v, v) + 1.0
    logp = torch.from_numpy(np.log(counts / counts.sum(1, keepdims=True)))
    out = {"data_key": splits.key, "train_tokens": int(len(tr)), "vocab": v}
    for split, tokens in (("val", splits.val), ("test", splits.test)):
        total, n = 0.0, 0
        for batch in eval_batches(tokens, 64, size["seq_len"], size["eval_tokens"]):
            total -= float(logp[batch[:, :-1], batch[:, 1:]].sum())
            n += batch[:, 1:].numel()
        out[f"{split}_loss"] = total / n
    return out


def bigram(path: Path, quick: bool = False) -> dict[str, Any]:
    """The bigram reference of this study's data, cached at ``<records>_bigram.json``."""
    out = path.with_name(path.stem + "_bigram.json")
    if out.is_file():
        return common.load_records(out)
    ref = {**bigram_loss(size64(quick)), "formula": "p(b|a) = (n_ab + 1) / (n_a + V), train split"}
    common.save_json(out, ref)
    return ref


# ----------------------------------------------------------------------------- status
def status(path: Path, quick: bool = False) -> None:
    """Each configuration's seed-0 grid, optimum, seeds, bytes; the references; the next run."""
    recs = common.load_records(path)
    done = CF.recorded(recs)
    ref = bigram(path, quick)
    print(
        f"records {path}: {len(recs)} runs; bigram val {ref['val_loss']:.4f} test {ref['test_loss']:.4f}"
    )
    for name in CONFIGS:
        runs = sorted(
            (r for r in recs if r["config"] == name), key=lambda r: (r["seed"], r["outer_lr"])
        )
        if not runs:
            continue
        best, v = best_val(name, done)
        print(f"{name}: centre {centre(name):g}, optimum {best} (val {v})")
        for r in runs:
            b = r["bytes"]
            print(
                f"  lr {r['outer_lr']:g} seed {r['seed']}: val {r['val_loss']:.4f} "
                f"test {r['test_loss']:.4f} up {b['up_per_node_round']:.0f} "
                f"down {b['down_per_node_round']:.0f} B/node/round, {r['wall_s']:.0f} s"
            )
    print("next:", next_run(done, exact=exact_available()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", help=f"configurations (of {len(CONFIGS)}) to run")
    p.add_argument("--queue", action="store_true", help="run the plan (PLAN) in priority order")
    p.add_argument("--until", help="queue: start no run after HH:MM UTC")
    p.add_argument("--one", nargs=4, metavar=("CONFIG", "LR", "SEED", "PHASE"))
    p.add_argument("--records", type=Path, help=f"records file (default {RECORDS})")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds, in process")
    p.add_argument("--status", action="store_true", help="the records so far and the next run")
    p.add_argument("--table", action="store_true", help="the docs table and plot (records only)")
    p.add_argument("--bigram", action="store_true", help="the bigram reference loss")
    p.add_argument("--check-imports", action="store_true", help="where the code comes from")
    a = p.parse_args(argv)
    for name in a.configs or []:
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    path = a.records or (QUICK_RECORDS if a.quick else RECORDS)
    if a.check_imports:
        for k, f in check_imports().items():
            print(f"{k}: {f}")
    if a.bigram:
        print(bigram(path, a.quick))
    if a.one:
        one(a.one[0], float(a.one[1]), int(a.one[2]), a.one[3], a.quick, path)
    elif a.quick and not a.queue:
        for name in a.configs or ["diloco-fp32-nesterov", "diloco-sl64-m0-both"]:
            one(name, centre(name), 0, "quick", True, path)
    elif a.queue or a.configs:
        queue(a.until, a.configs, a.quick, path)
    if a.status:
        status(path, a.quick)
    if a.table:
        import frontier64_report

        frontier64_report.table(path, write=not a.quick)


if __name__ == "__main__":
    main()
