"""Server memory of a robust round at SmolLM2-135M's largest tensor, M up to 64.

A strategy round with ``robust`` set spills every reply (:class:`~flwr_isoloco.merging.spill.
SpillStore`) and calls :meth:`RobustMerge.merge` on the store. Its peak is set by the largest
tensor, the tied 49152 x 576 embedding (108 MiB fp32): read whole, the ``M`` copies are stacked
(64 x 108 MiB = 6.9 GiB, and the median's sort adds values and int64 indices); read in row
blocks (``rows=``, what ``RoundFold`` passes), one block's copies at a time. This script spills
``M`` synthetic pseudo-gradients of the embedding and one decoder layer
(:func:`~flwr_isoloco.testing.synthetic.llama_delta`), then per rule and mode measures the merge's
time and peak RSS above the RSS before the call (rule ``mean``, unit weights, CPU), and checks
that both modes give the same tensors (bit for bit except Krum's distances, summed in another
order). The rest of the model adds tensors no larger than the layer's, one at a time.

    nice -n 10 python benchmarks/memory/robust_memory_135m.py --workers 16 64 --whole-max 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("benchmarks/merging")  # rule_cost_135m: shapes and the peak-RSS probe

from rule_cost_135m import MIB, _measure, smollm2_135m_shapes  # noqa: E402

from flwr_isoloco.merging.robust import RobustMerge, resolve_robust  # noqa: E402
from flwr_isoloco.merging.rules import resolve_rule  # noqa: E402
from flwr_isoloco.merging.spill import SpillStore  # noqa: E402
from flwr_isoloco.testing.synthetic import llama_delta  # noqa: E402

OUT = common.RESULTS / "robust_memory_135m.json"
RULES = ("distance-filter", "median", "multikrum")


def spill(store: SpillStore, shapes: dict, m: int) -> list[int]:
    """``m`` synthetic deltas written to ``store`` one at a time (never all in memory)."""
    return [store.put(llama_delta(shapes, i)) for i in range(m)]


def one(store, entries, shapes, rule_name: str, blocks: bool) -> tuple[dict, float, float]:
    """``(g, seconds, peak extra MiB)`` of one robust merge over the spilled entries."""
    rule = resolve_rule("mean")
    robust = RobustMerge(*resolve_robust(rule_name, None, rule))
    keys = list(shapes)

    def run():
        return robust.merge(
            rule,
            {"device": "cpu"},
            keys,
            lambda i, k: store.get(entries[i], k),
            [1.0] * len(entries),
            rows=(lambda i, k, a, b: store.rows(entries[i], k, a, b)) if blocks else None,
            shapes=shapes if blocks else None,
        )

    return _measure(run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--whole-max", type=int, default=16, help="largest M read whole")
    ap.add_argument("--rules", nargs="+", default=list(RULES))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = smollm2_135m_shapes(layers=1)
    tensor_mib = {k: torch.Size(s).numel() * 4 / MIB for k, s in shapes.items()}
    report = {
        "what": __doc__.split("\n")[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "keys": {k: list(s) for k, s in shapes.items()},
        "largest_tensor_mib": max(tensor_mib.values()),
        "block_mib": RobustMerge.block_bytes / MIB,
        "load-avg-at-start": os.getloadavg(),
        "runs": [],
    }
    for m in args.workers:
        with SpillStore(tempfile.gettempdir()) as store:
            entries = spill(store, shapes, m)
            print(f"M = {m}: {store.bytes_written / MIB:.0f} MiB spilled", flush=True)
            for name in args.rules:
                modes = [True] + ([False] if m <= args.whole_max else [])
                got = {}
                for blocks in modes:
                    g, s, peak = one(store, entries, shapes, name, blocks)
                    got[blocks] = g
                    row = {"workers": m, "rule": name, "blocks": blocks, "s": s, "peak_mib": peak}
                    report["runs"].append(row)
                    print(json.dumps(row), flush=True)
                if len(got) == 2:
                    diff = max(float((got[True][k] - got[False][k]).abs().max()) for k in shapes)
                    report["runs"][-1]["max_abs_diff_vs_blocks"] = diff
                del got
    report["load-avg-at-end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
