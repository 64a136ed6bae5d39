"""Issue 34, item 2: a round released, then lost with a crash before its checkpoint, and redone
on resume, must not be released again under the same noise, and both releases count
(flwr_isoloco/strategies/diloco/dp_journal.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from privacy_helpers import QUIET, flower_epsilon

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.strategies import CentralDP, DiLoCo, LocalDP

STEP, C, Z, K = 1.0, 0.05, 1.0, 3


def _app(missing_in_round: int | None = None):
    """Node ``pid`` replies ``theta + STEP`` (every update clipped to ``C``); node 0 raises in
    round ``missing_in_round`` (its reply is missing)."""

    def train(msg: Message, ctx) -> Message:
        pid = int(ctx.node_config["partition-id"])
        if pid == 0 and int(msg.content["config"]["server-round"]) == missing_in_round:
            raise RuntimeError("node 0 is down")
        theta = msg.content["arrays"].to_torch_state_dict()
        new = {k: v + STEP for k, v in theta.items()}
        return Message(
            RecordDict({"arrays": ArrayRecord(new), "m": MetricRecord({"num-examples": 1})}),
            reply_to=msg,
        )

    return {"train": train}


def _strategy(tmp_path, dp=CentralDP, **kw) -> DiLoCo:
    s = DiLoCo(
        **QUIET,
        outer_lr=1.0,
        outer_momentum=0.0,  # theta_r = theta_{r-1} - g_r: each release is readable off theta
        **kw,
        privacy=dp(noise_multiplier=Z, clipping_norm=C),
    )
    attach = getattr(s.dp, "attach_journal", None)  # (absent before issue 34)
    if attach is not None:
        attach(tmp_path / "dp-journal.json")
    return s


class _Crash(RuntimeError):
    pass


def _first_run(tmp_path, **kw):
    """Rounds 1-2; round 1 checkpointed, the crash after round 2's release, before its
    checkpoint. Returns the released model of round 2 and the checkpoint path."""
    s = _strategy(tmp_path, **kw)
    seen = {}

    def hook(rnd, arrays, *_):
        seen[rnd] = arrays.to_torch_state_dict()["w"].double()
        if rnd == 2:
            raise _Crash("server killed before writing round 2's checkpoint")
        sd = s.state_dict()
        save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], sd["meta"])

    with pytest.raises(_Crash):
        s.start(
            grid=FakeGrid(_app(), num_nodes=K),
            initial_arrays=ArrayRecord({"w": torch.zeros(8, 8)}),
            num_rounds=2,
            on_round_end=hook,
        )
    return seen[2], tmp_path / "ck.safetensors"


def _resume(tmp_path, path, missing_in_round=None, **kw):
    tensors, meta = load_checkpoint(path)
    s = _strategy(tmp_path, **kw)
    s.load_state_dict({"tensors": tensors, "meta": meta})
    res = s.start(
        grid=FakeGrid(_app(missing_in_round), num_nodes=K),
        initial_arrays=ArrayRecord({"w": torch.zeros(8, 8)}),
        num_rounds=2,
    )
    return s, res


def test_a_round_redone_after_a_crash_draws_new_noise_and_both_releases_count(tmp_path):
    """The redo of round 2 misses node 0. Same noise: the two released models would differ by
    exactly node 0's clipped update / k (its update without noise); epsilon must count round
    1, round 2 and its redo."""
    first, path = _first_run(tmp_path)
    s, res = _resume(tmp_path, path, missing_in_round=2)
    redo = res.arrays.to_torch_state_dict()["w"].double()
    n = redo.numel()
    node0 = torch.full_like(redo, -STEP).mul_(C / (STEP * math.sqrt(n)))  # clip(delta_0)
    leak = (redo - first) - node0 / K  # 0 when the noise is replayed
    noise_norm = Z * C * math.sqrt(2 * n) / K  # of (N - N') / k
    assert float(leak.norm()) > 0.3 * noise_norm
    assert s.dp.accountant.num_releases == 3
    want = flower_epsilon(Z, 3, 1e-5, 1)
    assert res.train_metrics_clientapp[2]["dp-epsilon"] == pytest.approx(want, rel=1e-12)
    doc = json.loads((tmp_path / "dp-journal.json").read_text())
    assert [(r["round"], r["attempt"]) for r in doc["releases"]] == [(1, 0), (2, 0), (2, 1)]


def test_local_dp_charges_the_round_sent_before_the_crash(tmp_path):
    """Local DP: the sites release when they answer the train messages, so the journal
    records the round before they are sent and the resume charges it (``z / 2`` each)."""
    _, path = _first_run(tmp_path, dp=LocalDP)
    s, res = _resume(tmp_path, path, dp=LocalDP)
    assert s.dp.accountant.num_releases == 3
    want = flower_epsilon(Z / 2, 3, 1e-5, 1)
    assert res.train_metrics_clientapp[2]["dp-epsilon"] == pytest.approx(want, rel=1e-12)


def test_no_release_when_the_journal_cannot_be_written(tmp_path):
    """The journal is written before the release: if it cannot be, the round's model does not
    leave the server (no hook, no result) and the error says why."""
    s = DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=Z, clipping_norm=C))
    s.dp.attach_journal(tmp_path / "gone" / "dp-journal.json")
    (tmp_path / "gone").write_text("")  # its folder became a file: the write fails
    seen = []
    with pytest.raises(OSError):
        s.start(
            grid=FakeGrid(_app(), num_nodes=K),
            initial_arrays=ArrayRecord({"w": torch.zeros(8, 8)}),
            num_rounds=1,
            on_round_end=lambda *a: seen.append(a),
        )
    assert seen == [] and s.dp.accountant.num_releases == 0


def test_the_app_runner_journal_follows_resume_from(tmp_path):
    """``attach_dp_journal(strategy, out, resume)``: written to ``out``; on resume, read from
    the checkpoint's folder (another output folder continues it)."""
    from flwr_isoloco.strategies.diloco.dp_journal import JOURNAL, attach_dp_journal

    a, b = tmp_path / "a", tmp_path / "b"
    first = DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=Z, clipping_norm=C))
    attach_dp_journal(first, a, None)
    grid = FakeGrid(_app(), num_nodes=K)
    first.start(grid=grid, initial_arrays=ArrayRecord({"w": torch.zeros(2)}), num_rounds=1)
    sd = first.state_dict()
    save_checkpoint(a / "ck.safetensors", sd["tensors"], sd["meta"])
    second = DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=Z, clipping_norm=C))
    attach_dp_journal(second, b, a / "ck.safetensors")
    tensors, meta = load_checkpoint(a / "ck.safetensors")
    second.load_state_dict({"tensors": tensors, "meta": meta})
    second.start(grid=grid, initial_arrays=ArrayRecord({"w": torch.zeros(2)}), num_rounds=2)
    doc = json.loads((b / JOURNAL).read_text())
    assert [r["round"] for r in doc["releases"]] == [1, 2] and doc["run"] == first.dp.run_id
    plain = DiLoCo(**QUIET)
    attach_dp_journal(plain, tmp_path / "c", None)  # no DP noise: no journal
    assert getattr(plain.dp, "journal", None) is None


