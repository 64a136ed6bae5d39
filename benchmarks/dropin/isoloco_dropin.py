"""IsoLoCo as a drop-in for FedAvg: why the paper's update diverges in a small app, and the sweep.

Runs ``examples/digits`` (small CNN on sklearn's 8x8 digits, SGD inner steps, 4 nodes) in-process
on the fake grid (``tests/fakegrid.py``; same weights as Ray) with each strategy variant, and
records per round and per tensor (``--diagnose``):

- ``theta``: ``||theta||_F`` after the round; ``mean``: ``||g||_F`` of the weighted mean
  pseudo-gradient ``g = sum_i w_i (theta - theta_i)``; ``step``: ``||theta_old - theta_new||_F``;
  ``ratio``: step / mean (FedAvg: 1);
- for 2-D tensors, ``s_max``, ``s_min`` and ``s_mean`` of ``g``'s singular values: Iso-C sets
  every singular value to ``s_mean``, so it multiplies the direction of ``s_min`` by
  ``gain = s_mean / s_min``;
  and ``rank``, its numerical rank (of ``r = min(m, n)``): the ``r - rank`` null directions
  are the ones Iso-C moves by ``s_mean`` although the data does not determine them;
- ``echo``: ``||g_r|| / ||step_{r-1}||``, how far the clients push back against the last
  outer step (about ``c x`` the overshoot; > 1 once the outer step overshoots).

The sweep (``--sweep``) runs FedAvg, DiLoCo(), IsoLoCo() and IsoLoCo(preset="isoloco-paper")
for seeds 0-2 on IID and Dirichlet(0.5) shards and writes final test accuracies; ``--extra``
adds an MLP on the same data. ``--quick``: 1 seed, fewer rounds. Results:
``benchmarks/results/isoloco_dropin.json``.

    PYTHONPATH=. .venv/bin/python benchmarks/dropin/isoloco_dropin.py --diagnose --sweep [--quick]
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/isoloco_dropin.py --lr-grid   # the preset's lr
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/isoloco_dropin.py --bn --docs  # BatchNorm table

``--bn``: the BatchNorm CNN (``model="cnn-bn"``) for FedAvg, ``DiLoCo()``, ``IsoLoCo()`` and
both with ``buffers="none"`` (the outer step owning the running statistics, as before), seeds
0-2, IID and Dirichlet(0.5), plus the running-variance case (``--negative-variance``), written to
``benchmarks/results/isoloco_dropin_bn.json``; ``--docs`` writes the table into
docs/strategies.md ("Buffers"; ``--table --bn --docs`` from the saved JSON, no run).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("tests", "examples/digits", "benchmarks/dropin")

from dropin_apps import (  # noqa: E402, F401  (bigram_case re-exported: swap_fedavg_bigram, tests)
    _paper,
    bigram_case,
    lm_case,
    negative_variance,
)
from flwr.app import ArrayRecord, Context, RecordDict  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flwr_isoloco.merging.iso_range import iso_c_range, numerical_rank  # noqa: E402
from flwr_isoloco.merging.rules import MergeRule, _streaming  # noqa: E402
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings  # noqa: E402

OUT = common.RESULTS / "isoloco_dropin.json"
OUT_BN = common.RESULTS / "isoloco_dropin_bn.json"
"""``--bn`` / ``--negative-variance`` records (their own file: the other sweeps are rerun apart)."""


def _pattern_only(names: list[str]) -> str:
    return "^(" + "|".join(n.replace(".", r"\.") for n in names) + ")$"


RANGE_RULE = MergeRule("iso_c_range", _streaming(iso_c_range), iso_c_range)
"""Iso-C on the numerical range at Iso-C's own scale (not registered: a diagnosis step)."""

