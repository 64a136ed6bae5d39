"""benchmarks/gpu/gpu_check.py on a machine without CUDA, and its merge part on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import outer_reference as ref
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


def _drawn(shapes):
    """The deltas the module docstring promises, drawn here: 4 workers, one generator seeded 0,
    N(0, 1) x 1e-3 per tensor in the order of ``shapes``."""
    g = torch.Generator().manual_seed(0)
    return [{k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()} for _ in range(4)]


def test_merge_part_on_cpu_gives_the_rules_written_out(gc, monkeypatch):
    """The merge part with ``device="cpu"``: every rule's result (captured) against the rule
    written out in fp64 (outer_reference: the mean of the 4 deltas; Iso-C ``mean(s) U V^T`` of
    that mean on the matrix, the mean on the vector), ``iso_c_ns`` (Newton-Schulz) within 0.1 %
    of the exact Iso-C (tests/test_merging.py bounds it by 1 % in general); the record's counts are
    hand-computed (6 x 4 + 4 = 28 entries) and its ``max_abs_cpu`` is the reference's."""
    import flwr_isoloco.merging as merging

    shapes = {"w": (6, 4), "b": (4,)}
    deltas = _drawn(shapes)
    got: dict[str, list[dict[str, torch.Tensor]]] = {}
    real = merging.merge

    def spy(rule, ds, *args, device="auto", **kw):
        same = all(torch.equal(d[k], e[k]) for d, e in zip(ds, deltas, strict=True) for k in e)
        assert same, "merge_part's deltas are not the documented draw (seed 0, std 1e-3)"
        assert device == "cpu"
        out = real(rule, ds, *args, device=device, **kw)
        got.setdefault(rule, []).append(out)
        return out

    monkeypatch.setattr(merging, "merge", spy)
    written = []
    out = gc.merge_part(60, written.append, device="cpu", shapes=shapes)
    assert [r["rule"] for r in out["rules"]] == ["mean", "iso_c", "iso_c_ns"]
    assert all("error" not in r for r in out["rules"]), out["rules"]
    assert (out["workers"], out["parameters"], len(written)) == (4, 28, 3)
    ones = [1.0] * 4
    mean = {k: ref.mean([d[k].double() for d in deltas], ones) for k in shapes}
    want = {"mean": mean, "iso_c": {"w": ref.iso_c(mean["w"]), "b": mean["b"]}}
    want["iso_c_ns"] = want["iso_c"]
    for r in out["rules"]:
        rule, w = r["rule"], want[r["rule"]]
        tol = 1e-3 if rule == "iso_c_ns" else 1e-5  # NS to its tolerance: 5e-5 measured
        assert len(got[rule]) == 3  # the CPU reference, the "device" run's first and warm call
        for res in got[rule]:
            ref.assert_close(res, w, tol=tol)
        assert r["max_abs_cpu"] == pytest.approx(
            max(float(v.abs().max()) for v in w.values()), rel=tol
        )
        assert r["max_abs_diff"] == 0.0  # the "device" run is a second CPU run: the same bits


def test_stages_part_dry_on_the_cpu_times_every_stage_of_the_apps_path(gc, tmp_path, monkeypatch):
    """The stages part on the CPU at the tiny size (its dry path): every stage of the app's path
    is found in the worker and timed, the stages and ``other`` add up to the message, and the
    tokens/s are the recorded medians' quotients."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written = []
    res = gc.stages_part(60, written.append, device="cpu", size_name="tiny")["cells"][0]
    assert written and res["stages_absent"] == []
    med = res["median_s"]
    for row in res["rows"]:
        parts = sum(v for k, v in row.items() if k != "message")
        assert parts == pytest.approx(row["message"], rel=1e-9)
        assert all(v >= 0 for k, v in row.items() if k != "other")
    tokens = 2 * 16 * 3  # the tiny size: batch 2 x 16 tokens, H = 3
    assert res["tokens_per_s_handler"] == pytest.approx(tokens / med["message"])
    assert res["tokens_per_s_bare"] == pytest.approx(tokens / res["bare_median_s"])
    assert gc.LIMITS_S["stages"] >= 60
