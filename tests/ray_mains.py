"""One Ray simulation whose ServerApp runs several ServerApp ``main`` functions in turn, so
tests that compare swapped strategies on a stateless ClientApp pay Ray's start-up once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def run_mains(mains: Iterable[Callable[[Any, Any], Any]], client_app: Any, nodes: int) -> None:
    """``main(grid, context)`` of each of ``mains`` in turn, in one Ray simulation of ``nodes``
    SuperNodes of ``client_app`` (one CPU each, 2 in all, no GPU)."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation  # imports Ray: only when a test runs

    mains = list(mains)
    server = ServerApp()

    @server.main()
    def main(grid, context):
        for fn in mains:
            fn(grid, context)

    run_simulation(
        server_app=server,
        client_app=client_app,
        num_supernodes=nodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