# name -> factory; the diagnosis variants isolate one factor each
DIAGNOSIS: dict[str, Callable[[], object]] = {
    "FedAvg": lambda: FedAvg(),
    "DiLoCo()": lambda: DiLoCo(),
    "DiLoCo(lr=1.8, mu=0.8)": lambda: DiLoCo(outer_lr=1.8, outer_momentum=0.8),
    "paper": lambda: _paper(),
    "paper, mu=0": lambda: _paper(outer_momentum=0.0),
    "paper, Iso-C on fc1 only": lambda: _paper(
        merge_settings=MergeSettings(options={"spectral_pattern": _pattern_only(["fc1.weight"])})
    ),
    "Iso-C, lr=0.7, mu=0.9": lambda: _paper(outer_lr=0.7, outer_momentum=0.9),
    "Iso-C on the range, lr=0.7, mu=0.9": lambda: _paper(
        merge=RANGE_RULE, outer_lr=0.7, outer_momentum=0.9
    ),
    "paper lr/mu, iso_c_matched": lambda: _paper(merge="iso_c_matched"),
    "IsoLoCo()": lambda: IsoLoCo(),
}
SWEEP: dict[str, Callable[[], object]] = {
    "FedAvg": lambda: FedAvg(),
    "DiLoCo()": lambda: DiLoCo(),
    "IsoLoCo()": lambda: IsoLoCo(),
    "IsoLoCo(preset='isoloco-paper')": lambda: _paper(),
}
BN_SWEEP: dict[str, Callable[[], object]] = {
    "FedAvg": lambda: FedAvg(),
    "DiLoCo()": lambda: DiLoCo(),
    "IsoLoCo()": lambda: IsoLoCo(),
    "DiLoCo(buffers='none')": lambda: DiLoCo(merge_settings=MergeSettings(buffers="none")),
    "IsoLoCo(buffers='none')": lambda: IsoLoCo(merge_settings=MergeSettings(buffers="none")),
}
"""The BatchNorm CNN (``model="cnn-bn"``): the defaults, which merge the running statistics as
FedAvg does, and ``buffers="none"``, the outer step owning them (the behaviour before)."""
BN_BEGIN, BN_END = "<!-- BEGIN BUFFERS TABLE -->", "<!-- END BUFFERS TABLE -->"
DOC = REPO / "docs" / "strategies.md"


def _sd(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in arrays.to_torch_state_dict().items()}


