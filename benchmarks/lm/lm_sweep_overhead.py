"""Per-message overhead of a Flower/Ray round at M = 128 for the lm_sweep workload.

A FedAvg run of the sweep's main model with H = 1 inner step on G / M = 1 sequence per worker
and 3 rounds, so a round is almost all overhead (message in, context and AdamW state restored,
model built or reused, reply out, merge). Rounds 2-3 are timed (round 1 includes actor start-up).
Per message: ``round_s / M`` (wall, amortised over the Ray actors) and the overhead
``round_s * actors / M - t_step`` with ``t_step`` one inner step measured in process. Runs, in
one process and in this order, the worker's AdamW state in the per-parameter layout (the
previous default: three Flower Arrays per parameter in ``context.state``), in the flat layout
(three Arrays in all; the default now), and the flat layout with the model rebuilt for every
message (``--no-model-cache`` in lm_sweep.py); every run must end at the same validation loss
to the last bit. Writes ``benchmarks/results/lm_overhead.json``.

    nice -n 19 python benchmarks/lm/lm_sweep_overhead.py [--workers 128] [--num-cpus 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import lm_sweep_lib as lib  # noqa: E402
import torch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "lm_overhead.json"


def step_time(size: dict, repeats: int = 20) -> float:
    """Median seconds of one inner AdamW step on one sequence, one thread, in process."""
    from flwr_isoloco.clients.diloco_worker import next_token_loss

    torch.set_num_threads(1)
    model = lib.build_model(size, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, size["vocab"], (size["global_batch"] // 128, size["seq_len"] + 1))
    times = []
    for _ in range(repeats + 3):
        t = time.perf_counter()
        opt.zero_grad()
        next_token_loss(model, x)[0].backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size = {**lib.SIZES["main"], "rounds": args.rounds, "inner_steps": 1, "warmup": 1}
    t_step = step_time(size)
    out = {
        "workers": args.workers,
        "actors": args.num_cpus,
        "rounds": args.rounds,
        "t_step_s": t_step,
        "runs": [],
    }
    variants = (("named", True), ("flat", True), ("flat", False))
    for layout, cache in variants:
        load0 = os.getloadavg()[0]
        res = lib.run_flower(
            "fedavg",
            args.workers,
            0,
            1.0,
            0.0,
            size,
            num_cpus=args.num_cpus,
            model_cache=cache,
            state_layout=layout,
        )
        rounds = res["round_s"][1:]
        per_round = statistics.median(rounds)
        out["runs"].append(
            {
                "state_layout": layout,
                "model_cache": cache,
                "round_s": res["round_s"],
                "wall_s": res["wall_s"],
                "per_message_wall_s": per_round / args.workers,
                "per_message_overhead_s": per_round * args.num_cpus / args.workers - t_step,
                "load_avg_start": load0,
                "load_avg_end": os.getloadavg()[0],
                "val_loss": res["val_loss"],
            }
        )
        print(json.dumps(out["runs"][-1]), flush=True)
    named, flat, nocache = (r["per_message_overhead_s"] for r in out["runs"])
    out["overhead_ratio_flat_over_named"] = flat / named
    out["overhead_ratio_cache_off_over_on"] = nocache / flat
    out["same_val_loss_to_the_bit"] = len({r["val_loss"] for r in out["runs"]}) == 1
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)


if __name__ == "__main__":
    main()
