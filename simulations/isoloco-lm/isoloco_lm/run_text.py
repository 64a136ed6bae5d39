"""The run's text and tokenizer: the ``data.corpus`` token splits with the BPE trained on them,
or the pretrained model's tokenizer (``model.name-or-path``), and the run's cache folder.

Its own module so that :mod:`.task` and :mod:`.node_data` both use it without importing each
other; ``task`` re-exports :func:`cache_dir` and :func:`text_data`.
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig

from flwr_isoloco.data.text import prepare_tokens
from flwr_isoloco.runconfig import RunConfigError

from . import pretrained


def cache_dir(cfg: DictConfig) -> Path | None:
    return Path(cfg.data["cache-dir"]) if cfg.data["cache-dir"] else None


def cache_path(cfg: DictConfig) -> str | None:
    """:func:`cache_dir` as a string (None when unset), as the loaders take it."""
    c = cache_dir(cfg)
    return str(c) if c else None


@functools.lru_cache(maxsize=4)
def _tokens(corpus: str, vocab: int, val_fraction: float, cache: str | None):
    # Per-process memo (simulation actors reuse it); the files on disk are the real cache.
    return prepare_tokens(corpus, vocab, val_fraction, cache)


def text_data(cfg: DictConfig):
    if pretrained.is_pretrained(cfg):
        return pretrained.text_data(cfg, cache_path(cfg))
    cache = cache_dir(cfg)
    data = _tokens(
        cfg.data.corpus,
        cfg.model["vocab-size"],
        cfg.data["val-fraction"],
        str(cache) if cache else None,
    )
    if data.vocab_size != cfg.model["vocab-size"]:
        raise RunConfigError(
            f"run-config key 'model.vocab-size' = {cfg.model['vocab-size']}: the corpus only supports "
            f"a BPE vocabulary of {data.vocab_size}"
        )
    return data