def _tiny_spec():
    """An app on the app runner: DiLoCo with central DP, no evaluation, rows of dp-epsilon."""
    from omegaconf import OmegaConf

    from flwr_isoloco.apprunner import AppRun, AppSpec

    base = {
        "num-server-rounds": 2,
        "rounds-this-run": 0,
        "resume-from": "",
        "checkpoint": True,
        "round-timeout": 60.0,
        "torch-threads": 0,
        "output-dir": "",
    }

    def build(cfg, nodes):
        s = DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=Z, clipping_norm=C))
        return AppRun(
            strategy=s,
            initial_arrays=ArrayRecord({"w": torch.zeros(4)}),
            evaluate=lambda rnd, arrays: None,
            row=lambda rnd, tm, em: {"dp-epsilon": tm["dp-epsilon"]},
            summary=lambda row: "",
        )

    return AppSpec(
        name="dp_journal_test",
        label="dp-journal-test",
        load_config=lambda rc: OmegaConf.create({**base, **rc}),
        nodes=lambda cfg: (K, True, 10.0),
        build=build,
    )


def test_the_app_runner_charges_a_release_lost_before_its_checkpoint(tmp_path, monkeypatch):
    """Through ``run_app``: the checkpoint of round 2 fails to be written (the crash), a resume
    from round 1's checkpoint into another folder charges round 2's first release."""
    import flwr_isoloco.apprunner as runner

    real = runner.save_checkpoint

    def crash_at_round_2(path, tensors, meta):
        if meta["round"] == 2:
            raise _Crash("killed while writing round 2's checkpoint")
        return real(path, tensors, meta)

    monkeypatch.setattr(runner, "save_checkpoint", crash_at_round_2)
    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(_Crash):
        runner.run_app(
            _tiny_spec(), FakeGrid(_app(), num_nodes=K), {"output-dir": str(a)}, settle_s=0
        )
    monkeypatch.undo()
    resume = {"output-dir": str(b), "resume-from": str(a / runner.CHECKPOINT)}
    runner.run_app(_tiny_spec(), FakeGrid(_app(2), num_nodes=K), resume, settle_s=0)
    rows = json.loads((b / "results.json").read_text())["rounds"]
    assert rows[1]["dp-epsilon"] == pytest.approx(flower_epsilon(Z, 3, 1e-5, 1), rel=1e-12)
    doc = json.loads((b / "dp-journal.json").read_text())
    assert [(r["round"], r["attempt"]) for r in doc["releases"]] == [(1, 0), (2, 0), (2, 1)]


