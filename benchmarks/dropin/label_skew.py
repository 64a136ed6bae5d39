"""The drop-in under strong label skew: label-sorted and Dirichlet(0.1) shards.

Two apps, in-process on the fake grid (``tests/fakegrid.py``), each a plain Flower app whose
FedAvg is swapped out:

- ``cancer``: an MLP (30 -> 32 -> 2) trained with Adam (lr 0.01, a fresh optimiser each round,
  one local epoch, batch 32) on sklearn's breast-cancer data (standardised; a fixed stratified
  split, 426 train / 143 test rows), 5 nodes, 15 rounds;
- ``digits``: ``examples/digits`` (CNN, SGD lr 0.05 momentum 0.9), 4 nodes, 10 rounds, run by
  :func:`isoloco_dropin.run_digits` with two extra shardings patched into its partitioner.

Shardings: ``sorted`` (training rows sorted by label, cut into equal contiguous shards: most nodes
see one class) and ``dir0.1`` (flwr-datasets' DirichletPartitioner, alpha 0.1, seeded).
Strategies: FedAvg, DiLoCo(), IsoLoCo() and the previous default's merge (``IsoLoCo(merge=
"iso_c_full")`` below: ``iso_c_matched`` before the agreement cap), seeds 0-2, final test
accuracy. ``--diagnose``: per round, for the 2-D tensors, how much of the merge's energy lies in
singular directions of the mean where the nodes disagree (:func:`disagreement`).

    PYTHONPATH=. .venv/bin/python benchmarks/dropin/label_skew.py [--quick] [--diagnose]
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/label_skew.py --docs   # the table into the docs
    PYTHONPATH=. .venv/bin/python benchmarks/dropin/label_skew.py --ablation  # merge vs outer step
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO

import isoloco_dropin as dropin  # noqa: E402  (puts examples/digits and tests on the path)
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flwr_isoloco.merging.polar import thin_svd  # noqa: E402
from flwr_isoloco.merging.rules import MergeRule, _streaming  # noqa: E402
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings  # noqa: E402

OUT = common.RESULTS / "label_skew.json"
PARTS = ("sorted", "dir0.1")


def _iso_c_full(g: torch.Tensor) -> torch.Tensor:
    """The previous ``"dropin"`` merge: ``iso_c_matched`` with no amplification cap."""
    from flwr_isoloco.merging.iso_range import iso_c_matched

    return iso_c_matched(g, max_gain=None)


FULL_RULE = MergeRule("iso_c_full", _streaming(_iso_c_full), _iso_c_full)


def _agreement_weighted(deltas, weights, key: str = "") -> torch.Tensor:
    """A diagnosis rule (needs every node's delta): the uncapped merge's level ``t =
    ||g|| / sqrt(r)`` approached only where the nodes agree, ``s'_j = s_j + a_j (t - s_j)`` with
    the agreement ``a_j`` of :func:`disagreement` (capped at 1), then rescaled to ``||g||``."""
    g = sum(w * d for w, d in zip(weights, deltas, strict=True)).double()
    u, s, vh = thin_svd(g)
    node = torch.stack([(u * (d.double() @ vh.T)).sum(0) for d in deltas])
    spread = (torch.tensor(weights, dtype=torch.float64)[:, None] * node.abs()).sum(0)
    agree = (s / spread.clamp_min(1e-300)).clamp(max=1.0)
    flat = s + agree * (s.norm() / s.numel() ** 0.5 - s)
    flat = flat * (s.norm() / flat.norm().clamp_min(1e-300))
    return ((u * flat) @ vh).to(deltas[0].dtype)


AGREEMENT_RULE = MergeRule("agreement_weighted", _agreement_weighted)

STRATEGIES: dict[str, Callable[[], object]] = {
    "FedAvg": lambda: FedAvg(),
    "DiLoCo()": lambda: DiLoCo(),
    "IsoLoCo() before": lambda: IsoLoCo(merge=FULL_RULE),
    "IsoLoCo()": lambda: IsoLoCo(),
}


ABLATION: dict[str, Callable[[], object]] = {
    "mean, lr 0.5, mu 0.9 (the dropin step)": lambda: DiLoCo(outer_lr=0.5),
    "mean, lr 0.35, mu 0.9": lambda: DiLoCo(outer_lr=0.35),
    "mean, lr 0.5, mu 0.8": lambda: DiLoCo(outer_lr=0.5, outer_momentum=0.8),
    "IsoLoCo() before, lr 1, mu 0 (FedAvg's step)": lambda: IsoLoCo(
        merge=FULL_RULE, outer_lr=1.0, outer_momentum=0.0
    ),
    "IsoLoCo(), lr 1, mu 0 (FedAvg's step)": lambda: IsoLoCo(outer_lr=1.0, outer_momentum=0.0),
    "IsoLoCo(), lr 0.5, mu 0.8": lambda: IsoLoCo(outer_momentum=0.8),
    "Iso-C flattened where the nodes agree": lambda: IsoLoCo(merge=AGREEMENT_RULE),
    "IsoLoCo() before, first layer only": lambda: IsoLoCo(
        merge=FULL_RULE, merge_settings=MergeSettings(options={"spectral_pattern": r"^0\."})
    ),
    "IsoLoCo() before, classifier only": lambda: IsoLoCo(
        merge=FULL_RULE, merge_settings=MergeSettings(options={"spectral_pattern": r"^2\."})
    ),
}
"""Cancer-app variants that separate the merge from the outer step (``--ablation``)."""


# ---- shards -------------------------------------------------------------------------------


def shards(labels: np.ndarray, num: int, kind: str, seed: int) -> list[np.ndarray]:
    """Row indices of each node: ``sorted`` (stable sort by label, equal contiguous cuts) or
    ``dirK`` (DirichletPartitioner, alpha K, seeded, at least 5 rows a node)."""
    if kind == "sorted":
        return [np.asarray(p) for p in np.array_split(np.argsort(labels, kind="stable"), num)]
    if kind.startswith("dir"):
        return _dirichlet(labels, num, float(kind[3:]), seed)
    raise ValueError(f"unknown sharding {kind!r}")


def _dirichlet(labels: np.ndarray, num: int, alpha: float, seed: int, least: int = 5):
    """Each class's rows (shuffled) split over the nodes in proportions ~ Dirichlet(alpha),
    redrawn (same generator) until every node has at least ``least`` rows."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num)]
        for c in np.unique(labels):
            rows = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num))[:-1] * len(rows)).astype(int)
            for p, chunk in zip(parts, np.split(rows, cuts), strict=True):
                p.extend(chunk.tolist())
        if min(len(p) for p in parts) >= least:
            return [np.sort(np.asarray(p)) for p in parts]
    raise RuntimeError(f"no Dirichlet({alpha}) split with {least} rows a node in 1000 draws")


