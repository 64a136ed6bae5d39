"""The one app runner (issue 9, item 2): both apps write the same results.json envelope and
checkpoint fields, and both apps' clients keep their state through the one node-state
mechanism (a node-state file per trained node; a resumed node reads it back)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "simulations" / "isoloco-lm"))
sys.path.insert(0, str(REPO / "simulations" / "rwlora-sentiment"))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402

from flwr_isoloco.apprunner import CHECKPOINT, CHECKPOINT_SPEC  # noqa: E402
from flwr_isoloco.checkpoint import load_checkpoint  # noqa: E402
from flwr_isoloco.clients.node_state import NODE_STATE  # noqa: E402
from flwr_isoloco.clients.worker_cache import TOKEN_KEY  # noqa: E402

ENVELOPE = {"app", "status", "output-dir", "config", "resumed-from", "initial", "rounds"}
ENVELOPE_END = ENVELOPE | {"wall-time-s"}


def _lm(tmp_path: Path) -> tuple[dict, object]:
    from isoloco_lm import client_app

    from flwr_isoloco.data.text import load_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "play.txt").write_text(load_corpus("shakespeare")[0][:30_000], encoding="utf-8")
    rc = {
        "num-server-rounds": 2,
        "model.hidden": 32,
        "model.heads": 2,
        "model.vocab-size": 300,
        "train.seq-len": 16,
        "train.batch-size": 2,
        "train.local-steps": 2,
        "train.warmup-steps": 1,
        "data.val-tokens": 256,
        "data.corpus": str(corpus),
        "data.cache-dir": str(tmp_path / "cache"),
        "strategy.min-nodes": 2,
    }
    return rc, {"train": client_app.train}


def _sentiment(tmp_path: Path) -> tuple[dict, object]:
    from rwlora_sentiment.client_app import app

    rc = {
        "num-server-rounds": 2,
        "eval-every": 2,
        "strategy.name": "gossip",
        "strategy.local-steps": 1,
        "train.batch-size": 4,
        "data.max-examples": 16,
        "data.eval-examples": 8,
        "data.test-size": 200,
        "model.max-length": 16,
        "strategy.graph": "ring",
        "strategy.node-wait-s": 5.0,
    }
    return rc, app


def _run_server(app: str):
    if app == "isoloco_lm":
        from isoloco_lm.server_app import run_server
    else:
        from rwlora_sentiment.server_app import run_server
    return run_server


@pytest.mark.parametrize("app, make", [("isoloco_lm", _lm), ("rwlora_sentiment", _sentiment)])
def test_both_apps_write_one_schema_and_resume_client_state_from_files(app, make, tmp_path):
    torch.set_num_threads(1)
    rc, client = make(tmp_path)
    run_server = _run_server(app)
    nodes = 2 if app == "isoloco_lm" else 3
    half = {**rc, "rounds-this-run": 1} if app == "isoloco_lm" else {**rc, "num-server-rounds": 1}
    half["output-dir"] = str(tmp_path / "half")
    out = run_server(FakeGrid(client, num_nodes=nodes, run_config=half), half, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert ENVELOPE_END <= set(res) and res["app"] == app
    assert res["initial"]["round"] == 0 and "eval-time-s" in res["initial"]
    assert [r["round"] for r in res["rounds"]] == [1]
    assert {"round-wall-s", "elapsed-s"} <= set(res["rounds"][0])
    _, meta = load_checkpoint(out / CHECKPOINT, kind=app, spec=CHECKPOINT_SPEC)
    assert meta["history"] == res["rounds"] and meta["initial"] == res["initial"]
    # one client-state mechanism: every node that trained wrote its node-state file for round 1
    files = sorted(p.name for p in (out / "node-state").iterdir())
    assert files == [f"node-p{i}-r1.safetensors" for i in range(nodes)], files
    _, node_meta = load_checkpoint(out / "node-state" / files[0], kind=NODE_STATE)
    assert node_meta["round"] == 1 and node_meta["records"]
    # resumed by fresh nodes (empty context.state): the state comes back from those files
    rest = {**rc, "output-dir": str(tmp_path / "rest"), "resume-from": str(out / CHECKPOINT)}
    full = {**rc, "output-dir": str(tmp_path / "full")}
    out_rest = run_server(FakeGrid(client, num_nodes=nodes, run_config=rest), rest, settle_s=0.0)
    out_full = run_server(FakeGrid(client, num_nodes=nodes, run_config=full), full, settle_s=0.0)
    r_rest = json.loads((out_rest / "results.json").read_text())
    r_full = json.loads((out_full / "results.json").read_text())
    assert r_rest["status"] == r_full["status"] == "completed"
    assert [r["round"] for r in r_rest["rounds"]] == [1, 2]
    t_rest, _ = load_checkpoint(out_rest / CHECKPOINT)
    t_full, _ = load_checkpoint(out_full / CHECKPOINT)

    def flat(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}/")
            else:
                yield prefix + k, v

    a, b = dict(flat(t_full)), dict(flat(t_rest))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # node-state files of the resumed run carry the same state as the uninterrupted run's
    for i in range(nodes):
        fa, ma = load_checkpoint(out_full / "node-state" / f"node-p{i}-r2.safetensors")
        fb, mb = load_checkpoint(out_rest / "node-state" / f"node-p{i}-r2.safetensors")
        assert ma["records"] == mb["records"]  # config records (e.g. the data cursor)
        fa, fb = dict(flat(fa)), dict(flat(fb))
        assert set(fa) == set(fb)
        # the worker cache's token is unique to each write by design (worker_cache.new_token):
        # it says which write the moments came from, not what they are
        tokens = {k for k in fa if k.endswith("/" + TOKEN_KEY)}
        assert all(not torch.equal(fa[k], fb[k]) for k in tokens)
        assert all(torch.equal(fa[k], fb[k]) for k in set(fa) - tokens)
