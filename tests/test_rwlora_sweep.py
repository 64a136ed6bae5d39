"""benchmarks/rwlora/rwlora_sweep.py (issue 11, RW-LoRA part): records, resume, target logic, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "rwlora"))

import rwlora_sweep as S  # noqa: E402
import rwlora_sweep_report as R  # noqa: E402

FIELDS = {
    "method",
    "graph",
    "clients",
    "partition",
    "rank",
    "seed",
    "updates_to_target",
    "mb_relayed_to_target",
    "mb_p2p_to_target",
    "final_acc",
    "final_updates",
    "budget_updates",
    "wall_s",
    "run_config",
    "started_utc",
    "curve",
    "test_examples",
}


def test_quick_run_writes_records_and_rerun_skips(tmp_path):
    out = tmp_path / "sweep.json"
    argv = [
        "--quick",
        "--methods",
        "rwlora",
        "gossip",
        "fedavg",
        "--graphs",
        "ring",
        "--partitions",
        "iid",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    S.main(argv)
    recs = json.loads(out.read_text())
    assert [(r["method"], r["graph"]) for r in recs] == [
        ("rwlora", "ring"),
        ("gossip", "ring"),
        ("fedavg", "none"),
    ]
    budget = S.SIZES["quick"]["updates"]
    for r in recs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["quick"] is True and r["clients"] == S.QUICK_CLIENTS and r["partition"] == "iid"
        assert set(r["updates_to_target"]) == {"0.65", "0.70", "0.75", "0.80"}
        assert (
            set(r["mb_p2p_to_target"])
            == set(r["mb_relayed_to_target"])
            == set(r["updates_to_target"])
        )
        assert r["final_updates"] == budget == r["curve"][-1]["updates"]  # equal updates
        assert r["curve"][0]["updates"] == 0 and r["curve"][0]["round"] == 0
        assert r["final_acc"] == r["curve"][-1]["acc"] and 0.0 <= r["final_acc"] <= 1.0
        assert r["test_examples"] == S.SIZES["quick"]["eval_examples"]
        assert r["run_config"]["data.partitioner"] == "iid"
        assert r["run_config"]["strategy.name"] == r["method"]
    gossip = recs[1]
    assert 0.0 <= gossip["final_acc_vertex_mean"] <= 1.0
    assert set(gossip["updates_to_target_vertex_mean"]) == set(gossip["updates_to_target"])
    assert "final_acc_vertex_mean" not in recs[0]
    text = out.read_text()
    S.main(argv)  # resumable: every cell is done, nothing runs, nothing is appended
    assert out.read_text() == text


def test_run_config_maps_graphs_partitions_and_budget():
    full = S.SIZES["full"]
    rc = S.run_config(
        dict(
            method="gossip", graph="regular-3", clients=8, partition="dirichlet-0.5", rank=4, seed=2
        ),
        full,
        1,
    )
    assert (
        rc["strategy.graph"] == "random_regular:d=3" and rc["strategy.transition"] == "metropolis"
    )
    assert rc["data.partitioner"] == "dirichlet" and rc["data.dirichlet-alpha"] == 0.5
    assert rc["lora.r"] == 4 and rc["seed"] == 2 and rc["data.eval-examples"] == 1000
    assert rc["num-server-rounds"] == 320 // 40 and rc["eval-every"] == 160 // 40
    rw = S.run_config(
        dict(method="rwlora", graph="ring", clients=16, partition="iid", rank=8, seed=0), full, 1
    )
    assert rw["num-server-rounds"] == 64 and rw["eval-every"] == 8
    fed = S.run_config(
        dict(method="fedavg", graph="none", clients=16, partition="iid", rank=8, seed=0), full, 1
    )
    assert fed["num-server-rounds"] == 4 and fed["eval-every"] == 1  # at most once per round
    with pytest.raises(ValueError, match="not a multiple"):
        S.run_config(
            dict(method="gossip", graph="ring", clients=6, partition="iid", rank=8, seed=0), full, 1
        )
    with pytest.raises(ValueError, match="dirichlet"):
        S.partition_keys("dirichlet-x")


def test_lr_option_reaches_the_run_config_and_makes_its_own_cell(capsys):
    cell = dict(method="rwlora", graph="ring", clients=8, partition="iid", rank=8, seed=0)
    args = S.parse_args(["--lr", "5e-4"])
    rc = S.run_config(cell, S.sizing(args), 1)
    default = S.run_config(cell, S.sizing(S.parse_args([])), 1)
    assert rc["train.lr"] == 5e-4 and default["train.lr"] == S.SIZES["full"]["lr"] == 2e-3
    assert R.DEFAULT_LR == S.SIZES["full"]["lr"]  # the report's main tables are the default lr
    done = [{**cell, "quick": False, "run_config": default}]
    assert S.find_done(done, {**cell, "quick": False}, default) is done[0]
    assert S.find_done(done, {**cell, "quick": False}, rc) is None  # an lr probe is not skipped
    for bad in ("0", "-1e-3", "nan", "inf"):
        with pytest.raises(SystemExit):
            S.parse_args([f"--lr={bad}"])
        assert "finite learning rate" in capsys.readouterr().err


def test_cells_fedavg_once_per_partition_and_suite_size():
    cells = S.cells(S.METHODS, list(S.GRAPHS), [8], ["iid", "dirichlet-0.5"], [8], [0, 1, 2])
    fed = [c for c in cells if c["method"] == "fedavg"]
    assert len(fed) == 6 and {c["graph"] for c in fed} == {"none"}
    assert len(cells) == 2 * 3 * 2 * 3 + 6
    assert [c["seed"] for c in cells[:14]] == [0] * 14  # seed-major
    args = S.parse_args(["--suite", "all", "--work", "/tmp"])
    planned = S.planned_cells(args)
    assert len(planned) == 42 + 6 + 3  # rank 8 of the rank table is a main cell
    shards = [
        S.planned_cells(S.parse_args(["--suite", "all", "--work", "/tmp", "--shard", f"{i}/2"]))
        for i in (0, 1)
    ]
    assert len(shards[0]) + len(shards[1]) == len(planned)
    assert sorted(map(str, shards[0] + shards[1])) == sorted(map(str, planned))
    args = S.parse_args(["--updates", "160", "--gossip-eval-every", "80", "--work", "/tmp"])
    size = S.sizing(args)
    assert size["updates"] == 160 and size["gossip_eval_every"] == 80 and size["eval_every"] == 40
    est = S.estimate_s(
        dict(method="gossip", graph="ring", clients=8, partition="iid", rank=8, seed=0),
        S.SIZES["full"],
    )
    # 3 evaluation points x 9 adapters x 14.5 s + 8 rounds x 4 x 5 x 0.475 s + 17 s start-up
    assert est == pytest.approx(17 + 27 * 14.5 + 8 * 4 * 5 * 0.475)


ROWS = {
    "initial": {"test-accuracy": 0.5, "test-loss": 0.69},
    "rounds": [
        {"round": 1, "local-updates": 40, "bytes-relayed": 2_000_000, "bytes-p2p": 1_000_000},
        {
            "round": 2,
            "local-updates": 80,
            "bytes-relayed": 4_000_000,
            "bytes-p2p": 2_000_000,
            "test-accuracy": 0.70,
            "test-accuracy-vertex-mean": 0.60,
        },
        {
            "round": 3,
            "local-updates": 120,
            "bytes-relayed": 6_000_000,
            "bytes-p2p": 3_000_000,
            "test-accuracy": 0.66,
            "test-accuracy-vertex-mean": 0.68,
        },
        {
            "round": 4,
            "local-updates": 160,
            "bytes-relayed": 8_000_000,
            "bytes-p2p": 4_000_000,
            "test-accuracy": 0.76,
            "test-accuracy-vertex-mean": 0.71,
        },
    ],
}


def test_target_logic_first_evaluation_at_or_above():
    rows = S.eval_rows(ROWS)
    assert [r["local-updates"] for r in rows] == [0, 80, 120, 160]  # round 0 counts as 0
    hit = S.to_target(rows, (0.5, 0.65, 0.70, 0.75, 0.80))
    assert hit["updates"] == {"0.50": 0, "0.65": 80, "0.70": 80, "0.75": 160, "0.80": None}
    assert hit["mb_relayed"]["0.75"] == 8.0 and hit["mb_p2p"]["0.70"] == 2.0
    assert hit["mb_p2p"]["0.80"] is None
    assert hit["before"] == {"0.50": None, "0.65": 0, "0.70": 0, "0.75": 120, "0.80": None}
    own = S.to_target(rows, (0.65, 0.70), key="test-accuracy-vertex-mean")
    assert own["updates"] == {"0.65": 120, "0.70": 160}  # round 0 has no vertex mean
    rec = S.summarise(ROWS, budget=120)  # accuracy at equal updates: the evaluation at 120
    assert rec["final_acc"] == 0.66 and rec["final_updates"] == 120
    assert rec["final_acc_vertex_mean"] == 0.68 and rec["best_acc"] == 0.76


def _rec(method, graph, seed, ups, acc, clients=8, rank=8, own=None, lr=2e-3):
    keys = ("0.70", "0.75")
    rec = {
        "method": method,
        "graph": graph,
        "clients": clients,
        "partition": "iid",
        "rank": rank,
        "seed": seed,
        "quick": False,
        "budget_updates": 320,
        "run_config": {"train.lr": lr},  # the report reads the lr from here (older records)
        "wall_s": 100.0,
        "updates_to_target": dict(zip(keys, ups, strict=True)),
        "mb_relayed_to_target": {
            k: None if u is None else u / 10 for k, u in zip(keys, ups, strict=True)
        },
        "mb_p2p_to_target": {
            k: None if u is None else u / 20 for k, u in zip(keys, ups, strict=True)
        },
        "final_acc": acc,
        "curve": [
            {"updates": 0, "acc": 0.5, "acc_vertex_mean": None},
            {"updates": 320, "acc": acc, "acc_vertex_mean": own},
        ],
    }
    if own is not None:
        rec.update(
            final_acc_vertex_mean=own,
            updates_to_target_vertex_mean=dict(zip(keys, (200, None), strict=True)),
            mb_relayed_to_target_vertex_mean={},
            mb_p2p_to_target_vertex_mean={},
        )
        rec["curve"][0]["acc_vertex_mean"] = 0.5
    return rec


def test_report_renders_exact_numbers(tmp_path):
    recs = [
        _rec("rwlora", "ring", 0, (80, 120), 0.78),
        _rec("rwlora", "ring", 1, (120, None), 0.80),
        _rec("rwlora", "ring", 2, (None, None), 0.82),
        _rec("gossip", "ring", 0, (280, 600), 0.79, own=0.75),
        _rec("fedavg", "none", 0, (280, 280), 0.725),
        _rec("rwlora", "ring", 0, (40, 80), 0.81, rank=2),
        _rec("rwlora", "ring", 0, (160, None), 0.74, clients=16),
        _rec("rwlora", "ring", 0, (40, 40), 0.9, lr=5e-4),  # lr probe: its own cell
    ]
    recs.append({**recs[0], "final_acc": 0.1, "quick": True})  # quick records are not reported
    path = tmp_path / "s.json"
    path.write_text(json.dumps(recs))
    loaded = R.load(path)
    assert len(loaded) == 8
    text = R.render(loaded)
    assert ("| iid | ring | RW-LoRA | 3 | 100 ± 28 (2/3) | 120 (1/3) | 0.800 ± 0.020 |") in text
    assert "| iid | ring | gossip, averaged adapter | 1 | 280 (1/1) | 600 (1/1) | 0.790 |" in text
    assert (
        "| iid | ring | gossip, mean of vertices | 1 | 200 (1/1) | not reached (0/1) | 0.750 |"
        in text
    )
    assert "| iid | none | FedAvg-LoRA | 1 | 280 (1/1) | 280 (1/1) | 0.725 |" in text
    assert (
        "| iid | ring | RW-LoRA | 3 | 10.0 ± 2.8 (2/3) | 12.0 (1/3) | 0.800 ± 0.020 |" in text
    )  # MB relayed
    assert "| 2 | RW-LoRA | 1 | 40 (1/1) | 80 (1/1) | 0.810 |" in text  # rank table
    assert "| 16 | ring | RW-LoRA | 1 | 160 (1/1) | not reached (1/1) | 0.740 |" not in text
    assert "| 16 | ring | RW-LoRA | 1 | 160 (1/1) | not reached (0/1) | 0.740 |" in text
    assert "s0: 0.790 (vertices 0.750)" in text
    assert "| iid | 0.0005 | RW-LoRA | 1 | 40 (1/1) | 40 (1/1) | 0.900 |" in text  # lr probe
    assert "| iid | 0.002 | RW-LoRA | 3 | 100 ± 28 (2/3) | 120 (1/3) | 0.800 ± 0.020 |" in text
    assert "0.900" not in text.split("#### Inner learning rate")[0]  # not in the main tables
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\n{R.BEGIN}\nold\n{R.END}\n\ntail\n")
    R.write_doc(doc, text)
    R.write_doc(doc, text)  # idempotent
    new = doc.read_text()
    assert new.startswith("# Title\n") and new.endswith("\ntail\n") and "old" not in new
    assert new.count(R.BEGIN) == 1 and "100 ± 28 (2/3)" in new
    png = R.plot(loaded, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 1000


def _append_many(path: str, tag: int) -> None:
    for j in range(15):
        S.append_record(Path(path), {"tag": tag, "j": j})  # takes the folder's lock itself


def test_parallel_shards_lose_no_record(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "shared.json"
    procs = [
        mp.get_context("fork").Process(target=_append_many, args=(str(path), t)) for t in (0, 1, 2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    recs = json.loads(path.read_text())
    assert sorted((r["tag"], r["j"]) for r in recs) == [
        (t, j) for t in (0, 1, 2) for j in range(15)
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]  # no lock or temp file left


def test_variants_make_their_own_cells_and_old_records_stay_the_papers_walk():
    cell = dict(method="rwlora", graph="ring", clients=8, partition="dirichlet-0.5", rank=8, seed=0)
    full = S.SIZES["full"]
    paper = S.run_config({**cell, "variant": "paper"}, full, 1)
    assert paper == S.run_config(cell, full, 1)  # no key added: the first records still match
    k2 = S.run_config({**cell, "variant": "k2"}, full, 1)
    assert k2["strategy.local-steps"] == 2 and k2["num-server-rounds"] == 160
    assert k2["eval-every"] == 20  # every 40 updates, as the paper's walk
    avg = S.run_config({**cell, "variant": "avg0.9"}, full, 1)
    assert avg["strategy.average-decay"] == 0.9 and avg["num-server-rounds"] == 64
    val = S.run_config(cell, {**full, "eval_split": "val", "per_class": True}, 1)
    assert val["data.eval-split"] == "val" and val["eval-per-class"] is True
    old = [{**cell, "quick": False, "run_config": paper}]  # a record without variant/eval_split
    key = {**cell, "quick": False, "variant": "paper", "eval_split": "test"}
    assert S.find_done(old, key, paper) is old[0]
    assert S.find_done(old, {**key, "variant": "avg0.9"}, avg) is None
    assert S.find_done(old, {**key, "eval_split": "val"}, val) is None
    got = S.cells(["rwlora", "gossip"], ["ring"], [8], ["iid"], [8], [0], ["paper", "k2"])
    assert [(c["method"], c["variant"]) for c in got] == [
        ("rwlora", "paper"),
        ("rwlora", "k2"),
        ("gossip", "paper"),  # variants are RW-LoRA's
    ]


def _skew(
    variant, acc, curve_accs, split="val", seed=0, partition="dirichlet-0.5", method="rwlora"
):
    rec = _rec(method, "ring", seed, (None, None), acc)
    rec.update(variant=variant, eval_split=split, partition=partition, visit_counts={"0": 64})
    rec["curve"] = [
        {
            "updates": 40 * i,
            "acc": a,
            "mb_p2p": 0.3 * i,
            "mb_relayed": 0.6 * i,
            "acc_class_0": a,
            "acc_class_1": a,
        }
        for i, a in enumerate(curve_accs)
    ]
    rec["best_acc"] = max(curve_accs)
    return rec


def test_best_variant_and_skew_tables(tmp_path):
    recs = [
        _skew("paper", 0.50, [0.5, 0.6, 0.5, 0.50]),
        _skew("avg0.9", 0.70, [0.5, 0.6, 0.7, 0.70]),
        _skew("k2", 0.70, [0.5, 0.6, 0.6, 0.70]),  # same final, lower mean of the last 3
        _skew("avg0.9", 0.74, [0.5, 0.7, 0.74], split="test", seed=1),
        _skew("paper", 0.51, [0.5, 0.51], split="test", seed=1),
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(recs))
    loaded = R.load(path)
    assert R.rwlora_sweep_skew.best_variant(loaded, 2e-3) == "avg0.9"
    assert R.rwlora_sweep_skew.best_variant(loaded, 2e-3, ["paper", "k2"]) == "k2"
    assert R.main(["--results", str(path), "--best-variant"]) is None
    # a constant predictor scores its class's share in plain accuracy, 0.5 balanced: no winner
    const = _skew("carry", 0.567, [0.5, 0.567, 0.567, 0.567])
    for c in const["curve"]:
        c.update(acc_class_0=0.0, acc_class_1=1.0)
    assert R.rwlora_sweep_skew.best_variant([loaded[0], const], 2e-3) == "paper"
    text = R.render(loaded)
    assert (
        "| avg0.9 **(best)** | average-decay=0.9 | 0.700 | 0.700 | 0.667 | 0.700 | 0.700 / 0.700 |"
        in text
    )
    assert "| lrdecay8 | lr-decay-hops=8 | pending |" in text
    assert (
        "| dirichlet-0.5 | ring | RW-LoRA, avg0.9 | pending | 0.740 | pending | 0.740 (1 seed) |"
        in text
    )
    assert "| dirichlet-0.5 | ring | RW-LoRA, paper's walk | pending | 0.510 | pending |" in text
    main_part = text.split("#### Label skew")[0]
    assert "0.740" not in main_part and "0.700" not in main_part  # variants: their own section
    png = R.rwlora_sweep_skew.plot(loaded, 2e-3, tmp_path / "k.png")
    assert png is not None and png.stat().st_size > 1000


def test_class_dynamics_counts_single_class_evaluations(tmp_path):
    """Recall < 0.2 counts as single-class; a run without per-class fields is matched to a
    constant answer's accuracy, the test set's positive share recovered from another run."""
    k2 = _skew("k2", 0.82, [0.5, 0.4, 0.82], split="test", seed=1)
    k2["test_examples"] = 1000
    for c, (r0, r1) in zip(k2["curve"], [(0.5, 0.5), (1.0, 0.0), (0.7, 0.9)], strict=True):
        c.update(acc_class_0=r0, acc_class_1=r1)  # acc = 0.4 r0 + 0.6 r1: 60 % positive
    paper = _skew("paper", 0.55, [0.5, 0.4, 0.6, 0.55], split="test", seed=1)
    for c in paper["curve"]:
        del c["acc_class_0"], c["acc_class_1"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([k2, paper]))
    recs = R.load(path)
    k2, paper = recs
    K = R.rwlora_sweep_skew
    assert K.test_shares(recs, 2e-3) == {1: 0.6}
    d = K.class_dynamics(k2)
    assert (d["n"], d["one_class"], d["constant"]) == (2, 1, False)
    assert d["final_balanced"] == pytest.approx(0.8)
    assert K.class_dynamics(paper) is None  # no share known: nothing to match
    table = K.class_dynamics_table(recs, 2e-3, ["paper", "k2"])
    assert (
        "| paper | test | 1 | 2/3 (constant answer's acc) | 40: neg, 80: pos, 120: 0.550 | - |"
        in table
    )
    assert "| k2 | test | 1 | 1/2 | 40: 1.00 / 0.00, 80: 0.70 / 0.90 | 0.800 |" in table
    assert "| k2 | val | 0 | pending | | |" in table
    summary = K.class_dynamics_summary(recs, 2e-3, ["paper", "k2"])
    assert "- `paper`, test split: single-class evaluations ring 2/3 (1 runs)" in summary
    assert "all three graphs 1/2 (1 runs)." in summary and "seed 1 0.600" in summary
    assert K.bytes_line(recs, 2e-3, ["k2"]) == (
        "- Bytes for the 320 updates (ring): RW-LoRA, k2 0.6 MB P2P / 1.2 MB relayed (64 hops);"
        " RW-LoRA, paper's walk 0.9 MB P2P / 1.8 MB relayed (64 hops)."
    )
    assert K.holds_line(recs, 2e-3, ["paper", "k2"]) == (  # the paper's: no per-class fields
        "- `k2`: final balanced test accuracy >= 0.55 in 1 of 1 cells under Dirichlet(0.5)"
        " (lowest 0.800)."
    )
    assert K.compute_line(recs, 2e-3) == (  # the paper's walk's test cell is the main sweep's
        "- Compute for this section (records' `wall_s`): 100 s = screening 0 runs, 0 s + finals"
        " 1 runs, 100 s (k2 1 runs, 100 s, 100-100 s each)."
    )
