"""The DiLoCo family: :class:`DiLoCo` (``diloco``) and :class:`IsoLoCo` (``isoloco``) merge the
nodes' pseudo-gradients and take an outer optimiser step. Their settings objects (``settings``:
reply checks, rounds, codec, divergence guard, robust rules, DP), train round (``train_round``),
construction helpers (``setup``), run-config section (``config``), checkpoint state
(``state``), differential privacy (``privacy``, ``dp_journal``) and SecAgg+ (``secagg``)."""

from flwr_isoloco.strategies.diloco import settings
from flwr_isoloco.strategies.diloco.diloco import DILOCO_RUN_CONFIG, ISOLOCO_RUN_CONFIG, DiLoCo
from flwr_isoloco.strategies.diloco.isoloco import IsoLoCo
from flwr_isoloco.strategies.diloco.settings import *  # noqa: F403 (settings.__all__)

__all__ = ["DILOCO_RUN_CONFIG", "ISOLOCO_RUN_CONFIG", "DiLoCo", "IsoLoCo", *settings.__all__]
