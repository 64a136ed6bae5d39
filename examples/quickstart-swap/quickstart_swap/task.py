"""A tiny classifier (one linear layer) on seeded synthetic data, so the example needs no
download and runs in seconds; any PyTorch model works the same way.

Partition ``p`` of ``n`` holds 200 points of two Gaussian classes in 8 dimensions whose
means are ``+-mu`` shifted by ``0.3 p`` (a little non-IID); the test set is unshifted.
"""

import torch

DIM, ROWS = 8, 200


class Net(torch.nn.Module):
    """``logits = W x + b`` for 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def load_data(partition_id: int, shift: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of one partition (``partition_id = -1``: the test set, no shift)."""
    g = torch.Generator().manual_seed(1000 + partition_id)
    y = torch.randint(0, 2, (ROWS,), generator=g)
    mu = torch.linspace(-1.0, 1.0, DIM)
    x = torch.randn(ROWS, DIM, generator=g) + (2 * y[:, None] - 1) * mu
    if partition_id >= 0:
        x = x + shift * partition_id
    return x, y


def train(net: Net, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float) -> float:
    """Full-batch SGD; returns the last training loss."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def test(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(loss, accuracy)``."""
    with torch.no_grad():
        logits = net(x)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        return loss, float((logits.argmax(1) == y).float().mean())
