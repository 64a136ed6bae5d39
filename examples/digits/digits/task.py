"""Model, data and training loop of the digits app (sklearn's 8x8 digits, no download).

Data: ``sklearn.datasets.load_digits`` (1797 images, 10 classes, values 0..16 scaled to
[0, 1]); a fixed stratified split (``random_state=0``) gives 1437 training and 360 test images.
The training images are split over ``num-partitions`` nodes by flwr-datasets' partitioners on
an in-memory dataset: ``IidPartitioner`` or ``DirichletPartitioner`` (label skew,
``alpha``, ``partition-seed``).

``split = "validation"`` (for tuning) holds out a fixed stratified 20 % of the training images
(288, ``random_state=0``) as the evaluation set; the nodes then share the other 1149 and the
test images are not touched. ``split = "test"`` (default) is the split above.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

TEST_FRACTION = 0.2
SPLIT_SEED = 0
SPLITS = ("test", "validation")


MODELS = ("cnn", "mlp", "cnn-bn")


class Net(nn.Module):
    """``model="cnn"``: two 3x3 conv layers (16, 32 channels, max-pool 2 each), then
    128 -> 64 -> 10. ``model="mlp"``: 64 -> 64 -> 10. ``model="cnn-bn"``: the CNN with a
    ``BatchNorm2d`` after each conv layer (running statistics in the state_dict: buffers, which
    DiLoCo / IsoLoCo merge as FedAvg does). Initialised from ``seed``."""

    def __init__(self, seed: int = 0, model: str = "cnn") -> None:
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {model!r}")
        torch.manual_seed(seed)
        self.model = model
        conv = model != "mlp"
        if conv:
            self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        if model == "cnn-bn":
            self.bn1, self.bn2 = nn.BatchNorm2d(16), nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 2 * 2 if conv else 64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.model != "mlp":
            bn = self.model == "cnn-bn"
            x = self.conv1(x)
            x = nn.functional.max_pool2d(torch.relu(self.bn1(x) if bn else x), 2)
            x = self.conv2(x)
            x = nn.functional.max_pool2d(torch.relu(self.bn2(x) if bn else x), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _cut(x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The fixed stratified 80 / 20 cut: ``[x_a, x_b, y_a, y_b]``."""
    from sklearn.model_selection import train_test_split

    return train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)


@lru_cache(maxsize=2)
def _split(split: str = "test") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, x_eval, y_train, y_eval)`` of ``split`` (module doc)."""
    from sklearn.datasets import load_digits

    if split not in SPLITS:
        raise ValueError(f"run-config key 'split' must be one of {SPLITS}, got {split!r}")
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    x_train, x_eval, y_train, y_eval = _cut(x, y)
    if split == "validation":  # the same cut again, inside the training images
        x_train, x_eval, y_train, y_eval = _cut(x_train, y_train)
    return x_train, x_eval, y_train, y_eval


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def load_test(split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation set ``(x, y)``: the fixed 360 test images, or ``split="validation"``'s
    288 held-out training images."""
    _, x_test, _, y_test = _split(split)
    return _tensors(x_test, y_test)


@lru_cache(maxsize=64)
def partition_indices(
    num_partitions: int,
    partitioner: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    split: str = "test",
) -> tuple[tuple[int, ...], ...]:
    """Training-set indices of every partition (flwr-datasets partitioners, seeded)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    _, _, y_train, _ = _split(split)
    if partitioner == "iid":
        part = IidPartitioner(num_partitions=num_partitions)
    elif partitioner == "dirichlet":
        part = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=10,
            seed=seed,
        )
    else:
        raise ValueError(f"partitioner must be 'iid' or 'dirichlet', got {partitioner!r}")
    part.dataset = Dataset.from_dict({"idx": list(range(len(y_train))), "label": y_train.tolist()})
    return tuple(tuple(part.load_partition(p)["idx"]) for p in range(num_partitions))


def load_partition(
    partition_id: int,
    num_partitions: int,
    partitioner: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    split: str = "test",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of one node's share of the training set (of ``split``)."""
    x_train, _, y_train, _ = _split(split)
    idx = np.asarray(
        partition_indices(num_partitions, partitioner, alpha, seed, split)[partition_id]
    )
    return _tensors(x_train[idx], y_train[idx])


def train(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int = 32,
    momentum: float = 0.9,
    seed: int = 0,
) -> float:
    """Mini-batch SGD with momentum, as in Flower's quickstart-pytorch (batches shuffled with
    ``seed``, a fresh optimiser each round); returns the mean loss of the last epoch."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    g = torch.Generator().manual_seed(seed)
    net.train()
    total = 0.0
    for _ in range(epochs):
        total, batches = 0.0, 0
        for b in torch.randperm(len(y), generator=g).split(batch_size):
            loss = nn.functional.cross_entropy(net(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, batches = total + float(loss.detach()), batches + 1
        total /= max(batches, 1)
    return total


def test(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(loss, accuracy)``; a non-finite loss is reported as is."""
    net.eval()
    with torch.no_grad():
        logits = net(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        return loss, float((logits.argmax(1) == y).float().mean())
