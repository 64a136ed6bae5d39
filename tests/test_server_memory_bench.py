"""benchmarks/memory/server_memory.py --quick: real Ray simulations at M = 2 and 4 with a tiny model;
the JSON holds both cells with sampled peaks, a fit, and a rerun skips the measured cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "memory" / "server_memory.py"

sys.path.insert(0, str(REPO / "benchmarks" / "memory"))
import server_memory  # noqa: E402


def test_fit_recovers_a_known_slope():
    model = 10**8
    cells = [{"M": m, "status": "ok", "x": (2e9 + 0.5 * model * m) / 1e9} for m in (4, 16, 64)]
    f = server_memory.fit(cells, "x", model)
    assert f["slope-model-copies"] == pytest.approx(0.5) and f["r2"] == pytest.approx(1.0)
    assert f["intercept-gb"] == pytest.approx(2.0)
    assert server_memory.fit(cells[:1], "x", model) is None  # one M: no slope


def test_model_preset_is_51_mib():
    assert server_memory.model_bytes("51MiB") == 4 * 13_373_952


@pytest.mark.slow
def test_quick_run_writes_cells_and_resumes(tmp_path):
    out = tmp_path / "mem.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--strategies", "diloco", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=1200, capture_output=True, text=True)
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert [(c["M"], c["status"]) for c in cells] == [(2, "ok"), (4, "ok")]
    for c in cells:
        assert c["replies-used"] == [c["M"], c["M"]]
        assert 0.1 < c["sim-peak-gb"] < c["tree-peak-gb"]
        assert c["round2-wall-s"] > 0
    (fit,) = data["fits"]
    assert fit["sim-peak-gb"]["points"] == 2
    again = subprocess.run(cmd, check=True, timeout=600, capture_output=True, text=True)
    assert again.stdout.count("already measured; skipped") == 2
    assert len(json.loads(out.read_text())["cells"]) == 2
    assert "| after | diloco | 4 |" in again.stdout


def _descendants(root):
    import psutil

    try:
        return root.children(recursive=True)
    except psutil.Error:
        return []


def _leads_sleep(p) -> bool:
    """A ``sleep`` that leads its own process group (setsid has run and exec'd it)."""
    import psutil

    try:
        return p.name() == "sleep" and os.getpgid(p.pid) == p.pid
    except (psutil.Error, ProcessLookupError):
        return False


def test_stop_ends_every_process_group_under_the_run():
    """A run's SuperLink and SuperExec lead their own process groups (setsid), as run_app.sh
    and Flower start them; run_app.sh itself (our group) exits once they are gone."""
    import psutil

    proc = subprocess.Popen(["bash", "-c", "setsid sleep 300 & setsid sleep 300 & wait"])
    root = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120  # both setsid exec'd into sleep, each its own group
    while True:
        kids = [k for k in _descendants(root) if _leads_sleep(k)]
        if len(kids) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(kids) == 2 and len({os.getpgid(k.pid) for k in kids}) == 2
    server_memory.stop(root)
    proc.wait(timeout=30)
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


def test_synthetic_app_is_the_lm_app_with_the_benchmark_workers(tmp_path):
    app = server_memory.synthetic_app(tmp_path, REPO)
    toml = (app / "pyproject.toml").read_text()
    assert 'clientapp = "isoloco_lm.synthetic_client:app"' in toml
    assert 'serverapp = "isoloco_lm.server_app:app"' in toml
    lm = REPO / "simulations" / "isoloco-lm"
    assert (app / "isoloco_lm" / "server_app.py").read_bytes() == (
        lm / "isoloco_lm" / "server_app.py"
    ).read_bytes()
    assert (lm / "pyproject.toml").read_text().count("synthetic") == 0  # the user's app as is


def test_synthetic_pseudo_gradient_is_seeded_and_shaped_like_the_message():
    import torch
    from flwr.app import ArrayRecord

    sys.path.insert(0, str(REPO / "benchmarks" / "memory" / "apps" / "server_load"))
    import client_app as synthetic

    rec = ArrayRecord({"w": torch.ones(3, 5), "h": torch.ones(4).half(), "n": torch.arange(2)})
    a, b = synthetic.pseudo_gradient(rec, 7), synthetic.pseudo_gradient(rec, 7)
    assert {k: (tuple(v.shape), v.dtype) for k, v in a.items()} == {
        "w": ((3, 5), torch.float32),
        "h": ((4,), torch.float16),
        "n": ((2,), torch.int64),
    }
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["w"], synthetic.pseudo_gradient(rec, 8)["w"])
    g = torch.Generator().manual_seed(7)
    assert torch.equal(a["w"], torch.randn(3, 5, generator=g) * synthetic.SCALE)
    assert torch.equal(a["n"], torch.zeros(2, dtype=torch.int64))
