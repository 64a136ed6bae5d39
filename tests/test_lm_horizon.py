"""benchmarks/lm/lm_sweep.py --protocol horizon (issue 21): sizing, the no-repeat budget, how cells
take their tuned outer and inner lrs, the grids (extension, momentum probe, the narrower grid of
the longest horizon) and the report. All pure: no run is started."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lm"))

import lm_sweep_horizon as hz  # noqa: E402
import lm_sweep_horizon_report as hrep  # noqa: E402
import lm_sweep_lib as lib  # noqa: E402


def test_horizon_sizing_takes_t_steps_the_combined_corpus_and_an_inner_lr():
    s = lib.protocol_size("horizon", 8, horizon=600, inner_lr=1.5e-3)
    assert (s["rounds"], s["inner_steps"], s["global_batch"], s["inner_lr"]) == (
        60,
        10,
        128,
        1.5e-3,
    )
    assert s["corpora"] == ["shakespeare", "wiki", "bbc", "sotu"] and lib.num_rows(s) == 76_800
    assert lib.protocol_size("horizon", 8, horizon=200)["inner_lr"] == 3e-3  # the main value
    assert lib.protocol_size("horizon", 4, quick=True, horizon=4)["corpora"] == ["shakespeare"]
    for bad in ({"horizon": 605}, {"horizon": None}, {"horizon": 200, "inner_lr": -1.0}):
        with pytest.raises(ValueError):
            lib.protocol_size("horizon", 8, **bad)
    with pytest.raises(ValueError):
        lib.protocol_size("main", 8, horizon=600)  # main keeps its 200 steps
    main = lib.protocol_size("main", 8)
    assert "corpora" not in main and lib.DATA["corpora"] == ("shakespeare",)  # pinned


def test_max_horizon_is_the_longest_run_that_repeats_no_row():
    # brute force over small cases: T G rows of seq_len + 1 tokens must fit, T a multiple of H
    for tokens in (0, 64, 5_000, 12_345):
        for seq, g, h in ((3, 4, 2), (7, 2, 5)):
            fits = [t for t in range(0, 2_000, h) if t * g * (seq + 1) <= tokens]
            assert lib.max_horizon(tokens, seq, g, h) == max(fits)
    # the combined corpus (docs/results-lm.md): 8,994,242 training tokens = 138,372 rows of 65
    assert 8_994_242 // 65 == 138_372
    assert lib.max_horizon(8_994_242, 64, 128, 10) == 1080 == max(lib.HORIZONS)
    assert 1200 * 128 > 138_372 >= 1080 * 128  # 1,200 steps would repeat 15,228 rows


def _hrec(method, lr, mu, val, inner=3e-3, horizon=600, **kw):
    """A seed-0 M = 8 horizon tuning record."""
    return {
        "method": method,
        "workers": 8,
        "quick": False,
        "seed": 0,
        "outer_lr": lr,
        "outer_momentum": mu,
        "val_loss": val,
        "protocol": "horizon",
        "horizon": horizon,
        "inner_lr": inner,
        **kw,
    }


def test_horizon_cells_take_the_optimum_at_their_inner_lr_tuned_at_600_steps():
    tun = [_hrec("isoloco", lr, 0.8, v) for lr, v in ((1.27, 3.9), (1.8, 3.8), (2.55, 3.85))]
    hp = hz.cell_hp(tun, "isoloco", 600, False)
    assert (hp["outer_lr"], hp["inner_lr"], hp["inner_lr_source"], hp["tuned_on_edge"]) == (
        1.8,
        3e-3,
        "default",
        None,
    )
    assert hz.cell_hp(tun, "isoloco", 200, False)["hp_source"] == "default"  # T = 200 untuned
    one = hz.cell_hp([_hrec("isoloco", 1.8, 0.8, 3.8, horizon=200)], "isoloco", 200, False)
    assert (one["outer_lr"], one["tuned"], one["hp_source"]) == (1.8, False, "grid-centre-T200")
    # the inner grid at the anchor (1.8, 0.8): 6e-3 wins, so cells use it and the outer
    # optimum is taken among the records at 6e-3 only
    tun += [_hrec("isoloco", 1.8, 0.8, v, inner=i) for i, v in ((1.5e-3, 3.9), (6e-3, 3.7))]
    assert hz.anchor(tun, "isoloco", False) == (1.8, 0.8)
    lr, src, side = hz.inner_lr(tun, "isoloco", 200, False)
    assert (lr, src, side) == (6e-3, "tuned-T600-M8", "high")
    assert hz.next_inner_lr([1.5e-3, 3e-3, 6e-3], 6e-3) == 0.012
    tun.append(_hrec("isoloco", 2.55, 0.8, 3.6, inner=6e-3))
    hp = hz.cell_hp(tun, "isoloco", 600, False)
    assert (hp["outer_lr"], hp["inner_lr"], hp["tuned_on_edge"]) == (2.55, 6e-3, "high")
    # fedavg: fixed outer point, inner lr tuned; dp-adamw: its own peak lr at each T
    fed = [_hrec("fedavg", 1.0, 0.0, v, inner=i) for i, v in ((1.5e-3, 4.5), (3e-3, 4.4))]
    assert hz.cell_hp(fed, "fedavg", 1080, False)["inner_lr"] == 3e-3
    dp = [
        _hrec("dp-adamw", None, None, v, inner=i, horizon=200)
        for i, v in ((1e-3, 4.4), (2e-3, 4.3), (4e-3, 4.35))
    ]
    hp = hz.cell_hp(dp, "dp-adamw", 200, False)
    assert (hp["outer_lr"], hp["inner_lr"], hp["inner_lr_on_edge"]) == (None, 2e-3, None)
    assert hz.cell_hp(dp, "dp-adamw", 600, False)["inner_lr_source"] == "default"


def test_horizon_grid_extends_past_its_edge_and_probes_the_momentum():
    recs = [_hrec("diloco", lr, 0.8, 5.0 - lr) for lr in hz.GRIDS["diloco"][0]]
    assert hz.next_outer_point(recs) == (0.707, 0.8)  # best at the high edge: one sqrt(2) out
    recs.append(_hrec("diloco", 0.707, 0.8, 4.9))
    assert hz.next_outer_point(recs) is None  # 0.5 is interior now
    recs.append(_hrec("diloco", 0.5, 0.9, 4.0))  # the momentum probe wins: explore around it
    assert hz.next_outer_point(recs) == (0.354, 0.9)
    assert hz.edge([1.0], 1.0) is None and hz.edge([1.0, 2.0], 1.0) == "low"


def test_horizon_report_pairs_seeds_and_marks_pending_cells(tmp_path):
    tuning = [
        _hrec("isoloco", lr, 0.8, v, horizon=200)
        for lr, v in ((1.27, 4.0), (1.8, 3.9), (2.55, 3.95))
    ]
    tuning += [
        _hrec("diloco", lr, 0.8, v, horizon=200)
        for lr, v in ((0.177, 4.7), (0.25, 4.6), (0.354, 4.65))
    ]
    for r in tuning:
        r["test_loss"] = r["val_loss"] + 0.05
    cells = [
        {**_hrec(m, lr, 0.8, 0.0, horizon=200), "seed": s, "test_loss": base + 0.01 * s}
        for m, lr, base in (("isoloco", 1.8, 3.9), ("diloco", 0.25, 4.5))
        for s in (1, 2)
    ]
    cells.append({**_hrec("diloco", 0.5, 0.8, 0.0, horizon=200), "seed": 1, "test_loss": 9.0})
    cur = hrep.current(cells, tuning)
    # seed 0 from the grid's optimum, seeds 1-2 from the cells file; the stale lr 0.5 is out
    assert sorted(k for k in cur if k[0] == "diloco") == [("diloco", 200, 8, s) for s in (0, 1, 2)]
    assert cur[("diloco", 200, 8, 1)]["test_loss"] == 4.51
    assert [round(x, 6) for _, x in hrep.pair(cur, "diloco", "isoloco", 200, 8)] == [0.7, 0.6, 0.6]
    gap = hrep.gap_table(cur)
    assert "| 8 | 200 | +0.6333 (sd 0.0577; 3/3 seeds: s0: +0.700, s1: +0.600, s2: +0.600)" in gap
    assert "| 1 | 200 | pending | pending | pending |" in gap
    table = hrep.loss_table(cur)
    assert (
        "| 200 | 8 | isoloco | 3/3 | 3.9267 |" in table
        and "| 200 | 8 | pending (0/3) | 4.5600 (3/3) | 3.9267 (3/3) | pending (0/3) |" in table
        and "| 600 | 32 | pending (0/2) |" in table
    )
    block = hrep.report(cells, tuning, tmp_path, "img")
    assert block.startswith(hrep.BEGIN) and (tmp_path / "lm_horizon_gap.png").is_file()
    assert "6 of 105 planned" in block and "isoloco, T = 200, M = 8" in block


def _fake_tuner(tuning, loss):
    """ensure_cell / load_records stand-ins: each run appends a seed-0 M = 8 record whose
    validation loss is ``loss(outer_lr, mu, inner_lr)``; returns (ensure_cell, load, runs)."""
    runs = []

    def ensure_cell(method, workers, seed, hp, args, path, protocol, horizon, grid=False):
        lr, mu, lr_in = hp["outer_lr"], hp["outer_momentum"], hp["inner_lr"]
        runs.append((lr, mu, lr_in))
        tuning.append(_hrec(method, lr, mu, loss(lr, mu, lr_in), inner=lr_in, horizon=horizon))

    return ensure_cell, (lambda path: tuning), runs


def test_longest_horizon_grid_is_three_lrs_around_the_shorter_optimum_and_skips_a_lost_probe():
    args = types.SimpleNamespace(tuning_file="t.json", quick=False, grid_points=None)
    # T = 600: IsoLoCo's grid, optimum 1.8 at 0.8 and the probe at 0.9 lost; T = 200 likewise
    tun = []
    for t in (200, 600):
        tun += [
            _hrec("isoloco", lr, 0.8, 4.0 + abs(lr - 1.8), horizon=t) for lr in (1.27, 1.8, 2.55)
        ]
        tun.append(_hrec("isoloco", 1.8, 0.9, 4.5, horizon=t))
    assert hz.initial_grid(tun, "isoloco", 1080, 3e-3, False) == [1.8, 1.27, 2.55]
    assert hz.initial_grid(tun, "isoloco", 600, 3e-3, False) == hz.centre_out("isoloco")
    assert hz.probe_lost_before(tun, "isoloco", 1080, 3e-3, False)
    assert not hz.probe_lost_before(tun, "isoloco", 600, 3e-3, False)  # 600 keeps the full rule
    # at T = 1080 the optimum moved up to 3.6: the grid extends past 2.55 until it is inside
    ensure, load, runs = _fake_tuner(tun, lambda lr, mu, i: 3.0 + abs(lr - 3.6))
    hz.tune_outer("isoloco", 1080, args, ensure, load)
    assert runs == [
        (1.8, 0.8, 3e-3),
        (1.27, 0.8, 3e-3),
        (2.55, 0.8, 3e-3),
        (3.61, 0.8, 3e-3),
        (5.11, 0.8, 3e-3),
    ]  # no probe at 0.9: it lost at 200 and 600
    assert hz.cell_hp(tun, "isoloco", 1080, False)["outer_lr"] == 3.61
    # a probe that won once is run again at the longer T
    tun2 = [r for r in tun if r["horizon"] < 1080]
    tun2[-1] = {**tun2[-1], "val_loss": 3.0}  # T = 600's probe now beats its grid
    assert not hz.probe_lost_before(tun2, "isoloco", 1080, 3e-3, False)
    ensure, load, runs = _fake_tuner(tun2, lambda lr, mu, i: 3.0 + abs(lr - 1.8) + mu)
    hz.tune_outer("isoloco", 1080, args, ensure, load)
    assert runs[-1] == (1.8, 0.9, 3e-3) and len(runs) == 4
    # dp-adamw: its peak lr, a factor 2 either side of the T = 600 optimum
    dp = [_hrec("dp-adamw", None, None, v, inner=i) for i, v in ((7.5e-4, 3.8), (1.5e-3, 3.5))]
    dp.append(_hrec("dp-adamw", None, None, 3.6, inner=3e-3))
    assert hz.initial_grid(dp, "dp-adamw", 1080, 1.5e-3, False) == [1.5e-3, 7.5e-4, 3e-3]
    ensure, load, runs = _fake_tuner(dp, lambda lr, mu, i: 3.0 + abs(i - 1.5e-3))
    hz.tune_outer("dp-adamw", 1080, args, ensure, load)
    assert runs == [(None, None, 1.5e-3), (None, None, 7.5e-4), (None, None, 3e-3)]
