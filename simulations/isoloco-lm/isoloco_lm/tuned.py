"""Each merge rule's own outer lr and momentum: the optimum of the project's LM tuning sweep.

``strategy.outer-lr`` / ``strategy.outer-momentum`` at -1 mean "the chosen rule's tuned
value": the lowest validation loss of the sweep's grid for that rule (seed 0, M = 8 workers,
main protocol; ``benchmarks/lm/lm_sweep.py`` ``tuned_hp``, results in
``benchmarks/results/lm_tuning.json``, discussed in docs/results-lm.md). The sweep's model is
of this app's kind (a small LLaMA on Shakespeare, AdamW inner steps) but not its exact size,
so these are starting points, not optima for every configuration. A rule the sweep did not
tune (``iso_c_ns``) keeps its strategy class's default. The table is copied here because the
app ships as a FAB without ``benchmarks/``; a test checks that it equals the sweep's optimum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flwr_isoloco.plotting import MERGE_NAMES

__all__ = ["SOURCE", "TUNED", "OuterValues", "outer_values"]

SOURCE = "benchmarks/results/lm_tuning.json"


class Tuned(NamedTuple):
    method: str  # the sweep's method name (benchmarks/lm/lm_sweep_lib.py METHODS)
    outer_lr: float
    outer_momentum: float


# merge rule -> the sweep method that runs it with Nesterov momentum where it has one
TUNED: dict[str, Tuned] = {
    "mean": Tuned("diloco", 0.25, 0.8),
    "iso_c": Tuned("isoloco", 1.8, 0.8),
    "iso_cts": Tuned("iso_cts", 8.0, 0.0),
    "tsv_m": Tuned("tsv_m", 5.66, 0.0),
    "ties": Tuned("ties", 0.7, 0.0),
    "dare": Tuned("dare", 0.7, 0.0),
}


class OuterValues(NamedTuple):
    outer_lr: float
    outer_momentum: float
    message: str  # which values are in force and where they came from (logged by the app)


def _possessive(merge: str) -> str:
    """``"TIES'"``, ``"Iso-C's"``, ``"the mean merge's"``."""
    if merge == "mean":
        return "the mean merge's"
    name = MERGE_NAMES.get(merge, merge)
    return f"{name}'" if name.endswith("S") else f"{name}'s"


def outer_values(
    merge: str, lr: float, momentum: float, class_defaults: dict[str, Any], class_name: str
) -> OuterValues:
    """The outer lr / momentum in force for ``merge``: the run config's where set (not -1),
    else the rule's tuned value (:data:`TUNED`), else the strategy class's default."""
    tuned = TUNED.get(merge)
    label = _possessive(merge)
    chosen, sources = [], []
    for key, value, field in (
        ("outer-lr", lr, "outer_lr"),
        ("outer-momentum", momentum, "outer_momentum"),
    ):
        if value != -1.0:
            chosen.append(float(value))
            sources.append("run config")
        elif tuned is not None:
            chosen.append(getattr(tuned, field))
            sources.append(f"{label} tuned value{{s}}, {SOURCE}")
        else:
            chosen.append(float(class_defaults[key]))
            sources.append(f"{class_name}'s default{{s}}; {merge} was not in the tuning sweep")
    if sources[0] == sources[1]:
        where = sources[0].format(s="s")
        text = f"outer lr {chosen[0]}, momentum {chosen[1]} ({where})"
    else:
        text = (
            f"outer lr {chosen[0]} ({sources[0].format(s='')}), "
            f"momentum {chosen[1]} ({sources[1].format(s='')})"
        )
    unset = [k for k, v in (("outer-lr", lr), ("outer-momentum", momentum)) if v == -1.0]
    if unset:
        text += "; set " + " / ".join(f"strategy.{k}" for k in unset) + " to override"
    return OuterValues(chosen[0], chosen[1], text)
