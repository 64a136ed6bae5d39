"""Where one DiLoCo worker message's seconds and memory go, stage by stage
(``benchmarks/gpu/worker_throughput.py --stages <size>``; the GPU study of ``benchmarks/gpu/``).

The message is the isoloco-lm app's path without its data: the app's ClientApp mods
(``download_mod``, ``secagg_mod``, both pass-through at their defaults), the node-state wrapper
(``with_node_state`` with a node folder: the node's state between messages lives on its disk)
and the worker's train handler, fed real Flower ``Message`` / ``Context`` objects; each message
carries the previous reply's weights. A wall-clock timer (synchronising the device) wraps each
stage's function, found by name in the worker's modules (:data:`STAGES`; a stage whose
function the installed worker lacks is recorded as absent); a stage's seconds exclude the time
of the stages nested in it; ``other`` is the message's seconds minus every stage's.

    overhead_s = message_s - inner_steps_s

Peak memory (``--rss``): each arm in a process of its own, ``ru_maxrss`` after its messages
(the bare loop: model, gradients, AdamW moments and the activations of one step; the floor is
``4 x parameters x 4`` bytes of fp32 model, gradient and two moments). Each arm also records
its RSS once the runtime both load is imported (interpreter, torch, transformers, Flower; before
any model), and ``<arm>_above_runtime_over_floor`` is what the model and its messages add above
that, against the floor.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]  # worker_throughput
import torch  # noqa: E402
from worker_throughput import Size, arms, common, sizes, sync, timed  # noqa: E402

from flwr_isoloco.clients.node_state import remove_run_temp_dir  # noqa: E402

STAGES: dict[str, tuple[str, ...]] = {
    "mods": (),  # the app's ClientApp mods, timed where they are chained (_mods_chain)
    # stage: the functions ("module:function") timed as that stage, those the worker has
    "state_read": ("flwr_isoloco.clients.node_state:_reload",),
    "unpack": ("flwr_isoloco.clients.diloco_worker:_received_arrays",),
    "load_model": ("flwr_isoloco.clients.diloco_worker:load_model_arrays",),
    "optimizer_restore": ("flwr_isoloco.clients.diloco_worker:restore_moments",),
    "inner_steps": ("flwr_isoloco.clients.diloco_worker:_inner_steps",),
    "optimizer_save": (
        "flwr_isoloco.clients.diloco_worker:save_adamw",
        "flwr_isoloco.clients.diloco_worker:store_moments",
    ),
    "cache_keep": (
        "flwr_isoloco.clients.diloco_worker:keep_moments",
        "flwr_isoloco.clients.worker_cache:keep_moments",
    ),
    "reply": ("flwr_isoloco.clients.diloco_worker:reply_content",),
    "state_write": ("flwr_isoloco.clients.node_state:_save",),
    "state_offload": ("flwr_isoloco.clients.node_state:_offload",),
}


class StageTimer:
    """Wall seconds per stage of one message; nested stages are subtracted from their parent."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._stack: list[float] = []  # child seconds accumulated per open stage

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            sync(self.device)
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                spent = time.perf_counter() - t0
                inner = self._stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + spent - inner
                if self._stack:
                    self._stack[-1] += spent

        timed_fn.__wrapped_stage__ = name
        return timed_fn

    def install(self) -> dict[str, str]:
        """Wrap every stage's function where the worker's modules look it up; returns the
        stages timed (stage -> ``module:function``)."""
        found = {"mods": "isoloco-lm ClientApp mods (download_mod, secagg_mod)"}
        for stage, targets in STAGES.items():
            for target in targets:
                mod_name, fn_name = target.split(":")
                mod = importlib.import_module(mod_name)
                fn = getattr(mod, fn_name, None)
                while hasattr(fn, "__wrapped_stage__"):  # an earlier timer's: time for this one
                    fn = fn.__wrapped__
                if fn is None:
                    continue
                setattr(mod, fn_name, self.wrap(stage, fn))
                found.setdefault(stage, target)
        return found


