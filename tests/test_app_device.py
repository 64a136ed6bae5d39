"""Devices and precision in the apps (issue 37): ``train.device`` / ``train.precision`` /
``train.compile`` checked and passed to the workers, and a server-only setting
(``strategy.merge-device``) that never breaks a node."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from fakegrid import FakeGrid
from isoloco_lm import client_app, server_app, task
from lm_app import tiny_config, write_corpus

from flwr_isoloco.runconfig import RunConfigError

RW_APP = str(Path(__file__).resolve().parents[1] / "simulations" / "rwlora-sentiment")
if RW_APP not in sys.path:
    sys.path.insert(0, RW_APP)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), plays=2, chars=20_000)
    return tiny_config(corpus, tmp_path_factory.mktemp("cache"), num_server_rounds=1)


# ----------------------------------------------------------------------------- merge device
@no_gpu
def test_server_merge_device_cuda_does_not_break_gpu_less_nodes(tiny, tmp_path):
    """Every node sees ``strategy.merge-device='cuda'`` in its run config on this GPU-less
    machine and trains (it checks the spelling only); the server, here on the CPU, uses all
    three replies."""
    grid = FakeGrid(
        {"train": client_app.train},
        num_nodes=3,
        run_config={**tiny, "strategy.merge-device": "cuda"},
    )
    node_cfg = task.load_config({**tiny, "strategy.merge-device": "cuda"}, node=True)
    assert node_cfg.strategy["merge-device"] == "cuda"
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "strategy.merge-device": "cpu"}
    out = server_app.run_server(grid, rc, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    (row,) = res["rounds"]
    assert row["replies-used"] == 3 and row["replies-rejected"] == 0
    assert row["val-loss"] < res["initial"]["val-loss"]


@no_gpu
@pytest.mark.parametrize("option", ["cuda", "cuda:1"])
def test_server_refuses_cuda_merge_device_naming_the_key(tiny, tmp_path, option):
    """On the server the key is resolved: a CUDA device that is not visible is refused before
    anything is sent, naming strategy.merge-device and the fix."""
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "strategy.merge-device": option}
    with pytest.raises(RunConfigError, match=r"strategy\.merge-device.*no CUDA device") as err:
        task.load_config(rc)
    assert "'auto'" in str(err.value) and "'cpu'" in str(err.value)
    assert "'strategy.merge'" not in str(err.value)
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=rc)
    with pytest.raises(RunConfigError, match=r"strategy\.merge-device"):
        server_app.run_server(grid, rc, settle_s=0.0)
    assert grid.log == []  # nothing was sent to any node


def test_merge_device_spelling_is_checked_on_nodes_too(tiny):
    with pytest.raises(RunConfigError, match=r"'strategy\.merge-device' has bad value 'gpu'"):
        task.load_config({**tiny, "strategy.merge-device": "gpu"}, node=True)


# ----------------------------------------------------------------------------- run-config keys
@pytest.mark.parametrize(
    "override,pattern",
    [
        ({"train.device": "gpu"}, r"'train\.device' has bad value 'gpu'"),
        ({"train.device": "cuda:x"}, r"'train\.device' has bad value 'cuda:x'"),
        ({"train.precision": "fp8"}, r"'train\.precision' has bad value 'fp8'"),
        ({"train.precision": "BF16"}, r"'train\.precision' has bad value 'BF16'"),
        ({"train.compile": "yes"}, r"'train\.compile'.*expected bool"),
    ],
)
@pytest.mark.parametrize("app", ["isoloco-lm", "rwlora-sentiment"])
def test_device_keys_refuse_bad_values_naming_the_key(app, override, pattern):
    from rwlora_sentiment import task as rw_task

    load = task.load_config if app == "isoloco-lm" else rw_task.load_config
    for good in ({}, {"train.device": "cuda:1", "train.precision": "bf16", "train.compile": True}):
        load(good)  # spelling only: a GPU-less machine may check a GPU run's config
    with pytest.raises(RunConfigError, match=pattern):
        load(override)


def test_both_apps_pass_the_keys_to_their_workers():
    from rwlora_sentiment import task as rw_task

    cfg = rw_task.client_config(
        rw_task.load_config(
            {"train.device": "cpu", "train.precision": "fp16", "train.compile": True}
        )
    )
    assert (cfg.device, cfg.precision, cfg.compile) == ("cpu", "fp16", True)
    assert rw_task.client_config(rw_task.load_config({})).device == "auto"


# ----------------------------------------------------------------------------- isoloco-lm node
def _one_round(tiny, tmp_path, name, **keys):
    rc = {**tiny, "output-dir": str(tmp_path / name), **keys}
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=rc)
    out = server_app.run_server(grid, rc, settle_s=0.0)
    return json.loads((out / "results.json").read_text())


def test_bf16_through_the_clientapp_on_cpu(tiny, tmp_path):
    """train.precision='bf16' runs end to end on the CPU: every node's reply is used, finite,
    and it is not the fp32 run's (autocast took effect) though close to it."""
    fp32 = _one_round(tiny, tmp_path, "fp32")
    bf16 = _one_round(tiny, tmp_path, "bf16", **{"train.precision": "bf16"})
    (a,), (b,) = fp32["rounds"], bf16["rounds"]
    assert b["replies-used"] == 3 and b["replies-rejected"] == 0
    assert math.isfinite(b["train-loss"]) and math.isfinite(b["val-loss"])
    assert b["val-loss"] != a["val-loss"] and abs(b["val-loss"] - a["val-loss"]) < 0.05
    assert abs(b["train-loss"] - a["train-loss"]) < 0.05