def _patch_digits() -> None:
    """Teach the digits app the ``sorted`` and ``dirK`` shardings (its own: iid, dirichlet)."""
    import digits.task as task

    if getattr(task, "_label_skew_patched", False):
        return
    orig = task.partition_indices

    @lru_cache(maxsize=64)
    def partition_indices(num_partitions, partitioner="iid", alpha=0.5, seed=0, split="test"):
        if partitioner in ("iid", "dirichlet"):
            return orig(num_partitions, partitioner, alpha, seed, split)
        y = task._split(split)[2]  # the training labels of ``split`` (the app's run-config key)
        return tuple(tuple(int(i) for i in p) for p in shards(y, num_partitions, partitioner, seed))

    task.partition_indices = partition_indices
    task._label_skew_patched = True


# ---- the breast-cancer app ------------------------------------------------------------------


@lru_cache(maxsize=2)
def cancer_data(split: str = "test"):
    """Standardised (train-set statistics) breast-cancer split: x_tr, x_te, y_tr, y_te.
    ``split="validation"`` (for tuning) cuts the same stratified 25 % again out of the 426
    training rows (319 train / 107 evaluation rows); the test rows are not touched."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    if split not in ("test", "validation"):
        raise ValueError(f"split must be 'test' or 'validation', got {split!r}")
    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    if split == "validation":
        x_tr, x_te, y_tr, y_te = train_test_split(
            x_tr, y_tr, test_size=0.25, random_state=0, stratify=y_tr
        )
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-8
    f = lambda a: torch.tensor((a - mu) / sd, dtype=torch.float32)  # noqa: E731
    return f(x_tr), f(x_te), torch.tensor(y_tr), torch.tensor(y_te)


def cancer_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))


cancer_app = ClientApp()


@cancer_app.train()
def _cancer_train(msg: Message, context: Context) -> Message:
    rc, pid = context.run_config, int(context.node_config["partition-id"])
    x_tr, _, y_tr, _ = cancer_data(rc.get("split", "test"))
    idx = shards(
        y_tr.numpy(), int(context.node_config["num-partitions"]), rc["partitioner"], rc["seed"]
    )[pid]
    x, y = x_tr[idx], y_tr[idx]
    net = cancer_net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    rnd = int(msg.content["config"].get("server-round", 0))
    gen = torch.Generator().manual_seed(1000 * rnd + pid)
    total = 0.0
    for b in torch.randperm(len(y), generator=gen).split(32):
        loss = nn.functional.cross_entropy(net(x[b]), y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach())
    metrics = MetricRecord({"train_loss": total, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@cancer_app.evaluate()
def _cancer_evaluate(msg: Message, context: Context) -> Message:
    """Nothing to evaluate on the nodes (the server tests): an empty reply."""
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def run_cancer(
    factory: Callable[[], object], part: str, seed: int, rounds: int, split: str = "test"
) -> dict:
    """One federation of the breast-cancer app (5 nodes); final accuracy, per round, records
    (evaluated on ``split``'s evaluation rows, :func:`cancer_data`)."""
    from fakegrid import FakeGrid

    _, x_te, _, y_te = cancer_data(split)
    net = cancer_net(seed)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            logits = net(x_te)
        loss = float(nn.functional.cross_entropy(logits, y_te))
        return MetricRecord(
            {"loss": loss, "accuracy": float((logits.argmax(1) == y_te).float().mean())}
        )

    strategy = factory()
    if hasattr(strategy, "seed"):
        strategy.seed = seed
    rc = {"partitioner": part, "seed": seed, "split": split}
    grid = FakeGrid(cancer_app, num_nodes=5, run_config=rc)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=rounds,
        evaluate_fn=evaluate,
    )
    ev = result.evaluate_metrics_serverapp
    acc = {r: float(m["accuracy"]) for r, m in ev.items()}
    out = {
        "final": acc[max(acc)],
        "accuracy": acc,
        "loss": {r: float(m["loss"]) for r, m in ev.items()},
    }
    return out


