"""What every strategy shares: the resumable lifecycle (``lifecycle``), a reply's one path
(``replies``: decode, check, weigh; ``wire``: record helpers; ``ledger``: who was sent what),
the reply stream of a round, replies taken as they arrive with a quorum (``stream``), waiting for nodes
(``nodes``), federated evaluation (``evaluation``), metrics (``metrics``) and the guards
(``guard``: empty rounds; ``divergence``: the server loss). Nothing here imports a family."""

from flwr_isoloco.strategies.core.lifecycle import ResumableStrategy, RoundOutcome
from flwr_isoloco.strategies.core.nodes import NodeWaitError, wait_for_nodes

__all__ = ["NodeWaitError", "ResumableStrategy", "RoundOutcome", "wait_for_nodes"]
