"""The DiLoCo worker's train handler against a bare PyTorch loop (the GPU study of
``benchmarks/gpu/``).

One process, one device, one precision: the same model (the same starting weights), the same
batches in the same order, the same AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1), the
same learning-rate schedule (:func:`~flwr_isoloco.clients.diloco_worker.inner_lr`) and gradient
clipping (norm 1). A *message* is H inner steps. The bare arm is the loop a user would write:
the model and its AdamW live across messages, each step moves its batch to the device, runs the
forward pass (under ``torch.autocast`` for bf16), backward, clip, step; one host sync per
message. The handler arm is ``make_diloco_train_handler`` driven by real Flower ``Message``
and ``Context`` objects: each message carries the weights of the previous reply (an
``ArrayRecord``), the handler builds or reuses the model, restores AdamW from
``context.state``, runs H steps, saves the state and builds its reply, exactly as a
ClientApp calls it (without the node-state files of ``with_node_state``). The model function is
the one its owner uses: the isoloco-lm app's ``build_model`` (demo), ``lm_sweep_lib.build_model``
(sweep) and a seeded ``LlamaForCausalLM`` with SmolLM2-135M's configuration (135m; the
weights do not change the cost, and the GGUF package is not needed).

Both arms run one warm-up message, then ``repeats`` messages alternated (ABBA order). With
``t_b`` / ``t_h`` the medians of a bare / handler message's seconds::

    ratio          = tokens/s(handler) / tokens/s(bare) = t_b / t_h
    t_step         = t_b / H
    overhead_steps = (t_h - H t_step) / t_step      (per-message overhead in inner steps)

At the end of every cell the handler's last reply is compared with the bare model's weights
(``max_abs_diff``; in fp32 the two arms are the same computation, so it is at rounding level).

``--node-state temp``: the handler in ``with_node_state(temp_dir=True)``, as the isoloco-lm app
runs it (the node's state in its private temp folder, the AdamW moments memory-mapped there).

``--share demo`` (the demo's share of wall time in inner steps) and ``--profile <size>`` (where
one handler message's seconds go): :mod:`worker_share`.

    python benchmarks/gpu/worker_throughput.py --phase before   # CPU, every cell
    python benchmarks/gpu/worker_throughput.py --share demo --phase after
    python benchmarks/gpu/worker_throughput.py --profile 135m --phase after
    python benchmarks/gpu/worker_throughput.py --quick --out /tmp/wt.json

Writes ``benchmarks/results/worker_throughput.json``: ``{phase: {"cells": ..., "share": ..., "profile": ...}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (0, 1)]  # worker_sizes, common
import common  # noqa: E402

common.on_path("simulations/isoloco-lm", "tests", "benchmarks/lm")
common.offline_env()

import torch  # noqa: E402
from worker_sizes import Size, sizes, smollm2_135m_config  # noqa: E402,F401 (re-exported)

OUT = common.RESULTS / "worker_throughput.json"
HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}
MIN_LR_RATIO = 0.1
APP_LOCAL_STEPS = 20  # isoloco-lm's train.local-steps default: the projected ratio's H


def _runtime_defaults() -> dict[str, Any]:
    """The installed worker's runtime options and their defaults: the fields of ``Runtime``, or
    the handler's keywords in an older package (on ``PYTHONPATH``) that has no ``Runtime``."""
    from flwr_isoloco import clients

    if hasattr(clients, "Runtime"):
        return {f.name: f.default for f in dataclasses.fields(clients.Runtime)}
    params = inspect.signature(clients.make_diloco_train_handler).parameters
    return {k: p.default for k, p in params.items()}


def handler_features() -> dict[str, bool]:
    """Which device options the installed worker takes (an older package may lack them)."""
    options = _runtime_defaults()
    feats = {k: k in options for k in ("precision", "compile", "cache_nodes")}
    feats["device_auto"] = options.get("device") == "auto"
    return feats


