"""Smallest Flower app used to prove the loopback deployment harness."""
