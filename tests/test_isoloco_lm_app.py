"""The isoloco-lm app: config validation, in-process runs (FakeGrid), exact resume, a real
`flwr run` (slow)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import tomllib
import torch
from fakegrid import FakeGrid
from isoloco_lm import client_app, server_app, task
from lm_app import APP_DIR, REPO, tiny_config, write_corpus

from flwr_isoloco.checkpoint import load_checkpoint
from flwr_isoloco.runconfig import RunConfigError, flatten


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real-text corpus (3 plays, 40k characters each) so tokenizer training is fast."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tiny(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_config(corpus, tmp_path_factory.mktemp("cache"), num_server_rounds=4)


def _run(rc, num_nodes=3, faults=()):
    grid = FakeGrid({"train": client_app.train}, num_nodes=num_nodes, run_config=rc)
    for node, fault, times in faults:
        grid.set_fault(grid.node_ids[node], fault, times)
    out = server_app.run_server(grid, rc, settle_s=0.0)
    return out, json.loads((out / "results.json").read_text())


# ----------------------------------------------------------------------------- config
def test_schema_matches_pyproject():
    with open(APP_DIR / "pyproject.toml", "rb") as fh:
        app_cfg = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert flatten(app_cfg) == flatten(task.DEFAULTS)
    task.load_config({})  # the defaults themselves are valid


@pytest.mark.parametrize(
    "override,pattern",
    [
        ({"strategy.name": "fedsgd"}, r"'strategy\.name' has bad value 'fedsgd'"),
        (
            {"strategy.merge": "median"},
            r"'strategy\.merge' has bad value 'median': unknown merge rule",
        ),
        ({"train.lr": -0.001}, r"'train\.lr' has bad value -0\.001: must be > 0"),
        ({"strategy.outer-lr": -0.5}, r"'strategy\.outer-lr' has bad value -0\.5"),
        ({"strategy.outer-momentum": -0.2}, r"'strategy\.outer-momentum' has bad value -0\.2"),
        (
            {"data.corpus": "/nonexistent/corpus"},
            r"'data\.corpus' has bad value '/nonexistent/corpus': no such file",
        ),
        ({"resume-from": "/nonexistent/ck.safetensors"}, r"'resume-from'.*no such file"),
        ({"output-dir": "relative/out"}, r"'output-dir'.*absolute"),
        (
            {"strategy.outer_lr": 1.0},
            r"unknown run-config key 'strategy\.outer_lr'.*did you mean 'strategy\.outer-lr'",
        ),
        ({"train.local-steps": 2.5}, r"'train\.local-steps'.*expected int"),
        ({"model.hidden": 30, "model.heads": 4}, r"'model\.\*'.*divisible by heads"),
        (
            {"strategy.name": "fedavg", "strategy.outer-lr": 0.7},
            r"'strategy\.outer-lr'.*conflicts with strategy\.name 'fedavg'",
        ),
        (
            {"strategy.name": "diloco", "strategy.fast": True},
            r"'strategy\.fast'.*needs strategy\.name 'isoloco'",
        ),
        ({"num-server-rounds": 0}, r"'num-server-rounds' has bad value 0"),
    ],
)
def test_bad_run_config_named(override, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        task.load_config(override)


def test_bad_config_stops_server_before_training(tiny, tmp_path):
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=tiny)
    rc = {**tiny, "output-dir": str(tmp_path), "strategy.merge": "nope"}
    with pytest.raises(RunConfigError, match="strategy.merge"):
        server_app.run_server(grid, rc, settle_s=0.0)
    assert grid.log == [] and not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    "name,merge,expected",
    [
        ("isoloco", "", ("IsoLoCo", "iso_c", 1.8, 0.8)),
        ("diloco", "", ("DiLoCo", "mean", 0.25, 0.8)),  # each rule's tuned values (tuned.py)
        ("fedavg", "", ("DiLoCo", "mean", 1.0, 0.0)),
        ("diloco", "ties", ("DiLoCo", "ties", 0.7, 0.0)),
        ("isoloco", "ties", ("IsoLoCo", "ties", 0.7, 0.0)),
        ("isoloco", "iso_cts", ("IsoLoCo", "iso_cts", 8.0, 0.0)),
    ],
)
def test_strategy_choice(name, merge, expected):
    s = task.build_strategy(task.load_config({"strategy.name": name, "strategy.merge": merge}))
    assert (type(s).__name__, s.merge_name, s.outer.lr, s.outer.momentum) == expected
    fast = task.build_strategy(task.load_config({"strategy.fast": True}))
    assert fast.merge_name == "iso_c_ns"
    nomom = task.build_strategy(
        task.load_config({"strategy.outer-momentum": 0.0, "strategy.outer-lr": 2.1})
    )
    assert (nomom.outer.lr, nomom.outer.momentum) == (2.1, 0.0)


# ----------------------------------------------------------------------------- in-process runs
def test_run_writes_results_and_learns(tiny, tmp_path):
    out, res = _run({**tiny, "output-dir": str(tmp_path / "a")})
    assert res["status"] == "completed"
    assert [r["round"] for r in res["rounds"]] == [1, 2, 3, 4]
    assert all(r["replies-used"] == 3 and r["replies-rejected"] == 0 for r in res["rounds"])
    # loss falls from the untrained model's ~ln(vocab)
    assert abs(res["initial"]["val-loss"] - math.log(400)) < 0.3
    assert res["rounds"][-1]["val-loss"] < res["initial"]["val-loss"] - 0.2
    assert math.isclose(res["rounds"][-1]["val-ppl"], math.exp(res["rounds"][-1]["val-loss"]))
    assert [r["diverged"] for r in res["rounds"]] == [0, 0, 0, 0]
    for name in ("results.json", "loss.png", "checkpoint.safetensors", "model"):
        assert (out / name).exists(), name
    _, meta = load_checkpoint(out / "checkpoint.safetensors")
    assert meta["round"] == 4 and meta["config"] == res["config"]


def test_resume_is_exact(tiny, tmp_path):
    """4 rounds in one go == 2 rounds, then resume (fresh nodes: state from files) for 2 more."""
    full, res_full = _run({**tiny, "output-dir": str(tmp_path / "full")})
    half, res_half = _run({**tiny, "output-dir": str(tmp_path / "half"), "rounds-this-run": 2})
    assert res_half["status"] == "partial" and len(res_half["rounds"]) == 2
    rest, res_rest = _run(
        {
            **tiny,
            "output-dir": str(tmp_path / "rest"),
            "resume-from": str(half / "checkpoint.safetensors"),
        }
    )
    assert res_rest["status"] == "completed"
    t_full, m_full = load_checkpoint(full / "checkpoint.safetensors")
    t_rest, m_rest = load_checkpoint(rest / "checkpoint.safetensors")
    assert m_full["round"] == m_rest["round"] == 4
    for group in ("theta",):
        for k, v in t_full["strategy"][group].items():
            assert torch.equal(v, t_rest["strategy"][group][k]), k
    for k, v in t_full["strategy"].get("outer", {}).items():
        assert (
            torch.equal(v, t_rest["strategy"]["outer"][k]) if isinstance(v, torch.Tensor) else True
        )
    assert [r["val-loss"] for r in res_full["rounds"]] == [
        r["val-loss"] for r in res_rest["rounds"]
    ]
    assert [r["train-loss"] for r in res_full["rounds"]] == [
        r["train-loss"] for r in res_rest["rounds"]
    ]


def test_divergence_stop_ends_the_run_failed_and_logs_the_outer_values(tiny, tmp_path, caplog):
    """TIES at outer lr 1000 (its tuned momentum 0 kept): round 1's val loss explodes, the guard
    (on-divergence 'stop') ends the run after the round's row and checkpoint, status failed."""
    from flwr_isoloco.strategies.core.divergence import DivergenceError

    rc = {
        **tiny,
        "output-dir": str(tmp_path / "d"),
        "strategy.merge": "ties",
        "strategy.outer-lr": 1000.0,
        "strategy.on-divergence": "stop",
    }
    with caplog.at_level("INFO", logger="flwr"), pytest.raises(DivergenceError, match="round 1"):
        _run(rc)
    assert (
        "isoloco-lm: outer lr 1000.0 (run config), momentum 0.0 (TIES' tuned value, "
        "benchmarks/results/lm_tuning.json); set strategy.outer-momentum to override"
    ) in caplog.text
    assert "divergence guard: round 1: val-loss" in caplog.text
    res = json.loads((tmp_path / "d" / "results.json").read_text())
    assert res["status"] == "failed" and "diverged" in res["error"]
    assert [r["diverged"] for r in res["rounds"]] == [1]
    assert "(diverged: see the divergence guard's warning)" in caplog.text  # the round's line
    _, meta = load_checkpoint(tmp_path / "d" / "checkpoint.safetensors")
    assert meta["round"] == 1


