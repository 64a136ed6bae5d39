"""benchmarks/lm/lm_sweep.py (issue 11): protocol, tuning-grid logic, resumability, determinism
(the horizon protocol's pure tests are in tests/test_lm_horizon.py).

The pure tests run in milliseconds; ``test_quick_sweep_*`` does three real ``--quick`` Flower
simulations (Ray) and a dozen tiny dp-adamw loops (~60 s on 2 cores), so it is marked slow.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lm"))

import lm_sweep  # noqa: E402
import lm_sweep_lib as lib  # noqa: E402

from flwr_isoloco.data.corpora import three_way_split  # noqa: E402


def _rec(method, lr, mu, val, workers=8, quick=False):
    return {
        "method": method,
        "workers": workers,
        "protocol": "main",
        "quick": quick,
        "seed": 0,
        "outer_lr": lr,
        "outer_momentum": mu,
        "val_loss": val,
    }


def test_three_way_split_is_disjoint_interleaved_and_complete():
    docs = ["".join(f"doc {d} line {i}\n" for i in range(4)) for d in range(50)]  # unique lines
    train, val, test = three_way_split(docs, chunk_chars=40, period=5)
    assert len(train) + len(val) + len(test) == len("\n".join(docs))
    assert len(val) > 0 and len(test) > 0 and len(train) > len(val) + len(test)
    # held-out text comes from the start, middle and end of the corpus, not one block
    held = {int(line.split()[1]) for line in (val + test).splitlines() if line}
    assert min(held) < 10 and max(held) >= 40 and held & set(range(20, 30))
    tr, va, te = (set(x.splitlines()) - {""} for x in (train, val, test))
    assert not (tr & va or tr & te or va & te)  # chunks are cut at line breaks: no line shared


@pytest.mark.parametrize("workers", [1, 8, 128])
def test_every_m_trains_on_the_same_rows_once(workers):
    size = {"rounds": 3, "inner_steps": 2, "global_batch": 128}
    n = lib.num_rows(size)
    rows = np.arange(n * 3, dtype=np.int32).reshape(n, 3)  # row id in column 0 (times 3)
    per = 128 // workers
    seen = [
        int(lib.worker_batch(rows, m, workers, s, per)[i, 0]) // 3
        for m in range(workers)
        for s in range(6)
        for i in range(per)
    ]
    assert sorted(seen) == list(range(n))  # every row exactly once, whatever M
    with pytest.raises(IndexError):
        lib.worker_batch(rows, workers - 1, workers, 6, per)  # past the worker's slice


def test_tuned_hp_falls_back_to_documented_defaults_then_reads_the_grid():
    hp = lm_sweep.tuned_hp("isoloco", 8, [], quick=False)
    assert (hp["outer_lr"], hp["outer_momentum"], hp["tuned"], hp["hp_source"]) == (
        1.8,
        0.8,
        False,
        "default",
    )
    assert lm_sweep.tuned_hp("fedavg", 32, [], False)["outer_lr"] == 1.0
    grid = [
        _rec("isoloco", 1.3, 0.8, 4.0),
        _rec("isoloco", 1.8, 0.8, 3.9),
        _rec("isoloco", 2.5, 0.8, 3.95),
        _rec("isoloco", 1.8, 0.9, 3.91),
        _rec("isoloco", 0.9, 0.8, 3.0, quick=True),
    ]
    hp = lm_sweep.tuned_hp("isoloco", 16, grid, quick=False)
    assert (hp["outer_lr"], hp["outer_momentum"], hp["hp_source"], hp["tuned_on_edge"]) == (
        1.8,
        0.8,
        "tuned-M8",
        None,
    )
    grid.append(_rec("isoloco", 1.27, 0.8, 3.5, workers=64))
    assert lm_sweep.tuned_hp("isoloco", 32, grid, False)["hp_source"] == "tuned-M64"
    assert (
        lm_sweep.tuned_hp("isoloco", 16, grid, False)["outer_lr"] == 1.8
    )  # M <= 16: the M = 8 optimum


def test_grid_extends_until_the_optimum_is_interior():
    # loss falls with lr: the optimum sits on the high edge, so the grid grows by sqrt(2)
    recs = [_rec("diloco", lr, 0.9, 5.0 - lr) for lr in (0.25, 0.35, 0.5, 0.7, 1.0)]
    assert lm_sweep.extension(recs) == (1.41, 0.9)
    recs.append(_rec("diloco", 1.41, 0.9, 4.5))  # now 1.0 is best and interior
    assert lm_sweep.extension(recs) is None
    low = [_rec("x", lr, 0.0, lr) for lr in (0.7, 1.0, 1.4, 2.0)]
    assert lm_sweep.extension(low) == (0.495, 0.0)
    # DiLoCo's grid holds FedAvg (lr 1, mu 0) and >= 5 lrs x 2 momenta
    pts = lm_sweep.initial_grid("diloco", 8, [], False)
    assert (
        (1.0, 0.0) in pts
        and len({p[0] for p in pts}) >= 5
        and len({p[1] for p in pts if p[1]}) == 2
    )
    m64 = lm_sweep.initial_grid("isoloco", 64, [_rec("isoloco", 1.8, 0.8, 3.9)], False)
    assert m64 == [(1.27, 0.8), (1.8, 0.8), (2.55, 0.8)]


def test_budget_larger_than_the_corpus_is_refused():
    size = {**lib.SIZES["main"], "rounds": 10_000}
    with pytest.raises(ValueError, match="repeat data"):
        lib.run_rows(size, 0)


@pytest.mark.slow
def test_quick_sweep_records_resumes_and_repeats(tmp_path):
    a, b, t = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "tuning.json"
    common = [
        "--quick",
        "--workers",
        "4",
        "--seeds",
        "0",
        "--tuning-file",
        str(t),
        "--num-cpus",
        "2",
    ]
    lm_sweep.main([*common, "--methods", "isoloco", "dp-adamw", "--out", str(a)])
    recs = json.loads(a.read_text())
    assert [r["method"] for r in recs] == ["isoloco", "dp-adamw"]
    for r in recs:
        for k in (
            "method",
            "protocol",
            "workers",
            "seed",
            "outer_lr",
            "outer_momentum",
            "inner_steps",
            "rounds",
            "tokens",
            "val_loss",
            "test_loss",
            "wall_s",
        ):
            assert k in r, k
        assert r["protocol"] == "main" and r["workers"] == 4 and r["tokens"] == 2 * 2 * 128 * 16
        assert math.isfinite(r["test_loss"]) and r["test_loss"] < math.log(1024)  # learnt something
        assert len(r["val_curve"]) == r["rounds"]
    iso = recs[0]
    assert (iso["outer_lr"], iso["outer_momentum"], iso["tuned"], iso["flower"]) == (
        1.8,
        0.8,
        False,
        True,
    )
    lm_sweep.main([*common, "--methods", "isoloco", "dp-adamw", "--out", str(a)])
    assert len(json.loads(a.read_text())) == 2  # both cells were already there: skipped
    # same cell again from scratch, models rebuilt per message: same losses (spec: to 1e-3)
    lm_sweep.main([*common, "--methods", "isoloco", "--out", str(b), "--no-model-cache"])
    again = json.loads(b.read_text())[0]
    assert abs(again["val_loss"] - iso["val_loss"]) < 1e-5
    assert abs(again["test_loss"] - iso["test_loss"]) < 1e-5
    assert again["model_cache"] is False and iso["model_cache"] is True
    # --protocol horizon --quick: the dp-adamw peak-lr grid at M = 8 (in process), then cells
    h, ht = tmp_path / "h.json", tmp_path / "ht.json"
    hq = ["--protocol", "horizon", "--quick", "--horizon", "4", "--tuning-file", str(ht)]
    lm_sweep.main([*hq, "--tune", "--methods", "dp-adamw", "fedavg", "--out", str(h)])
    grid = json.loads(ht.read_text())
    assert [r["inner_lr"] for r in grid][:4] == [1.5e-3, 7.5e-4, 3e-3, 6e-3]  # centre first
    assert all(r["workers"] == 8 and r["horizon"] == 4 and r["grid"] for r in grid)
    best = min(grid, key=lambda r: r["val_loss"])["inner_lr"]
    cells = [*hq, "--methods", "isoloco", "dp-adamw", "--workers", "4", "--num-cpus", "2"]
    lm_sweep.main([*cells, "--out", str(h)])
    iso_h, dp_h = json.loads(h.read_text())
    for r in (iso_h, dp_h):
        assert (r["protocol"], r["horizon"], r["rounds"], r["corpora"]) == (
            "horizon",
            4,
            2,
            ["shakespeare"],
        )
    # T = 4 at the default inner lr is the main --quick cell: the same computation, same loss
    assert iso_h["inner_lr"] == 3e-3 and abs(iso_h["val_loss"] - iso["val_loss"]) < 1e-5
    assert dp_h["inner_lr"] == best and dp_h["inner_lr_source"] == "tuned-T4-M8"
    lm_sweep.main([*cells, "--out", str(h)])
    assert len(json.loads(h.read_text())) == 2  # resumed: nothing ran again


def test_identical_runs_are_recognised_across_method_names():
    assert set(lm_sweep.same_run_methods("fedavg", 0.0)) == {"fedavg", "diloco", "diloco-sgd"}
    assert set(lm_sweep.same_run_methods("iso_c-sgd", 0.0)) == {"iso_c-sgd", "isoloco"}
    assert lm_sweep.same_run_methods("diloco", 0.9) == ["diloco"]  # Nesterov on: a different run
    assert lm_sweep.same_run_methods("dp-adamw", None) == ["dp-adamw"]


def test_secondary_protocols_keep_the_token_budget():
    main = lib.protocol_size("main", 8)
    n = lib.num_rows(main)
    for m, rounds in ((4, 80), (16, 20), (64, 5)):  # per-worker-batch: 8 sequences per worker
        s = lib.protocol_size("per-worker-batch", m)
        assert (s["global_batch"], s["rounds"], lib.num_rows(s)) == (8 * m, rounds, n)
    with pytest.raises(ValueError):
        lib.protocol_size("per-worker-batch", 128)  # 25,600 sequences make no whole rounds
    assert [lib.protocol_size("h-sweep", 8, inner_steps=h)["rounds"] for h in (10, 30, 100)] == [
        20,
        7,
        2,
    ]
    with pytest.raises(ValueError):
        lib.protocol_size("main", 8, inner_steps=30)
    with pytest.raises(ValueError):
        lib.protocol_size("main", 3)  # 128 is not divisible by 3
    big = sum(
        p.numel() for p in lib.build_model(lib.protocol_size("large-model", 8), 0).parameters()
    )
    small = sum(p.numel() for p in lib.build_model(main, 0).parameters())
    assert small == 529_056 and 3.5 < big / small < 4.5


def test_iso_c_no_embed_leaves_embedding_and_head_to_the_mean():
    strat = lib.make_strategy("isoloco", 8, 1.8, 0.8, 0, protocol="iso_c-no-embed")
    assert strat.merge_name == "iso_c" and strat.merge_options == {"spectral_pattern": r"layers\."}
    assert lib.make_strategy("isoloco", 8, 1.8, 0.8, 0).merge_options == {}
    with pytest.raises(ValueError):
        lib.make_strategy("diloco", 8, 0.7, 0.9, 0, protocol="iso_c-no-embed")


def test_report_tables_mark_the_optimum_and_average_seeds():
    import lm_sweep_report as rep

    grid = [
        _rec("isoloco", lr, mu, v)
        for lr, mu, v in ((1.3, 0.8, 3.9), (1.8, 0.8, 3.8), (1.8, 0.9, 3.85))
    ]
    table = rep.tuning_table(grid)
    assert "| 0.8 | 3.9000 | 3.8000* |" in table and "| 0.9 |  | 3.8500 |" in table
    cells = [
        {
            **_rec("diloco", 0.5, 0.9, 4.0 + s),
            "seed": s,
            "test_loss": 4.0 + 0.1 * s,
            "hp_source": "tuned-M8",
        }
        for s in range(3)
    ]
    row = rep.main_table(cells, "main").splitlines()[-1]
    assert row.startswith("| diloco | 8 | 3 | 4.1000 | 0.1000 | 5.0000 |")


def test_report_gap_is_paired_by_seed_and_cells_use_todays_tuned_values(tmp_path):
    import lm_sweep_report as rep

    tuning = [_rec("isoloco", lr, 0.8, v) for lr, v in ((1.3, 3.9), (1.8, 3.8), (2.5, 3.85))]
    tuning += [_rec("diloco", lr, 0.8, v) for lr, v in ((0.35, 4.7), (0.5, 4.6), (0.7, 4.65))]
    cells = []
    for s in range(3):
        cells.append({**_rec("isoloco", 1.8, 0.8, 0.0), "seed": s, "test_loss": 4.0 + 0.01 * s})
        cells.append({**_rec("diloco", 0.5, 0.8, 0.0), "seed": s, "test_loss": 4.5 + 0.02 * s})
    cells.append({**_rec("diloco", 0.25, 0.8, 0.0), "seed": 0, "test_loss": 9.0})  # stale hp
    cells.append({**_rec("isoloco", 1.8, 0.8, 0.0), "seed": 5, "test_loss": 1.0})  # unpaired
    cur = rep.current_cells(cells, tuning)
    assert all(r["test_loss"] != 9.0 for r in cur) and len(cur) == 7
    row = rep.gap_table(cur).splitlines()[-1]
    # seeds 0, 1, 2 only: differences 0.50, 0.51, 0.52
    assert row.startswith("| 8 | 3 | +0.5100 | 0.0100 | s0: +0.5000, s1: +0.5100, s2: +0.5200")
    block = rep.report(cur + [{**cells[0], "workers": 1}], tuning, tmp_path, "img")
    assert block.startswith(rep.BEGIN) and block.endswith(rep.END)
    assert {p.name for p in tmp_path.iterdir()} == {
        "lm_sweep_loss_vs_m.png",
        "lm_sweep_gap.png",
        "lm_sweep_tuning.png",
    }
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{rep.BEGIN}\nold\n{rep.END}\ntail\n")
    rep.write_docs(doc, block)
    assert doc.read_text() == f"head\n{block}\ntail\n"


def test_report_ranks_merge_rules_and_sets_protocols_beside_their_main_cell():
    import lm_sweep_report as rep

    tuning = [_rec("isoloco", lr, 0.8, v) for lr, v in ((1.3, 3.9), (1.8, 3.8), (2.5, 3.85))]
    main = [{**_rec("isoloco", 1.8, 0.8, 3.8), "seed": 0, "test_loss": 3.9}]
    main.append({**_rec("ties", 0.7, 0.0, 4.4), "seed": 0, "test_loss": 4.5})
    main.append({**_rec("ties", 0.7, 0.0, 4.5), "seed": 1, "test_loss": 4.7})
    rows = rep.ranked_table(main, (8,)).splitlines()[2:]
    assert rows[0].startswith("| 8 | IsoLoCo (Iso-C + Nesterov) | 1.8 / 0.8 | 1 | 3.9000 | - |")
    assert rows[1].startswith("| 8 | TIES | 0.7 / 0 | 2 | 4.6000 | 0.1414 | 4.4500 |")
    h30 = {**main[0], "protocol": "h-sweep", "inner_steps": 30, "rounds": 7, "test_loss": 3.7}
    stale = {**h30, "outer_lr": 2.5, "test_loss": 1.0}  # not today's tuned value: left out
    table = rep.protocols_table([main[0], h30, stale], tuning)
    assert table.splitlines()[2:] == [
        "| h-sweep | 8 | 30 | 7 | IsoLoCo (Iso-C + Nesterov) | 0 | 3.7000 | 3.9000 | -0.2000 |"
    ]
    ref = rep.with_tuned_reference(
        [{**main[0], "method": "dp-adamw"}],
        [
            {**main[0], "method": "dp-adamw", "inner_lr": lr, "val_loss": v}
            for lr, v in ((1.5e-3, 4.3), (3e-3, 4.4))
        ],
    )
    assert [(r["inner_lr"], r["outer_lr"]) for r in ref] == [(1.5e-3, None)]
    assert "- (peak lr 0.0015)" in rep.ranked_table(ref, (8,))


def test_old_records_keep_their_cell_key_so_the_issue_11_sweep_resumes():
    for name in ("lm_sweep.json", "lm_tuning.json"):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / name
        for rec in json.loads(path.read_text()):
            if rec["protocol"] == "horizon":
                continue
            size = lib.protocol_size(
                rec["protocol"],
                rec["workers"],
                rec["quick"],
                rec["inner_steps"] if rec["protocol"] == "h-sweep" else None,
            )
            key = (
                rec["method"],
                rec["protocol"],
                rec["workers"],
                rec["seed"],
                rec["outer_lr"],
                rec["outer_momentum"],
                size["inner_steps"],
                size["rounds"],
                rec["quick"],
                size["inner_lr"],
                tuple(size.get("corpora") or lib.DATA["corpora"]),
            )
            assert lm_sweep.cell_key(rec) == key  # what ensure_cell looks up for this cell