def _mods_chain(handler, timer: StageTimer | None):
    """The isoloco-lm ClientApp's mods around ``handler`` (``(msg, ctx) -> reply``), each
    timed as stage ``mods`` by ``timer``."""
    from flwr_isoloco.clients import download
    from flwr_isoloco.clients import secagg as sm

    mods = [download.make_download_mod(), sm.secagg_mod]
    if timer is not None:
        mods = [timer.wrap("mods", m) for m in mods]

    def call(msg, ctx):
        fn = handler
        for mod in reversed(mods):
            fn = functools.partial(mod, call_next=fn)
        return fn(msg, ctx)

    return call


def _node_handler(size: Size, device, precision, app: bool, messages: int, timer=None):
    """The handler arm of ``worker_throughput``, wrapped as the isoloco-lm app wraps it
    (its mods; ``with_node_state(temp_dir=True)``: the node's state in this machine's private
    per-run folder, newest file only) when ``app``, else alone (the state in
    ``context.state``)."""
    from flwr_isoloco.clients.node_state import with_node_state

    _bare, handler, _ = arms(size, device, precision, False, messages)
    del _bare
    if app:
        wrapped = with_node_state(handler.handler, temp_dir=True)
        handler.handler = _mods_chain(wrapped, timer)
    return handler


def stage_breakdown(
    size: Size, device: torch.device, precision: str, messages: int = 3, app: bool = True
) -> dict[str, Any]:
    """Median seconds per stage over ``messages`` handler messages after one warm-up, and the
    bare loop's message seconds (alternated with them)."""
    timer = StageTimer(device)
    found = timer.install()
    bare, _h, batches = arms(size, device, precision, False, messages + 1)
    try:
        handler = _node_handler(size, device, precision, app, messages + 1, timer)
        handler.message()
        timed(lambda: bare.message(batches), device)
        rows, bare_s = [], []
        for r in range(messages):
            timer.seconds = {}
            order = ("h", "b") if r % 2 == 0 else ("b", "h")
            for arm in order:
                if arm == "b":
                    bare_s.append(timed(lambda: bare.message(batches), device))
                else:
                    total = timed(handler.message, device)
            row = dict(timer.seconds)
            row["message"] = total
            row["other"] = total - sum(timer.seconds.values())
            rows.append(row)
    finally:
        remove_run_temp_dir(os.getpid())
    keys = [*STAGES, "other", "message"]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    med["overhead"] = statistics.median(r["message"] - r.get("inner_steps", 0.0) for r in rows)
    return {
        "size": size.name,
        "precision": precision,
        "device": str(device),
        "h": size.h,
        "messages": messages,
        "path": "app (mods + with_node_state temp_dir)" if app else "handler alone",
        "median_s": med,
        "rows": rows,
        "bare_msg_s": bare_s,
        "bare_median_s": statistics.median(bare_s),
        "ratio": statistics.median(bare_s) / med["message"],
        "stages_timed": found,
        "package": str(Path(importlib.import_module("flwr_isoloco").__file__).parent),
        "stages_absent": sorted(set(STAGES) - set(found)),
        "load_avg_end": list(os.getloadavg()),
    }


