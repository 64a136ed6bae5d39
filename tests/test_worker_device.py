"""The DiLoCo worker's device, precision and torch.compile options (issue 37 items 1-3, CPU).

No GPU here: ``"auto"`` must be the CPU, a CUDA device must be refused at construction with the
fix named, and the CUDA branch of ``"auto"`` is checked with ``torch.cuda`` patched. bf16 and fp16
run for real on the CPU (CPU autocast supports both), against a hand-written autocast loop.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from test_diloco_worker import (
    BATCHES,
    LR,
    handler,
    model_fn,
    new_context,
    reference_continuous_adamw,
    schedule,
    send,
)
from test_worker_cache import _empty_caches, _theta0  # noqa: F401  (autouse fixture)

from flwr_isoloco.clients import (
    Runtime,
    TrainSettings,
    make_diloco_train_handler,
    make_lm_evaluate_handler,
)
from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY
from flwr_isoloco.clients.precision import PRECISIONS, autocast, check_precision, grad_scaler
from flwr_isoloco.clients.worker_cache import cache_stats
from flwr_isoloco.merging.device import resolve_device, resolve_node_device

H = 3
NO_CUDA = not torch.cuda.is_available()


def _round1(**runtime):
    reply = send(handler(runtime=Runtime(**runtime)), _theta0(), 1, new_context())
    assert not reply.has_error()
    return reply.content["arrays"].to_torch_state_dict(), reply.content["metrics"]


def _norm_diff(a, b):
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ----------------------------------------------------------------------------- device
@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal where no GPU is visible")
@pytest.mark.parametrize("option", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_a_gpu_is_refused_at_construction_with_the_fix(option):
    for make in (
        lambda **kw: handler(runtime=Runtime(**kw)),
        lambda **kw: make_lm_evaluate_handler(model_fn, lambda c: [], **kw),
    ):
        with pytest.raises(ValueError) as err:
            make(device=option)
        msg = str(err.value)
        assert msg.startswith(f"train.device {option!r}: no CUDA device is visible here")
        assert "--federation-config" in msg and "client-resources-num-gpus" in msg and "0.5" in msg
        assert "does not cap" in msg and "CUDA_VISIBLE_DEVICES" in msg and "'cpu'" in msg


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:x", 3])
def test_an_unknown_device_is_refused_naming_train_device(bad):
    with pytest.raises(ValueError, match=rf"train.device {bad!r} is not one of auto, cpu"):
        Runtime(device=bad)
    with pytest.raises(ValueError, match=rf"merge device {bad!r} is not one of"):
        resolve_device(bad)  # the server's option keeps its own name


def test_auto_is_the_visible_gpu_else_the_cpu(monkeypatch):
    assert resolve_node_device("auto") == torch.device("cuda" if not NO_CUDA else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_node_device("auto") == torch.device("cuda")  # Ray's CUDA_VISIBLE_DEVICES
    assert resolve_node_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(
        ValueError, match=r"'cuda:1': only 1 CUDA device\(s\) are visible.*num-gpus"
    ):
        resolve_node_device("cuda:1")


@pytest.mark.parametrize("device", ["auto", torch.device("cpu")])
def test_auto_and_cpu_give_the_plain_adamw_loop_here(device):
    """Without a GPU, "auto" is the CPU: the first round's reply is H = 3 steps of the plain
    fp32 ``torch.optim.AdamW`` loop written in test_diloco_worker (warm-up + cosine lr, grad
    clip 1), to fp32 round-off."""
    if not NO_CUDA:
        pytest.skip("auto is the GPU here")
    got, metrics = _round1(device=device)
    want = reference_continuous_adamw(H)
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=0, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}"
        )
    assert metrics["inner-steps"] == H and "skipped-steps" not in metrics


def test_the_node_logs_its_device_once_per_process(caplog):
    train = handler(runtime=Runtime(precision="bf16"))
    ctx = new_context(pid=3)
    ctx.node_id = 4242
    theta = _theta0()
    with caplog.at_level(logging.INFO):
        for rnd in (1, 2):
            theta = send(train, theta, rnd, ctx).content["arrays"].to_torch_state_dict()
    lines = [r.getMessage() for r in caplog.records if "trains on" in r.getMessage()]
    assert len(lines) == 1
    assert "node 4242 (partition 3) trains on cpu in bf16" in lines[0]


# ----------------------------------------------------------------------------- precision
def test_check_precision_names_the_option():
    assert PRECISIONS == ("fp32", "bf16", "fp16") and check_precision(" BF16") == "bf16"
    with pytest.raises(ValueError, match=r"train.precision 'fp8' is not one of 'fp32', 'bf16'"):
        check_precision("fp8")
    with pytest.raises(ValueError, match="train.precision"):
        Runtime(precision="half")
    assert grad_scaler("cpu", "bf16") is None and grad_scaler("cpu", "fp16") is not None


def _autocast_reference(precision, steps=H):
    """H inner steps written out by hand: autocast forward, fp32 AdamW, fp16 loss scaling."""
    model = model_fn()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=True
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    skipped = 0
    for s in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = schedule(s)
        batch = BATCHES[s % len(BATCHES)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, 32).float(), batch[:, 1:].reshape(-1)
            )
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            continue
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    return {k: v.detach() for k, v in model.state_dict().items()}, skipped, opt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_round_is_the_autocast_loop_and_close_to_fp32(precision):
    """The handler in bf16/fp16 on the CPU: its reply is the hand-written autocast loop's, fp32,
    finite, differs from the fp32 reply, and by less than 10 % of the round's update in norm:
    ``||theta_lp - theta_fp32|| < 0.1 ||theta_fp32 - theta_0||`` (measured: bf16 3.5 %, fp16
    0.1 %; elementwise the first Adam steps are ~sign(g) * lr, so a small gradient entry whose
    sign the rounding flips moves by 2 lr: no elementwise bound fits)."""
    got, metrics = _round1(precision=precision)
    want, skipped, _ = _autocast_reference(precision)
    fp32, _ = _round1(precision="fp32")
    theta0 = _theta0()
    for k in got:
        assert got[k].dtype == torch.float32 and bool(torch.isfinite(got[k]).all())
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    assert 0 < _norm_diff(got, fp32) < 0.1 * _norm_diff(fp32, theta0)
    if precision == "fp16":
        assert metrics["skipped-steps"] == skipped
    else:
        assert "skipped-steps" not in metrics


def test_low_precision_keeps_fp32_adamw_state():
    ctx = new_context()
    send(handler(runtime=Runtime(precision="bf16")), _theta0(), 1, ctx)
    stored = ctx.state[ADAMW_STATE_KEY].to_torch_state_dict()
    _, _, opt = _autocast_reference("bf16")
    ref = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in opt.param_groups[0]["params"]])
    assert stored["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(stored["exp_avg"], ref, rtol=0, atol=1e-7)


def test_fp16_counts_the_steps_the_scaler_skips():
    """A loss that overflows fp16 once scaled by 2**16 (x 1e3): the first steps are skipped
    (the scale halves each time) until the scaled gradient fits, and the reply says how many."""

    def big_loss(model, batch):
        logits = model(input_ids=batch[:, :-1]).logits
        return 1e3 * torch.nn.functional.cross_entropy(
            logits.reshape(-1, 32).float(), batch[:, 1:].reshape(-1)
        ), batch[:, 1:].numel()

    train = make_diloco_train_handler(
        model_fn, lambda c: BATCHES, loss_fn=big_loss,
        train=TrainSettings(lr=LR, local_steps=16, num_server_rounds=1),
        runtime=Runtime(precision="fp16"),
    )  # fmt: skip
    reply = send(train, _theta0(), 1, new_context())
    skipped = reply.content["metrics"]["skipped-steps"]
    assert 1 <= skipped < 16  # measured: 9 (2**16 -> 2**7)
    theta = reply.content["arrays"].to_torch_state_dict()
    assert all(bool(torch.isfinite(v).all()) for v in theta.values())
    assert _max_diff(theta, _theta0()) > 0  # the steps after the skips did apply


def test_evaluate_in_bf16_is_close_to_fp32_and_differs():
    theta = _theta0()
    msg = Message(RecordDict({"arrays": ArrayRecord(theta)}), 77, "evaluate")
    out = {}
    for p in ("fp32", "bf16"):
        ev = make_lm_evaluate_handler(model_fn, lambda c: BATCHES[:3], precision=p)
        out[p] = ev(msg, new_context()).content["metrics"]["eval-loss"]
    assert out["bf16"] != out["fp32"] and abs(out["bf16"] - out["fp32"]) < 1e-2
    assert math.isfinite(out["bf16"])


def test_autocast_fp32_is_no_context():
    x = torch.randn(2, 4)
    lin = torch.nn.Linear(4, 4)
    with autocast("cpu", "fp32"):
        assert lin(x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with autocast("cpu", "bf16"):
        assert lin(x).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- compile
def compile_run(backend: str | None) -> dict:
    """Two nodes x two rounds with ``compile=True`` (``torch.compile`` wrapped to count its calls
    and, with ``backend``, to use that backend) next to the same messages uncompiled; run in a
    child process (:func:`_in_child`): dynamo keeps fake tensors alive after its reset."""
    calls = []
    real = torch.compile

    def counting(model, **kw):
        calls.append(1)
        return real(model, **({"backend": backend} if backend else {}))

    torch.compile = counting
    theta = {pid: _theta0() for pid in (0, 1)}
    ref = dict(theta)
    ctxs = {pid: new_context(pid) for pid in (0, 1)}
    ref_ctxs = {pid: new_context(pid) for pid in (0, 1)}
    for ctx in (*ctxs.values(), *ref_ctxs.values()):
        ctx.node_id = 700 + int(ctx.node_config["partition-id"])
    train, plain = (
        handler(runtime=Runtime(compile=True, cache_nodes=2)),
        handler(runtime=Runtime(cache_nodes=0)),
    )
    for rnd in (1, 2):
        for pid in (0, 1):
            theta[pid] = (
                send(train, theta[pid], rnd, ctxs[pid]).content["arrays"].to_torch_state_dict()
            )
            ref[pid] = (
                send(plain, ref[pid], rnd, ref_ctxs[pid]).content["arrays"].to_torch_state_dict()
            )
    diff = max(_max_diff(theta[pid], ref[pid]) for pid in (0, 1))
    return {"calls": len(calls), "builds": cache_stats()["model-builds"], "max_diff": diff}


def _in_child(backend: str | None) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); import test_worker_device as t; "
        f"print('RESULT', json.dumps(t.compile_run({backend!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_compile_happens_once_per_process_and_is_reused():
    """torch.compile (here with the 'eager' backend: the same tracing, no C++ build) runs once for
    two nodes and two rounds (the model pool's one model), and the replies equal the
    uncompiled ones bitwise."""
    res = _in_child("eager")
    assert res == {"calls": 1, "builds": 1, "max_diff": 0.0}


@pytest.mark.slow
def test_compile_with_inductor_gives_the_same_reply_within_fp32_tolerance():
    """The real thing (inductor; builds C++ kernels, ~45 s on 2 busy cores): compiled once,
    replies within 1e-5 of the uncompiled ones (measured 1.3e-7 after one round)."""
    res = _in_child(None)
    assert res["calls"] == 1 and res["builds"] == 1 and res["max_diff"] < 1e-5


def test_compile_is_checked():
    with pytest.raises(ValueError, match="compile must be True or False"):
        Runtime(compile="yes")


def test_fused_adamw_and_its_restored_step_lives_on_the_parameters_device():
    """CUDA and the CPU get fused AdamW. A fused optimiser's restored step count is on the
    parameter's device, where its kernel reads it (CUDA; the CPU trivially here)."""
    from flwr_isoloco.clients.adamw_state import adamw_to_flat, flat_to_adamw
    from flwr_isoloco.clients.diloco_worker import _use_fused_adamw

    assert _use_fused_adamw(torch.device("cuda")) and _use_fused_adamw(torch.device("cpu"))
    model = model_fn()
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], fused=True)
    sum(p.sum() for _, p in named).backward()
    opt.step()
    again = torch.optim.AdamW([p for _, p in named], fused=True)
    flat_to_adamw(again, named, adamw_to_flat(opt, named))
    for _, p in named:
        assert again.state[p]["step"].device == p.device
        assert torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"])