def test_resume_rejects_changed_config(tiny, tmp_path):
    half, _ = _run({**tiny, "output-dir": str(tmp_path / "h"), "rounds-this-run": 1})
    rc = {
        **tiny,
        "output-dir": str(tmp_path / "r"),
        "train.lr": 1e-3,
        "resume-from": str(half / "checkpoint.safetensors"),
    }
    with pytest.raises(
        RunConfigError, match=r"'train\.lr' = 0\.001 differs from the checkpoint's 0\.003"
    ):
        _run(rc)


def test_bad_replies_dropped_run_goes_on(tiny, tmp_path):
    def nan_reply(reply):
        from flwr.app import ArrayRecord

        rec = reply.content.array_records["arrays"]
        sd = rec.to_torch_state_dict()
        k = next(iter(sd))
        sd[k] = torch.full_like(sd[k], float("nan"))
        reply.content["arrays"] = ArrayRecord(sd)
        return reply

    rc = {**tiny, "output-dir": str(tmp_path / "f"), "num-server-rounds": 3}
    _, res = _run(rc, faults=[(0, "raise", 1), (1, nan_reply, 1), (2, "timeout", 1)])
    r1 = res["rounds"][0]
    assert (r1["replies-used"], r1["replies-rejected"]) == (0, 2)  # timed-out reply is missing
    assert r1["val-loss"] == pytest.approx(res["initial"]["val-loss"])  # model kept
    assert all(r["replies-used"] == 3 for r in res["rounds"][1:])
    assert res["rounds"][-1]["val-loss"] < res["initial"]["val-loss"]


