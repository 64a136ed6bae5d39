"""benchmarks/gpu/gpu_check.py on a machine without CUDA, and its merge part on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location(
        "gpu_check", REPO / "benchmarks" / "gpu" / "gpu_check.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_writes_cuda_false_and_exits_0(gc, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["cuda"] is False and rec["parts"] == {}
    assert "no CUDA device" in rec["message"]
    assert "no CUDA device" in capsys.readouterr().out
    assert sum(gc.LIMITS_S.values()) <= 8 * 60  # the check's promise: at most 8 minutes


def test_merge_part_on_cpu_matches_the_mean(gc):
    shapes = {"w": (6, 4), "b": (4,)}
    written = []
    out = gc.merge_part(60, written.append, device="cpu", shapes=shapes)
    assert [r["rule"] for r in out["rules"]] == list(gc.MERGE_RULES)
    assert all("error" not in r for r in out["rules"]), out["rules"]
    assert out["parameters"] == 28 and len(written) == len(gc.MERGE_RULES)
    assert all(r["max_abs_diff"] == 0.0 for r in out["rules"])  # same device, same result
    # the deltas are what random_deltas draws: the mean rule's input, checked independently
    deltas = gc.random_deltas(shapes)
    assert deltas[0]["w"].std() == pytest.approx(1e-3, rel=0.6)
    from flwr_isoloco.merging import merge

    got = merge("mean", deltas, device="cpu")
    want = torch.stack([d["w"] for d in deltas]).mean(0)
    assert torch.allclose(got["w"], want, atol=1e-9)
