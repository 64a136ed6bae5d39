"""One malicious site vs the weight bound, and an honest size-skewed federation.

Real Flower runs (Ray simulation through ``flwr.simulation.run_simulation``) of the isoloco-lm
app's ServerApp (``run_server``) and its DiLoCo worker, 8 nodes, a small LLaMA. Cases:

- ``honest``: every node honest, equal ``num-examples``;
- ``skew-on`` / ``skew-off``: node ``p`` reports ``num-examples x 10**(p/7)`` (a 10x spread),
  default bound (``max-weight-ratio=5``) vs off: the bound must change nothing;
- ``attack-off`` / ``attack-on``: node 3 sends the *reverse* of its honest update
  (``theta + (theta - theta_i)``) with ``num-examples = 1e12``, bound off vs the default.

Each case appends ``{case, strategy, val_loss per round, ...}`` to
``benchmarks/results/weight_bound.json`` (cases already there are skipped: resumable); the
table in ``docs/strategies.md`` is then regenerated from that file.

    nice -n 10 python benchmarks/privacy/weight_bound_bench.py [--strategies isoloco diloco] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("simulations/isoloco-lm")
RESULTS = common.RESULTS / "weight_bound.json"
DOC = REPO / "docs" / "strategies.md"
BEGIN, END = "<!-- BEGIN WEIGHT BOUND TABLE -->", "<!-- END WEIGHT BOUND TABLE -->"
NODES, BAD = 8, 3
CASES = ("honest", "skew-on", "skew-off", "attack-off", "attack-on")
RC: dict = {}  # the run config of the current case (read by the ClientApp wrapper in Ray workers)


def run_config(strategy: str, case: str, out: Path, quick: bool) -> dict:
    rc = {
        "num-server-rounds": 3 if quick else 8,
        "output-dir": str(out),
        "checkpoint": False,
        "strategy.name": strategy,
        "strategy.min-nodes": NODES,
        "train.local-steps": 3 if quick else 10,
        "train.warmup-steps": 2 if quick else 20,  # the warm-up must fit in the run
        **common.SMALL_LM,
        "strategy.max-weight-ratio": 0.0 if case.endswith("-off") else 5.0,
    }
    return rc


def _client_app():
    from flwr.app import ArrayRecord
    from flwr.clientapp import ClientApp
    from isoloco_lm import client_app

    app = ClientApp()

    @app.train()
    def train(msg, context):
        cfg = json.loads(os.environ["WEIGHT_BOUND_RC"])
        context = common.with_run_config(context, cfg["rc"])
        theta = msg.content["arrays"].to_torch_state_dict()
        reply = client_app.train(msg, context)
        if reply.has_error():
            return reply
        pid = int(context.node_config["partition-id"])
        metrics = reply.content["metrics"]
        if cfg["case"].startswith("skew"):
            metrics["num-examples"] = float(metrics["num-examples"]) * 10 ** (pid / 7)
        if cfg["case"].startswith("attack") and pid == BAD:
            mine = reply.content["arrays"].to_torch_state_dict()
            reply.content["arrays"] = ArrayRecord({k: 2 * theta[k] - mine[k] for k in theta})
            metrics["num-examples"] = 1e12
        return reply

    return app


def run_case(strategy: str, case: str, quick: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"wb-{strategy}-{case}-"))
    rc = run_config(strategy, case, out, quick)
    os.environ["WEIGHT_BOUND_RC"] = json.dumps({"rc": rc, "case": case})
    res, wall = common.run_lm_app(rc, _client_app(), NODES)
    return {
        "case": case,
        "strategy": strategy,
        "status": res["status"],
        "initial_val_loss": res["initial"]["val-loss"],
        "val_loss": [r["val-loss"] for r in res["rounds"]],
        "replies_used": [r["replies-used"] for r in res["rounds"]],
        "wall_s": wall,
        "quick": quick,
    }


def write_table(records: list[dict], doc: Path = DOC) -> None:
    """The validation-loss table (one row per strategy, one column per case) into ``doc``."""
    full = [r for r in records if not r["quick"]]
    strategies = sorted({r["strategy"] for r in full}, reverse=True)
    lines = ["| strategy | initial | " + " | ".join(CASES) + " |", "|---" * (len(CASES) + 2) + "|"]
    for st in strategies:
        by_case = {r["case"]: r for r in full if r["strategy"] == st}
        init = next(iter(by_case.values()))["initial_val_loss"]
        cells = [f"{by_case[c]['val_loss'][-1]:.4f}" if c in by_case else "" for c in CASES]
        lines.append(f"| {st} | {init:.4f} | " + " | ".join(cells) + " |")
    common.write_block(doc, BEGIN, END, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=["isoloco", "diloco"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    # Ray's workers import this file (the ClientApp above) and the LM app
    common.export_path("benchmarks/privacy", "simulations/isoloco-lm")
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    for strategy in args.strategies:
        for case in args.cases:
            if any(
                r["strategy"] == strategy and r["case"] == case and r["quick"] == args.quick
                for r in done
            ):
                continue
            rec = run_case(strategy, case, args.quick)
            print(json.dumps(rec), flush=True)
            done.append(rec)
            common.save_json(args.out, done)
    if args.out == RESULTS and any(not r["quick"] for r in done):
        write_table(done)


if __name__ == "__main__":
    main()
