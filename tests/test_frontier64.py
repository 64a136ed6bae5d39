"""benchmarks/compression/frontier64.py --quick: real 64 x 64 sparseloco tiles, bytes, resume, plan.

Two tiny in-process runs (FakeGrid, the sweep's real ClientApp with download_mod) of a model
whose every 2-D tensor is a multiple of 64 each way: fp32 DiLoCo and sparseloco k = 64 both ways
with outer momentum 0. The queue's order is checked on made-up records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def f64(tmp_path_factory):
    spec = importlib.util.spec_from_file_location(
        "frontier64", REPO / "benchmarks" / "compression" / "frontier64.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["frontier64"] = mod
    spec.loader.exec_module(mod)
    mod.QUICK_RECORDS = tmp_path_factory.mktemp("frontier64") / "quick.json"
    mod.main(["--quick"])
    return mod


def test_quick_tiles_are_64_by_64_and_bytes_from_messages(f64):
    from flwr.app import ArrayRecord

    from flwr_isoloco.compression.lowbit import sparseloco_bytes, tiling

    recs = {r["config"]: r for r in f64.common.load_records(f64.QUICK_RECORDS)}
    fp32, sl = recs["diloco-fp32-nesterov"], recs["diloco-sl64-m0-both"]
    assert fp32["study"] == "frontier64" and fp32["model"]["tensors_2d"] > 0
    assert len(fp32["round_s"]) == 2 and fp32["imports"]
    model = f64.L.build_model(f64.size64(True), 0)
    state = model.state_dict()
    assert all(tiling(tuple(t.shape), 4096)[2:] == (64, 64) for t in state.values() if t.dim() == 2)
    full = ArrayRecord(state).count_bytes()
    assert fp32["bytes"]["up_arrays_per_node_round"] == full
    assert fp32["bytes"]["down_arrays_per_node_round"] == full
    # sparseloco payload: 112 bytes per 64 x 64 tile + a 16-byte table per 2-D tensor (the
    # 1-D norm weights go whole); the record's arrays add only their shapes and dtypes
    opts = {"chunk": 4096, "k": 64, "bits": 2}
    payload = sum(sparseloco_bytes(tuple(t.shape), opts) for t in state.values() if t.dim() == 2)
    assert payload == sum(112 * t.numel() // 4096 + 16 for t in state.values() if t.dim() == 2)
    b = sl["bytes"]
    assert payload < b["up_arrays_per_node_round"] < full / 50
    assert payload < b["down_arrays_per_node_round"] < full / 50
    assert b["round1_down_per_node"] >= full  # round 1 sends the model (nodes hold nothing)
    assert b["total_run"] == sum(r["down"] + r["up"] for r in sl["bytes_rounds"])


def test_resume_skips_recorded_run(f64, capsys):
    before = f64.common.load_records(f64.QUICK_RECORDS)
    f64.one("diloco-fp32-nesterov", 0.25, 0, "quick", True)
    assert "skip diloco-fp32-nesterov|lr=0.25|seed=0" in capsys.readouterr().out
    assert f64.common.load_records(f64.QUICK_RECORDS) == before


def test_study_model_shapes():
    spec = importlib.util.spec_from_file_location(
        "frontier64_shapes", REPO / "benchmarks" / "compression" / "frontier64.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    size = mod.size64()
    assert size["rounds"] * size["inner_steps"] == mod.HORIZON == 800
    m = mod.model_shapes(size)
    assert m["parameters"] == 2_131_200
    assert m["shapes_2d"] == [(256, 256), (256, 704), (704, 256), (1024, 256)]


def test_plan_order_and_seed_bar(f64):
    key, grid = f64.CF.key, f64.CF.lr_grid

    def tune(done, name, vals):
        for lr, v in zip(grid(f64.centre(name)), vals, strict=True):
            done[key(name, lr, 0)] = {"val_loss": v}

    done = {}
    nxt = f64.next_run(done, exact=False)
    assert nxt == ("diloco-fp32-nesterov", 0.177, 0, "tune")
    tune(done, "diloco-fp32-nesterov", (3.6, 3.5, 3.7))
    # the pair that decides the 25x question first: sparseloco-exact's grid, then both seeds
    assert f64.next_run(done, exact=True)[:2] == (f64.EXACT, 0.707)  # SparseLoCo's lr 1.0
    assert f64.next_run(done, exact=False) == ("diloco-fp32-nesterov", 0.25, 1, "seed")
    tune(done, f64.EXACT, (3.53, 3.52, 3.6))  # +0.02: gets seeds
    seeds = []
    while (nxt := f64.next_run(done, exact=True))[0] != "isoloco-fp32-nesterov":
        seeds.append(nxt[:3])
        done[key(*nxt[:3])] = {"val_loss": 9.0}
    assert seeds == [
        ("diloco-fp32-nesterov", 0.25, 1),
        ("diloco-fp32-nesterov", 0.25, 2),
        (f64.EXACT, 1.0, 1),
        (f64.EXACT, 1.0, 2),
    ]
    tune(done, "isoloco-fp32-nesterov", (3.4, 3.3, 3.5))
    assert f64.next_run(done, exact=False)[0] == "diloco-int4-nesterov-both"
    tune(done, "diloco-int4-nesterov-both", (3.6, 3.54, 3.7))  # +0.04: gets seeds
    tune(done, "isoloco-int4-nesterov-both", (3.4, 3.36, 3.5))  # +0.06: does not
    tune(done, "diloco-sl64-m0-both", (4.2, 4.1, 4.3))
    tune(done, "isoloco-sl64-m0-both", (4.2, 4.1, 4.3))
    seeds = []
    while (nxt := f64.next_run(done, exact=True))[0] != f64.CONTROL:
        seeds.append(nxt[:3])
        done[key(*nxt[:3])] = {"val_loss": 9.0}
    assert seeds == [
        ("isoloco-fp32-nesterov", 1.8, 1),
        ("isoloco-fp32-nesterov", 1.8, 2),
        ("diloco-int4-nesterov-both", 0.25, 1),
        ("diloco-int4-nesterov-both", 0.25, 2),
    ]
    # the control (fp32, momentum 0) comes late, on its own grid around SparseLoCo's lr 1.0
    assert nxt == (f64.CONTROL, 0.707, 0, "tune")
    assert f64.reference(f64.INT4_M0, done) == "diloco-fp32-nesterov"
    tune(done, f64.CONTROL, (3.5, 3.45, 3.6))  # below fp32 Nesterov (3.5): the new reference
    assert f64.reference(f64.INT4_M0, done) == f64.CONTROL
    assert f64.reference("isoloco-int4-nesterov-both", done) == "isoloco-fp32-nesterov"
    assert not f64.gets_seeds("diloco-int4-nesterov-both", done)  # now +0.09
    seeds = []
    while (nxt := f64.next_run(done, exact=True))[0] != f64.INT4_M0:
        seeds.append(nxt[:3])
        done[key(*nxt[:3])] = {"val_loss": 9.0}
    assert seeds == [(f64.CONTROL, 1.0, 1), (f64.CONTROL, 1.0, 2)]  # fp32: always seeded
    assert nxt == (f64.INT4_M0, 0.707, 0, "tune")
    tune(done, f64.INT4_M0, (3.52, 3.48, 3.6))  # +0.03 over the control: gets seeds
    assert f64.next_run(done, exact=True) == (f64.INT4_M0, 1.0, 1, "seed")
    done[key(f64.INT4_M0, 1.0, 1)] = done[key(f64.INT4_M0, 1.0, 2)] = {"val_loss": 9.0}
    assert f64.next_run(done, exact=True) is None


def test_report_optimum_ratios_and_paired_deltas(f64):
    """The table's numbers from made-up records: the val-optimal lr, x fewer up / down / run
    from the records' bytes (round 1 counted apart), paired test deltas seed by seed."""
    import frontier64_report as R

    key, grid = f64.CF.key, f64.CF.lr_grid

    def rec(name, lr, seed, val, test, up, down):
        return {
            "key": key(name, lr, seed), "outer_lr": lr, "seed": seed, "val_loss": val,
            "test_loss": test, "rounds": 80, "workers": 8,
            "download": "none" if "fp32" in name else "Codec('exact')",
            "bytes": {
                "round1_up_per_node": up, "up_per_node_round": up, "round1_down_per_node": 100.0,
                "down_per_node_round": down, "down_arrays_per_node_round": down,
                "total_run": 8 * (100.0 + 79 * down + 80 * up),
            },
        }  # fmt: skip

    done = {}
    for name, vals, up, down in (
        ("diloco-fp32-nesterov", (3.6, 3.5, 3.7), 100.0, 100.0),
        (f64.EXACT, (3.53, 3.52, 3.6), 1.0, 8.0),
    ):
        for lr, v in zip(grid(f64.centre(name)), vals, strict=True):
            r = rec(name, lr, 0, v, v + 0.05, up, down)
            done[r["key"]] = r
    for s, (a, b) in {1: (3.56, 3.57), 2: (3.54, 3.58)}.items():
        for name, lr, t in (("diloco-fp32-nesterov", 0.25, a), (f64.EXACT, 1.0, b)):
            r = rec(name, lr, s, t, t, *((100.0, 100.0) if "fp32" in name else (1.0, 8.0)))
            done[r["key"]] = r
    rows = {r["config"]: r for r in R.rows(done)}
    ex = rows[f64.EXACT]
    assert ex["lr"] == 1.0 and ex["status"].startswith("tuned")
    assert ex["x"]["up"] == pytest.approx(100.0)
    assert ex["x"]["down"] == pytest.approx((100 + 79 * 100) / (100 + 79 * 8))
    assert ex["x"]["run"] == pytest.approx((100 + 79 * 100 + 8000) / (100 + 79 * 8 + 80))
    # nodes that build round 0 themselves: round 1's 100 bytes of model do not go down
    assert ex["x"]["run_local0"] == pytest.approx((100 + 79 * 100 + 8000) / (79 * 8 + 80))
    assert rows["diloco-fp32-nesterov"]["x"]["run_local0"] == pytest.approx(1.0)
    assert ex["paired"] == pytest.approx({0: 0.02, 1: 0.01, 2: 0.04})
    assert ex["val_delta"] == pytest.approx(0.02)
    assert ex["reference"] == "diloco-fp32-nesterov" and ex["paired_same_opt"] == {}
    text = R.table_text(list(rows.values()))
    assert "+0.0400" in text and "100.0x" in text
    # fp32 at momentum 0 tuned below fp32 Nesterov: the reference of every DiLoCo point, and
    # the same-optimiser fp32 of sparseloco-exact
    for lr, v in zip(grid(f64.centre(f64.CONTROL)), (3.5, 3.45, 3.6), strict=True):
        r = rec(f64.CONTROL, lr, 0, v, v + 0.05, 100.0, 100.0)
        done[r["key"]] = r
    rows = {r["config"]: r for r in R.rows(done)}
    ex, nest = rows[f64.EXACT], rows["diloco-fp32-nesterov"]
    assert ex["reference"] == nest["reference"] == f64.CONTROL
    assert ex["paired"] == ex["paired_same_opt"] == pytest.approx({0: 3.57 - 3.50})
    assert ex["val_delta"] == pytest.approx(3.52 - 3.45)
    assert nest["paired"] == pytest.approx({0: 3.55 - 3.50}) and nest["paired_same_opt"] == {}
    assert "(vs fp32-m0)" in R.table_text(list(rows.values()))
