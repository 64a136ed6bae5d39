"""Log lines and commands a user can trust (issue 34, item 9, the non-DP part): a perplexity
beyond the exp cap is printed as capped, and the hf_causal_lm README's commands export."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "hf-causal-lm"
sys.path.insert(0, str(EXAMPLE))


@pytest.mark.parametrize("loss", [67.3, 154.8])
def test_a_capped_perplexity_is_printed_as_capped(loss):
    from isoloco_lm.server_app import summary

    row = {"round": 0, "val-loss": loss, "val-ppl": math.exp(min(loss, 50.0))}
    text = summary(row)
    assert "5184705528587072045056" not in text
    assert text == f"val loss {loss:.4f} ppl >5.2e+21 (capped)"


def test_an_uncapped_perplexity_is_printed_as_before():
    from isoloco_lm.server_app import summary

    assert summary({"round": 0, "val-loss": 4.5139, "val-ppl": 91.27}) == (
        "val loss 4.5139 ppl 91.3"
    )


def test_every_hf_causal_lm_readme_command_writes_to_an_absolute_output_dir():
    readme = (EXAMPLE / "README.md").read_text(encoding="utf-8")
    commands = [ln for ln in readme.splitlines() if ln.startswith("flwr run examples/hf-causal")]
    assert len(commands) >= 2
    for cmd in commands:
        assert re.search(r"output-dir='/[^']+'", cmd), cmd


def test_hf_causal_lm_refuses_a_relative_output_dir_before_loading_anything(capsys):
    from hf_causal_lm.server_app import check_output_dir, main

    rc = {"output-dir": "relative/out", "model": "/nonexistent", "cache-dir": ""}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(ValueError, match="output-dir must be an absolute path"):
        main(None, ctx)
    check_output_dir("")
    assert "output-dir is empty" in capsys.readouterr().out
