"""The isoloco-lm app's test fixtures: a small real-text corpus and the tiny run config its
in-process runs share. (``conftest.py`` puts the app's folder on ``sys.path``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "simulations" / "isoloco-lm"

TINY_MODEL = {
    "model.hidden": 32,
    "model.heads": 2,
    "model.vocab-size": 400,
    "train.seq-len": 32,
    "train.batch-size": 4,
    "train.local-steps": 3,
    "train.warmup-steps": 2,
    "data.val-tokens": 1024,
    "strategy.min-nodes": 3,
}
"""A 32-wide LLaMA on a 400-word vocabulary, 3 inner steps of 4 x 32 tokens, 3 nodes."""


def write_corpus(folder: Path, plays: int = 3, chars: int = 40_000) -> Path:
    """``folder`` with the first ``chars`` characters of ``plays`` Shakespeare plays, one
    ``.txt`` each: real text, small enough that tokenizer training is fast."""
    from flwr_isoloco.data.text import load_corpus

    for i, text in enumerate(load_corpus("shakespeare")[:plays]):
        (folder / f"play{i}.txt").write_text(text[:chars], encoding="utf-8")
    return folder


def tiny_config(corpus: Path, cache_dir: Path, num_server_rounds: int) -> dict[str, Any]:
    """:data:`TINY_MODEL` for ``num_server_rounds`` rounds on ``corpus``, cached in ``cache_dir``."""
    return {
        "num-server-rounds": num_server_rounds,
        **TINY_MODEL,
        "data.corpus": str(corpus),
        "data.cache-dir": str(cache_dir),
    }