def _resume_into(tmp_path, folder: str, checkpoint, missing_in_round=None):
    """The documented resume: a new output folder whose journal continues the one beside
    ``checkpoint`` (the app runner's ``attach_dp_journal``). The released model of round 2."""
    from flwr_isoloco.strategies.diloco.dp_journal import attach_dp_journal

    out = tmp_path / folder
    s = _strategy(tmp_path / "unused")
    attach_dp_journal(s, out, checkpoint)
    tensors, meta = load_checkpoint(checkpoint)
    s.load_state_dict({"tensors": tensors, "meta": meta})
    res = s.start(
        grid=FakeGrid(_app(missing_in_round), num_nodes=K),
        initial_arrays=ArrayRecord({"w": torch.zeros(8, 8)}),
        num_rounds=2,
    )
    return s, res.arrays.to_torch_state_dict()["w"].double()


def _leak(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||(a - b) - clip(delta_0) / k||``: 0 when ``a`` (all nodes) and ``b`` (node 0
    missing) were released under the same noise."""
    n = a.numel()
    node0 = torch.full_like(a, -STEP).mul_(C / (STEP * math.sqrt(n)))
    return float(((b - a) - node0 / K).norm())


def test_resuming_one_checkpoint_twice_never_replays_noise_and_charges_every_release(tmp_path):
    """The resume command run twice from the same checkpoint (two output folders): the second
    sees the first's release of round 2 (the journal beside the checkpoint records it), draws
    new noise and charges it: round 1, round 2 before the crash and in each resume, 4."""
    (tmp_path / "unused").mkdir()
    _, path = _first_run(tmp_path)
    first, a = _resume_into(tmp_path, "b", path, missing_in_round=2)
    second, b = _resume_into(tmp_path, "c", path)
    noise_norm = Z * C * math.sqrt(2 * a.numel()) / K  # of (N - N') / k
    assert _leak(b, a) > 0.3 * noise_norm
    assert first.dp.accountant.num_releases == 3 and second.dp.accountant.num_releases == 4
    doc = json.loads((tmp_path / "dp-journal.json").read_text())
    assert [(r["round"], r["attempt"]) for r in doc["releases"]] == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert len({r["nonce"] for r in doc["releases"]}) == 4  # a fresh secret per release


def test_a_forked_journal_still_draws_new_noise(tmp_path):
    """Checkpoint and journal copied to another folder before the first resume: the second
    resume cannot see the first's release (same attempt), but each release's nonce is fresh,
    so the two released models do not differ by node 0's bare update."""
    import shutil

    (tmp_path / "unused").mkdir()
    _, path = _first_run(tmp_path)
    fork = tmp_path / "fork"
    fork.mkdir()
    for name in ("ck.safetensors", "dp-journal.json"):
        shutil.copy(tmp_path / name, fork / name)
    _, a = _resume_into(tmp_path, "b", path, missing_in_round=2)
    _, b = _resume_into(tmp_path, "c", fork / "ck.safetensors")
    noise_norm = Z * C * math.sqrt(2 * a.numel()) / K
    assert _leak(b, a) > 0.3 * noise_norm


def test_a_round_whose_outer_step_fails_after_the_dp_merge_is_charged(tmp_path, monkeypatch):
    """The noised sum was formed and its norm is published even when the outer step fails:
    the round is journaled and charged. No round publishes the exact clipped count."""
    s = _strategy(tmp_path)

    def fail(*a, **k):
        raise ValueError("outer step refused")

    monkeypatch.setattr(s.outer, "step", fail)
    res = s.start(
        grid=FakeGrid(_app(), num_nodes=K),
        initial_arrays=ArrayRecord({"w": torch.zeros(8, 8)}),
        num_rounds=1,
    )
    m = res.train_metrics_clientapp[1]
    assert "pseudo-grad-norm" in m and "dp-clipped-fraction" not in m
    assert s.dp.accountant.num_releases == 1
    assert m["dp-epsilon"] == pytest.approx(flower_epsilon(Z, 1, 1e-5, 1), rel=1e-12)
    doc = json.loads((tmp_path / "dp-journal.json").read_text())
    assert [(r["round"], r["attempt"]) for r in doc["releases"]] == [(1, 0)]
