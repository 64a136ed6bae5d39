"""Privacy-utility table: central DP at epsilon in {inf, 8, 2, 0.5} (delta 1e-5) on the isoloco-lm app.

Real Flower runs (Ray simulation through ``flwr.simulation.run_simulation``) of the app's
ServerApp (``run_server``) and its DiLoCo worker, M simulated sites, a small LLaMA. Per cell
(strategy x M x epsilon) the noise multiplier ``z`` is the smallest that keeps epsilon after
the run's rounds at or under the target (:func:`~flwr_isoloco.strategies.diloco.privacy.noise_for_epsilon`,
Flower's accountant, no sampling amplification), the clipping norm ``C`` is ``--clip`` and
``strategy.dp-max-epsilon`` is the target itself (the run would stop before passing it).
``epsilon = inf`` is the plain run (no clipping, no noise).

Each cell appends ``{strategy, nodes, epsilon, z, clip, val_loss per round, dp_epsilon per
round, ...}`` to ``benchmarks/results/privacy_utility.json`` (cells already there are skipped:
resumable); the table in ``docs/privacy.md`` is regenerated from that file alone::

    nice -n 10 python benchmarks/privacy/privacy_utility.py [--nodes 8 32] [--quick]
    python benchmarks/privacy/privacy_utility.py --table          # the docs table from the json only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("simulations/isoloco-lm", "")
RESULTS = common.RESULTS / "privacy_utility.json"
DOC = REPO / "docs" / "privacy.md"
BEGIN, END = "<!-- BEGIN PRIVACY UTILITY TABLE -->", "<!-- END PRIVACY UTILITY TABLE -->"
EPSILONS = (math.inf, 8.0, 2.0, 0.5)
DELTA = 1e-5
ENV = "PRIVACY_UTILITY_RC"


def rounds(quick: bool) -> int:
    return 2 if quick else 5


def run_config(strategy: str, nodes: int, eps: float, clip: float, out: Path, quick: bool) -> dict:
    """The app's run config of one cell (DP keys from :func:`dp_keys`)."""
    return {
        "num-server-rounds": rounds(quick),
        "output-dir": str(out),
        "checkpoint": False,
        "round-timeout": 3600.0,  # a loaded machine must not turn slow replies into missing ones
        "strategy.name": strategy,
        "strategy.min-nodes": nodes,
        "train.local-steps": 3 if quick else 10,
        "train.warmup-steps": 2 if quick else 10,  # the warm-up must fit in the run
        **common.SMALL_LM,
        **dp_keys(eps, clip, rounds(quick)),
    }


def dp_keys(eps: float, clip: float, num_rounds: int) -> dict:
    """``strategy.dp-*`` for a target epsilon (none for ``inf``)."""
    if math.isinf(eps):
        return {}
    from flwr_isoloco.strategies.diloco.privacy import noise_for_epsilon

    return {
        "strategy.dp-clipping-norm": clip,
        "strategy.dp-noise-multiplier": noise_for_epsilon(eps, num_rounds, DELTA),
        "strategy.dp-delta": DELTA,
        "strategy.dp-max-epsilon": eps,
    }


def _client_app():
    """The app's ClientApp, seeing this cell's run config (run_simulation passes none)."""
    from flwr.clientapp import ClientApp
    from isoloco_lm import client_app

    app = ClientApp()

    @app.train()
    def train(msg, context):
        return client_app.train(msg, common.with_run_config(context, json.loads(os.environ[ENV])))

    return app


def run_cell(strategy: str, nodes: int, eps: float, clip: float, quick: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"pu-{strategy}-{nodes}-{eps}-"))
    rc = run_config(strategy, nodes, eps, clip, out, quick)
    os.environ[ENV] = json.dumps(rc)
    res, wall = common.run_lm_app(rc, _client_app(), nodes)
    rows = res["rounds"]
    return {
        "strategy": strategy,
        "nodes": nodes,
        "epsilon": None if math.isinf(eps) else eps,
        "z": rc.get("strategy.dp-noise-multiplier", 0.0),
        "clip": None if math.isinf(eps) else clip,
        "status": res["status"],
        "initial_val_loss": res["initial"]["val-loss"],
        "val_loss": [r["val-loss"] for r in rows],
        "dp_epsilon": [r.get("dp-epsilon") for r in rows],
        "unclipped_fraction": [r.get("dp-unclipped-fraction") for r in rows],  # adaptive C only
        "pseudo_grad_norm": [r.get("pseudo-grad-norm") for r in rows],
        "model_parameters": res.get("model-parameters"),
        "wall_s": wall,
        "quick": quick,
    }


def _eps_label(e: float | None) -> str:
    return "inf" if e is None else f"{e:g}"


def table(records: list[dict], quick: bool = False) -> str:
    """One row per (strategy, M, epsilon): z, C, epsilon spent, final loss and its cost."""
    recs = [r for r in records if r["quick"] == quick]
    lines = [
        "| strategy | M | target epsilon | z | C | noise std on the mean (z C / M) | epsilon spent "
        "| final val loss | vs no DP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {None: 0, **{e: i + 1 for i, e in enumerate(sorted(EPSILONS[1:], reverse=True))}}
    recs.sort(key=lambda r: (r["strategy"] != "diloco", r["nodes"], order.get(r["epsilon"], 9)))
    for r in recs:
        base = next(
            (
                b
                for b in recs
                if (b["strategy"], b["nodes"], b["epsilon"]) == (r["strategy"], r["nodes"], None)
            ),
            None,
        )
        last = r["val_loss"][-1] if r["val_loss"] else float("nan")
        cost = "" if base is None or r is base else f"{last - base['val_loss'][-1]:+.3f}"
        spent = next((e for e in reversed(r["dp_epsilon"]) if e is not None), None)
        clip = "" if r["clip"] is None else f"{r['clip']:g}"
        std = "" if r["clip"] is None else f"{r['z'] * r['clip'] / r['nodes']:.3g}"
        spent_s = "" if spent is None else f"{spent:.3f}"
        lines.append(
            f"| {r['strategy']} | {r['nodes']} | {_eps_label(r['epsilon'])} | {r['z']:.3g} | "
            f"{clip} | {std} | {spent_s} | {last:.4f} | {cost} |"
        )
    return "\n".join(lines)


def write_table(records: list[dict], doc: Path = DOC) -> None:
    """Replace the text between the markers of ``doc`` with :func:`table`."""
    common.write_block(doc, BEGIN, END, table(records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=["diloco", "isoloco"])
    ap.add_argument("--nodes", nargs="+", type=int, default=[8])
    ap.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    ap.add_argument("--clip", type=float, default=1.0, help="clipping norm C")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 3 local steps")
    ap.add_argument("--table", action="store_true", help="only regenerate the docs table")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    if not args.table:
        common.export_path("", "simulations/isoloco-lm")
        for strategy in args.strategies:
            for nodes in args.nodes:
                for eps in args.epsilons:
                    key = (strategy, nodes, None if math.isinf(eps) else eps, args.quick)
                    if any(
                        (r["strategy"], r["nodes"], r["epsilon"], r["quick"]) == key for r in done
                    ):
                        continue
                    rec = run_cell(strategy, nodes, eps, args.clip, args.quick)
                    print(json.dumps(rec), flush=True)
                    done.append(rec)
                    common.save_json(args.out, done)
    if args.out == RESULTS and any(not r["quick"] for r in done):
        write_table(done)
    else:
        print(table(done, quick=args.quick))


if __name__ == "__main__":
    main()