def run_digits(
    factory: Callable[[], object], part: str, seed: int, rounds: int, split: str = "test"
) -> dict:
    """:func:`isoloco_dropin.run_digits` (4 nodes) with the shardings of :func:`shards`."""
    _patch_digits()
    return dropin.run_digits(factory, part, seed, rounds, split=split)


APPS = {"cancer": (run_cancer, 15), "digits": (run_digits, 10)}
APP_NAMES = {"cancer": "breast-cancer MLP, Adam, 5 nodes", "digits": "digits CNN, SGD, 4 nodes"}
PART_NAMES = {"sorted": "label-sorted shards", "dir0.1": "Dirichlet(0.1) shards"}


# ---- diagnosis ------------------------------------------------------------------------------


def disagreement(deltas: list[torch.Tensor], weights: list[float], merged: torch.Tensor) -> dict:
    """Spectrum of the mean ``g = sum w_i d_i`` against the nodes' deltas, for one 2-D tensor.

    For each singular triplet ``(s_j, u_j, v_j)`` of ``g``, the agreement ``a_j = s_j /
    sum_i w_i |u_j^T d_i v_j|`` (1: every node moves the same way along it; near 0: the nodes'
    moves cancel). Returned: the share of ``||g||^2`` and of ``||merged||^2`` in the directions
    with ``a_j < 0.5`` and in the top direction (``merged``'s energy measured along the same
    triplets), the largest amplification ``|u_j^T merged v_j| / s_j`` and the agreement of the
    direction it hits."""
    g = sum(w * d for w, d in zip(weights, deltas, strict=True))
    u, s, vh = thin_svd(g.double())
    k = int((s > s[0] * 1e-6).sum())
    u, s, vh = u[:, :k], s[:k], vh[:k]
    node = torch.stack([(u * (d.double() @ vh.T)).sum(0) for d in deltas])  # M x k
    spread = (torch.tensor(weights, dtype=torch.float64)[:, None] * node.abs()).sum(0)
    agree = s / spread.clamp_min(1e-300)
    proj = (u * (merged.double() @ vh.T)).sum(0)
    low = agree < 0.5
    gain = proj.abs() / s
    j = int(gain.argmax())
    return {
        "rank": k,
        "mean_low_share": float((s[low] ** 2).sum() / (s**2).sum()),
        "merged_low_share": float((proj[low] ** 2).sum() / (proj**2).sum().clamp_min(1e-300)),
        "mean_top_share": float(s[0] ** 2 / (s**2).sum()),
        "merged_top_share": float(proj[0] ** 2 / (proj**2).sum().clamp_min(1e-300)),
        "max_gain": float(gain[j]),
        "agree_at_max_gain": float(agree[j]),
        "agree_median": float(agree.median()),
    }


