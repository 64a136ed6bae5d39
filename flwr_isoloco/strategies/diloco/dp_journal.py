"""The DP journal: every DP release of a run, on disk before it leaves the server.

A round releases its noised result before the round's checkpoint is written: central DP hands
the new model to the evaluation clients, to ``evaluate_fn`` and to the round-end hook that
writes the checkpoint; local DP sends the train messages, which the sites answer with their
noised deltas. A crash in between, then a resume from the checkpoint, redoes that round. Were
its noise drawn again from ``(key, round)`` and its replies different (one site fewer), the two
released means ``(S + N) / k`` and ``(S' + N) / k`` would differ by one site's clipped update
without noise; and the first release would be missing from epsilon. Two rules close this:

1. Before a release, its record ``(round, attempt, nonce)`` is added to the journal, a JSON
   file replaced atomically and fsync'd (:func:`~flwr_isoloco.checkpoint.write_json_atomic`);
   if that write fails the release does not happen. A resumed run writes its records to its own
   journal *and* to the one it continued (beside the checkpoint), so a second resume from the
   same checkpoint sees the first resume's releases.
2. The noise of a round is drawn from ``(key, round, attempt, nonce)``: ``attempt`` is the number
   of releases of that round the journal already holds, ``nonce`` a fresh 63-bit secret drawn
   for each release (0 under a fixed DP ``seed``, whose noise is reproducible by design). A redo
   never reuses released noise, even when the journal it read was lost, copied or forked.

On resume (:meth:`~flwr_isoloco.strategies.diloco.privacy.StrategyDP.parse_state`), every record of a
round after the checkpoint's is a release the checkpoint's accountant does not hold: each is
charged to it (conservative for a release that was journaled but never sent). The journal
names its run (a random id also kept in the checkpoint's ``dp`` field), so the journal of
another run is refused, and a strategy with DP noise refuses to load a state without its
journal. The app runner (:mod:`flwr_isoloco.apprunner`) keeps the journal next to the
checkpoint (:data:`JOURNAL`) and reads the one beside ``resume-from``; a user calling
``strategy.start()`` directly attaches one with
:meth:`~flwr_isoloco.strategies.diloco.privacy.StrategyDP.attach_journal` before the first round, or
the run cannot be resumed.
"""

from __future__ import annotations

import json
import os
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

__all__ = ["JOURNAL", "DPJournal", "attach_dp_journal", "charge_unsaved"]

JOURNAL = "dp-journal.json"
_FORMAT = "flwr-isoloco-dp-journal/1"


def _bad(path: Path, why: str) -> ValueError:
    return ValueError(f"DP journal {str(path)!r}: {why}")


Release = tuple[int, int, int]  # (round, attempt, nonce)


