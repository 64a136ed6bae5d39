"""docs/strategies.md's constructor tables are the code's: regenerated, they are the block in
the file (``python -m flwr_isoloco.strategies.diloco.reference docs/strategies.md`` rewrites
it); every argument of every constructor is in them with its default; every argument has a
description in its class's docstring (the few that have none are listed here and can only
shrink); the registries' names (merge rules, codecs, ``"exact"``, robust rules) are there; and
no table of the page has a row cut by a ``|`` inside a cell."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from flwr_isoloco.compression import CODECS, EXACT
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.strategies.diloco import reference
from flwr_isoloco.strategies.diloco.settings import ROBUST_CLASSES

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "strategies.md"

UNDESCRIBED: dict[str, str] = {}
"""Arguments whose class docstring gives no description (their table cell says so). The list
can only shrink: describe the argument in its docstring, then remove it here."""


def test_the_block_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert reference.replace_block(text) == text, (
        "docs/strategies.md: the constructor tables are stale; run "
        "python -m flwr_isoloco.strategies.diloco.reference docs/strategies.md"
    )


def test_a_stale_block_is_caught(tmp_path):
    text = DOC.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `outer_lr`"))
    stale = text.replace(row + "\n", "", 1)
    assert reference.replace_block(stale) != stale
    path = tmp_path / "strategies.md"
    path.write_text(stale, encoding="utf-8")
    assert reference.main(["--check", str(path)]) == 1
    assert reference.main([str(path)]) == 0 and path.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("cls", reference.CONSTRUCTORS, ids=lambda c: c.__name__)
def test_every_argument_is_in_its_table_with_its_default(cls):
    rows = reference.rows(cls)
    listed = {n: (r, i) for r in rows for i, n in enumerate(r.names)}
    for p in inspect.signature(cls).parameters.values():
        name = f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
        assert name in listed, f"{cls.__name__}: no row for {name}"
        row, i = listed[name]
        default = row.defaults[min(i, len(row.defaults) - 1)]
        if p.default is not p.empty and default != "DiLoCo's":
            assert (
                repr(p.default) in default
                or f'"{p.default}"' in default
                or (default == f"`{type(p.default).__name__}()`")
            ), (cls.__name__, name, default, p.default)
    assert f"**`{cls.__name__}(" in reference.render()


def test_every_argument_has_a_description():
    missing = set(reference.undescribed())
    new = sorted(missing - set(UNDESCRIBED))
    assert not new, f"arguments without a description in their class's docstring: {new}"
    described = sorted(set(UNDESCRIBED) - missing)
    assert not described, f"now described: remove from UNDESCRIBED {described}"
    for name in missing:  # shown as missing, never blank
        cls, arg = name.split(".", 1)
        row = next(line for line in reference.render().split(f"**`{cls}(", 1)[1].splitlines()
                   if line.startswith(f"| `{arg}`"))  # fmt: skip
        assert reference.NO_DESCRIPTION in row


def test_a_missing_description_is_reported():
    class Documented:
        """Something.

        Parameters
        ----------
        alpha, beta : float
            Two numbers.
        gamma :
        """

        def __init__(self, *, alpha=1.0, beta=2.0, gamma=None, delta=0):
            pass

    entries = reference.numpydoc_parameters(Documented.__doc__)
    assert entries["alpha"] == entries["beta"] == ("float", "Two numbers.")
    assert entries["gamma"] == ("", "") and "delta" not in entries
    rows = reference.rows(Documented)
    assert [r.names for r in rows] == [("alpha", "beta"), ("gamma",), ("delta",)]
    assert [r.description for r in rows][1:] == ["", ""]
    assert reference.NO_DESCRIPTION in reference.render_class(Documented)


def test_the_prose_docstrings_give_each_field_its_own_text():
    from flwr_isoloco.strategies import CentralDP, Codec, Rounds

    assert reference.prose_description(Rounds, "grace_s").startswith("then wait at most")
    assert reference.prose_description(CentralDP, "noise_multiplier").startswith("`z`: noise")
    assert "downloads only" in reference.prose_description(Codec, "nodes_hold_initial")
    assert reference.prose_description(Codec, "name").startswith("the codec (`int8`")


def test_the_registries_names_are_in_the_tables():
    text = reference.render()
    for name in [*MERGE_RULES, *(c for c in CODECS if c != "none"), EXACT, "max_gain"]:
        assert f"`{name}" in text or f'`"{name}"`' in text, name
    for name in ROBUST_CLASSES:
        assert f'`"{name}"`' in text, name
    assert "int4" in text and "sparseloco" in text and "iso_c_matched" in text


def _cells(line: str) -> list[str]:
    return re.split(r"(?<!\\)\|", line.strip().strip("|"))


def test_no_table_row_is_cut_by_a_pipe():
    lines = DOC.read_text(encoding="utf-8").splitlines()
    bad = []
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.match(r"^\|\s*:?-{2,}", lines[i + 1])):
            continue
        width = len(_cells(line))
        j = i + 2
        while j < len(lines) and lines[j].startswith("|"):
            if len(_cells(lines[j])) != width:
                bad.append(
                    f"docs/strategies.md:{j + 1}: {len(_cells(lines[j]))} cells, not {width}"
                )
            j += 1
    assert not bad, "\n".join(bad)
