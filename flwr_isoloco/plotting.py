"""Plot helpers shared by the apps and benchmarks: run labels people can read, and figures
written atomically with mode 0644.

- :func:`run_label` names a run by what it is: ``run_label("diloco", "iso_c", momentum=0.0)``
  is ``"DiLoCo, Iso-C merge, no momentum"``, not the config spelling ``iso_c-nomom``.
- :func:`integer_round_ticks` puts ticks on whole rounds only (Matplotlib's default locator
  labels a 3-round run 0, 0.5, 1, ..., rounds that do not exist).
- :func:`save_figure` writes a Matplotlib figure through a temporary file in the same folder
  and ``os.replace``, so a reader never sees half a PNG, and makes it readable by others
  (``0644``) like ``results.json`` (a bare ``savefig`` follows the umask).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = [
    "STRATEGY_NAMES",
    "MERGE_NAMES",
    "RESULT_MODE",
    "integer_round_ticks",
    "run_label",
    "save_figure",
]

RESULT_MODE = 0o644

STRATEGY_NAMES = {
    "isoloco": "IsoLoCo",
    "diloco": "DiLoCo",
    "fedavg": "FedAvg",
    "rwlora": "RW-LoRA",
    "gossip": "gossip LoRA",
}
MERGE_NAMES = {
    "mean": "mean",
    "iso_c": "Iso-C",
    "iso_c_ns": "Iso-C (Newton-Schulz)",
    "iso_cts": "Iso-CTS",
    "tsv_m": "TSV-M",
    "ties": "TIES",
    "dare": "DARE",
}


def run_label(
    strategy: str | None = None,
    merge: str | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
) -> str:
    """Readable name of a run: strategy, merge rule, outer momentum (each optional).

    ``momentum`` 0 is said as "no momentum"; ``None`` (the strategy's default) is not said;
    ``nesterov`` says "Nesterov momentum". Unknown names are shown as given.
    """
    parts = []
    if strategy:
        parts.append(STRATEGY_NAMES.get(strategy, strategy))
    if merge:
        parts.append(f"{MERGE_NAMES.get(merge, merge)} merge")
    if momentum is not None:
        kind = "Nesterov momentum" if nesterov else "momentum"
        parts.append("no momentum" if momentum == 0 else f"{kind} {momentum:g}")
    return ", ".join(parts) if parts else "run"


def integer_round_ticks(ax) -> None:
    """Ticks of ``ax``'s x axis (rounds) on integers only."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 100, mode: int = RESULT_MODE) -> Path:
    """``fig.savefig`` to ``path`` atomically, file mode ``mode``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