def worker_kwargs(train: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The installed worker's arguments for these settings: ``train=TrainSettings(...)`` and
    ``runtime=Runtime(...)``, or the same as keywords in an older package that lacks them."""
    from flwr_isoloco import clients

    if hasattr(clients, "TrainSettings"):
        return {"train": clients.TrainSettings(**train), "runtime": clients.Runtime(**runtime)}
    return {**train, **runtime}


def make_batches(size: Size, seed: int = 1) -> list[torch.Tensor]:
    """``H`` distinct seeded batches of token ids ``(batch, seq_len + 1)`` on the CPU."""
    g = torch.Generator().manual_seed(seed)
    shape = (size.batch, size.seq_len + 1)
    return [torch.randint(0, size.vocab, shape, generator=g) for _ in range(size.h)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: str):
    """Mixed precision as the worker runs it: fp32 weights, autocast to bf16/fp16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


class Bare:
    """The bare loop: model + AdamW kept across messages; AdamW fused where the worker fuses it
    (``diloco_worker._use_fused_adamw``: CUDA and the CPU; with a worker that lacks it, the
    default AdamW), so both arms run one optimiser."""

    def __init__(self, model, device, precision, total_steps, warmup, compile_):
        from flwr_isoloco.clients import diloco_worker

        fused = getattr(diloco_worker, "_use_fused_adamw", lambda _device: False)
        self.model = model.to(device).train()
        self.device, self.precision = device, precision
        self.total, self.warmup = total_steps, warmup
        kw = {"fused": True} if fused(device) else {}
        self.opt_kwargs = kw
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=HP["lr"],
            betas=HP["betas"],
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            **kw,
        )
        self.fwd = torch.compile(self.model) if compile_ else self.model
        self.step = 0

    def message(self, batches: list[torch.Tensor]) -> float:
        """H steps on ``batches`` (in order); returns the mean loss."""
        from flwr_isoloco.clients.diloco_worker import inner_lr, next_token_loss

        total = torch.zeros((), device=self.device)
        for batch in batches:
            lr = inner_lr(self.step, self.total, HP["lr"], self.warmup, MIN_LR_RATIO)
            for group in self.opt.param_groups:
                group["lr"] = lr
            x = batch.to(self.device, non_blocking=True)
            self.opt.zero_grad(set_to_none=True)
            with autocast(self.device, self.precision):
                loss, _ = next_token_loss(self.fwd, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), HP["clip"])
            self.opt.step()
            total += loss.detach()
            self.step += 1
        return float(total) / len(batches)


class Handler:
    """The worker's train handler, fed one Flower Message per call."""

    def __init__(self, size, template, device, precision, total_msgs, warmup, compile_):
        from flwr_isoloco.clients import make_diloco_train_handler
        from flwr_isoloco.models.hf import model_arrays

        feats = handler_features()
        kw: dict[str, Any] = {}
        if feats["precision"]:
            kw["precision"] = precision
        elif precision != "fp32":
            raise ValueError(f"the installed handler has no precision argument ({precision})")
        if compile_:
            if not feats["compile"]:
                raise ValueError("the installed handler has no compile argument")
            kw["compile"] = True
        batches = make_batches(size)
        train = dict(
            lr=HP["lr"],
            betas=HP["betas"],
            weight_decay=HP["weight_decay"],
            clip_norm=HP["clip"],
            local_steps=size.h,
            num_server_rounds=total_msgs,
            warmup_steps=warmup,
            min_lr_ratio=MIN_LR_RATIO,
        )
        self.handler = make_diloco_train_handler(
            lambda ctx: size.build(0),
            lambda ctx: lambda i: batches[i % len(batches)],
            **worker_kwargs(train, {"device": str(device), **kw}),
        )
        self.context = common.node_context()
        self.context.run_id = os.getpid()  # its own run temp folder: benchmarks run side by side
        self.arrays = model_arrays(template)
        self.round = 0
        self.loss = float("nan")

    def message(self) -> None:
        self.round += 1
        reply = self.handler(
            common.train_message(self.arrays, {"server-round": self.round}), self.context
        )
        if reply.has_error():
            raise RuntimeError(f"handler error: {reply.error.reason}")
        self.arrays = reply.content["arrays"]
        self.loss = float(reply.content["metrics"]["train-loss"])


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def max_abs_diff(handler: Handler, bare: Bare) -> float:
    """Largest |handler reply - bare weights| over the travelling tensors (a tied tensor once,
    as :func:`~flwr_isoloco.models.hf.model_arrays` sends it)."""
    from flwr_isoloco.models.hf import model_arrays

    got = handler.arrays.to_torch_state_dict()
    ref = model_arrays(bare.model).to_torch_state_dict()
    if set(got) != set(ref):
        raise ValueError(f"reply names differ from the model's: {sorted(set(got) ^ set(ref))}")
    return max(float((got[k].float() - ref[k].float()).abs().max()) for k in ref)