# ----------------------------------------------------------------------------- node data-path
def _own_text(folder):
    """A site's own text: two files of words that are not in the Shakespeare corpus."""
    folder.mkdir()
    for f in range(2):
        lines = [f"zebra {f} counts {i} quantum xylophones near the harbour" for i in range(150)]
        (folder / f"notes{f}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "ignored.csv").write_text("not,text\n")
    return folder


def _windows_in(row, tokens):
    """Is ``row`` a contiguous window of ``tokens``?"""
    import numpy as np

    wins = np.lib.stride_tricks.sliding_window_view(tokens, len(row))
    return bool((wins == row.numpy()).all(axis=1).any())


def test_node_data_path_trains_on_own_text(tiny, tmp_path, monkeypatch, caplog):
    """Node 0 trains on its own folder (all of it, run's tokenizer); node 1's data-path does not
    exist: it logs why and its error reply is dropped; node 2 keeps its corpus shard."""
    from tokenizers import Tokenizer

    from flwr_isoloco.data.text import load_corpus

    site, missing = _own_text(tmp_path / "site"), tmp_path / "no-such-site"
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def spy(real):
        def wrapped(cfg, *args):
            fn = real(cfg, *args)
            pid = args[1] if real is task.local_batches else args[0]

            def batch(i):
                b = fn(i)
                seen[pid].append(b)
                return b

            return batch

        return wrapped

    monkeypatch.setattr(client_app, "local_batches", spy(task.local_batches))
    monkeypatch.setattr(client_app, "node_batches", spy(task.node_batches))
    paths = {0: str(site), 1: str(missing)}
    rc = {**tiny, "output-dir": str(tmp_path / "out"), "num-server-rounds": 2}
    grid = FakeGrid(
        {"train": client_app.train},
        num_nodes=3,
        run_config=rc,
        node_config_fn=lambda i: {"data-path": paths[i]} if i in paths else {},
    )
    with caplog.at_level("ERROR", logger="flwr"):
        out = server_app.run_server(grid, rc, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    assert [(r["replies-used"], r["replies-rejected"]) for r in res["rounds"]] == [(2, 1)] * 2
    assert [e.outcome for e in grid.log if e.node_id == grid.node_ids[1]] == ["raised"] * 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("partition-id 1" in m and str(missing) in m for m in errors), errors

    cfg = task.load_config(rc)
    data = task.text_data(cfg)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    own = "\n".join(load_corpus(str(site)))
    own_tokens = task.local_tokens(cfg, str(site), 0)
    assert not seen[1] and len(seen[0]) == len(seen[2]) == 2 * tiny["train.local-steps"]
    for b in seen[0]:  # node 0: windows of its own text, tokenised with the run's tokenizer
        for row in b:
            assert tok.decode(row.tolist()) in own
            assert _windows_in(row, own_tokens)
    # all of the folder is used, not a 1/3 shard: both files show up in node 0's batches
    drawn = " ".join(tok.decode(row.tolist()) for b in seen[0] for row in b)
    assert "zebra 0 " in drawn and "zebra 1 " in drawn
    shard = task.shard_tokens(data.train, 2, 3)
    for b in seen[2]:  # node 2: unchanged, windows of its shard of the corpus
        for row in b:
            assert _windows_in(row, shard)
            assert "zebra" not in tok.decode(row.tolist())


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda d: "relative/site", r"must be an absolute path"),
        (lambda d: str(d / "nope"), r"no such file or directory"),
        (lambda d: (d / "empty").mkdir() or str(d / "empty"), r"holds no \.txt or \.md files"),
        (
            lambda d: (d / "blank.txt").write_text("  \n\n") and str(d / "blank.txt"),
            r"holds no text",
        ),
        (
            lambda d: (d / "short.md").write_text("A few words.\n") and str(d / "short.md"),
            r"tokens are too few for train\.seq-len 32",
        ),
    ],
)
def test_node_data_path_errors_name_node_and_path(tiny, tmp_path, make, pattern):
    path = make(tmp_path)
    cfg = task.load_config(tiny)
    with pytest.raises(task.NodeDataError, match=pattern) as err:
        task.local_batches(cfg, path, 4)
    assert f"node partition-id 4: node-config data-path={path!r}" in str(err.value)


