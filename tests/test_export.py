"""Exports that load with Hugging Face alone (issue 9, item 5), in-process.

The LM export must load with ``AutoModelForCausalLM``/``AutoTokenizer`` offline and generate;
the adapter export must load with ``PeftModel.from_pretrained(base, d)``, head included, and
give the same logits (so the same test accuracy) as the model it was exported from.
"""

from __future__ import annotations

import stat

import pytest
import torch

from flwr_isoloco.models import classifier
from flwr_isoloco.models.export import export_adapter, export_causal_lm, quiet_hf
from flwr_isoloco.models.llama import build_llama, llama_config

TEXTS = ["a wonderful, moving film", "dull and far too long", "I loved it", "a waste of time"]
LABELS = [1, 0, 1, 0]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _tokenizer_file(tmp_path):
    from flwr_isoloco.data.text import train_tokenizer

    text = "To be, or not to be, that is the question.\nWhether 'tis nobler in the mind\n" * 50
    train_tokenizer(text, 300, tmp_path / "cache")
    (path,) = (tmp_path / "cache").glob("tokenizer-*.json")
    return path


def _modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


def test_causal_lm_export_prints_no_progress_bar(tmp_path, capfd):
    model = build_llama(llama_config(vocab_size=300, hidden=32, heads=2, layers=1), seed=3)
    export_causal_lm(model, _tokenizer_file(tmp_path), tmp_path / "model")
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out


def test_causal_lm_export_loads_offline_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_llama(llama_config(vocab_size=300, hidden=32, heads=2, layers=1), seed=3)
    d = export_causal_lm(model, _tokenizer_file(tmp_path), tmp_path / "model")
    with quiet_hf():
        loaded = AutoModelForCausalLM.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
    ids = tok("To be, or not", return_tensors="pt")
    assert ids["input_ids"].shape[1] > 1
    assert tok.decode(ids["input_ids"][0]) == "To be, or not"  # byte-level BPE round trip
    with torch.no_grad():
        want = model(input_ids=ids["input_ids"]).logits
        got = loaded(input_ids=ids["input_ids"]).logits
    assert torch.equal(want, got)
    out = loaded.generate(**ids, max_new_tokens=5, do_sample=False)
    n = ids["input_ids"].shape[1]
    assert n < out.shape[1] <= n + 5 and torch.equal(out[0, :n], ids["input_ids"][0])
    assert isinstance(tok.decode(out[0]), str)
    assert loaded.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id is None  # the source model is left as it was
    assert set(_modes(d).values()) == {0o644}


@pytest.mark.parametrize("train_head", [True, False])
def test_adapter_export_loads_with_peft_head_included(tmp_path, train_head):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    spec = classifier.LoRASpec(train_head=train_head, seed=5)
    model = classifier.build_model(spec)
    g = torch.Generator().manual_seed(11)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=g)
        for k, v in classifier.adapter_state_dict(model).items()
    }
    tok = classifier.load_tokenizer(spec.model)
    d = export_adapter(model, state, tmp_path / "adapter", tokenizer=tok)
    want = classifier.evaluate(model, tok, TEXTS, LABELS)

    with quiet_hf():
        base = AutoModelForSequenceClassification.from_pretrained(
            classifier.resolve_model_path(spec.model), num_labels=2
        )
        loaded = PeftModel.from_pretrained(base, d)
    got = classifier.evaluate(loaded, tok, TEXTS, LABELS)
    assert got["accuracy"] == want["accuracy"]
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    batch = classifier.encode(tok, TEXTS)
    with torch.no_grad():
        assert torch.allclose(model(**batch).logits, loaded(**batch).logits, atol=1e-6)
    assert (d / "tokenizer.json").is_file()
    assert all(m == 0o644 for m in _modes(d).values())


def test_quiet_hf_hides_progress_bars_and_restores_them():
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())
    with quiet_hf():
        assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()) == before


def test_building_the_classifier_prints_no_loading_bar(capfd):
    classifier.build_model(classifier.LoRASpec(seed=2))
    err = capfd.readouterr().err
    assert "Loading weights" not in err