class Recorder:
    """Per round and 2-D tensor, :func:`disagreement` of the train replies against the merge
    the strategy's rule makes of their mean. Replies are taken where the fake grid hands them
    to the server (DiLoCo's round loop does not go through ``aggregate_train``)."""

    def __init__(self, strategy) -> None:
        from fakegrid import FakeGrid

        rule = getattr(strategy, "rule", None)  # FedAvg: none, the mean
        self._rule = rule.transform if rule is not None and rule.streaming else (lambda g: g)
        self.spectra: list[dict] = []
        self._theta: dict[str, torch.Tensor] = {}
        self._replies: list = []
        conf, pull = strategy.configure_train, FakeGrid.pull_messages

        def configure_train(server_round, arrays, config, grid):
            self.finish()
            self._theta = dropin._sd(arrays)
            return conf(server_round, arrays, config, grid)

        def pull_messages(grid, ids):
            out = list(pull(grid, ids))
            self._replies += [m for m in out if m.metadata.message_type == "train"]
            return out

        strategy.configure_train = configure_train
        FakeGrid.pull_messages = pull_messages
        self._restore = lambda: setattr(FakeGrid, "pull_messages", pull)

    def finish(self) -> None:
        ok = [m for m in self._replies if not m.has_error()]
        self._replies = []
        if not ok:
            return
        w = [float(m.content["metrics"]["num-examples"]) for m in ok]
        w = [x / sum(w) for x in w]
        sds = [dropin._sd(m.content["arrays"]) for m in ok]
        row = {}
        for k, th in self._theta.items():
            if th.ndim == 2:
                deltas = [th - sd[k] for sd in sds]
                g = sum(wi * d for wi, d in zip(w, deltas, strict=True))
                row[k] = disagreement(deltas, w, self._rule(g))
        self.spectra.append(row)

    def close(self) -> list[dict]:
        self.finish()
        self._restore()
        return self.spectra


def diagnose(app: str, part: str, seed: int) -> dict:
    run, rounds = APPS[app]
    out = {}
    for name in ("DiLoCo()", "IsoLoCo() before", "IsoLoCo()"):
        holder = {}

        def factory(name=name, holder=holder):
            s = STRATEGIES[name]()
            holder["rec"] = Recorder(s)
            return s

        r = run(factory, part, seed, rounds)
        spectra = holder["rec"].close()
        out[name] = {"final": r["final"], "accuracy": r["accuracy"], "spectra": spectra}
        print(f"[diagnose {app} {part} s{seed}] {name}: {r['final']:.3f}", flush=True)
    return out


# ---- sweep and table ------------------------------------------------------------------------


