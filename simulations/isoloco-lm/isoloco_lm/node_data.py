"""A node's own training text (node-config ``data-path``) and the seeded batch windows.

``task`` re-exports these names; the run's tokenizer and cache come from :mod:`.run_text`.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from omegaconf import DictConfig

from flwr_isoloco.clients.hf_lm import batch_generator
from flwr_isoloco.data.text import load_corpus, sample_batch

from . import pretrained
from .run_text import cache_path, text_data


def window_batches(cfg: DictConfig, tokens: np.ndarray, partition_id: int):
    """``batch(i)``: ``train.batch-size`` random windows of ``train.seq-len`` tokens of
    ``tokens``, seeded by (seed, partition, i) so a resumed node draws exactly the same batches."""
    bs, seq, seed = cfg.train["batch-size"], cfg.train["seq-len"], cfg.seed

    def batch(index: int) -> torch.Tensor:
        g = batch_generator(seed, partition_id, index)
        return sample_batch(tokens, bs, seq, g)

    return batch


# A node's own text: ``--node-config "... data-path='/abs/site/data'"`` (a .txt/.md file or a
# folder of them). The node trains on all of it, encoded with the run's tokenizer (the one
# trained on the training split of ``data.corpus``), so server and nodes share one vocabulary.
DATA_PATH_KEY = "data-path"


class NodeDataError(ValueError):
    """A node's ``data-path`` cannot be used (missing, unreadable, empty, too short)."""


@functools.lru_cache(maxsize=4)
def _encode_local(text: str, tokenizer_path: str) -> np.ndarray:
    # Per-process memo (simulation actors reuse it across rounds).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return np.asarray(tok.encode(text).ids, dtype=np.int32)


def local_tokens(cfg: DictConfig, data_path: str, partition_id: int) -> np.ndarray:
    """All of the node's own text at ``data_path``, encoded with the run's tokenizer (no
    sharding). Raises :class:`NodeDataError` naming the node's partition-id and the path."""

    def fail(reason: str) -> NodeDataError:
        return NodeDataError(
            f"node partition-id {partition_id}: node-config {DATA_PATH_KEY}={data_path!r}: {reason}"
        )

    path = os.path.expanduser(data_path)
    if not os.path.isabs(path):
        raise fail("must be an absolute path to a .txt/.md file or a folder of them")
    if not os.path.exists(path):
        raise fail("no such file or directory")
    try:
        docs = load_corpus(path)  # the same local-path loader (and cleaning) as data.corpus
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read it ({type(exc).__name__}: {exc})") from exc
    text = "\n".join(docs)  # joined as split_text joins the corpus documents
    if not text.strip():
        raise fail("holds no text")
    if pretrained.is_pretrained(cfg):
        tokens = pretrained.encode(cfg, cache_path(cfg), text)
    else:
        tokens = _encode_local(text, str(text_data(cfg).tokenizer_path))
    need = cfg.train["seq-len"] + 2
    if len(tokens) < need:
        raise fail(
            f"{len(tokens)} tokens are too few for train.seq-len {cfg.train['seq-len']} "
            f"(need at least {need})"
        )
    return tokens


def local_batches(cfg: DictConfig, data_path: str, partition_id: int):
    """Like :func:`node_batches`, but random windows of the node's own text (``data-path``),
    seeded the same way; the text is read and encoded now, so a bad path fails at once."""
    return window_batches(cfg, local_tokens(cfg, data_path, partition_id), partition_id)