class Recorder:
    """Wraps a strategy's configure_train / aggregate_train to record the per-tensor numbers."""

    def __init__(self, strategy) -> None:
        self.rounds: list[dict] = []
        self._theta: dict[str, torch.Tensor] = {}
        self._last_step: dict[str, float] = {}
        conf, agg = strategy.configure_train, strategy.aggregate_train

        def configure_train(server_round, arrays, config, grid):
            self._theta = _sd(arrays)
            return conf(server_round, arrays, config, grid)

        def aggregate_train(server_round, replies):
            replies = list(replies)
            g = self._mean_delta(replies)
            new, metrics = agg(server_round, replies)
            if new is not None and g:
                self.rounds.append(self._stats(g, _sd(new)))
            return new, metrics

        strategy.configure_train, strategy.aggregate_train = configure_train, aggregate_train

    def _mean_delta(self, replies) -> dict[str, torch.Tensor]:
        ok = [m for m in replies if not m.has_error()]
        if not ok:
            return {}
        w = [float(m.content["metrics"]["num-examples"]) for m in ok]
        tot = sum(w)
        g = {k: torch.zeros_like(v) for k, v in self._theta.items()}
        for m, wi in zip(ok, w, strict=True):
            sd = _sd(m.content["arrays"])
            for k in g:
                g[k] += (wi / tot) * (self._theta[k] - sd[k])
        return g

    def _stats(self, g: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
        out = {}
        for k, gk in g.items():
            step = float((self._theta[k] - new[k]).norm())
            mean = float(gk.norm())
            row = {
                "theta": float(new[k].norm()),
                "mean": mean,
                "step": step,
                "ratio": step / mean if mean > 0 else 0.0,
                "echo": mean / self._last_step[k] if self._last_step.get(k) else 0.0,
            }
            if gk.ndim == 2:
                s = torch.linalg.svdvals(gk.double())
                row.update(
                    s_max=float(s[0]),
                    s_min=float(s[-1]),
                    s_mean=float(s.mean()),
                    gain=float(s.mean() / s[-1]) if s[-1] > 0 else math.inf,
                    rank=numerical_rank(
                        torch.linalg.svdvals(gk), tuple(gk.shape)
                    ),  # fp32, as the rule
                    r=int(s.numel()),
                )
            self._last_step[k] = step
            out[k] = row
        return out


def run_digits(
    factory: Callable[[], object],
    partitioner: str,
    seed: int,
    rounds: int,
    record: bool = False,
    model: str = "cnn",
    split: str = "test",
) -> dict:
    """One federation of the digits app; final accuracy, accuracy per round, records.
    ``split="validation"`` evaluates on the app's held-out training images (for tuning)."""
    from digits import client_app, server_app
    from fakegrid import FakeGrid

    rc = {
        "num-server-rounds": rounds,
        "partitioner": partitioner,
        "partition-seed": seed,
        "model-seed": seed,
        "model": model,
        "split": split,
        "output-dir": "",
    }
    strategy = factory()
    if hasattr(strategy, "seed"):
        strategy.seed = seed
    rec = Recorder(strategy) if record else None
    grid = FakeGrid(client_app.app, num_nodes=4, run_config=rc)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    acc = server_app.run_federation(grid, ctx, strategy)
    result = server_app.LAST["result"]
    loss = {r: float(m["loss"]) for r, m in result.evaluate_metrics_serverapp.items()}
    out = {"final": acc[max(acc)], "accuracy": acc, "loss": loss}
    if rec is not None:
        out["rounds"] = rec.rounds
    return out


def diagnose(rounds: int, partitioner: str = "iid", seed: int = 0) -> dict:
    res = {}
    for name, factory in DIAGNOSIS.items():
        t0 = time.perf_counter()
        res[name] = run_digits(factory, partitioner, seed, rounds, record=True)
        print(
            f"[diagnose] {name}: final acc {res[name]['final']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return res


def lr_scan(rounds: int, seed: int = 0) -> dict:
    """Mean vs iso_c at mu = 0.8 and lr 1.0..1.6: where the outer step stops being stable."""
    res: dict = {}
    for part in ("iid", "dirichlet"):
        for lr in (1.0, 1.2, 1.4, 1.6):
            for merge in ("mean", "iso_c"):
                r = run_digits(
                    lambda lr=lr, merge=merge: DiLoCo(merge=merge, outer_lr=lr, outer_momentum=0.8),
                    part,
                    seed,
                    rounds,
                )
                cell = {"final": r["final"], "max_loss": max(r["loss"].values())}
                res.setdefault(part, {}).setdefault(merge, {})[str(lr)] = cell
                print(f"[scan] {part} {merge} lr {lr} mu 0.8: {cell}", flush=True)
    return res


def sweep(
    rounds: int,
    seeds: list[int],
    model: str = "cnn",
    parts: tuple[str, ...] = ("iid", "dirichlet"),
    variants: dict[str, Callable[[], object]] | None = None,
) -> dict:
    res: dict = {}
    for part in parts:
        for seed in seeds:
            for name, factory in (variants or SWEEP).items():
                r = run_digits(factory, part, seed, rounds, model=model)
                res.setdefault(part, {}).setdefault(name, {})[str(seed)] = r["final"]
                print(f"[sweep {model}] {part} seed {seed} {name}: {r['final']:.3f}", flush=True)
    return res


DROPIN_LRS = (0.35, 0.5, 0.7)
"""The "dropin" preset's outer lr grid (momentum 0.9): the preset takes the largest lr that
passes every app of :func:`lr_grid` (digits CNN/MLP cells >= FedAvg - 0.01, the byte bigram's
loss down by 0.5 in 3 rounds as tests/test_swap_fedavg_example.py asks)."""


def lr_grid(rounds: int, seeds: list[int]) -> dict:
    """IsoLoCo(outer_lr=lr) (dropin otherwise) for lr in DROPIN_LRS on the bigram and every
    digits cell, and FedAvg-paired failures per lr."""
    res: dict = {}
    for lr in DROPIN_LRS:
        cell: dict = {"bigram": bigram_case(lambda lr=lr: IsoLoCo(outer_lr=lr))}
        for model in ("cnn", "mlp"):
            for part in ("iid", "dirichlet"):
                for seed in seeds:
                    r = run_digits(
                        lambda lr=lr: IsoLoCo(outer_lr=lr), part, seed, rounds, model=model
                    )
                    cell.setdefault(model, {}).setdefault(part, {})[str(seed)] = r["final"]
        res[str(lr)] = cell
        print(f"[lr-grid] lr {lr}: bigram {[round(x, 3) for x in cell['bigram']]}", flush=True)
    return res


def check(res: dict, tol: float = 0.01, names: tuple[str, ...] = ("IsoLoCo()",)) -> list[str]:
    """Cells where a strategy in ``names`` < FedAvg - tol (seed-paired)."""
    bad = []
    for part, cells in res.items():
        for seed, fed in cells["FedAvg"].items():
            for name in names:
                got = cells[name][seed]
                if got < fed - tol:
                    bad.append(f"{part} seed {seed}: {name} {got:.3f} < FedAvg {fed:.3f} - {tol}")
    return bad


def table(res: dict, variants: dict | None = None) -> str:
    """Markdown: one row per strategy, one column per (shard, seed) cell, final test accuracy."""
    cells = [
        (p, seed) for p in ("iid", "dirichlet") if p in res for seed in sorted(res[p]["FedAvg"])
    ]
    head = "| strategy | " + " | ".join(f"{p} s{seed}" for p, seed in cells) + " |"
    rows = [head, "|---" * (len(cells) + 1) + "|"]
    for name in [n for n in (variants or SWEEP) if n in res[cells[0][0]]]:
        vals = " | ".join(f"{res[p][name][seed]:.3f}" for p, seed in cells)
        rows.append(f"| {name} | {vals} |")
    return "\n".join(rows)


def code_version() -> str:
    """The commit measured: ``git rev-parse HEAD`` (``+dirty`` when flwr_isoloco/ or the app has
    uncommitted changes), or ``$BENCH_COMMIT`` where the tree is an exported snapshot."""
    import os

    head = common.git("rev-parse", "HEAD")
    if not head:
        return os.environ.get("BENCH_COMMIT", "unknown")
    dirty = common.git("status", "--porcelain", "flwr_isoloco", "examples/digits")
    return head + ("+dirty" if dirty else "")


def bn_docs(saved: dict, doc: Path = DOC) -> None:
    """Write the BatchNorm table (``saved["sweep_bn"]``) and the running-variance record
    between the BUFFERS TABLE markers of docs/strategies.md."""
    cfg = saved.get("config_bn", {})
    lines = [
        f'Final test accuracy, `examples/digits` `model="cnn-bn"`, {cfg.get("nodes", 4)} nodes,'
        f" {cfg.get('rounds', 10)} rounds (`benchmarks/results/isoloco_dropin_bn.json`, "
        "`sweep_bn`):",
        "",
        table(saved["sweep_bn"], BN_SWEEP),
        "",
        "Cells below FedAvg - 0.01 (`DiLoCo()`, `IsoLoCo()`): "
        + ("; ".join(saved.get("sweep_bn_failures", [])) or "none")
        + ".",
    ]
    nv = saved.get("negative_variance")
    if nv:
        lines += [
            "",
            "Server `running_var` after rounds 1-5 when it starts at 1.0 and every node "
            "reports 0.2 (`negative_variance`; FedAvg: 0.2 from round 1):",
            "",
            '| strategy | outer step owns the buffers (before) | default `buffers="auto"` |',
            "|---|---|---|",
        ]
        before = saved.get("negative_variance_before", {})
        for name, seen in nv.items():
            old = " / ".join(f"{v:g}" for v in before.get(name, [])) or "-"
            lines.append(f"| {name} | {old} | {' / '.join(f'{v:g}' for v in seen)} |")
    common.write_block(doc, BN_BEGIN, BN_END, "\n".join(lines))
    print(f"wrote the buffers table into {doc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--scan", action="store_true", help="outer lr scan at mu = 0.8")
    ap.add_argument("--extra", action="store_true", help="also the MLP sweep")
    ap.add_argument("--lm", action="store_true", help="the LM app in-process, 3 strategies")
    ap.add_argument("--lr-grid", action="store_true", help="the dropin preset's lr grid")
    ap.add_argument("--lm-only", nargs="*", help="LM variants whose name starts with these")
    ap.add_argument("--quick", action="store_true", help="1 seed, 6 rounds")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--parts", nargs="+", default=["iid", "dirichlet"], help="shardings to sweep")
    ap.add_argument("--out", type=Path, default=None, help=f"{OUT.name}; --bn: {OUT_BN.name}")
    ap.add_argument("--table", action="store_true", help="print the sweeps in --out as markdown")
    ap.add_argument(
        "--negative-variance", action="store_true", help="the drop-in's BatchNorm running_var case"
    )
    ap.add_argument("--bn", action="store_true", help="the BatchNorm CNN sweep (+ running_var)")
    ap.add_argument("--docs", action="store_true", help="write the BatchNorm table into docs")
    args = ap.parse_args()
    if args.out is None:
        args.out = OUT_BN if args.bn or args.negative_variance else OUT
    if args.table:
        saved = json.loads(args.out.read_text())
        for key in ("sweep", "sweep_mlp", "sweep_bn"):
            if key in saved:
                print(f"{key}:\n{table(saved[key], BN_SWEEP if key == 'sweep_bn' else None)}\n")
        if args.docs:
            bn_docs(saved)
        return
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.WARNING)
    rounds = 6 if args.quick else args.rounds
    seeds = [0] if args.quick else [0, 1, 2]
    out: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    out["config"] = {"rounds": rounds, "seeds": seeds, "nodes": 4, "app": "examples/digits"}
    if args.diagnose:
        out["diagnosis"] = diagnose(rounds)
    if args.scan:
        out["lr_scan"] = lr_scan(rounds)
    if args.sweep:
        out["sweep"] = sweep(rounds, seeds, parts=tuple(args.parts))
        out["sweep_failures"] = check(out["sweep"])
    if args.extra:
        out["sweep_mlp"] = sweep(rounds, seeds, model="mlp", parts=tuple(args.parts))
        out["sweep_mlp_failures"] = check(out["sweep_mlp"])
    if args.lr_grid:
        out["lr_grid"] = lr_grid(rounds, seeds)
        out["bigram_fedavg"] = bigram_case(
            lambda: FedAvg(fraction_train=1.0, min_available_nodes=2)
        )
    if args.bn:
        out["config_bn"] = {**out["config"], "model": "cnn-bn", "commit": code_version()}
        out["sweep_bn"] = sweep(rounds, seeds, "cnn-bn", tuple(args.parts), BN_SWEEP)
        out["sweep_bn_failures"] = check(out["sweep_bn"], names=("DiLoCo()", "IsoLoCo()"))
    if args.negative_variance or args.bn:
        out["negative_variance"] = negative_variance()
        out["negative_variance_before"] = negative_variance(
            merge_settings=MergeSettings(buffers="none")
        )
    if args.lm:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out["lm"] = {**out.get("lm", {}), **lm_case(args.rounds, Path(tmp), args.lm_only)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    if args.docs and "sweep_bn" in out:
        bn_docs(out)


if __name__ == "__main__":
    main()