def sweep(app: str, seeds: list[int], rounds: int | None, names: list[str]) -> dict:
    run, default_rounds = APPS[app]
    res: dict = {}
    for part in PARTS:
        for seed in seeds:
            for name in names:
                t0 = time.perf_counter()
                r = run(STRATEGIES[name], part, seed, rounds or default_rounds)
                res.setdefault(part, {}).setdefault(name, {})[str(seed)] = r["final"]
                print(
                    f"[{app}] {part} s{seed} {name}: {r['final']:.3f} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return res


def check(res: dict, tol: float = 0.01) -> list[str]:
    bad = []
    for app, parts in res.items():
        for part, cells in parts.items():
            for seed, fed in cells["FedAvg"].items():
                iso = cells.get("IsoLoCo()", {}).get(seed)
                if iso is not None and iso < fed - tol:
                    bad.append(
                        f"{app} {part} s{seed}: IsoLoCo() {iso:.3f} < FedAvg {fed:.3f} - {tol}"
                    )
    return bad


def table(res: dict) -> str:
    """Markdown: per app and sharding, each strategy's seeds and mean +- sd."""
    rows = []
    for app in [a for a in APPS if a in res]:
        for part in [p for p in PARTS if p in res[app]]:
            cells = res[app][part]
            seeds = sorted(cells["FedAvg"], key=int)
            rows.append(f"{APP_NAMES[app]}, {PART_NAMES[part]}:\n")
            rows.append("| strategy | " + " | ".join(f"s{s}" for s in seeds) + " | mean +- sd |")
            rows.append("|---" * (len(seeds) + 2) + "|")
            for name in [n for n in STRATEGIES if n in cells]:
                v = [cells[name][s] for s in seeds]
                sd = statistics.stdev(v) if len(v) > 1 else 0.0
                vals = " | ".join(f"{x:.3f}" for x in v)
                rows.append(f"| {name} | {vals} | {statistics.mean(v):.3f} +- {sd:.3f} |")
            rows.append("")
    return "\n".join(rows)


DOCS = REPO / "docs" / "strategies.md"
BEGIN, END = "<!-- label_skew:begin -->", "<!-- label_skew:end -->"


def docs_block(saved: dict) -> str:
    """The block between :data:`BEGIN` and :data:`END` in docs/strategies.md, from the record."""
    res = saved["sweep"]
    bad = check(res)
    verdict = (
        "IsoLoCo() >= FedAvg - 0.01 in every cell."
        if not bad
        else "Cells where IsoLoCo() < FedAvg - 0.01: " + "; ".join(bad) + "."
    )
    return f"{BEGIN}\n{table(res)}\n{verdict}\n{END}"


def write_docs(saved: dict, path: Path = DOCS) -> None:
    """Replace the marked block of ``path`` with :func:`docs_block` (markers must exist)."""
    text = path.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + docs_block(saved) + text[stop:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seed 0, 5 rounds; label_skew_quick.json")
    ap.add_argument("--apps", nargs="+", default=list(APPS))
    ap.add_argument("--only", nargs="+", default=list(STRATEGIES), help="strategy names")
    ap.add_argument("--diagnose", action="store_true", help="disagreement spectra, seed 0")
    ap.add_argument("--ablation", action="store_true", help="cancer: merge vs outer step")
    ap.add_argument("--repeats", action="store_true", help="FedAvg vs IsoLoCo(), 4 reruns")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print --out's sweep as markdown")
    ap.add_argument("--docs", action="store_true", help="write --out's sweep into the docs")
    args = ap.parse_args()
    if args.table or args.docs:
        saved = json.loads(args.out.read_text())
        print(docs_block(saved))
        if args.docs:
            write_docs(saved)
            print(f"wrote the label_skew block of {DOCS}")
        return
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.WARNING)
    seeds, rounds = ([0], 5) if args.quick else ([0, 1, 2], None)
    if args.quick and args.out == OUT:  # never mix a quick run into the full record
        args.out = OUT.with_name("label_skew_quick.json")
    out: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    out["config"] = {"seeds": seeds, "rounds": {a: rounds or APPS[a][1] for a in APPS}}
    if args.repeats:  # the same cell again and again: is it reproducible?
        out["repeats"] = {
            name: [run_digits(STRATEGIES[name], "dir0.1", 2, 10)["final"] for _ in range(4)]
            for name in ("FedAvg", "IsoLoCo()")
        }
        print(out["repeats"])
    elif args.ablation:
        STRATEGIES.update(ABLATION)
        out["ablation"] = {"cancer": sweep("cancer", seeds, rounds, ["FedAvg", *ABLATION])}
        print(table(out["ablation"]))
    elif args.diagnose:
        out["diagnosis"] = {app: {p: diagnose(app, p, 0) for p in PARTS} for app in args.apps}
    else:
        res = out.setdefault("sweep", {})
        for app in args.apps:
            new = sweep(app, seeds, rounds, args.only)
            for part, cells in new.items():
                for name, vals in cells.items():
                    res.setdefault(app, {}).setdefault(part, {}).setdefault(name, {}).update(vals)
        out["failures"] = check(res)
        print(table(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