@no_gpu
def test_cuda_on_a_gpu_less_node_is_refused_before_anything_with_the_fix(tiny, monkeypatch):
    """The node resolves train.device first: no model is built, no data read; the error names
    the key and the fix (num-gpus)."""
    from flwr.app import ConfigRecord, MessageType, RecordDict

    def never(*a, **k):
        raise AssertionError("touched before the device was checked")

    monkeypatch.setattr(client_app, "build_model", never)
    monkeypatch.setattr(client_app, "node_batches", never)
    grid = FakeGrid(
        {"train": client_app.train}, num_nodes=1, run_config={**tiny, "train.device": "cuda"}
    )
    msg = grid.create_message(
        RecordDict({"config": ConfigRecord({})}), MessageType.TRAIN, grid.node_ids[0], "1"
    )
    (reply,) = grid.send_and_receive([msg])
    reason = reply.error.reason
    assert reply.has_error() and "ValueError: train.device 'cuda': no CUDA device" in reason
    assert "client-resources-num-gpus" in reason and "AssertionError" not in reason


# ----------------------------------------------------------------------------- LoRA clients
def _lora_cfg(**kw):
    from flwr_isoloco.clients.lora_client import LoRAClientConfig

    return LoRAClientConfig(
        max_examples=48, batch_size=4, local_steps=2, max_length=24, test_size=500, **kw
    )


def _lora_send(client, kind, adapter, config=None, num_nodes=1):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    grid = FakeGrid({"train": client.train, "evaluate": client.evaluate}, num_nodes=num_nodes)
    content = RecordDict({"arrays": ArrayRecord(adapter), "config": ConfigRecord(config or {})})
    msg = grid.create_message(content, kind, grid.node_ids[0], "1")
    (reply,) = grid.send_and_receive([msg])
    return reply


@pytest.mark.parametrize(
    "bad,pattern",
    [
        ({"device": "gpu"}, r"device 'gpu' is not one of"),
        ({"precision": "fp8"}, r"precision 'fp8' is not one of"),
        ({"compile": 1}, r"compile must be True or False"),
    ],
)
def test_lora_configs_refuse_bad_device_options(bad, pattern, tmp_path):
    from flwr_isoloco.clients.lora_causal import CausalLoRAClientConfig, CausalLoRASpec

    with pytest.raises(ValueError, match=pattern):
        _lora_cfg(**bad)
    with pytest.raises(ValueError, match=pattern):
        CausalLoRAClientConfig(lora=CausalLoRASpec(model=str(tmp_path)), **bad)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_client_bf16_on_cpu_keeps_fp32_adapter_and_moments(precision, caplog, monkeypatch):
    """bf16 (fp16: with its gradient scaler) autocast on the CPU: the adapter and AdamW moments that travel are fp32 and finite,
    the loss is the fp32 run's to bf16 rounding but not equal to it; the node logs its device
    once."""
    from flwr.app import MessageType

    from flwr_isoloco.clients import precision as precision_mod
    from flwr_isoloco.clients.lora_client import OPTIMIZER_KEY, LoRAClient
    from flwr_isoloco.models import classifier

    cfg32, cfg16 = _lora_cfg(), _lora_cfg(precision=precision)
    init = classifier.initial_adapter(cfg32.lora)
    carry = {"local-steps": 3, "carry-optimizer-state": True}
    a = _lora_send(LoRAClient(cfg32), MessageType.TRAIN, init, carry)
    monkeypatch.setattr(precision_mod, "_ANNOUNCED", set())  # the same node id: a new process
    with caplog.at_level("INFO", logger="flwr"):
        client = LoRAClient(cfg16)
        b = _lora_send(client, MessageType.TRAIN, init, carry)
        ev = _lora_send(client, MessageType.EVALUATE, init)
    assert not b.has_error() and not ev.has_error(), b.error if b.has_error() else ev.error
    out, out32 = (
        b.content["arrays"].to_torch_state_dict(),
        a.content["arrays"].to_torch_state_dict(),
    )
    moments = b.content[OPTIMIZER_KEY].to_torch_state_dict()
    for t in (*out.values(), *moments.values()):
        assert t.dtype == torch.float32 and torch.isfinite(t).all()
    assert any(not torch.equal(out[k], init[k]) for k in out)
    la, lb = a.content["metrics"]["train_loss"], b.content["metrics"]["train_loss"]
    assert la != lb and abs(la - lb) < 0.02 * abs(la)
    assert any(not torch.equal(out[k], out32[k]) for k in out)
    assert math.isfinite(ev.content["metrics"]["eval_loss"])
    said = [
        r.getMessage() for r in caplog.records if f"trains on cpu in {precision}" in r.getMessage()
    ]
    assert len(said) == 1, said  # train and evaluate: once


