"""The byte-bigram example (``examples/swap-fedavg``) under each strategy the docs compare.

Runs the example in-process on the fake grid (3 nodes, 3 rounds, 10 Adam steps at lr 0.1 per
round: :func:`benchmarks.isoloco_dropin.bigram_case`) once per strategy and writes the
validation loss per round (round 0 first) to ``benchmarks/results/swap_fedavg_bigram.json``,
with the merge rule, outer lr and momentum each strategy resolved to and the commit. The
README's bigram sentence is generated from this file (``benchmarks/docs/docs_claims.py``).

    .venv/bin/python benchmarks/dropin/swap_fedavg_bigram.py
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402
from dropin_apps import bigram_case  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flwr_isoloco.strategies import DiLoCo, IsoLoCo  # noqa: E402

OUT = common.RESULTS / "swap_fedavg_bigram.json"

STRATEGIES = {
    "FedAvg": lambda: FedAvg(fraction_train=1.0, min_available_nodes=2),
    "DiLoCo()": lambda: DiLoCo(),
    "IsoLoCo()": lambda: IsoLoCo(),
    "IsoLoCo(preset='isoloco-paper')": lambda: IsoLoCo(preset="isoloco-paper"),
    "IsoLoCo(merge='iso_c', outer_lr=0.7, outer_momentum=0.9)": lambda: IsoLoCo(
        merge="iso_c", outer_lr=0.7, outer_momentum=0.9
    ),
}


def _settings(strategy: object) -> dict:
    """The merge rule and outer step a strategy resolved to (FedAvg: the mean, lr 1, no momentum)."""
    outer = getattr(strategy, "outer", None)
    if outer is None:
        return {"merge": "mean", "outer-lr": 1.0, "outer-momentum": 0.0}
    return {
        "merge": strategy.merge_name,
        "outer-lr": outer.lr,
        "outer-momentum": outer.momentum,
        "preset": getattr(strategy, "preset", None),
    }


def main() -> None:
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.WARNING)
    runs = {}
    for label, factory in STRATEGIES.items():
        t0 = time.monotonic()
        losses = bigram_case(factory, rounds=3)
        runs[label] = {
            **_settings(factory()),
            "val-loss": losses,
            "wall-s": round(time.monotonic() - t0, 1),
        }
        print(f"{label}: {' -> '.join(f'{x:.3f}' for x in losses)}", flush=True)

    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": common.git("rev-parse", "HEAD"),
        "uncommitted-changes": bool(common.git("status", "--porcelain", "--untracked-files=no")),
        "config": {
            "app": "examples/swap-fedavg",
            "nodes": 3,
            "rounds": 3,
            "local-steps": 10,
            "lr": 0.1,
            "engine": "in-process fake grid (tests/fakegrid.py)",
        },
        "runs": runs,
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
