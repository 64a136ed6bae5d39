"""A byte-level bigram language model (one 256 x 256 logit table) on Shakespeare.

Small enough that the example runs in seconds; any PyTorch model works the same way.
"""

import numpy as np
import torch

from flwr_isoloco.data.text import load_corpus, shard_rows, split_text


class Bigram(torch.nn.Module):
    """``logits(next byte | byte) = table[byte]``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(256, 256)
        torch.nn.init.zeros_(self.table.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)


_CACHE: dict[str, np.ndarray] = {}


def _bytes(split: str) -> np.ndarray:
    if split not in _CACHE:
        train, val = split_text(load_corpus("shakespeare"), 0.05)
        _CACHE["train"] = np.frombuffer(train.encode("utf-8"), dtype=np.uint8)
        _CACHE["val"] = np.frombuffer(val.encode("utf-8")[:200_000], dtype=np.uint8)
    return _CACHE[split]


def node_data(partition_id: int, num_partitions: int) -> torch.Tensor:
    """This node's contiguous slice of the training text (as byte ids)."""
    data = _bytes("train")
    start, stop = shard_rows(len(data), partition_id, num_partitions)
    return torch.from_numpy(data[start:stop].astype(np.int64))


def loss_on(model: Bigram, data: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(data[:-1]), data[1:])


def val_loss(model: Bigram) -> float:
    with torch.no_grad():
        return float(loss_on(model, torch.from_numpy(_bytes("val").astype(np.int64))))
