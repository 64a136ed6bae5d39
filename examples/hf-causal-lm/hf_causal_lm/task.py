"""The model and the text of the example: any causal LM, any ``datasets.Dataset`` of text.

Memoised per process: a simulated node is asked every round.
"""

from __future__ import annotations

import functools

import datasets

from flwr_isoloco.clients.hf_lm import causal_lm_fn, load_tokenizer, pretrained_folder
from flwr_isoloco.data.text import load_corpus
from flwr_isoloco.models.hf import smollm2_gguf


@functools.lru_cache(maxsize=2)
def model_source(model: str, cache_dir: str = "") -> str:
    """A folder ``from_pretrained`` reads: ``smollm2`` and .gguf files are converted once."""
    if model == "smollm2":
        folder, gguf = smollm2_gguf()
        return pretrained_folder(folder, gguf_file=gguf, cache_dir=cache_dir or None)
    return pretrained_folder(model, cache_dir=cache_dir or None)


@functools.lru_cache(maxsize=2)
def model_fn_for(source: str):
    return causal_lm_fn(source)


@functools.lru_cache(maxsize=2)
def tokenizer_for(source: str):
    return load_tokenizer(source)


@functools.lru_cache(maxsize=2)
def text_splits(text: str, val_docs: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, held-out)`` Datasets with a ``text`` column; the last ``val_docs`` rows are
    held out. One row per document: ``shakespeare`` (the plays), a folder of .txt/.md files,
    or a Hub data set's ``text`` column (:func:`flwr_isoloco.data.text.load_corpus`)."""
    ds = datasets.Dataset.from_dict({"text": load_corpus(text)})
    n = len(ds)
    if not 0 < val_docs < n:
        raise ValueError(f"val-docs must be in [1, {n - 1}] for {n} documents, got {val_docs}")
    return ds.select(range(n - val_docs)), ds.select(range(n - val_docs, n))
