"""``resume-from`` with hostile or wrong checkpoints (issue 8, B4, B6-B8), through the apps'
``run_server``: each is refused with a CheckpointError naming the file and the field or
tensor, before any round runs (no train message is sent)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flwr_isoloco.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flwr_isoloco.runconfig import RunConfigError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "simulations" / "isoloco-lm"))
sys.path.insert(0, str(REPO / "simulations" / "rwlora-sentiment"))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402
from isoloco_lm import client_app, server_app  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny isoloco_lm run of 1 round with checkpoints: (run config, its output folder)."""
    from flwr_isoloco.data.text import load_corpus

    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(load_corpus("shakespeare")[:2]):
        (d / f"play{i}.txt").write_text(text[:20_000], encoding="utf-8")
    rc = {
        "num-server-rounds": 3,
        "rounds-this-run": 1,
        "model.hidden": 16,
        "model.heads": 2,
        "model.layers": 1,
        "model.vocab-size": 300,
        "train.seq-len": 16,
        "train.batch-size": 2,
        "train.local-steps": 1,
        "train.warmup-steps": 1,
        "data.val-tokens": 256,
        "data.corpus": str(d),
        "data.cache-dir": str(tmp_path_factory.mktemp("cache")),
        "strategy.min-nodes": 2,
    }
    out = tmp_path_factory.mktemp("run")
    rc["output-dir"] = str(out)
    grid = FakeGrid({"train": client_app.train}, num_nodes=2, run_config=rc)
    server_app.run_server(grid, rc, settle_s=0.0)
    assert (out / "checkpoint.safetensors").is_file() and (out / "node-state").is_dir()
    return rc, out


def _resume(rc, path):
    """Run the app resuming from ``path``; return (error, train messages sent)."""
    run = {**rc, "output-dir": str(Path(path).parent / "rest"), "resume-from": str(path)}
    run.pop("rounds-this-run")
    grid = FakeGrid({"train": client_app.train}, num_nodes=2, run_config=run)
    with pytest.raises((CheckpointError, RunConfigError)) as e:
        server_app.run_server(grid, run, settle_s=0.0)
    sent = [m for m in grid.log if m.message_type == "train"]
    return e.value, sent


def _rewrite(lm, tmp_path, edit) -> Path:
    """A copy of the run's checkpoint after ``edit(tensors, meta)``, with valid digests."""
    _, out = lm
    tensors, meta = load_checkpoint(out / "checkpoint.safetensors")
    edit(tensors, meta)
    path = tmp_path / "ck" / "checkpoint.safetensors"
    save_checkpoint(path, tensors, meta)
    shutil.copytree(out / "node-state", path.parent / "node-state")
    return path


def _refused(lm, path, pattern) -> str:
    err, sent = _resume(lm[0], path)
    assert isinstance(err, CheckpointError), err
    assert str(err).startswith(f"checkpoint {str(path)!r}"), str(err)
    assert re.search(pattern, str(err)), str(err)
    assert sent == []  # refused before any round
    return str(err)


