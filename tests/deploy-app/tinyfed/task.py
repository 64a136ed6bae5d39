"""A 2-parameter linear model y = w*x + b, fitted by gradient descent on per-node data."""

import numpy as np

TRUE_W, TRUE_B = 2.0, 1.0


def node_data(partition_id: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Seeded points of y = 2x + 1 + noise; each partition sees its own x range."""
    rng = np.random.default_rng(1000 + partition_id)
    x = rng.uniform(partition_id, partition_id + 1.0, size=n)
    y = TRUE_W * x + TRUE_B + 0.01 * rng.standard_normal(n)
    return x, y


def mse(params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error of params = [w, b]."""
    return float(np.mean((params[0] * x + params[1] - y) ** 2))


def local_train(params: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int, lr: float):
    """Plain gradient descent on the MSE: grad = 2/n * [sum(r*x), sum(r)], r = w*x+b-y."""
    p = params.astype(np.float64).copy()
    for _ in range(steps):
        r = p[0] * x + p[1] - y
        p -= lr * 2.0 * np.array([np.mean(r * x), np.mean(r)])
    return p.astype(np.float32)
