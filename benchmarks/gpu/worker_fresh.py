"""A deployed node's message: the DiLoCo worker in a fresh ClientApp process per message
(``python benchmarks/gpu/worker_fresh.py --size 135m``; the GPU study of ``benchmarks/gpu/``).

In a deployment the SuperNode starts a new ClientApp process for every message, so nothing of
the previous message survives in memory: the process imports its packages, builds the model,
receives the message and the node's ``context.state``, trains, and sends back the reply and the
state. This emulates that on one machine without a SuperLink: for each message the parent runs
a child process that

- reads the message as Flower's deployment moves it, the deflated objects of its
  ``RecordDict`` (one per ``Array`` chunk, named by sha256), checks every object's id and
  inflates it (:func:`flwr.supercore.inflatable.inflatable_utils.validate_object_content`,
  ``inflate_object_from_contents``): ``transport_in``;
- reads the node's ``Context`` (protobuf, as the SuperNode hands it over): part of ``transport_in``;
- runs the isoloco-lm app's path (its mods, ``with_node_state(temp_dir=True)``, the worker)
  under :class:`worker_stages.StageTimer`, with ``model_fn`` timed as ``model_build``;
- deflates the reply (the object ids are computed) and writes it and the context:
  ``transport_out``.

``import_s`` is the child's seconds from its first import until its imports are done,
``child_s`` until it returns; ``child_wall_s`` - ``child_s`` is the interpreter's start and exit. The bare loop's
message (one process, model and AdamW kept) is measured in the parent between the children::

    overhead_s = child wall seconds - inner_steps_s     (what a message costs beyond its steps)

What it leaves out: the gRPC hops between SuperLink, SuperNode and ClientApp (loopback
sockets), and the SuperLink's own store.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T0 = time.time()
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
import torch  # noqa: E402
import worker_stages as ws  # noqa: E402
import worker_throughput as wt  # noqa: E402


def _deflated(obj) -> dict[str, bytes]:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return {oid: o.deflate() for oid, o in get_all_nested_objects(obj).items()}


def _inflated(root: str, contents: dict[str, bytes]):
    from flwr.supercore.inflatable.inflatable_utils import (
        inflate_object_from_contents,
        validate_object_content,
    )

    for content in contents.values():
        validate_object_content(content)
    return inflate_object_from_contents(root, contents)


def child(work: Path, size_name: str, precision: str, rnd: int, rounds: int, run_id: int):
    """One message in this (fresh) process; its seconds per stage."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.serde import context_from_proto, context_to_proto
    from flwr.proto.message_pb2 import Context as ContextProto

    from flwr_isoloco.clients import make_diloco_train_handler
    from flwr_isoloco.clients.node_state import with_node_state

    import_s = time.time() - T0
    torch.set_num_threads(1)
    size = wt.sizes("cpu", quick=size_name == "tiny", names=[size_name])[size_name]
    timer = ws.StageTimer(torch.device("cpu"))
    timer.install()
    t = time.perf_counter()
    root, contents = pickle.loads((work / "message.pkl").read_bytes())
    arrays = _inflated(root, contents)
    ctx_file = work / "context.pb"
    if ctx_file.is_file():
        proto = ContextProto()
        proto.ParseFromString(ctx_file.read_bytes())
        ctx = context_from_proto(proto)
    else:
        ctx = wt.common.node_context()
        ctx.run_id = run_id  # the parent's: its own run temp folder
    wt.common.node_context()  # Flower's task identity, without which no Message can be built
    transport_in = time.perf_counter() - t
    batches = wt.make_batches(size)
    build = timer.wrap("model_build", lambda _ctx: size.build(0))
    settings = dict(
        lr=wt.HP["lr"], betas=wt.HP["betas"], weight_decay=wt.HP["weight_decay"],
        clip_norm=wt.HP["clip"], local_steps=size.h, num_server_rounds=rounds,
        warmup_steps=size.h, min_lr_ratio=wt.MIN_LR_RATIO,
    )  # fmt: skip
    train = make_diloco_train_handler(
        build,
        lambda _ctx: lambda i: batches[i % len(batches)],
        **wt.worker_kwargs(settings, {"precision": precision}),
    )
    handler = ws._mods_chain(with_node_state(train, temp_dir=True), timer)
    msg = Message(
        RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd})}), 77, "train"
    )
    t = time.perf_counter()
    reply = handler(msg, ctx)
    message_s = time.perf_counter() - t
    if reply.has_error():
        raise RuntimeError(reply.error.reason)
    t = time.perf_counter()
    out = reply.content["arrays"]
    (work / "message.pkl").write_bytes(pickle.dumps((out.object_id, _deflated(out)), protocol=5))
    ctx_file.write_bytes(context_to_proto(ctx).SerializeToString())
    transport_out = time.perf_counter() - t
    stages = dict(timer.seconds)
    stages["other"] = message_s - sum(stages.values())
    return {
        "import_s": import_s,
        "transport_in_s": transport_in,
        "transport_out_s": transport_out,
        "handler_s": message_s,
        "stages_s": stages,
        "child_s": time.time() - T0,  # from its first import to its return
        "package": str(Path(sys.modules["flwr_isoloco"].__file__).parent),
    }


