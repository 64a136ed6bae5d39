"""Issue 9, item 8: file modes (results and plots 0644, checkpoints 0600), the loss plot from
round 0, readable plot labels, the "done" log line of a resumed run."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from flwr_isoloco.checkpoint import save_checkpoint, write_json_atomic
from flwr_isoloco.plotting import run_label, save_figure

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "simulations" / "isoloco-lm"))
sys.path.insert(0, str(REPO / "simulations" / "rwlora-sentiment"))
sys.path.insert(0, str(REPO / "tests"))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)  # the modes below must not depend on the user's umask
    yield
    os.umask(old)


def test_results_0644_checkpoints_0600_figures_0644(tmp_path, strict_umask):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_json_atomic(tmp_path / "results.json", {"a": 1})
    save_checkpoint(tmp_path / "ck.safetensors", {"t": torch.zeros(2)}, {"round": 1})
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "plot.png")
    plt.close(fig)
    assert _mode(tmp_path / "results.json") == 0o644
    assert _mode(tmp_path / "ck.safetensors") == 0o600
    assert _mode(tmp_path / "plot.png") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ck.safetensors",
        "plot.png",
        "results.json",
    ]


@pytest.mark.parametrize(
    "args,label",
    [
        (("diloco", "iso_c", 0.0), "DiLoCo, Iso-C merge, no momentum"),
        ((None, "iso_c", 0.0), "Iso-C merge, no momentum"),
        (("isoloco", "iso_c", 0.8), "IsoLoCo, Iso-C merge, momentum 0.8"),
        (("isoloco", "iso_c", 0.8, True), "IsoLoCo, Iso-C merge, Nesterov momentum 0.8"),
        (("rwlora",), "RW-LoRA"),
        (("gossip",), "gossip LoRA"),
    ],
)
def test_run_labels_say_what_a_run_is(args, label):
    assert run_label(*args) == label


def test_loss_plot_starts_at_round_0(tmp_path, monkeypatch):
    from isoloco_lm import plots

    seen = {}

    def capture(fig, path):
        ax = fig.axes[0]
        seen["lines"] = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]

    monkeypatch.setattr(plots, "save_figure", capture)
    rounds = [{"round": 1, "val-loss": 5.0, "train-loss": 5.5}, {"round": 2, "val-loss": 4.0}]
    plots.plot_losses(rounds, tmp_path / "loss.png", "t", initial={"round": 0, "val-loss": 7.6})
    (val_x, val_y), (tr_x, tr_y) = seen["lines"]
    assert (val_x, val_y) == ([0, 1, 2], [7.6, 5.0, 4.0])
    assert (tr_x, tr_y) == ([1], [5.5])
    assert seen["legend"][0].startswith("validation loss")


def test_plot_titles_are_readable():
    from isoloco_lm.plots import plot_title as lm_title
    from rwlora_sentiment.plots import plot_title as rw_title

    assert (
        lm_title("isoloco", "iso_c", 0.8, 920_000, True)
        == "IsoLoCo, Iso-C merge, Nesterov momentum 0.8, 0.92M params"
    )
    assert lm_title("fedavg", "mean", 0.0, 920_000) == "FedAvg, 0.92M params"
    assert rw_title("rwlora", "ring", 3) == "RW-LoRA on a ring graph, 3 clients"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_lm_done_line_counts_this_run_and_the_total(tmp_path, monkeypatch):
    from fakegrid import FakeGrid
    from flwr.common.logger import FLOWER_LOGGER
    from isoloco_lm import client_app, server_app

    from flwr_isoloco.data.text import load_corpus

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "play.txt").write_text(load_corpus("shakespeare")[0][:60_000], encoding="utf-8")
    rc = {
        "num-server-rounds": 3,
        "model.hidden": 32,
        "model.heads": 2,
        "model.vocab-size": 400,
        "train.seq-len": 32,
        "train.batch-size": 4,
        "train.local-steps": 2,
        "train.warmup-steps": 2,
        "data.val-tokens": 512,
        "data.corpus": str(corpus),
        "data.cache-dir": str(tmp_path / "cache"),
        "strategy.min-nodes": 2,
    }
    handler = _Lines()
    FLOWER_LOGGER.addHandler(handler)
    try:
        first = {**rc, "output-dir": str(tmp_path / "a"), "rounds-this-run": 2}
        a = server_app.run_server(
            FakeGrid({"train": client_app.train}, 2, run_config=first), first, settle_s=0.0
        )
        second = {
            **rc,
            "output-dir": str(tmp_path / "b"),
            "resume-from": str(a / "checkpoint.safetensors"),
        }
        b = server_app.run_server(
            FakeGrid({"train": client_app.train}, 2, run_config=second), second, settle_s=0.0
        )
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    done = [line for line in handler.lines if "isoloco-lm: done" in line]
    assert done[0].startswith("isoloco-lm: done, 2 rounds in this run, 2 of 3 in total")
    assert done[1].startswith("isoloco-lm: done, 1 rounds in this run, 3 of 3 in total")
    for name in ("results.json", "loss.png"):
        assert _mode(b / name) == 0o644
    assert _mode(b / "checkpoint.safetensors") == 0o600
    assert {_mode(p) for p in (b / "model").iterdir()} == {0o644}


def test_requirements_data_names_docs_that_exist():
    import re

    text = (REPO / "requirements-data.txt").read_text(encoding="utf-8")
    docs = re.findall(r"[\w./-]+\.md", text)
    assert docs, "requirements-data.txt should point to the docs that describe the packages"
    for doc in docs:
        assert (REPO / doc).is_file(), doc
