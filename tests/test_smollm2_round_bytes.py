"""benchmarks/compression/smollm2_round_bytes.py --quick: the LM app on a tiny pretrained LLaMA,
sparseloco both ways, 2 nodes, 2 rounds; the counted bytes against the wire format's sizes."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from flwr_isoloco.compression.lowbit import packed_len, sparseloco_bytes

SCRIPT = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "compression" / "smollm2_round_bytes.py"
)
HEADER_MAX = 8_000  # the codec's JSON header array (names, shapes, options) of 20 tensors


@pytest.fixture(scope="module")
def rec():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("smollm2_round_bytes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(["--quick"])


def _expected(shapes: dict, per_2d) -> int:
    """Array bytes of an encoding without its header: 2-D tensors through ``per_2d``, the
    rest raw fp32 (``min_dims = 2``)."""
    return sum(per_2d(tuple(s)) if len(s) >= 2 else 4 * math.prod(s) for s in shapes.values())


def test_round_bytes_follow_the_wire_format(rec):
    shapes, r = rec["shapes"], rec["per-node-per-round"]
    n = sum(math.prod(s) for s in shapes.values())
    assert rec["fp32"]["payload"] == 4 * n == r["1"]["down-arrays"]  # round 1: the full model
    opts = {"chunk": 4096, "k": 64, "bits": 2}
    sparse = _expected(shapes, lambda s: sparseloco_bytes(s, opts))
    for way in ("down-arrays", "up-arrays"):
        assert 0 < r["2"][way] - sparse < HEADER_MAX, (way, r["2"][way], sparse)
    assert r["1"]["up-arrays"] == r["2"]["up-arrays"]  # uploads are compressed from round 1
    # int8 / int4 offline: n bytes (n/2 for int4) + one fp32 scale per 256 entries per tensor
    for codec, per_entry in (("int8", 1), ("int4", 0.5)):
        want = _expected(
            shapes,
            lambda s, p=per_entry: (
                packed_len(math.prod(s), int(8 * p)) + 4 * math.ceil(math.prod(s) / 256)
            ),
        )
        got = rec["offline-round-2"]["download"][codec]["payload"]
        assert 0 < got - want < HEADER_MAX, (codec, got, want)
    assert not rec["errors"] and [m["replies-used"] for m in rec["app-metrics"]] == [2, 2]
    s = rec["summary-round-2-per-node"]
    assert s["sparseloco"]["down"] < s["int4"]["down"] < s["int8"]["down"] < s["fp32"]["down"]
