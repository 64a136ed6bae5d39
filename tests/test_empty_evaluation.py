"""An evaluation round that sends no message is no round: nothing is pushed, pulled or waited
for, no "0 replies used" line is logged and there are no evaluation metrics for it."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord
from test_lifecycle import init_model, plain_app

from flwr_isoloco.strategies import DiLoCo, GossipLoRA, IsoLoCo, RWLoRA

torch.set_num_threads(1)
N = 3


class CountingGrid(FakeGrid):
    """A FakeGrid that records every push and pull by message type."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, tuple[str, ...]]] = []  # (push|pull, message types)
        self._type_of: dict[str, str] = {}

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        self._type_of.update(
            {i: m.metadata.message_type for i, m in zip(ids, messages, strict=True)}
        )
        self.calls.append(("push", tuple(m.metadata.message_type for m in messages)))
        return ids

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        self.calls.append(("pull", tuple(self._type_of.get(i, "?") for i in ids)))
        return super().pull_messages(ids)

    def empty_or_evaluate(self) -> list[tuple[str, tuple[str, ...]]]:
        """Calls that carried no message at all, or an evaluate message."""
        return [(c, ts) for c, ts in self.calls if not ts or "evaluate" in ts]


# No evaluation message in any round: fraction 0, or a fraction of 3 nodes that rounds to 0
# with min_evaluate_nodes=0.
CASES = {
    "DiLoCo-fraction-0": lambda: DiLoCo(
        min_train_nodes=1, min_available_nodes=N, fraction_evaluate=0.0
    ),
    "IsoLoCo-none-sampled": lambda: IsoLoCo(
        min_train_nodes=1, min_available_nodes=N, fraction_evaluate=0.1, min_evaluate_nodes=0
    ),
    "RWLoRA-none-sampled": lambda: RWLoRA(fraction_evaluate=0.1, min_evaluate_nodes=0),
    "GossipLoRA-none-sampled": lambda: GossipLoRA(fraction_evaluate=0.1, min_evaluate_nodes=0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_evaluation_without_messages_pulls_waits_and_logs_nothing(name, caplog):
    grid = CountingGrid(plain_app(with_query=True), num_nodes=N)
    s = CASES[name]()
    with caplog.at_level(logging.INFO):
        res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    assert grid.empty_or_evaluate() == []
    assert not [r for r in grid.log if r.message_type == "evaluate"]
    lines = [r.getMessage() for r in caplog.records]
    assert not [ln for ln in lines if "evaluate" in ln and "replies used" in ln], lines
    assert dict(res.evaluate_metrics_clientapp) == {}
    assert sorted(res.train_metrics_clientapp) == [1, 2]  # the rounds themselves ran


def test_an_evaluation_with_messages_still_runs_and_reports_its_wait():
    grid = CountingGrid(plain_app(with_query=True), num_nodes=N)
    s = RWLoRA(fraction_evaluate=1.0, min_evaluate_nodes=1)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1, timeout=5)
    m = res.evaluate_metrics_clientapp[1]
    assert m["replies-used"] == N and m["replies-arrived"] == N and m["replies-late"] == 0
    assert ("push", ("evaluate",) * N) in grid.calls