# ----------------------------------------------------------------------------- real flwr run
def _run_app(out, *overrides, timeout=420):
    env = {**os.environ, "NUM_SUPERNODES": "3", "CPUS_PER_CLIENT": "1"}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run_app.sh"), str(APP_DIR), str(out), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _toml(v):
    return f"'{v}'" if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


@pytest.mark.slow
def test_flwr_run_completes(tiny, tmp_path):
    rc = {**tiny, "num-server-rounds": 2}
    proc = _run_app(tmp_path / "out", *(f"{k}={_toml(v)}" for k, v in rc.items()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = json.loads((tmp_path / "out" / "run_app.json").read_text())["status"]
    assert status == "finished:completed"
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["status"] == "completed" and [r["round"] for r in res["rounds"]] == [1, 2]
    assert all(r["replies-used"] == 3 for r in res["rounds"])
    assert "Results: " + str(tmp_path / "out" / "results.json") in proc.stdout


@pytest.mark.slow
def test_flwr_run_bad_config_fails_loudly(tmp_path):
    """A bad value is refused by run_app.sh's pre-check (the app's own checks) before anything
    starts: exit 2 and the key named, as for an unknown key."""
    proc = _run_app(tmp_path / "bad", "strategy.merge='median'", timeout=240)
    assert proc.returncode == 2
    assert "'strategy.merge' has bad value 'median'" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad" / "flwr-run.log").exists()  # nothing was started


def test_run_app_names_unknown_key_before_starting(tmp_path):
    """Flower only says "[code: 15] Invalid run configuration."; run_app.sh names the key."""
    proc = _run_app(tmp_path / "unknown", "strategy.outer_lr=1.0", timeout=120)
    assert proc.returncode == 2
    assert (
        "unknown run-config key 'strategy.outer_lr' (did you mean strategy.outer-lr" in proc.stderr
    )
    assert not (tmp_path / "unknown" / "flwr-run.log").exists()  # nothing was started


def test_unwritable_node_state_does_not_lose_replies(tiny, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    (out / "node-state").write_text("a file where the state folder should be")
    _, res = _run({**tiny, "output-dir": str(out), "num-server-rounds": 2})
    assert res["status"] == "completed"
    assert [r["replies-used"] for r in res["rounds"]] == [3, 3]


def test_checkpoint_false_keeps_node_state_in_a_temp_folder_removed_at_the_end(
    tiny, tmp_path, monkeypatch
):
    """No checkpoint, so no folder from the server: each node's AdamW moments still leave
    ``context.state`` (only a handle stays) for a private per-run temp folder, the run equals
    the checkpointed one bit for bit, and the folder is gone when the run ends."""
    import tempfile

    from flwr.app import ArrayRecord

    from flwr_isoloco.clients.node_state import HANDLE_KEY, run_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = {**tiny, "num-server-rounds": 2}
    _, want = _run({**rc, "output-dir": str(tmp_path / "ckpt")})
    seen = []
    real = client_app.train

    def train(msg, ctx):  # what each node holds between rounds, and where its file is
        reply = real(msg, ctx)
        seen.append(Path(ctx.state[HANDLE_KEY]["path"]))
        assert seen[-1].is_file() and not any(
            isinstance(r, ArrayRecord) for r in ctx.state.values()
        )
        return reply

    grid = FakeGrid({"train": train}, num_nodes=3, run_config=rc)
    rc_b = {**rc, "output-dir": str(tmp_path / "b"), "checkpoint": False}
    out = server_app.run_server(grid, rc_b, grid.run_id, settle_s=0.0)
    got = json.loads((out / "results.json").read_text())
    assert got["status"] == "completed" and not (out / "node-state").exists()
    assert [r["val-loss"] for r in got["rounds"]] == [r["val-loss"] for r in want["rounds"]]
    folder = run_temp_dir(grid.run_id, create=False)
    assert len(seen) == 6 and {p.parent for p in seen} == {folder} and not folder.exists()


def test_loss_plot_ticks_whole_rounds_only(monkeypatch):
    """A 3-round run's loss.png labels rounds 0..3, not 0, 0.5, 1, ... (issue 17)."""
    from isoloco_lm import plots

    ticks = {}

    def capture(fig, path):
        fig.canvas.draw()
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        ticks["x"] = [t for t in ax.get_xticks() if lo <= t <= hi]

    monkeypatch.setattr(plots, "save_figure", capture)
    rounds = [{"round": r, "val-loss": 5.0 - r, "train-loss": 5.5 - r} for r in (1, 2, 3)]
    plots.plot_losses(rounds, Path("unused.png"), "t", initial={"round": 0, "val-loss": 7.6})
    assert ticks["x"] and all(float(t).is_integer() for t in ticks["x"]), ticks
    assert {0.0, 3.0} <= set(ticks["x"])
