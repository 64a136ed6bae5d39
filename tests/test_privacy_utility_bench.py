"""benchmarks/privacy/privacy_utility.py without Ray: its run configs are valid for the LM app, the noise
is calibrated on Flower's accountant, and the docs table is regenerated from the results file."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "simulations" / "isoloco-lm"))
_spec = importlib.util.spec_from_file_location(
    "privacy_utility", REPO / "benchmarks" / "privacy" / "privacy_utility.py"
)
pu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pu)


@pytest.mark.parametrize("eps", pu.EPSILONS)
def test_every_cell_config_is_a_valid_lm_app_config(eps, tmp_path):
    from isoloco_lm.task import build_strategy, load_config

    rc = pu.run_config("isoloco", 8, eps, 1.0, tmp_path, quick=False)
    s = build_strategy(load_config(rc))
    if math.isinf(eps):
        assert not s.dp.enabled
    else:
        assert s.dp.c == 1.0 and s.dp.max_epsilon == eps
        a = pu.dp_keys(eps, 1.0, pu.rounds(False))
        assert s.dp.z == a["strategy.dp-noise-multiplier"]


def test_table_is_regenerated_between_the_markers(tmp_path):
    def rec(strategy, eps, last, z=0.0):
        return {
            "strategy": strategy,
            "nodes": 8,
            "epsilon": eps,
            "z": z,
            "clip": None if eps is None else 1.0,
            "val_loss": [7.0, last],
            "dp_epsilon": [None, None] if eps is None else [eps / 2, eps * 0.99],
            "quick": False,
        }

    records = [rec("diloco", None, 6.0), rec("diloco", 2.0, 7.5, z=4.8), rec("isoloco", None, 5.0)]
    doc = tmp_path / "privacy.md"
    doc.write_text(f"intro\n{pu.BEGIN}\nold\n{pu.END}\nrest\n")
    pu.write_table(records, doc)
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    row = next(line for line in text.splitlines() if line.startswith("| diloco | 8 | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:] == ["4.8", "1", "0.6", "1.980", "7.5000", "+1.500"]
