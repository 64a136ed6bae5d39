"""benchmarks/gpu/worker_throughput.py --quick: the worker's handler against the bare loop.

One tiny model, fp32 and bf16 (CPU autocast), 1 repeat: both arms train the same weights on the
same batches, so in fp32 the handler's reply equals the bare loop's model; the recorded ratio
and overhead are the formulas of the module docstring applied to the recorded seconds."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    wt = load("worker_throughput")
    out = tmp_path_factory.mktemp("wt") / "wt.json"
    wt.main(["--quick", "--phase", "q", "--out", str(out)])
    return wt, json.loads(out.read_text())


def test_quick_cells_present_and_equal_to_bare_loop(quick):
    _, rec = quick
    cells = {(c["size"], c["precision"], c["compile"]): c for c in rec["q"]["cells"]}
    assert set(cells) == {("tiny", "fp32", False), ("tiny", "bf16", False)}
    for cell in cells.values():
        assert "error" not in cell and "skipped" not in cell, cell
    # fp32: the handler (rebuilt model, AdamW restored from the node's state) and the bare
    # loop (model and AdamW kept) are one computation: same final weights
    assert cells["tiny", "fp32", False]["max_abs_diff"] <= 1e-6
    assert cells["tiny", "bf16", False]["max_abs_diff"] <= 1e-2
    assert rec["q"]["runs"]["cells"]["handler_features"]["precision"] is True


def test_quick_ratio_is_the_medians_quotient(quick):
    _, rec = quick
    for c in rec["q"]["cells"]:
        mb, mh = statistics.median(c["bare_msg_s"]), statistics.median(c["handler_msg_s"])
        assert (c["bare_median_s"], c["handler_median_s"]) == (mb, mh)
        assert c["ratio"] == pytest.approx(mb / mh, rel=1e-12)
        step = mb / c["h"]
        assert c["overhead_steps"] == pytest.approx((mh - c["h"] * step) / step, rel=1e-9)
        assert c["tokens_per_s_handler"] / c["tokens_per_s_bare"] == pytest.approx(c["ratio"])


def test_merge_replaces_only_the_same_cells(quick, tmp_path):
    wt, _ = quick
    path = tmp_path / "r.json"
    a = {"size": "demo", "precision": "fp32", "compile": False, "ratio": 1.0}
    b = {"size": "135m", "precision": "fp32", "compile": False, "ratio": 0.5}
    wt.update_record(path, "after", "cells", [a], {"m": 1})
    wt.update_record(path, "after", "cells", [b], {"m": 2}, merge=True)
    wt.update_record(path, "after", "cells", [{**b, "ratio": 0.7}], {"m": 3}, merge=True)
    rec = json.loads(path.read_text())["after"]
    assert [(c["size"], c["ratio"]) for c in rec["cells"]] == [("demo", 1.0), ("135m", 0.7)]
    assert rec["runs"] == {"cells": {"m": 1}, "cells:135m:fp32": {"m": 3}}
