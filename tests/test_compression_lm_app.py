"""The isoloco-lm app with compressed uploads: bytes per round in results.json, and an exact
resume with error feedback (the residual travels in the node-state files)."""

from __future__ import annotations

import torch
from test_isoloco_lm_app import _run, corpus, tiny  # noqa: F401 - fixtures

from flwr_isoloco.checkpoint import load_checkpoint
from flwr_isoloco.clients.diloco_worker import RESIDUAL_STATE_KEY

TOPK = {"strategy.upload-codec": "topk", "strategy.codec-fraction": 0.05}


def test_compressed_resume_is_exact_and_bytes_are_reported(tiny, tmp_path):  # noqa: F811
    rc = {**tiny, **TOPK}
    full, res_full = _run({**rc, "output-dir": str(tmp_path / "full")})
    half, _ = _run({**rc, "output-dir": str(tmp_path / "half"), "rounds-this-run": 2})
    rest, res_rest = _run(
        {
            **rc,
            "output-dir": str(tmp_path / "rest"),
            "resume-from": str(half / "checkpoint.safetensors"),
        }
    )
    plain, res_plain = _run({**tiny, "output-dir": str(tmp_path / "plain"), "num-server-rounds": 1})
    # the residual is part of the node's saved state
    files = sorted((half / "node-state").glob("node-p0-r2.safetensors"))
    tensors, _ = load_checkpoint(files[0])
    assert any(RESIDUAL_STATE_KEY in str(k) for k in tensors), sorted(tensors)[:5]
    t_full, _ = load_checkpoint(full / "checkpoint.safetensors")
    t_rest, _ = load_checkpoint(rest / "checkpoint.safetensors")
    for k, v in t_full["strategy"]["theta"].items():
        assert torch.equal(v, t_rest["strategy"]["theta"][k]), k
    assert [r["val-loss"] for r in res_full["rounds"]] == [
        r["val-loss"] for r in res_rest["rounds"]
    ]
    up = [r["bytes-up"] for r in res_full["rounds"]]
    fp32_up = res_plain["rounds"][0]["bytes-up"]
    assert (
        len(set(up)) == 1 and 0.05 < up[0] / fp32_up < 0.3
    )  # top-5%: 2 x 5% of the 2-D entries + vectors
    assert (
        res_full["rounds"][0]["bytes-down"] == fp32_up
    )  # 3 nodes get the fp32 model, send fp32 back
    assert res_full["rounds"][-1]["val-loss"] < res_full["initial"]["val-loss"]