# ----------------------------------------------------------------------------- peak memory
def _rss_now_mib() -> float:
    """This process's resident set now (``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_arm(arm: str, size_name: str, precision: str, messages: int) -> dict[str, Any]:
    """Run one arm alone in this process; its peak RSS (``ru_maxrss``, MiB)."""
    torch.set_num_threads(1)
    import transformers  # noqa: F401  (the runtime both arms load, before the baseline)
    import worker_throughput  # noqa: F401

    import flwr_isoloco.clients  # noqa: F401

    base_mib = _rss_now_mib()  # the runtime: interpreter, torch, transformers, Flower
    size = sizes("cpu", quick=size_name == "tiny", names=[size_name])[size_name]
    device = torch.device("cpu")
    if arm == "bare":
        from worker_throughput import Bare, make_batches

        model = size.build(0)
        bare = Bare(model, device, precision, messages * size.h, size.h, False)
        batches = make_batches(size)
        for _ in range(messages):
            bare.message(batches)
        params = sum(p.numel() for p in model.parameters())
    else:
        from worker_throughput import Handler

        from flwr_isoloco.clients.node_state import with_node_state

        handler = Handler(size, size.build(0), device, precision, messages, size.h, False)
        handler.handler = _mods_chain(with_node_state(handler.handler, temp_dir=True), None)
        try:
            for _ in range(messages):
                handler.message()
        finally:
            remove_run_temp_dir(os.getpid())
        params = sum(v.numel() for v in handler.arrays.to_torch_state_dict().values())
    import flwr_isoloco

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "arm": arm,
        "peak_rss_mib": peak_mib,
        "runtime_rss_mib": base_mib,
        "parameters": params,
        "messages": messages,
        "package": str(Path(flwr_isoloco.__file__).parent),
    }


def peak_rss(size_name: str, precision: str, messages: int = 3) -> dict[str, Any]:
    """Both arms' peak RSS, each in a fresh process; the floor ``16 x parameters`` bytes."""
    out: dict[str, Any] = {"size": size_name, "precision": precision}
    for arm in ("bare", "handler"):
        code = (
            "import json; import worker_stages as w; "
            f"print(json.dumps(w.rss_arm({arm!r}, {size_name!r}, {precision!r}, {messages})))"
        )
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE
        )  # run from this folder: its "" on sys.path must not be the repository's package
        if res.returncode != 0:
            out[arm] = {"error": res.stderr[-2000:]}
            continue
        out[arm] = json.loads(res.stdout.strip().splitlines()[-1])
    if "peak_rss_mib" in out.get("bare", {}) and "peak_rss_mib" in out.get("handler", {}):
        floor = 16 * out["bare"]["parameters"] / 2**20
        out["floor_mib"] = floor
        out["handler_over_floor"] = out["handler"]["peak_rss_mib"] / floor
        out["bare_over_floor"] = out["bare"]["peak_rss_mib"] / floor
        out["handler_over_bare"] = out["handler"]["peak_rss_mib"] / out["bare"]["peak_rss_mib"]
        for arm in ("bare", "handler"):  # what the messages add above the runtime
            if "runtime_rss_mib" in out[arm]:
                above = out[arm]["peak_rss_mib"] - out[arm]["runtime_rss_mib"]
                out[f"{arm}_above_runtime_over_floor"] = above / floor
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    from worker_throughput import OUT, device_of, update_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="before", help="record key (before / after / ...)")
    ap.add_argument("--size", default="135m")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--messages", type=int, default=3)
    ap.add_argument("--rss", action="store_true", help="peak RSS of each arm instead")
    ap.add_argument("--path", choices=("app", "handler"), default="app")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = device_of(args.device)
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/gpu/worker_stages.py " + " ".join(argv or sys.argv[1:]),
        "commit": common.git("rev-parse", "HEAD"),
        "machine": common.machine(),
        "threads": args.threads,
    }
    results = []
    for precision in args.precisions.split(","):
        if args.rss:
            results.append(peak_rss(args.size, precision, args.messages))
        else:
            size = sizes(device.type, names=[args.size])[args.size]
            app = args.path == "app"
            results.append(stage_breakdown(size, device, precision, args.messages, app))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    meta["machine"]["load-avg-end"] = list(os.getloadavg())
    for res in results:  # one part per cell, so cells run apart do not overwrite each other
        kind = "rss" if args.rss else f"stages:{args.path}"
        update_record(args.out, args.phase, f"{kind}:{args.size}:{res['precision']}", res, meta)
    return {"results": results, **meta}


if __name__ == "__main__":
    main()