def test_untouched_checkpoint_resumes(lm, tmp_path):
    rc, _ = lm
    path = _rewrite(lm, tmp_path, lambda t, m: None)
    run = {**rc, "output-dir": str(tmp_path / "ok"), "resume-from": str(path)}
    run.pop("rounds-this-run")
    grid = FakeGrid({"train": client_app.train}, num_nodes=2, run_config=run)
    out = server_app.run_server(grid, run, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and [r["round"] for r in res["rounds"]] == [1, 2, 3]
    assert all(r["replies-used"] == 2 for r in res["rounds"])


def test_node_state_file_as_resume_from(lm):
    _, out = lm
    node_file = sorted((out / "node-state").iterdir())[0]
    _refused(
        lm, node_file, r"field 'app' is 'node-state' \(one node's state file.*expected 'isoloco_lm'"
    )


def test_rwlora_checkpoint_given_to_isoloco_lm(lm, tmp_path):
    def edit(t, m):
        m.clear()
        m.update({"app": "rwlora_sentiment", "round": 1, "app-state": {"cursors": {}}})

    path = _rewrite(lm, tmp_path, edit)
    _refused(lm, path, r"field 'app' is 'rwlora_sentiment' \(a rwlora_sentiment server")


def test_nan_in_model(lm, tmp_path):
    def edit(t, m):
        k = next(iter(t["strategy"]["theta"]))
        t["strategy"]["theta"][k] = torch.full_like(t["strategy"]["theta"][k], float("nan"))

    path = _rewrite(lm, tmp_path, edit)
    _refused(lm, path, r"tensor 'strategy/theta/.*' has non-finite values")


def test_wrong_shape_momentum_buffer(lm, tmp_path):
    def edit(t, m):
        mb = t["strategy"]["outer"]["momentum_buffer"]
        k = sorted(mb)[0]
        mb[k] = torch.zeros(mb[k].numel() + 1)

    path = _rewrite(lm, tmp_path, edit)
    _refused(
        lm, path, r"strategy state: tensor 'outer/momentum_buffer/.*' has shape \[\d+\], expected"
    )


def test_wrong_shape_model_tensor(lm, tmp_path):
    def edit(t, m):
        th = t["strategy"]["theta"]
        k = sorted(th)[0]
        th[k] = torch.zeros(*th[k].shape, 2)
        mb = t["strategy"]["outer"]["momentum_buffer"]
        mb[k] = torch.zeros_like(th[k])

    path = _rewrite(lm, tmp_path, edit)
    _refused(lm, path, r"strategy state: tensor 'theta/.*' has shape \[.*, 2\], expected")


def test_saved_outer_lr_that_differs_is_refused(lm, tmp_path):
    def edit(t, m):
        m["strategy"]["outer"]["lr"] = 0.1

    path = _rewrite(lm, tmp_path, edit)
    _refused(lm, path, r"field 'outer.lr' = 0.1 differs from this strategy's 1.8")


def test_flipped_bit_in_the_real_checkpoint(lm, tmp_path):
    path = _rewrite(lm, tmp_path, lambda t, m: None)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    _refused(lm, path, r"tensor '.*' does not match its sha256 digest")


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t, m: m.update(round=-3), r"field 'round' must be an int >= 0, got -3"),
        (lambda t, m: m.update(round="abc"), r"field 'round' must be an int >= 0, got 'abc'"),
        (lambda t, m: m.update(round=2), r"field 'history' does not hold rounds 1..2"),
        (lambda t, m: m.pop("history"), r"field 'history' is missing"),
        (lambda t, m: m.update(history=[{"r": 1}]), r"field 'history\[0\].round' is missing"),
        (lambda t, m: m.update(config=[]), r"field 'config' must be a JSON object"),
        (lambda t, m: m.pop("rng"), r"field 'rng' is missing"),
        (lambda t, m: m["rng"].update(torch=[1, 2]), r"field 'rng.torch' is not a valid state"),
        (
            lambda t, m: m["strategy"].update(server_round=5),
            r"the strategy holds 5 rounds, field 'round' = 1",
        ),
        (lambda t, m: m["strategy"].pop("dtypes"), r"strategy state: field 'dtypes' is missing"),
        (lambda t, m: t.pop("strategy"), r"tensor group 'theta' is missing"),
    ],
)
def test_bad_fields(lm, tmp_path, edit, pattern):
    _refused(lm, _rewrite(lm, tmp_path, edit), pattern)


def test_changed_config_is_still_a_run_config_error(lm, tmp_path):
    def edit(t, m):
        m["config"]["train"]["lr"] = 0.5

    path = _rewrite(lm, tmp_path, edit)
    err, sent = _resume(lm[0], path)
    assert isinstance(err, RunConfigError) and sent == []
    assert "'train.lr'" in str(err) and str(path) in str(err)


# ----------------------------------------------------------------------------- rwlora_sentiment
RW = {
    "eval-every": 1,
    "num-server-rounds": 1,
    "strategy.local-steps": 1,
    "strategy.carry-optimizer-state": True,
    "train.batch-size": 4,
    "data.max-examples": 24,
    "data.eval-examples": 8,
    "data.test-size": 200,
    "model.max-length": 16,
    "strategy.graph": "ring",
    "strategy.node-wait-s": 5.0,
}


