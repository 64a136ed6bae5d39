"""Helpers to run the DiLoCo worker on any Hugging Face causal LM and any text data set.

The recipe (the repository's ``docs/user-guide.md`` ("flwr-isoloco user guide"), "Your own
Hugging Face model"; the example app in the repository's ``examples/hf-causal-lm``)::

    model_fn = causal_lm_fn("HuggingFaceTB/SmolLM2-135M")     # or a local folder / a GGUF
    tok = load_tokenizer("HuggingFaceTB/SmolLM2-135M")
    def data_fn(context):
        texts = partition_texts(dataset, pid, num_partitions)  # flwr-datasets IidPartitioner
        return window_batches(tokenize_texts(texts, tok), 4, 256, seed=0, partition_id=pid)
    app.train()(make_diloco_train_handler(model_fn, data_fn, runtime=Runtime(micro_batch=2)))

and on the server ``initial_arrays = model_arrays(model)`` (each tied tensor once; see
:mod:`flwr_isoloco.models.hf`) and, at the end, ``load_model_arrays(model, result.arrays)``.

- :func:`pretrained_folder`: a GGUF is de-quantised once into a Hugging Face folder in the
  cache (``hf-<sha256 of its path, size, mtime>``; ~50 s for SmolLM2-135M on a loaded 2-core
  machine), so the workers load a plain folder (~0.5 s) every round; folders and Hub names are
  returned as they are.
- :func:`corpus_tokens`: the app corpus split as :func:`flwr_isoloco.data.text.split_text`
  does, encoded with a pretrained tokenizer, cached as ``.npy`` per (text, tokenizer) digest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flwr_isoloco.data.text import default_cache_dir, load_corpus, sample_batch, split_text
from flwr_isoloco.models.export import quiet_hf
from flwr_isoloco.models.hf import _gguf_source, load_causal_lm, load_tokenizer, parse_dtype

__all__ = [
    "batch_generator",
    "causal_lm_fn",
    "corpus_tokens",
    "encode_text",
    "load_tokenizer",
    "partition_texts",
    "pretrained_folder",
    "tokenize_texts",
    "tokenizer_digest",
    "window_batches",
]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def pretrained_folder(
    name_or_path: str, *, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str:
    """A folder (or Hub name) ``from_pretrained`` loads without ``gguf_file``: for a GGUF, its
    de-quantised fp32 copy in ``cache_dir`` (made once, written atomically); else unchanged."""
    folder, gguf = _gguf_source(name_or_path, gguf_file)
    if not gguf:
        return name_or_path
    src = Path(folder) / gguf
    st = src.stat()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / f"hf-{_sha(f'{src.resolve()}|{st.st_size}|{st.st_mtime_ns}')}"
    if (out / "config.json").is_file():
        return str(out)
    model, tok = load_causal_lm(folder, gguf_file=gguf)
    tmp = cache / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def causal_lm_fn(
    name_or_path: str,
    *,
    gguf_file: str | None = None,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
) -> Callable[[Any], torch.nn.Module]:
    """A DiLoCo worker ``model_fn``: ``(context) ->`` the pretrained model in ``dtype`` (a GGUF
    is converted once, :func:`pretrained_folder`); the received arrays then load into it."""
    source = pretrained_folder(name_or_path, gguf_file=gguf_file, cache_dir=cache_dir)

    def model_fn(_context=None) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with quiet_hf():
            return AutoModelForCausalLM.from_pretrained(source, dtype=parse_dtype(dtype))

    return model_fn


def tokenizer_digest(tokenizer) -> str:
    """Digest of a tokenizer's full definition (vocabulary, merges, normaliser, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return _sha(spec + repr(tokenizer.all_special_tokens))