def _nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read(path: Path) -> tuple[str | None, list[Release]]:
    """``(run id, [(round, attempt, nonce), ...])`` of the journal at ``path``; ``(None, [])``
    when there is no file (a record without a nonce has nonce 0). ``ValueError`` naming the
    file for anything malformed, ``OSError`` for a file that cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, []
    except OSError as exc:  # an OSError still: before a release, it stops the release
        raise OSError(f"DP journal {str(path)!r}: cannot be read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise _bad(path, f"is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise _bad(path, f"is not a {_FORMAT} file")
    run, items = doc.get("run"), doc.get("releases")
    if not isinstance(run, str) or not run or not isinstance(items, list):
        raise _bad(path, "needs 'run' (a non-empty str) and 'releases' (a list)")
    out = []
    for item in items:
        got = item if isinstance(item, dict) else {}
        rnd, att, nonce = got.get("round"), got.get("attempt"), got.get("nonce", 0)
        if not (_nat(rnd) and _nat(att) and _nat(nonce)) or rnd < 1:
            raise _bad(
                path, f"bad release {item!r} (needs int 'round' >= 1, 'attempt', 'nonce' >= 0)"
            )
        out.append((rnd, att, nonce))
    return run, out


class DPJournal:
    """The releases of one run (module docstring), written to ``path``.

    ``read_from`` (default ``path``) is the journal to continue: the one beside the checkpoint
    a run resumes from. Both are read again before each count and each record (another resume
    of the same checkpoint may have added releases), and every record is written to both. A
    missing file is an empty journal (:attr:`found` False).
    """

    def __init__(self, path: str | os.PathLike, read_from: str | os.PathLike | None = None):
        self.path = Path(path)
        self.source = self.path if read_from is None else Path(read_from)
        self.run, self.releases = _read(self.source)
        self.found = self.run is not None

    def _refresh(self, run: str) -> None:
        """Add the releases of run ``run`` that either file holds and this copy does not."""
        merged = list(self.releases) if run == self.run else []
        for where in dict.fromkeys((self.source, self.path)):
            got_run, got = _read(where)
            if got_run == run:
                merged += [r for r in got if r not in merged]
        if merged:
            self.run, self.releases = run, merged

    def attempts(self, run: str, server_round: int) -> int:
        """How many releases of round ``server_round`` of run ``run`` are recorded."""
        self._refresh(run)
        if run != self.run:
            return 0
        return sum(1 for r, _, _ in self.releases if r == server_round)

    def after(self, run: str, server_round: int) -> list[Release]:
        """The recorded releases of run ``run`` in rounds after ``server_round``."""
        if run != self.run:
            return []
        return [rel for rel in self.releases if rel[0] > server_round]

    def record(self, run: str, server_round: int, attempt: int, nonce: int = 0) -> None:
        """Add ``(server_round, attempt, nonce)`` and write the journal and the one it continues
        (atomically, fsync'd) before returning; a journal of another run (a fresh run in the
        same folder) is replaced."""
        from flwr_isoloco.checkpoint import write_json_atomic

        self._refresh(run)
        releases = (self.releases if run == self.run else []) + [(server_round, attempt, nonce)]
        doc = {
            "format": _FORMAT,
            "run": run,
            "releases": [{"round": r, "attempt": a, "nonce": n} for r, a, n in releases],
        }
        for where in dict.fromkeys((self.path, self.source)):
            if where == self.path or _read(where)[0] == run:  # never another run's file
                write_json_atomic(where, doc, mode=0o600)
        self.run, self.releases = run, releases


def charge_unsaved(
    j: DPJournal | None, accountant: Any, run: Any, server_round: int, event: Any, delta: float
) -> None:
    """Compose into ``accountant`` (a checkpoint's, of ``server_round`` rounds) one ``event``
    per release of run ``run`` that journal ``j`` records after ``server_round``: released,
    then lost with the crash before the next checkpoint. ``ValueError`` without the run's
    journal (resuming could replay that release's noise and leave it out of epsilon), or when
    the accountant counts more releases than the rounds and the journal allow."""
    if not isinstance(run, str) or not run:
        raise ValueError(
            "field 'dp.run' is missing: the checkpoint predates the DP journal, so a round "
            "released after it may be missing from its epsilon; it cannot be resumed"
        )
    if j is None or not j.found:
        where = "" if j is None else f" (none at {str(j.source)!r})"
        raise ValueError(
            f"resuming a DP run needs its DP journal{where}: it lists the releases the "
            f"checkpoint may not hold. Apps keep it beside the checkpoint (copy {JOURNAL} "
            "along); with strategy.start(), call strategy.dp.attach_journal(path) before the "
            "first round and before load_state_dict"
        )
    if j.run != run:
        raise ValueError(
            f"the DP journal {str(j.source)!r} is another run's ({j.run!r}; the checkpoint's "
            f"is {run!r})"
        )
    missed = j.after(run, server_round)
    journaled = len(j.releases) - len(missed)  # a round redone after a crash counts twice
    if accountant.num_releases > max(server_round, journaled):
        raise ValueError(
            f"field 'dp' counts {accountant.num_releases} releases, more than the "
            f"{server_round} rounds of the checkpoint (and the {journaled} its DP journal "
            "records up to them)"
        )
    if missed:
        accountant.compose(event, len(missed))
        log(
            WARNING,
            "DP: %d release(s) after round %d that the checkpoint does not hold (round %s) "
            "charged to epsilon, now %.4g",
            len(missed),
            server_round,
            ", ".join(str(r) for r, _, _ in missed),
            accountant.get_epsilon(delta),
        )


def attach_dp_journal(strategy: Any, out: Path, resume: Path | None) -> None:
    """Give ``strategy`` (if it has DP noise) the journal ``out / JOURNAL``, continuing the one
    beside the checkpoint ``resume`` (if any). Call before ``load_state_dict``."""
    dp = getattr(strategy, "dp", None)
    if dp is not None and getattr(dp, "accountant", None) is not None:
        dp.attach_journal(out / JOURNAL, None if resume is None else resume.parent / JOURNAL)