NODE_STATE = {"temp_dir": False}  # --node-state temp: the handler wrapped as isoloco-lm wraps it


def arms(size, device, precision, compile_, messages):
    """The two arms of one cell on the same starting weights and batches; with
    ``NODE_STATE["temp_dir"]`` the handler runs in ``with_node_state(temp_dir=True)``."""
    template = size.build(0)
    warmup = size.h  # the first message warms up the lr
    bare = Bare(copy.deepcopy(template), device, precision, messages * size.h, warmup, compile_)
    handler = Handler(size, template, device, precision, messages, warmup, compile_)
    if NODE_STATE["temp_dir"]:
        from flwr_isoloco.clients.node_state import remove_run_temp_dir, with_node_state

        remove_run_temp_dir(handler.context.run_id)  # no file of an earlier cell
        handler.handler = with_node_state(handler.handler, temp_dir=True)
    return bare, handler, make_batches(size)


def measure_cell(
    size: Size, device: torch.device, precision: str, compile_: bool, repeats: int
) -> dict[str, Any]:
    """One cell: the medians, ratio, overhead in steps and the final-weight difference."""
    bare, handler, batches = arms(size, device, precision, compile_, repeats + 1)
    timed(lambda: bare.message(batches), device)  # warm-up (and compile) of both arms
    timed(handler.message, device)
    tb, th = [], []
    for r in range(repeats):
        order = ("b", "h") if r % 2 == 0 else ("h", "b")
        for arm in order:
            if arm == "b":
                tb.append(timed(lambda: bare.message(batches), device))
            else:
                th.append(timed(handler.message, device))
    model_fn_s = statistics.median(
        timed(lambda: size.build(0).to(device), device) for _ in range(min(repeats, 3))
    )
    mb, mh = statistics.median(tb), statistics.median(th)
    step = mb / size.h
    tokens = size.batch * size.seq_len * size.h
    overhead = (mh - size.h * step) / step
    return {
        "size": size.name,
        "note": size.note,
        "device": str(device),
        "precision": precision,
        "compile": compile_,
        "parameters": sum(p.numel() for p in bare.model.parameters()),
        "batch": size.batch,
        "seq_len": size.seq_len,
        "h": size.h,
        "repeats": repeats,
        "bare_msg_s": tb,
        "handler_msg_s": th,
        "bare_median_s": mb,
        "handler_median_s": mh,
        "bare_step_s": step,
        "tokens_per_s_bare": tokens / mb,
        "tokens_per_s_handler": tokens / mh,
        "ratio": mb / mh,
        "overhead_steps": overhead,
        "projected_ratio_at_h20": APP_LOCAL_STEPS / (APP_LOCAL_STEPS + overhead),
        "model_fn_s": model_fn_s,
        "model_fn_steps": model_fn_s / step,
        "max_abs_diff": max_abs_diff(handler, bare),
        "bare_optimizer": {**bare.opt_kwargs},
        "handler_loss_last": handler.loss,
        "node_state": "temp_dir" if NODE_STATE["temp_dir"] else "context.state",
        "load_avg_end": list(os.getloadavg()),
    }


def run_cells(names, precisions, compiles, device, repeats, quick=False, limit_s=None):
    """Every (size, precision, compile) cell; a cell that fails records its error. Cells not
    started before ``limit_s`` seconds have passed are recorded as skipped."""
    table = sizes(device.type, quick, names)
    feats = handler_features()
    t0, cells = time.perf_counter(), []
    for name in names:
        for precision in precisions:
            for comp in compiles:
                key = {"size": name, "precision": precision, "compile": comp}
                if precision != "fp32" and not feats["precision"]:
                    cells.append({**key, "skipped": "handler has no precision argument yet"})
                    continue
                if comp and not feats["compile"]:
                    cells.append({**key, "skipped": "handler has no compile argument yet"})
                    continue
                if limit_s is not None and time.perf_counter() - t0 > limit_s:
                    cells.append({**key, "skipped": f"time limit {limit_s} s reached"})
                    continue
                try:
                    cell = measure_cell(table[name], device, precision, comp, repeats)
                except Exception as exc:  # noqa: BLE001 - recorded, the other cells go on
                    cell = {**key, "error": f"{type(exc).__name__}: {exc}"[:500]}
                print(
                    json.dumps({k: v for k, v in cell.items() if not k.endswith("msg_s")}),
                    flush=True,
                )
                cells.append(cell)
    return cells


