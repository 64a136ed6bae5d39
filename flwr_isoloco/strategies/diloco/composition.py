"""What composes with what in DiLoCo / IsoLoCo: the collectors against the guarantees, as data.

A *collector* is the way a round gathers its replies: synchronous rounds (plain ``start()``),
a quorum (``Rounds(quorum=..., grace_s=...)``), asynchronous rounds
(``Rounds(asynchronous=True)``) or SecAgg+ (:func:`~.secagg.use_secagg`). A *guarantee* is what
a feature promises (buffers become the nodes' weighted mean, central DP's epsilon, a bitwise
resume, ...). Each pair is one of:

- :class:`Holds`: it composes; ``check`` says in a few words how the repository's
  ``tests/test_composition.py`` checks it against an independent computation;
- :class:`Refused`: the strategy refuses the pair when it is built (``ValueError``) with
  ``reason``, one sentence saying why and what to do instead. The raise sites use these
  sentences (:func:`refusal`): ``asynchronous_setup.check_composition``,
  ``privacy.secagg_problems``, ``secagg.use_secagg`` and ``Rounds``.

:data:`ROW_PAIRS` holds the collectors that refuse each other. :func:`render` writes the matrix
as the Markdown of the repository's ``docs/strategies.md`` ("What composes with what");
``python -m flwr_isoloco.strategies.diloco.composition <markdown file>`` rewrites that block.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "COLLECTORS",
    "GUARANTEES",
    "MATRIX",
    "ROW_PAIRS",
    "Holds",
    "Refused",
    "refusal",
    "render",
    "render_block",
    "replace_block",
]


@dataclass(frozen=True)
class Holds:
    """The pair composes; ``check``: how the test checks it, in a few words."""

    check: str


@dataclass(frozen=True)
class Refused:
    """The strategy refuses the pair when built; ``reason``: why, and the fix (one sentence)."""

    reason: str


COLLECTORS: dict[str, tuple[str, str]] = {
    "synchronous": ("synchronous", "`start()`"),
    "quorum": ("quorum", "`Rounds(quorum=..., grace_s=...)`"),
    "asynchronous": ("asynchronous", "`Rounds(asynchronous=True)`"),
    "secagg": ("SecAgg+", "`use_secagg(...)`"),
}
"""Collector key -> (its name, how a strategy gets it)."""

GUARANTEES: dict[str, str] = {
    "buffers": "buffers",
    "central-dp": "central DP",
    "local-dp": "local DP",
    "robust": "robust rule",
    "upload": "upload codec",
    "download": "download codec",
    "divergence-skip": "divergence skip",
    "resume": "resume bitwise",
    "restart": "node restart",
    "late": "late / stale reply",
    "evaluation": "evaluation",
}
"""Guarantee key -> its column header."""

# ----------------------------------------------------------------------------- refusals
ASYNC_DP = (
    "the DP accountant composes one release per round of a sampled cohort, but an asynchronous "
    "step merges the first K replies of whichever nodes are fastest (a node may appear twice), "
    "so neither the sampling rate nor the per-node count of releases it assumes holds; use "
    "synchronous rounds with DP"
)
ASYNC_DOWNLOAD = (
    "download= (compressed downloads) keeps one broadcast model for every node, but "
    "asynchronous nodes train from different model versions; use download=None"
)
ASYNC_SECAGG = (
    "SecAgg+ unmasks the sum of one cohort that exchanged keys in the same round, while an "
    "asynchronous outer step takes the first K replies of nodes that each trained from their "
    "own model version; use synchronous rounds (Rounds(asynchronous=False)) with secure "
    "aggregation"
)
ASYNC_QUORUM = (
    "Rounds.quorum / grace_s close a synchronous round; asynchronous rounds never wait for a "
    "cohort (an outer step takes the first `replies_per_step` replies): leave them unset with "
    "asynchronous=True"
)
SECAGG_CENTRAL_DP = (
    "central DP clips each update on the server, which under SecAgg+ sees only their masked "
    "sum; use privacy=LocalDP(...), under which each site clips and noises its own delta"
)
SECAGG_ROBUST = (
    "a robust rule needs every update, but under SecAgg+ the server sees only their sum; use "
    "robust=None with SecAgg+, or rounds without SecAgg+ for a robust rule"
)
SECAGG_UPLOAD = (
    "SecAgg+ masks and sums dense quantised vectors, so a compressed delta cannot go through "
    "it; use upload=None (SecAgg+ quantises the delta itself)"
)
SECAGG_DOWNLOAD = (
    "SecAgg+ sends every node the full model and sums the deltas against it, so there is no "
    "broadcast model for a download codec to compress; use download=None with SecAgg+"
)
SECAGG_QUORUM = (
    "SecAgg+ closes a round itself, with its own dropout threshold (reconstruction_threshold); "
    "leave Rounds.quorum / grace_s unset with use_secagg"
)

# ----------------------------------------------------------------------------- the matrix
_SYNC: dict[str, Holds | Refused] = {
    "buffers": Holds("BatchNorm statistics = the weighted mean of the reported values"),
    "central-dp": Holds(
        "epsilon = Flower's accountant; the mean = clipped mean + noise_like recomputed; "
        "running variance clamped at 0"
    ),
    "local-dp": Holds("epsilon at z / 2 = Flower's accountant; the mean of the noised deltas"),
    "robust": Holds("the step = torch.median of the deltas"),
    "upload": Holds("the mean of the decoded int8 deltas; bytes up counted from the shapes"),
    "download": Holds("nodes train on B recomputed as B + decode(Q(theta - B)); bytes counted"),
    "divergence-skip": Holds("the skipped round's model and momentum put back bitwise"),
    "resume": Holds("checkpoint after round 2, resumed: bitwise the uninterrupted run"),
    "restart": Holds(
        "a node that lost its state between rounds trains the very next round (download codec: "
        "from the full B, sent to it within that round)"
    ),
    "late": Holds("a reply past the round timeout: left out, named, discarded next round"),
    "evaluation": Holds("nodes evaluate the model after the round's step (bitwise; B within Q)"),
}
_QUORUM: dict[str, Holds | Refused] = {
    "buffers": Holds("the weighted mean of the values of the quorum's replies"),
    "central-dp": Holds("(clipped sum of the quorum + noise_like) / nodes sampled; epsilon"),
    "local-dp": Holds("epsilon at z / 2; the mean of the quorum's noised deltas"),
    "robust": Holds("torch.median of the quorum's deltas"),
    "upload": Holds("the mean of the quorum's decoded int8 deltas; bytes up counted"),
    "download": Holds("every node, the straggler too, trains on B recomputed"),
    "divergence-skip": Holds("the skipped round's model put back bitwise"),
    "resume": Holds("resumed with the straggler left out again: bitwise the uninterrupted run"),
    "restart": Holds("a node that lost its state trains the next round"),
    "late": Holds("the straggler past quorum and grace: left out, named, discarded"),
    "evaluation": Holds("the quorum evaluates the model after the round's step, bitwise"),
}
_ASYNC: dict[str, Holds | Refused] = {
    "buffers": Holds("the mean of the reported values with weights n s(tau), never scaled by rho"),
    "central-dp": Refused(ASYNC_DP),
    "local-dp": Refused(ASYNC_DP),
    "robust": Holds("the step = rho torch.median of the deltas against the models sent"),
    "upload": Holds("the mean of the int8 deltas decoded against the model sent; bytes up"),
    "download": Refused(ASYNC_DOWNLOAD),
    "divergence-skip": Holds("the skipped step's model put back; no task sent from it"),
    "resume": Holds("checkpoint with tasks in flight, resumed: bitwise the uninterrupted run"),
    "restart": Holds("a node that lost its state keeps its tasks, every step full"),
    "late": Holds("tau > max_staleness dropped and named; else weighted (1 + tau)^-a"),
    "evaluation": Holds("the nodes idle at the step evaluate its model; equal speeds: bitwise"),
}
_SECAGG: dict[str, Holds | Refused] = {
    "buffers": Holds("the mean of the reported values within one SecAgg+ step"),
    "central-dp": Refused(SECAGG_CENTRAL_DP),
    "local-dp": Holds("epsilon at z / 2; the mean of the noised deltas within one step"),
    "robust": Refused(SECAGG_ROBUST),
    "upload": Refused(SECAGG_UPLOAD),
    "download": Refused(SECAGG_DOWNLOAD),
    "divergence-skip": Holds("the skipped round's model put back bitwise"),
    "resume": Holds("bitwise given the clients' rounding draws (their np.random state)"),
    "restart": Holds("a node that lost its SecAgg+ state trains the next round"),
    "late": Holds("a node silent at the masked-vector stage: unmasked, the rest merged, named"),
    "evaluation": Holds("nodes evaluate the model after the round's step, bitwise"),
}

MATRIX: dict[tuple[str, str], Holds | Refused] = {
    (row, col): cells[col]
    for row, cells in (
        ("synchronous", _SYNC),
        ("quorum", _QUORUM),
        ("asynchronous", _ASYNC),
        ("secagg", _SECAGG),
    )
    for col in GUARANTEES
}
"""(collector, guarantee) -> :class:`Holds` or :class:`Refused`, every pair."""

ROW_PAIRS: dict[tuple[str, str], Refused] = {
    ("asynchronous", "quorum"): Refused(ASYNC_QUORUM),
    ("asynchronous", "secagg"): Refused(ASYNC_SECAGG),
    ("quorum", "secagg"): Refused(SECAGG_QUORUM),
}
"""Collectors that refuse each other (the synchronous one composes with none: it is the
absence of the others)."""


def refusal(a: str, b: str) -> str:
    """The sentence the strategy raises for the refused pair ``(a, b)`` (a cell of
    :data:`MATRIX` or a pair of :data:`ROW_PAIRS`, either order); ``KeyError`` when it holds."""
    cell = MATRIX.get((a, b)) or ROW_PAIRS.get((a, b)) or ROW_PAIRS.get((b, a))
    if not isinstance(cell, Refused):
        raise KeyError(f"{a!r} with {b!r} is not refused")
    return cell.reason


# ----------------------------------------------------------------------------- Markdown
BEGIN = "<!-- BEGIN composition-matrix (generated by composition.render(); do not edit) -->"
END = "<!-- END composition-matrix -->"
BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)


def _mark(cell: Holds | Refused, notes: list[str]) -> str:
    if isinstance(cell, Holds):
        return "holds"
    if cell.reason not in notes:
        notes.append(cell.reason)
    return f"refused ({notes.index(cell.reason) + 1})"


def _overview(notes: list[str]) -> list[str]:
    """The matrix: a row per collector, ``holds`` / ``refused (n)`` per guarantee."""
    lines = [
        "| collector | " + " | ".join(GUARANTEES.values()) + " |",
        "|---|" + "---|" * len(GUARANTEES),
    ]
    for row, (name, how) in COLLECTORS.items():
        marks = [_mark(MATRIX[row, col], notes) for col in GUARANTEES]
        lines.append(f"| {name} ({how}) | " + " | ".join(marks) + " |")
    return lines


def render() -> str:
    """The matrix as Markdown: the overview table, the numbered refusal sentences (and the
    collectors that refuse each other), then each cell with how it is checked or why not."""
    notes: list[str] = []
    out = _overview(notes)
    pairs = [(a, b, c) for (a, b), c in ROW_PAIRS.items()]
    for _, _, cell in pairs:
        _mark(cell, notes)
    out += ["", "Refused, with the sentence the strategy raises (`ValueError`):", ""]
    out += [f"{i}. {reason}." for i, reason in enumerate(notes, start=1)]
    out += ["", "Collectors that refuse each other:", ""]
    out += [
        f"- {COLLECTORS[a][0]} with {COLLECTORS[b][0]}: refused ({notes.index(c.reason) + 1})"
        for a, b, c in pairs
    ]
    out += ["", "| collector | guarantee | how `tests/test_composition.py` checks it |"]
    out += ["|---|---|---|"]
    for (row, col), cell in MATRIX.items():
        what = cell.check if isinstance(cell, Holds) else _mark(cell, notes)
        out.append(f"| {COLLECTORS[row][0]} | {GUARANTEES[col]} | {what} |")
    return "\n".join(out) + "\n"


def render_block() -> str:
    """:func:`render` between the markers that delimit it in the strategies reference."""
    return f"{BEGIN}\n\n{render()}\n{END}"


def replace_block(text: str) -> str:
    """``text`` with its composition block replaced by :func:`render_block` (``ValueError``
    when it has none)."""
    if not BLOCK.search(text):
        raise ValueError(f"no composition block ({BEGIN!r} ... {END!r}) in the text")
    return BLOCK.sub(lambda _: render_block(), text, count=1)


if __name__ == "__main__":  # rewrite the block of the Markdown file(s) given
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(replace_block(path.read_text(encoding="utf-8")), encoding="utf-8")