def read_reply(path: Path) -> dict[str, torch.Tensor]:
    """The reply arrays a child wrote (its deflated objects, checked and inflated)."""
    root, contents = pickle.loads(path.read_bytes())
    return _inflated(root, contents).to_torch_state_dict()


def measure(size_name: str, precision: str, messages: int = 3, keep=None) -> dict[str, Any]:
    """``messages + 1`` children (the first is a warm-up of the page cache), alternated with
    bare-loop messages in this process; ``keep``: where to copy the last reply's file."""
    from flwr_isoloco.clients.node_state import remove_run_temp_dir
    from flwr_isoloco.models.hf import model_arrays

    size = wt.sizes("cpu", quick=size_name == "tiny", names=[size_name])[size_name]
    torch.set_num_threads(1)
    template = size.build(0)
    bare = wt.Bare(template, torch.device("cpu"), precision, (messages + 1) * size.h, size.h, False)
    batches = wt.make_batches(size)
    rows, bare_s = [], []
    remove_run_temp_dir(os.getpid())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        arrays = model_arrays(template)
        (work / "message.pkl").write_bytes(pickle.dumps((arrays.object_id, _deflated(arrays))))
        del arrays
        for rnd in range(1, messages + 2):
            code = (
                "import json; import worker_fresh as f; "
                f"print('ROW', json.dumps(f.child(f.Path({str(work)!r}), {size_name!r}, "
                f"{precision!r}, {rnd}, {messages + 1}, {os.getpid()})))"
            )
            t = time.perf_counter()
            res = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE
            )  # from this folder: its "" on sys.path must not be the repository's package
            wall = time.perf_counter() - t
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-3000:])
            row = json.loads(res.stdout.split("ROW ", 1)[1].splitlines()[0])
            row["child_wall_s"] = wall
            bare_s.append(wt.timed(lambda: bare.message(batches), torch.device("cpu")))
            if rnd > 1:
                rows.append(row)
        if keep is not None:
            Path(keep).write_bytes((work / "message.pkl").read_bytes())
    remove_run_temp_dir(os.getpid())
    return _summary(size, precision, rows, bare_s[1:])


def _summary(size, precision, rows, bare_s) -> dict[str, Any]:
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    stages = sorted({k for r in rows for k in r["stages_s"]})
    inner = med(lambda r: r["stages_s"].get("inner_steps", 0.0))
    wall = med(lambda r: r["child_wall_s"])
    return {
        "size": size.name,
        "precision": precision,
        "h": size.h,
        "messages": len(rows),
        "child_wall_s": wall,
        "import_s": med(lambda r: r["import_s"]),
        "child_s": med(lambda r: r["child_s"]),
        "transport_in_s": med(lambda r: r["transport_in_s"]),
        "transport_out_s": med(lambda r: r["transport_out_s"]),
        "handler_s": med(lambda r: r["handler_s"]),
        "stages_median_s": {k: med(lambda r, k=k: r["stages_s"].get(k, 0.0)) for k in stages},
        "overhead_s": wall - inner,
        "overhead_in_handler_s": med(lambda r: r["handler_s"]) - inner,
        "bare_msg_s": bare_s,
        "bare_median_s": statistics.median(bare_s),
        "ratio": statistics.median(bare_s) / wall,
        "package": sorted({r["package"] for r in rows}),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="after")
    ap.add_argument("--size", default="135m")
    ap.add_argument("--precisions", default="fp32")
    ap.add_argument("--messages", type=int, default=3)
    ap.add_argument("--out", type=Path, default=wt.OUT)
    args = ap.parse_args(argv)
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/gpu/worker_fresh.py " + " ".join(argv or sys.argv[1:]),
        "commit": wt.common.git("rev-parse", "HEAD"),
        "machine": wt.common.machine(),
    }
    out = []
    for precision in args.precisions.split(","):
        res = measure(args.size, precision, args.messages)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
        meta["machine"]["load-avg-end"] = list(os.getloadavg())
        wt.update_record(args.out, args.phase, f"fresh:{args.size}:{precision}", res, meta)
        out.append(res)
    return {"results": out, **meta}


if __name__ == "__main__":
    main()
