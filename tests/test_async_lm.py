"""The issue-38 LM study's measurements (benchmarks/async/async_lm.py): utilisation, the start
of the clock and the loss at the budget, against hand computations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "async"))
import async_lm  # noqa: E402


def task(node, sent, start, end):
    return {"node": node, "sent": sent, "task-start-s": start, "task-end-s": end}


def test_utilisation_by_hand():
    """Window [10, 20]: node 1 busy 11-14 and 15-25 (clipped to 20): 3 + 5 = 8 -> 0.8; node 2
    busy 8-12 (clipped from 10: 2) and a task sent at 16 with no reply (busy 16-20: 4) -> 0.6;
    node 3 was sent a task at 30 (after the window) and nothing else -> 0."""
    tasks = [task(1, 10.5, 11, 14), task(1, 14.5, 15, 25), task(2, 7.5, 8, 12)]
    sent = {"a": (1, 10.5), "b": (1, 14.5), "c": (2, 7.5), "d": (2, 16.0), "e": (3, 30.0)}
    got = async_lm.utilisation(tasks, sent, 10.0, 10.0)
    assert got == pytest.approx({1: 0.8, 2: 0.6, 3: 0.0})


def test_an_error_reply_without_timestamps_is_not_busy_time():
    tasks = [{"node": 1, "sent": 11.0}]  # an error reply: answered, no span
    assert async_lm.utilisation(tasks, {"a": (1, 11.0)}, 10.0, 10.0) == {1: 0.0}


def test_the_clock_starts_when_the_last_node_started_its_first_task():
    tasks = [task(1, 0, 25.0, 27), task(1, 27, 27.5, 29), task(2, 0, 26.0, 34), task(3, 0, 24, 26)]
    assert async_lm.start_time(tasks) == 26.0


def test_loss_at_the_budget_is_the_last_validation_before_it():
    curve = [(-1.0, 7.0), (30.0, 6.0), (89.9, 5.5), (90.0, 5.4), (95.0, 5.0)]
    assert async_lm.loss_at(curve, 90.0) == 5.4
    assert async_lm.loss_at(curve, 50.0) == 6.0
    assert async_lm.loss_at(curve, -2.0) is None


def test_every_mode_has_a_label_and_a_round_count():
    assert set(async_lm.MODES) == set(async_lm.LABELS) == set(async_lm.ROUNDS)
    for mode in async_lm.MODES:  # every mode's run config passes the LM app's checks
        from isoloco_lm import task as app_task

        rc = async_lm.run_config("isoloco", mode, 0, async_lm.SPREAD, 3, "")
        cfg = app_task.load_config(rc)
        assert cfg.train["slowdown-spread"] == async_lm.SPREAD


def test_overlapping_spans_count_once():
    """Two spans of one node overlapping (10-14 and 12-16) are busy 10-16: 6 of 10 s."""
    tasks = [task(1, 9, 10, 14), task(1, 11, 12, 16)]
    assert async_lm.utilisation(tasks, {}, 10.0, 10.0) == {1: pytest.approx(0.6)}


def test_the_docs_table_is_what_the_records_give():
    """docs/strategies.md's async-lm block is ``table(records)`` (``--table`` regenerates it)."""
    import common

    doc = async_lm.DOC.read_text()
    block = doc.split("<!-- async-lm:begin -->\n")[1].split("\n<!-- async-lm:end -->")[0]
    assert block == async_lm.table(common.load_records(async_lm.RECORDS))
