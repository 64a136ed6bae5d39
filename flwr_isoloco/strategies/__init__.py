"""Server-side Flower strategies (Message API), all with one lifecycle
(:class:`~flwr_isoloco.strategies.core.lifecycle.ResumableStrategy`: resumable ``start`` with
global round numbers and an ``on_round_end`` hook). Three sub-packages, one per family:

- ``core/``: what every strategy shares: the lifecycle, a reply's path (``replies``, ``wire``,
  ``ledger``), rounds with a quorum (``rounds``), node waiting (``nodes``), evaluation, metrics,
  the empty-round and divergence guards.
- ``diloco/``: :class:`DiLoCo`, :class:`IsoLoCo` (merge pseudo-gradients + outer optimiser),
  their settings objects (:class:`ReplyChecks`, :class:`Rounds`, :class:`Codec`,
  :class:`Divergence`, :class:`MergeSettings`, :class:`Records`, the robust rules,
  :class:`CentralDP` / :class:`LocalDP`), train round,
  run-config section, checkpoint state, DP and SecAgg+.
- ``graph/``: :class:`RWLoRA` (one adapter walks the client graph, one node per round) and
  :class:`GossipLoRA` (decentralised-SGD baseline with Metropolis mixing).

:func:`wait_for_nodes` (``core/nodes.py``) is the one node-waiting helper.
"""

from flwr_isoloco.strategies.core.lifecycle import ResumableStrategy, RoundOutcome
from flwr_isoloco.strategies.core.nodes import NodeWaitError, wait_for_nodes
from flwr_isoloco.strategies.diloco import DiLoCo, IsoLoCo
from flwr_isoloco.strategies.diloco.settings import (
    AdaptiveClipping,
    CentralDP,
    Codec,
    DistanceFilter,
    Divergence,
    Krum,
    LocalDP,
    Median,
    MergeSettings,
    MultiKrum,
    NormClip,
    Records,
    ReplyChecks,
    Robust,
    Rounds,
    TrimmedMean,
)
from flwr_isoloco.strategies.graph import GossipLoRA, RWLoRA

__all__ = [
    # the strategies
    "DiLoCo",
    "IsoLoCo",
    "RWLoRA",
    "GossipLoRA",
    # their settings
    "ReplyChecks",
    "Rounds",
    "Codec",
    "Divergence",
    "MergeSettings",
    "Records",
    "CentralDP",
    "LocalDP",
    "AdaptiveClipping",
    # robust merging rules (Robust: the base of a custom rule)
    "Robust",
    "NormClip",
    "TrimmedMean",
    "Median",
    "Krum",
    "MultiKrum",
    "DistanceFilter",
    # the lifecycle every strategy shares, for subclasses and apps
    "ResumableStrategy",
    "RoundOutcome",
    "NodeWaitError",
    "wait_for_nodes",
]
