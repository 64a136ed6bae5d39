"""DiLoCo()'s outer-step grid on the drop-in tables (benchmarks/dropin/diloco_defaults.py): the
docs block is what the record gives, the record's derived fields are what its cells give, and
the choice is made on the validation split alone. Reads the record; runs no federation."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "dropin"))
import diloco_defaults as dd  # noqa: E402


@pytest.fixture(scope="module")
def saved() -> dict:
    return json.loads(dd.OUT.read_text())


def test_the_docs_block_is_what_the_record_gives(saved, tmp_path):
    """docs/strategies.md's diloco_defaults block is ``diloco_defaults.py --docs`` of
    benchmarks/results/diloco_defaults.json (regenerated into a copy: no change)."""
    doc = tmp_path / "strategies.md"
    doc.write_text(dd.DOCS.read_text())
    dd.write_docs(saved, doc)
    assert doc.read_text() == dd.DOCS.read_text()


def test_every_cell_has_every_strategy_and_seed(saved):
    seeds = {str(s) for s in saved["config"]["seeds"]}
    assert seeds == {"0", "1", "2"}
    for split in dd.SPLITS:
        for key, (_, parts, _) in dd.TABLES.items():
            for part in parts:
                cells = saved[split][key][part]
                assert set(cells) == set(dd.GRID), (split, key, part)
                for name, by_seed in cells.items():
                    assert set(by_seed) == seeds, (split, key, part, name)
                    assert all(0.0 <= v <= 1.0 for v in by_seed.values())


def test_the_derived_fields_are_what_the_cells_give(saved):
    again = {s: saved[s] for s in dd.SPLITS}
    again[dd.MORE] = {s: saved[dd.MORE][s] for s in dd.SPLITS}
    dd.finish(again[dd.MORE])
    dd.finish(again)
    fields = ("stats", "summary", "choice", "choice_with_fedavg_step")
    for field in (*fields, "pooled_summary", "pooled_choice"):
        assert again[field] == saved[field], field
    for field in fields:
        assert again[dd.MORE][field] == saved[dd.MORE][field], (dd.MORE, field)
    assert saved[dd.MORE]["seeds"] == [3, 4, 5]


def test_the_choice_ignores_the_test_split(saved):
    """Reversing every test accuracy changes no part of the choice."""
    flipped = copy.deepcopy({s: saved[s] for s in dd.SPLITS})
    for _, _, cells in dd._cells(flipped["test"]):
        for by_seed in cells.values():
            for seed in by_seed:
                by_seed[seed] = 1.0 - by_seed[seed]
    dd.finish(flipped)
    assert flipped["choice"] == saved["choice"]
    assert flipped["summary"]["validation"] == saved["summary"]["validation"]
    assert all(n != "FedAvg" and dd.GRID[n][2] > 0 for n in (saved["choice"],))


def test_the_grid_is_the_settings_it_names(saved):
    """Each DiLoCo candidate builds with the outer lr / momentum its record entry names
    (Nesterov as DiLoCo's default), and the record names the same grid."""
    for name, (factory, lr, mu, _) in dd.GRID.items():
        assert saved["config"]["grid"][name] == {"outer_lr": lr, "outer_momentum": mu}
        if name == "FedAvg":
            continue
        outer = factory().outer
        assert (outer.lr, outer.momentum, outer.nesterov) == (lr, mu, mu > 0), name


def test_the_validation_splits_leave_the_test_rows_alone():
    """The label-skew apps' validation split: the breast-cancer app holds out 107 of its 426
    training rows (the nodes train on the other 319), and the digits app's label-skew shardings
    cut the validation split's 1149 training images (the patched partitioner takes the app's
    ``split`` argument)."""
    import label_skew
    from sklearn.datasets import load_breast_cancer

    x_tr, x_te, y_tr, _ = label_skew.cancer_data("test")
    v_tr, v_ev, w_tr, w_ev = label_skew.cancer_data("validation")
    assert (len(v_tr), len(v_ev), len(x_tr), len(x_te)) == (319, 107, 426, 143)
    assert int(w_tr.sum() + w_ev.sum()) == int(y_tr.sum())  # the same training rows, re-cut
    _, y = load_breast_cancer(return_X_y=True)
    assert abs(float(w_ev.float().mean()) - float(y.mean())) < 0.02  # stratified

    label_skew._patch_digits()
    import digits.task as task

    for kind in ("sorted", "dir0.1"):
        parts = task.partition_indices(4, kind, 0.5, 0, "validation")
        flat = sorted(i for p in parts for i in p)
        n = len(task._split("validation")[2])
        assert n == 1149 and flat == list(range(n)), kind
        assert task.partition_indices(4, kind, 0.5, 0, "test") != parts