def tokenize_texts(texts: Iterable[str], tokenizer, *, chunk: int = 256) -> np.ndarray:
    """int32 token stream: each text encoded without special tokens, followed by the
    end-of-text id (if the tokenizer has one); texts go through the fast tokenizer in
    batches of ``chunk``."""
    eos = tokenizer.eos_token_id
    out: list[int] = []
    texts = [t for t in texts if t]
    for i in range(0, len(texts), chunk):
        with quiet_hf():  # "sequence longer than the model's maximum": it is cut into windows
            ids = tokenizer(texts[i : i + chunk], add_special_tokens=False)["input_ids"]
        for row in ids:
            out.extend(row)
            if eos is not None:
                out.append(eos)
    return np.asarray(out, dtype=np.int32)


def _line_chunks(text: str, lines: int = 200) -> list[str]:
    # Line groups: the fast tokenizer runs in parallel and never sees one 5 MB string.
    parts = text.splitlines(keepends=True)
    return ["".join(parts[i : i + lines]) for i in range(0, len(parts), lines)]


def encode_text(text: str, tokenizer) -> np.ndarray:
    """int32 ids of ``text`` (no special tokens), encoded in groups of 200 whole lines: a token
    never spans a group boundary, which is a line break."""
    chunks = _line_chunks(text)
    out: list[int] = []
    for i in range(0, len(chunks), 256):
        with quiet_hf():
            rows = tokenizer(chunks[i : i + 256], add_special_tokens=False)["input_ids"]
        for row in rows:
            out.extend(row)
    return np.asarray(out, dtype=np.int32)


def corpus_tokens(
    corpus: str, tokenizer, val_fraction: float, cache_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray, str]:
    """``(train, val, key)``: ``corpus`` split by ``split_text`` and encoded with ``tokenizer``
    (line groups, no special tokens), cached as ``tokens-<key>-{train,val}.npy`` with ``key``
    the digests of both texts and of the tokenizer."""
    train_text, val_text = split_text(load_corpus(corpus), val_fraction)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = f"{_sha(train_text)}-{_sha(val_text)}-tok{tokenizer_digest(tokenizer)}"
    arrays = []
    for split, text in (("train", train_text), ("val", val_text)):
        path = cache / f"tokens-{key}-{split}.npy"
        if path.is_file():
            arrays.append(np.load(path, allow_pickle=False))
            continue
        tokens = encode_text(text, tokenizer)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tokens-{key}-{split}.{os.getpid()}.npy"
        np.save(tmp, tokens, allow_pickle=False)
        os.replace(tmp, path)
        arrays.append(tokens)
    return arrays[0], arrays[1], key


def partition_texts(
    dataset, partition_id: int, num_partitions: int, *, text_column: str = "text"
) -> list[str]:
    """Texts of partition ``partition_id`` of a ``datasets.Dataset``: flwr-datasets'
    ``IidPartitioner`` (contiguous, near-equal shards of the rows in their order)."""
    from flwr_datasets.partitioner import IidPartitioner

    if text_column not in dataset.column_names:
        raise ValueError(
            f"data set has no {text_column!r} column (columns: {dataset.column_names})"
        )
    partitioner = IidPartitioner(num_partitions=num_partitions)
    partitioner.dataset = dataset
    return list(partitioner.load_partition(partition_id)[text_column])


def batch_generator(seed: int, partition_id: int, index: int) -> torch.Generator:
    """The generator of batch ``index`` of a node: seeded by ``(seed, partition, index)``,
    reduced mod 2**64 so that no seed overflows ``manual_seed`` (smaller seeds unchanged)."""
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + partition_id) * 1_000_033 + index) % 2**64
    )


def window_batches(
    tokens: np.ndarray | Sequence[int],
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    partition_id: int = 0,
) -> Callable[[int], torch.Tensor]:
    """``batch(i)``: ``batch_size`` random windows of ``seq_len + 1`` tokens, seeded by
    :func:`batch_generator` (a resumed node draws the same batches)."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{len(tokens)} tokens are too few for seq_len {seq_len}")

    def batch(index: int) -> torch.Tensor:
        return sample_batch(tokens, batch_size, seq_len, batch_generator(seed, partition_id, index))

    return batch
