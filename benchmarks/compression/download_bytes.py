"""Bytes down per round with each download codec, in-process on FakeGrid; and bytes down per
sampled node against ``fraction_train``, with update chains and without (``--fraction``).

A plain FedAvg-style ClientApp behind ``download_mod`` (the one of ``tests/test_download.py``)
holding one SmolLM2-sized matrix (576 x 576) and a bias; DiLoCo at its defaults, 2 nodes, 4
rounds, every node sampled every round. Round 1 sends the full model to every node (they hold
nothing yet); later rounds send the compressed difference. Uploads stay plain here.

    PYTHONPATH=.:tests .venv/bin/python benchmarks/compression/download_bytes.py
    PYTHONPATH=.:tests .venv/bin/python benchmarks/compression/download_bytes.py --fraction

writes ``benchmarks/results/download_bytes.json`` (``download_chains.json`` with
``--fraction``: 8 nodes, 16 rounds, the same model; "before" is the broadcast keeping one
update, as it did before chains: a node more than one version behind got the full model).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.on_path("", "tests")
import torch  # noqa: E402
from fakegrid import FakeGrid  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from test_download import make_app  # noqa: E402

from flwr_isoloco.clients import download_mod, upload_mod  # noqa: E402
from flwr_isoloco.compression import broadcast  # noqa: E402
from flwr_isoloco.compression.record import payload_nbytes  # noqa: E402
from flwr_isoloco.strategies import Codec, DiLoCo  # noqa: E402

CODECS = ("none", "int8", "int4", "sparseloco")
ROUNDS, NODES = 4, 2


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(576, 576, generator=g), "b": torch.randn(576, generator=g)}


def run(codec: str) -> dict:
    s = DiLoCo(
        min_available_nodes=NODES,
        min_train_nodes=NODES,
        fraction_evaluate=0.0,
        download=codec,
    )
    grid = FakeGrid(make_app(), num_nodes=NODES)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(model()), num_rounds=ROUNDS)
    m = res.train_metrics_clientapp
    return {
        "bytes-down": [int(m[r]["bytes-down"]) for r in range(1, ROUNDS + 1)],
        "replies-used": [int(m[r]["replies-used"]) for r in range(1, ROUNDS + 1)],
    }


EXACT_STEP = {
    "merge": "sparseloco",
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "upload": Codec("sparseloco"),
}


def per_node(codec: str, fraction: float, links: int, nodes: int = 8, rounds: int = 16) -> float:
    """Mean bytes down per sampled node over rounds 2+, as a share of the full model."""
    keep, broadcast.MAX_LINKS = broadcast.MAX_LINKS, links
    exact = EXACT_STEP if codec == "exact" else {}  # SparseLoCo's step, its uploads sent down
    try:
        s = DiLoCo(
            min_available_nodes=nodes,
            min_train_nodes=1,
            fraction_train=fraction,
            fraction_evaluate=0.0,
            download=codec,
            **exact,
        )
        app = make_app((download_mod, upload_mod)) if exact else make_app()
        grid = FakeGrid(app, num_nodes=nodes)
        res = s.start(grid=grid, initial_arrays=ArrayRecord(model()), num_rounds=rounds)
    finally:
        broadcast.MAX_LINKS = keep
    m = res.train_metrics_clientapp
    full = payload_nbytes(ArrayRecord(model()))
    sampled = sum(m[r]["replies-used"] for r in range(2, rounds + 1))
    return sum(m[r]["bytes-down"] for r in range(2, rounds + 1)) / sampled / full


def by_fraction() -> None:
    out = {}
    for codec in ("int4", "sparseloco", "exact"):
        for fraction in (0.25, 0.5, 1.0):
            before, after = per_node(codec, fraction, 1), per_node(codec, fraction, 32)
            out[f"{codec}|{fraction}"] = {"before": round(before, 4), "after": round(after, 4)}
            print(f"{codec:>10} fraction {fraction}: per node {before:.3f} -> {after:.3f} of B")
    common.save_json(
        common.RESULTS / "download_chains.json",
        {"command": "benchmarks/compression/download_bytes.py --fraction", "runs": out},
    )


def main() -> None:
    if "--fraction" in sys.argv:
        by_fraction()
        return
    runs = {c: run(c) for c in CODECS}
    full = runs["none"]["bytes-down"]
    for c, r in runs.items():
        later = sum(r["bytes-down"][1:]) / sum(full[1:])
        r["rounds-2-on-vs-none"] = round(later, 5)
        print(
            f"{c:>10}: bytes-down per round {r['bytes-down']} (rounds 2+: {1 / later:.1f}x fewer)"
        )
    common.save_json(
        common.RESULTS / "download_bytes.json",
        {"command": "benchmarks/compression/download_bytes.py", "nodes": NODES, "runs": runs},
    )


if __name__ == "__main__":
    main()