@pytest.fixture(scope="module")
def rw(tmp_path_factory):
    """One round of the rwlora_sentiment app (RW-LoRA carrying AdamW state): its checkpoint."""
    from rwlora_sentiment.client_app import app as rw_client
    from rwlora_sentiment.server_app import CHECKPOINT, run_server

    out = tmp_path_factory.mktemp("rw")
    rc = {**RW, "output-dir": str(out)}
    run_server(FakeGrid(rw_client, num_nodes=3, run_config=rc), rc, settle_s=0.05)
    tensors, meta = load_checkpoint(out / CHECKPOINT)
    assert tensors["strategy"]["optimizer"], "the checkpoint carries AdamW state"
    return rc, out / CHECKPOINT


def _rw_refused(rw, tmp_path, edit, pattern, **over) -> str:
    from rwlora_sentiment.client_app import app as rw_client
    from rwlora_sentiment.server_app import run_server

    rc, ck = rw
    tensors, meta = load_checkpoint(ck)
    edit(tensors, meta)
    path = save_checkpoint(tmp_path / "checkpoint.safetensors", tensors, meta)
    run = {**rc, **over, "num-server-rounds": 2, "output-dir": str(tmp_path / "rest")}
    run["resume-from"] = str(path)
    grid = FakeGrid(rw_client, num_nodes=3, run_config=run)
    with pytest.raises(CheckpointError) as e:
        run_server(grid, run, settle_s=0.05)
    assert str(e.value).startswith(f"checkpoint {str(path)!r}"), str(e.value)
    assert re.search(pattern, str(e.value)), str(e.value)
    assert not [m for m in grid.log if m.message_type == "train"]
    return str(e.value)


def _reshape_first(group):
    def edit(t, m):
        g = t["strategy"][group]
        k = sorted(g)[0]
        g[k] = torch.zeros(g[k].numel() + 1)

    return edit


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t, m: m.pop("app-state"), r"field 'app-state' is missing"),
        (lambda t, m: m["app-state"].pop("cursors"), r"field 'app-state.cursors' is missing"),
        (
            lambda t, m: m["app-state"].update(cursors={"0": 1.5}),
            r"'app-state.cursors.0' must be an int",
        ),
        (
            lambda t, m: m["app-state"].update(cursors={"x": 1}),
            r"field 'app-state.cursors' has a bad key 'x'",
        ),
        (lambda t, m: m.update(round="abc"), r"field 'round' must be an int >= 0, got 'abc'"),
        (lambda t, m: m.update(round=-3), r"field 'round' must be an int >= 0, got -3"),
        (lambda t, m: m.update(app="isoloco_lm"), r"field 'app' is 'isoloco_lm'"),
        (lambda t, m: m.pop("config"), r"field 'config' is missing"),
        (
            lambda t, m: m["strategy"].update(round=7),
            r"strategy state: the strategy holds 7 rounds, field 'round' = 1",
        ),
        (lambda t, m: m["strategy"].update(failures=-1), r"field 'failures' must be an int >= 0"),
        (_reshape_first("token"), r"strategy state: tensor 'token/.*' has shape \[\d+\], expected"),
        (
            _reshape_first("optimizer"),
            r"tensor 'optimizer/.*exp_avg.*' has shape \[\d+\], expected",
        ),
    ],
)
def test_rwlora_bad_checkpoint(rw, tmp_path, edit, pattern):
    _rw_refused(rw, tmp_path, edit, pattern)


def test_rwlora_fedavg_arrays_of_the_wrong_shape(rw, tmp_path):
    def edit(t, m):
        token = t.pop("strategy")["token"]
        k = sorted(token)[0]
        t["strategy"] = {"arrays": {**token, k: torch.zeros(3)}}
        m["config"]["strategy"]["name"] = "fedavg"
        m["config"]["strategy"]["carry-optimizer-state"] = False
        m["strategy"] = {"round": 1, "bytes-relayed": 0, "local-updates": 0}

    over = {"strategy.name": "fedavg", "strategy.carry-optimizer-state": False}
    _rw_refused(rw, tmp_path, edit, r"tensor 'arrays/.*' has shape \[3\], expected", **over)
