"""benchmarks/privacy/attack_bench.py at its test size: in-process isoloco-lm runs on FakeGrid, 8 sites,
one sign-flipping site (x10), no defence vs the coordinate median; and the attacks' maths."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "privacy"))
sys.path.insert(0, str(REPO / "tests"))

import attack_bench  # noqa: E402


def test_attacks_and_alie_z():
    assert attack_bench.alie_z(8, 1) == 0.0  # s = 4: Phi^-1(1/2)
    assert math.isclose(attack_bench.alie_z(8, 2), 0.31863936, rel_tol=1e-6)  # Phi^-1(5/8)
    own = {"w": torch.tensor([1.0, -2.0, 2.0])}
    honest = [{"w": torch.tensor([1.0, 0.0, 2.0])}, {"w": torch.tensor([3.0, 0.0, 4.0])}]
    assert torch.equal(attack_bench.attacked("signflip", own, honest, 1, 0)[0]["w"], -10 * own["w"])
    d, w = attack_bench.attacked("maxweight", own, honest, 1, 0)
    assert torch.equal(d["w"], -own["w"]) and w == 1e12
    noise = attack_bench.attacked("noise", own, honest, 1, 0)[0]["w"]
    assert math.isclose(float(noise.norm()), 30.0, rel_tol=1e-5)  # 10 x ||own|| = 10 x 3
    alie = attack_bench.attacked("alie", own, honest, 2, 0)[0]["w"]
    want = torch.tensor([2.0, 0.0, 3.0]) - attack_bench.alie_z(8, 2) * torch.tensor([1.0, 0, 1])
    torch.testing.assert_close(alie, want)
    three = honest + [{"w": torch.tensor([2.0, 3.0, 0.0])}]  # median (2, 0, 2), mean (2, 1, 2)
    e, w = attack_bench.attacked("edge", own, three, 1, 0)
    # distances to the median: 1, sqrt 5, sqrt 13 (median sqrt 5); R = 0.9 x 2 x sqrt 5
    want = torch.tensor([2.0, 0, 2]) - 1.8 * math.sqrt(5) * torch.tensor([2.0, 1, 2]) / 3.0
    torch.testing.assert_close(e["w"], want)
    assert w == 1e12


def test_attackers_see_every_honest_update_when_pulled_one_by_one():
    from fakegrid import FakeGrid
    from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

    def train(msg, ctx):
        pid = int(ctx.node_config["partition-id"])
        theta = msg.content["arrays"].to_torch_state_dict()
        new = {"w": theta["w"] - float(pid)}  # delta_i = pid
        rec = RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})})
        return Message(rec, reply_to=msg)

    grid = attack_bench.attack_grid(FakeGrid, "alie", 2, 0)({"train": train}, num_nodes=8)
    theta = ArrayRecord({"w": torch.zeros(3)})
    msgs = [
        Message(RecordDict({"arrays": theta}), dst_node_id=n, message_type=MessageType.TRAIN)
        for n in grid.node_ids
    ]
    ids = list(grid.push_messages(msgs))
    got = {}
    for mid in ids:  # as the strategy's ReplyStream: one id per pull
        (r,) = grid.pull_messages([mid])
        got[r.metadata.src_node_id] = -float(r.content["arrays"].to_torch_state_dict()["w"][0])
    honest = torch.arange(6, dtype=torch.float64)  # partitions 0..5; 6 and 7 attack
    want = float(honest.mean() - attack_bench.alie_z(8, 2) * honest.std(unbiased=False))
    for n, p in zip(grid.node_ids, range(8), strict=True):
        assert got[n] == pytest.approx(want if p >= 6 else float(p), abs=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from flwr_isoloco.data.text import load_corpus

    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(load_corpus("shakespeare")[:3]):
        (d / f"play{i}.txt").write_text(text[:40_000], encoding="utf-8")
    extra = {
        "model.vocab-size": 400,
        "train.seq-len": 32,
        "train.batch-size": 4,
        "data.val-tokens": 1024,
        "data.corpus": str(d),
    }
    return extra, tmp_path_factory.mktemp("cache")


def test_sign_flip_costs_less_under_the_median(tiny):
    torch.set_num_threads(1)
    extra, cache = tiny
    cells = [("honest", 0, "none"), ("signflip", 1, "none"), ("signflip", 1, "median")]
    recs = [attack_bench.run_cell("isoloco", a, f, d, 0, "test", cache, extra) for a, f, d in cells]
    assert all(r["status"] == "completed" and r["replies_used"] == [8, 8] for r in recs)
    base, plain, median = (attack_bench.final(r) for r in recs)
    assert plain - base > 0.05  # the flipped, 10x update costs the undefended run
    assert abs(median - base) < (plain - base) / 2  # the median keeps most of it out
    text = attack_bench.table(recs, "test")
    assert "| signflip | 1 | " in text and "+0.000" in text


def test_table_lists_every_seed_and_checks_the_goal_on_the_worst():
    def rec(attack, f, defence, seed, loss):
        return {
            "strategy": "isoloco",
            "attack": attack,
            "f": f,
            "defence": defence,
            "seed": seed,
            "size": "headline",
            "val_loss": [9.0, loss],
        }

    recs = [rec("honest", 0, "none", s, 5.0 + s) for s in (0, 1)]
    recs += [rec("honest", 0, "multikrum", s, 5.01 + s) for s in (0, 1)]
    recs += [rec("signflip", 1, "multikrum", 0, 5.02), rec("signflip", 1, "multikrum", 1, 6.06)]
    recs += [rec("signflip", 2, "none", 0, float("nan"))]
    recs += [rec("edge", 1, "multikrum", 0, 5.5), rec("edge", 1, "multikrum", 1, 6.2)]
    text = attack_bench.table(recs, "headline")
    assert "| attack | f | none | multikrum |" in text  # only the defences run
    assert "| signflip | 1 |  | +0.040 ± 0.028 (+0.020 / +0.060) |" in text
    assert "| signflip | 2 | diverged (diverged / -) |  |" in text
    goal = next(line for line in text.splitlines() if line.startswith("- bounds with `multikrum`"))
    assert "honest <= 0.02: yes (worst +0.010" in goal
    # the thresholds count the four attacks they were set for; edge apart, worst seed
    assert "f = 1 <= 0.05: **no** (worst +0.060, signflip seed 1; 2 runs, 1/4 attacks)" in goal
    assert goal.endswith("; edge (worst seed): f = 1 +0.500"), goal


def test_defence_variants_set_the_robust_options_and_sort_after_their_rule(tmp_path):
    rc = attack_bench.run_config("isoloco", "multikrum:select=7,f=1", 0, "test", tmp_path, tmp_path)
    assert rc["strategy.robust"] == "multikrum" and rc["strategy.max-weight-ratio"] == 5.0
    assert rc["strategy.robust-select"] == 7 and rc["strategy.robust-f"] == 1
    assert (
        attack_bench.run_config(
            "isoloco", "trimmed-mean:trim=0.125", 0, "test", tmp_path, tmp_path
        )["strategy.robust-trim"]
        == 0.125
    )
    rc = attack_bench.run_config(
        "diloco", "distance-filter:ratio=1,factor=3", 0, "test", tmp_path, tmp_path
    )
    assert rc["strategy.max-weight-ratio"] == 1.0 and rc["strategy.robust-factor"] == 3.0
    assert (
        attack_bench.run_config("diloco", "bound:ratio=1", 0, "test", tmp_path, tmp_path)[
            "strategy.max-weight-ratio"
        ]
        == 1.0
    )
    for bad in ("mean", "median:trim=0.1x", "bound:f=1", "krum:k=2", "none:ratio=1"):
        with pytest.raises(ValueError):
            attack_bench.parse_defence(bad)
    got = attack_bench.defence_order(["norm-clip", "multikrum:select=7", "none", "multikrum"])
    assert got == ["none", "multikrum", "multikrum:select=7", "norm-clip"]


def test_write_table_fills_each_doc_with_its_grids(tmp_path):
    def rec(defence, size, loss):
        return {
            "strategy": "diloco",
            "attack": "honest",
            "f": 0,
            "defence": defence,
            "seed": 0,
            "size": size,
            "val_loss": [loss],
        }

    recs = [rec("none", s, 5.0) for s in ("headline", "quick")] + [rec("median", "quick", 5.5)]
    docs = {}
    for name, sizes in (("a.md", ("headline", "quick")), ("b.md", ("headline",))):
        p = tmp_path / name
        p.write_text(f"head\n{attack_bench.BEGIN}\nold\n{attack_bench.END}\ntail\n")
        docs[p] = sizes
    attack_bench.write_table(recs, docs)
    a, b = ((tmp_path / n).read_text() for n in ("a.md", "b.md"))
    assert a.startswith("head\n") and a.endswith("tail\n") and "old" not in a
    assert "(headline: 20 rounds" in a and "(quick: 5 rounds" in a and "+0.500" in a
    assert "(headline: 20 rounds" in b and "quick" not in b
