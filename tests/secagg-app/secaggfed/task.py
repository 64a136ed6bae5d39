"""The tiny model, each node's text batches and the validation batches (all seeded)."""

from __future__ import annotations

import torch

from flwr_isoloco.data.text import load_corpus
from flwr_isoloco.models.llama import build_llama, llama_config

VOCAB = 32
CFG = llama_config(vocab_size=VOCAB, hidden=16, layers=1, heads=2, max_seq_len=16)


def build_model(_ctx=None) -> torch.nn.Module:
    return build_llama(CFG, seed=0)


def _tokens(offset: int, n: int) -> torch.Tensor:
    """Shakespeare's bytes mod 32 (a learnable character-level stream), from ``offset``."""
    raw = load_corpus("shakespeare")[0].encode("utf-8")[offset : offset + n]
    return torch.tensor(list(raw), dtype=torch.long) % VOCAB


def node_batches(pid: int, n: int = 4) -> list[torch.Tensor]:
    """Node ``pid``'s shard: ``n`` batches of 2 sequences of 9 tokens."""
    t = _tokens(2000 * (pid + 1), n * 18)
    return [t[i * 18 : (i + 1) * 18].view(2, 9) for i in range(n)]


def val_batches() -> list[torch.Tensor]:
    t = _tokens(20_000, 8 * 18)
    return [t[i * 18 : (i + 1) * 18].view(2, 9) for i in range(8)]


def val_loss(model: torch.nn.Module) -> float:
    from flwr_isoloco.clients.diloco_worker import next_token_loss

    model.eval()
    with torch.no_grad():
        losses = [next_token_loss(model, b)[0].item() for b in val_batches()]
    return sum(losses) / len(losses)
