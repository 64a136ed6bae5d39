"""Accuracy of Iso-C from the Gram eigendecomposition against the SVD, by condition number.

For each shape and ``kappa = s_max / s_min`` (log-spaced spectrum, or 90% at 1 and 10% at
1/kappa), an fp32 matrix ``U diag(s) V^T``; relative Frobenius error against the fp64 SVD of
that same fp32 matrix (the exact answer) of: the fp32 SVD (what ``iso_c(method="svd")``
computes), the Gram path in fp32 and in fp64 (forced, whatever the acceptance bound says), and
``iso_c(method="gram")`` as shipped (bound-checked, SVD fallback; always the SVD for the square
576 x 576, whose forced fp64 Gram row shows what that route would give). Table to stdout and
``benchmarks/results/gram_accuracy.json``.

    python benchmarks/merging/gram_accuracy.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from flwr_isoloco.merging import iso_c
from flwr_isoloco.merging.polar import _gram_apply

OUT = Path(__file__).resolve().parents[1] / "results" / "gram_accuracy.json"


def _matrix(m, n, kappa, kind, gen):
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))
    if kind == "log":
        s = torch.logspace(0, -math.log10(kappa), r, dtype=torch.float64)
    else:
        s = torch.ones(r, dtype=torch.float64)
        s[-r // 10 :] = 1 / kappa
    return ((u * s) @ v.T * 1e-3).float()


def _rel(a, b):
    return float(torch.linalg.matrix_norm(a.double() - b) / torch.linalg.matrix_norm(b))


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'shape':10s} {'kind':7s} {'kappa':>7s}  svd32    gram32   gram64   shipped")
    for m, n in [(576, 1536), (192, 576), (576, 576)]:
        for kappa in [2, 4, 10, 30, 100, 300, 1e3, 1e4]:
            for kind in ["log", "cluster"]:
                x = _matrix(m, n, kappa, kind, gen)
                exact = iso_c(x.double(), method="svd")
                row = {"shape": [m, n], "kind": kind, "kappa": kappa}
                row["svd32"] = _rel(iso_c(x, method="svd"), exact)
                for work, name in ((torch.float32, "gram32"), (torch.float64, "gram64")):
                    out = _gram_apply(x, work, math.inf, "mean")
                    row[name] = _rel(out.float(), exact) if out is not None else float("nan")
                row["shipped"] = _rel(iso_c(x, method="gram"), exact)
                rows.append(row)
                print(
                    f"{m}x{n:<5d} {kind:7s} {kappa:7.0f}  {row['svd32']:.1e}  {row['gram32']:.1e}"
                    f"  {row['gram64']:.1e}  {row['shipped']:.1e}"
                )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"command": "python benchmarks/merging/gram_accuracy.py", "rows": rows})
    )


if __name__ == "__main__":
    main()
