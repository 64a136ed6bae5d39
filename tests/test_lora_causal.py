"""The peft LoRA client on a causal LM: a tiny random LlamaForCausalLM saved with save_pretrained,
real Shakespeare text, held-out perplexity, a peft export that merges into a plain HF model,
and RW-LoRA and gossip through Flower's simulation engine."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from tiny_hf import save_tiny_llama

from flwr_isoloco.clients.lora_causal import (
    CausalLoRAClientConfig,
    CausalLoRASpec,
    corpus_tokens,
    get_causal_model,
    target_modules_for,
)
from flwr_isoloco.clients.lora_client import LoRAClient
from flwr_isoloco.data.text import load_corpus
from flwr_isoloco.models.classifier import load_adapter_state_dict
from flwr_isoloco.models.export import export_adapter

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny-causal")
    text = base / "play.txt"  # real text: the first 60k characters of the first play
    text.write_text(load_corpus("shakespeare")[0][:60_000], encoding="utf-8")
    model = save_tiny_llama(base / "model")  # tied embeddings, as SmolLM2
    cfg = CausalLoRAClientConfig(
        lora=CausalLoRASpec(model=str(model), seed=3),
        corpus=str(text),
        val_fraction=0.2,
        seq_len=32,
        batch_size=4,
        local_steps=3,
        lr=5e-3,
        eval_tokens=1024,
        cache_dir=str(base / "cache"),
    )
    return cfg, base


def _send(grid, node, kind, adapter, config=None):
    content = RecordDict({"arrays": ArrayRecord(adapter), "config": ConfigRecord(config or {})})
    msg = grid.create_message(content, kind, grid.node_ids[node], "1")
    (reply,) = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error
    return reply


def test_target_modules_from_the_architecture():
    assert target_modules_for("llama") == ("q_proj", "v_proj")
    assert target_modules_for("gpt2") == ("c_attn",)
    assert target_modules_for("bloom") == ("query_key_value",)  # from peft's own table
    with pytest.raises(ValueError, match="name them"):
        target_modules_for("no-such-architecture")


def test_train_sends_only_the_adapter_and_evaluate_is_heldout_perplexity(tiny):
    cfg, _ = tiny
    built = get_causal_model(cfg.lora, slot="test")
    init = built.initial_adapter
    # LoRA on q_proj and v_proj of both layers, A and B; B starts at zero (the base model)
    assert len(init) == 2 * 2 * 2 and all(".self_attn." in k for k in init)
    assert all(not v.any() for k, v in init.items() if "lora_B" in k)
    grid = FakeGrid(
        {"train": LoRAClient(cfg).train, "evaluate": LoRAClient(cfg).evaluate}, num_nodes=4
    )
    reply = _send(grid, 1, MessageType.TRAIN, init, {"local-steps": 3})
    out = reply.content["arrays"].to_torch_state_dict()
    assert set(out) == set(init) and all(v.dtype == torch.float32 for v in out.values())
    assert all(not torch.equal(out[k], init[k]) for k in out)
    m = reply.content["metrics"]
    assert m["local-steps"] == 3 and m["examples-seen"] == 12 and m["partition-id"] == 1
    train, val = corpus_tokens(built.tokenizer, cfg.corpus, cfg.val_fraction, cfg.cache_dir)
    assert m["num-examples"] == len(np.array_split(np.arange(len(train) // 33), 4)[1])

    ev = _send(grid, 1, MessageType.EVALUATE, out).content["metrics"]
    assert ev["eval_ppl"] == pytest.approx(math.exp(ev["eval_loss"]), rel=1e-12)
    # independent computation: HF's own shifted loss on the same non-overlapping windows
    load_adapter_state_dict(built.model, out)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(1024 // 32):
            w = torch.from_numpy(val[i * 32 : i * 32 + 33].astype(np.int64))[None]
            total += float(built.model(input_ids=w, labels=w).loss) * 32
            count += 32
    assert ev["num-examples"] == count
    assert ev["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    # trained on text (3 steps at lr 5e-3) beats the untrained adapter's held-out loss
    base_ev = _send(grid, 1, MessageType.EVALUATE, init).content["metrics"]
    assert ev["eval_loss"] < base_ev["eval_loss"]


def test_site_text_from_node_config_data_path(tiny, tmp_path):
    cfg, _ = tiny
    site = tmp_path / "site.txt"
    site.write_text(load_corpus("shakespeare")[1][:8_000], encoding="utf-8")
    grid = FakeGrid(
        {"train": LoRAClient(cfg).train},
        num_nodes=2,
        node_config_fn=lambda i: {"data-path": str(site) if i == 0 else ""},
    )
    init = get_causal_model(cfg.lora, slot="test").initial_adapter
    rows = [
        _send(grid, i, MessageType.TRAIN, init).content["metrics"]["num-examples"] for i in (0, 1)
    ]
    tok = get_causal_model(cfg.lora, slot="test").tokenizer
    ids = tok(load_corpus(str(site))[0], add_special_tokens=False)["input_ids"]
    assert rows[0] == len(ids) // 33  # the site's own text, not a partition
    train, _ = corpus_tokens(tok, cfg.corpus, cfg.val_fraction, cfg.cache_dir)
    assert rows[1] == len(np.array_split(np.arange(len(train) // 33), 2)[1])


def test_seq_len_beyond_the_model_maximum_is_an_error_reply(tiny):
    cfg, _ = tiny
    long = dataclasses.replace(cfg, seq_len=65)  # the tiny model has 64 positions
    grid = FakeGrid({"train": LoRAClient(long).train}, num_nodes=2)
    init = get_causal_model(cfg.lora, slot="test").initial_adapter
    content = RecordDict({"arrays": ArrayRecord(init), "config": ConfigRecord({})})
    msg = grid.create_message(content, MessageType.TRAIN, grid.node_ids[0], "1")
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "max_position_embeddings 64" in reply.error.reason


def test_adapter_export_merges_into_a_plain_causal_lm(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, _ = tiny
    built = get_causal_model(cfg.lora, slot="test")
    gen = torch.Generator().manual_seed(0)
    adapter = {
        k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in built.initial_adapter.items()
    }
    folder = export_adapter(
        built.model, adapter, tmp_path / "adapter", tokenizer=built.tokenizer, head_modules=()
    )
    x = torch.arange(1, 17)[None]
    with torch.no_grad():
        want = built.model(input_ids=x).logits
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(cfg.lora.model), str(folder)
    )
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(str(tmp_path / "merged"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert type(again).__name__ == "LlamaForCausalLM"
    assert not any("lora" in k for k in again.state_dict())
    with torch.no_grad():
        got = again(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(cfg.lora.model)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=x).logits, want, atol=1e-3)  # adapter mattered


@pytest.mark.slow
def test_rwlora_and_gossip_on_the_causal_lm_through_ray(tiny):
    """benchmarks/rwlora/rwlora_llm.py as run for the results, on the tiny model: equal local updates,
    the same bytes through the server per update, held-out perplexity before and after."""
    cfg, base = tiny
    sys.path.insert(0, str(ROOT / "benchmarks" / "rwlora"))
    import rwlora_llm

    out = base / "rwlora_llm.json"
    res = rwlora_llm.main(
        ["--model", cfg.lora.model, "--corpus", cfg.corpus, "--val-fraction", "0.2",
         "--seq-len", "32", "--batch-size", "4", "--local-steps", "2", "--updates", "8",
         "--eval-tokens", "1024", "--lr", "5e-3", "--threads", "1", "--cache-dir",
         cfg.cache_dir, "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    rw, gossip = res["runs"]["rwlora"], res["runs"]["gossip"]
    assert (rw["rounds"], gossip["rounds"]) == (4, 1)
    assert rw["local-updates"] == gossip["local-updates"] == 8
    assert rw["before"] == gossip["before"]  # the same starting adapter and held-out text
    for r in (rw, gossip):
        assert r["after"]["heldout-ppl"] < r["before"]["heldout-ppl"]
        assert r["after"]["heldout-ppl"] == pytest.approx(math.exp(r["after"]["heldout-nll"]))
    # one adapter down and one up per K local steps in both: equal bytes through the server
    assert rw["bytes-relayed"] == gossip["bytes-relayed"] > 8 * rw["adapter-bytes"]
    # peer-to-peer: RW-LoRA one token per hop, gossip one adapter per edge and direction
    assert gossip["bytes-p2p"] == 4 * 3 * rw["bytes-p2p"] // 4
    assert "heldout-ppl-vertex-mean" in gossip["after"]
