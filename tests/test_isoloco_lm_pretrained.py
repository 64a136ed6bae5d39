"""The isoloco-lm app on a pretrained Hugging Face causal LM (model.name-or-path): key checks,
in-process runs on a tiny random LlamaForCausalLM saved with save_pretrained (fp32 and bf16),
the checkpoint and the export. (A `flwr run` of the same configuration through
scripts/run_app.sh takes ~1-2.5 min, over this file's test budget; it is not repeated here.)"""

import json

import pytest
import torch
from fakegrid import FakeGrid
from isoloco_lm import client_app, server_app, task
from lm_app import write_corpus
from safetensors import safe_open
from tiny_hf import save_tiny_llama

from flwr_isoloco.runconfig import RunConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), plays=2, chars=20_000)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def hf_run(request, corpus, tmp_path_factory):
    torch.set_num_threads(1)
    folder = save_tiny_llama(tmp_path_factory.mktemp("model"), dtype=request.param)
    return folder, {
        "num-server-rounds": 2,
        "model.name-or-path": str(folder),
        "train.seq-len": 32,
        "train.batch-size": 4,
        "train.micro-batch": 2,
        "train.local-steps": 2,
        "train.warmup-steps": 1,
        "data.val-tokens": 512,
        "data.corpus": str(corpus),
        "data.cache-dir": str(tmp_path_factory.mktemp("cache")),
        "strategy.min-nodes": 2,
    }


# ----------------------------------------------------------------------------- keys (fast)
@pytest.mark.parametrize(
    "override,pattern",
    [
        ({"model.name-or-path": "/x", "model.hidden": 64}, r"'model\.hidden' = 64 only applies"),
        ({"model.name-or-path": "/x", "model.vocab-size": 999}, r"'model\.vocab-size'"),
        (
            {"model.gguf-file": "m.gguf"},
            r"'model\.gguf-file' = 'm\.gguf' needs model\.name-or-path",
        ),
        ({"model.tokenizer": "gpt2"}, r"'model\.tokenizer' = 'gpt2' needs"),
        ({"model.dtype": "bfloat16"}, r"'model\.dtype' = 'bfloat16' needs"),
        ({"model.name-or-path": "x", "model.dtype": "int8"}, r"'model\.dtype' has bad value"),
        ({"model.name-or-path": "/surely/not/here"}, r"'model\.name-or-path'.*no such file"),
        ({"train.micro-batch": -1}, r"'train\.micro-batch'"),
    ],
)
def test_bad_pretrained_keys_are_refused(override, pattern, tmp_path):
    if override.get("model.name-or-path") == "/x":
        override = {**override, "model.name-or-path": str(tmp_path)}
    with pytest.raises(RunConfigError, match=pattern):
        task.load_config(override)


def test_default_keys_keep_the_builtin_model():
    cfg = task.load_config({})
    assert cfg.model["name-or-path"] == "" and not task.pretrained.is_pretrained(cfg)
    assert type(task.build_model(cfg)).__name__ == "LlamaForCausalLM"
    assert task.pretrained.check_keys(cfg, task.DEFAULTS["model"]) is None


def test_seq_len_longer_than_the_model_is_refused(hf_run, tmp_path):
    folder, rc = hf_run
    rc = {**rc, "train.seq-len": 65, "output-dir": str(tmp_path / "o")}  # the model has 64
    grid = FakeGrid({"train": client_app.train}, num_nodes=2, run_config=rc)
    with pytest.raises(RunConfigError, match=r"'train\.seq-len' = 65 .* maximum \(64"):
        server_app.run_server(grid, rc, settle_s=0.0)


# ----------------------------------------------------------------------------- runs
def test_pretrained_run_trains_checkpoints_once_and_exports_the_model(hf_run, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, rc = hf_run
    rc = {**rc, "output-dir": str(tmp_path / "a")}
    grid = FakeGrid({"train": client_app.train}, num_nodes=2, run_config=rc)
    out = server_app.run_server(grid, rc, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and len(res["rounds"]) == 2
    assert all(r["replies-used"] == 2 for r in res["rounds"])
    assert res["rounds"][-1]["val-loss"] < res["initial"]["val-loss"]
    assert res["rounds"][0]["worker-time-s"] > 0 and res["rounds"][0]["server-peak-rss-mb"] > 0
    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:  # the tie stored once
        keys = list(f.keys())
    assert any(k.endswith("model.embed_tokens.weight") for k in keys)
    assert not any(k.endswith("lm_head.weight") for k in keys)
    # model/: the input's architecture and tokenizer, trained weights, tie restored
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    got, want = AutoConfig.from_pretrained(out / "model"), AutoConfig.from_pretrained(folder)
    for key in (
        "architectures",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(got, key) == getattr(want, key), key
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    orig = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not torch.equal(model.model.norm.weight, orig.model.norm.weight)  # trained
    tok, ref = AutoTokenizer.from_pretrained(out / "model"), AutoTokenizer.from_pretrained(folder)
    assert tok.get_vocab() == ref.get_vocab()
    assert model.generation_config.eos_token_id == orig.generation_config.eos_token_id
    ids = tok("To be", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