# ----------------------------------------------------------------------------- record
def cell_key(cell: dict[str, Any]) -> tuple:
    return cell["size"], cell["precision"], cell["compile"]


def update_record(
    path: Path, phase: str, part: str, value: Any, meta: dict[str, Any], merge: bool = False
) -> None:
    """Set ``record[phase][part]`` (and its run's metadata) in the JSON at ``path``; ``merge``
    (cells only): replace the cells of the same (size, precision, compile), keep the others,
    and file the run's metadata under ``runs["cells:<sizes>:<precisions>"]``."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = data.setdefault(phase, {})
    runs = entry.setdefault("runs", {})
    if merge and part == "cells" and part in entry:
        new = {cell_key(c) for c in value}
        entry[part] = [c for c in entry[part] if cell_key(c) not in new] + value
        runs[
            ":".join(
                [
                    "cells",
                    *(",".join(dict.fromkeys(c[k] for c in value)) for k in ("size", "precision")),
                ]
            )
        ] = meta
    else:
        entry[part] = value
        runs[part] = meta
    common.save_json(path, data)


def _package_dir() -> str:
    """The folder of the ``flwr_isoloco`` measured (an older tree on ``PYTHONPATH`` for a
    "before" run; its commit is then in the run's ``command`` note, not ``commit``)."""
    import flwr_isoloco

    return str(Path(flwr_isoloco.__file__).parent)


def device_of(option: str) -> torch.device:
    """``--device``: ``auto`` is CUDA where visible, else the CPU."""
    if option == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(option)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="before", help="record key (before / after / ...)")
    ap.add_argument("--sizes", default="demo,sweep,135m")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--device", default="auto", help="auto (CUDA if present) / cpu / cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 repeat")
    ap.add_argument("--share", choices=("demo",), help="the demo's share of time in inner steps")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="add these cells to the phase's record (replacing the same cells)",
    )
    ap.add_argument(
        "--profile",
        choices=("demo", "sweep", "135m"),
        help="where one fp32 handler message's time goes at this size",
    )
    ap.add_argument("--limit-s", type=float, help="start no cell after this many seconds")
    ap.add_argument("--node-state", choices=("memory", "temp"), default="memory")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    NODE_STATE["temp_dir"] = args.node_state == "temp"
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/gpu/worker_throughput.py " + " ".join(argv or sys.argv[1:]),
        "commit": common.git("rev-parse", "HEAD"),
        "machine": common.machine(),
        "uncommitted-package-changes": bool(common.git("status", "--porcelain", "flwr_isoloco")),
        "threads": args.threads,
        "handler_features": handler_features(),
        "package": _package_dir(),
        "note": "the shared 2-core machine, loaded by other work (load average in machine); "
        "only the ratio is meaningful: both arms alternate in one process",
    }
    if args.profile:
        table = sizes(device_of(args.device).type, names=[args.profile])
        import worker_share

        result = worker_share.profile_message(table[args.profile], device_of(args.device), "fp32")
        update_record(args.out, args.phase, "profile", result, meta)
        return result
    if args.share:
        import worker_share

        result = worker_share.measure_share()
        meta["machine"]["load-avg-end"] = list(os.getloadavg())
        update_record(args.out, args.phase, "share", result, meta)
        return result
    device = device_of(args.device)
    names = ["tiny"] if args.quick else args.sizes.split(",")
    repeats = 1 if args.quick else args.repeats
    compiles = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    cells = run_cells(
        names, args.precisions.split(","), compiles, device, repeats, args.quick, args.limit_s
    )
    meta["machine"]["load-avg-end"] = list(os.getloadavg())
    update_record(args.out, args.phase, "cells", cells, meta, args.merge)
    return {"cells": cells, **meta}


if __name__ == "__main__":
    main()
