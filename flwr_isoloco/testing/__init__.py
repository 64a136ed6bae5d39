"""Test and benchmark fixtures, kept out of the library proper: seeded synthetic
pseudo-gradients for the merge rules (:mod:`flwr_isoloco.testing.synthetic`). Nothing in
``flwr_isoloco`` imports this package. The in-process fake Flower grid of the test suite is
not installed: it is the repository's ``tests/fakegrid.py``."""

from flwr_isoloco.testing.synthetic import adam_pseudo_gradient, low_rank_plus_noise

__all__ = ["adam_pseudo_gradient", "low_rank_plus_noise"]