def test_lora_client_compiles_once_per_process(monkeypatch):
    """compile=True wraps the cached model with torch.compile once, reuses the wrapper on the
    next message and trains exactly as without it (here torch.compile is a counting identity:
    the real one needs a C compiler and minutes on this CPU)."""
    from flwr.app import MessageType

    from flwr_isoloco.clients import lora_client
    from flwr_isoloco.models import classifier

    calls = []

    def fake_compile(model):
        calls.append(model)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(lora_client, "_COMPILED", {})
    cfg = _lora_cfg(compile=True)
    init = classifier.initial_adapter(cfg.lora)
    client = lora_client.LoRAClient(cfg)
    r1 = _lora_send(client, MessageType.TRAIN, init)
    r2 = _lora_send(client, MessageType.TRAIN, init)
    ref = _lora_send(lora_client.LoRAClient(_lora_cfg()), MessageType.TRAIN, init)
    assert len(calls) == 1 and calls[0] is classifier.get_model(cfg.lora)
    for r in (r1, r2):
        got, want = (
            r.content["arrays"].to_torch_state_dict(),
            ref.content["arrays"].to_torch_state_dict(),
        )
        assert all(torch.equal(got[k], want[k]) for k in want)


@no_gpu
def test_lora_cuda_refused_before_the_model_with_the_fix(monkeypatch):
    from flwr.app import Context, MessageType, RecordDict
    from rwlora_sentiment import client_app as rw_client

    from flwr_isoloco.clients import lora_client
    from flwr_isoloco.models import classifier

    def never(*a, **k):
        raise AssertionError("model built before the device was checked")

    cfg = _lora_cfg(device="cuda")
    init = classifier.initial_adapter(cfg.lora)
    monkeypatch.setattr(lora_client.SentenceTask, "model", never)
    reply = _lora_send(lora_client.LoRAClient(cfg), MessageType.TRAIN, init)
    assert reply.has_error() and "device 'cuda': no CUDA device" in reply.error.reason
    assert "client-resources-num-gpus" in reply.error.reason
    ctx = Context(
        1, 2, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {"train.device": "cuda:0"}
    )
    with pytest.raises(ValueError, match=r"train\.device 'cuda:0'.*num-gpus"):
        rw_client.node_config(ctx)


def test_causal_lora_bf16_on_cpu(tmp_path):
    from flwr.app import MessageType
    from tiny_hf import save_tiny_llama

    from flwr_isoloco.clients.lora_causal import (
        CausalLoRAClientConfig,
        CausalLoRASpec,
        get_causal_model,
    )
    from flwr_isoloco.clients.lora_client import LoRAClient
    from flwr_isoloco.data.text import load_corpus

    text = tmp_path / "play.txt"
    text.write_text(load_corpus("shakespeare")[0][:20_000], encoding="utf-8")
    common = dict(
        lora=CausalLoRASpec(model=str(save_tiny_llama(tmp_path / "m")), seed=3),
        corpus=str(text),
        val_fraction=0.2,
        seq_len=32,
        batch_size=4,
        local_steps=2,
        lr=5e-3,
        eval_tokens=512,
        cache_dir=str(tmp_path / "cache"),
    )
    init = get_causal_model(common["lora"], slot="test").initial_adapter
    replies = {}
    for p in ("fp32", "bf16"):
        client = LoRAClient(CausalLoRAClientConfig(precision=p, **common))
        replies[p] = [
            _lora_send(client, k, init) for k in (MessageType.TRAIN, MessageType.EVALUATE)
        ]
        assert not any(r.has_error() for r in replies[p])
    (t32, e32), (t16, e16) = replies["fp32"], replies["bf16"]
    out = t16.content["arrays"].to_torch_state_dict()
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in out.values())
    l32, l16 = t32.content["metrics"]["train_loss"], t16.content["metrics"]["train_loss"]
    assert l32 != l16 and abs(l32 - l16) < 0.02 * l32
    p32, p16 = e32.content["metrics"]["eval_ppl"], e16.content["metrics"]["eval_ppl"]
    assert math.isfinite(p16) and abs(p16 - p32) < 0.05 * p32
