"""Every number in a README.md / docs/*.md table has a record behind it (benchmarks/results/*).

A table's numbers are looked up in the records its section names: from the heading above the
table to the next heading, every ``benchmarks/results/<file>`` or bare ``<file>.json`` that
exists, and every ``benchmarks/<study>/<script>.py`` whose records start with the script's name
(``merging/merge_bench.py`` -> ``merge_bench.json``). A measurement table whose section names no record
fails. A printed number matches a recorded one when it equals it rounded to the printed digits
(``0.842`` matches 0.8416666). Left out, each for a stated reason:

- tables between the markers of a report script (``<!-- BEGIN X -->`` / ``<!-- x:begin -->``):
  the script writes them from the records, and its own tests check it;
- ``DEFINITIONS``: tables whose numbers are settings, constants or formulas, not measurements;
- ``SKIPPED_HEADER``: columns computed from other cells of the same row (ratios, shares) and
  prose columns, by header;
- ``NO_RECORD``: the few measured tables that have no record yet, each with its reason; the
  list can only shrink (an entry whose table now matches its records, or is gone, fails).

Also: the blocks ``benchmarks/docs/docs_claims.py`` writes into README.md and docs/results-lm.md are
what their records give, and the IsoLoCo preset tables say what ``ISOLOCO_PRESETS`` holds.
"""

from __future__ import annotations

import ast
import bisect
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

NUMBER = re.compile(r"(?<![\w.^])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w^])", re.I)
"""A number as printed: optional sign, thousands commas, decimals, exponent. Not part of a
name (``M8``, ``t1``, ``2^16``'s exponent, ``fp32``), not a digit inside a word."""

GENERATED = re.compile(
    r"<!--\s*(?:BEGIN\s+[^>]*?|[\w-]+:begin|docs_claims:[\w-]+:begin[^>]*?)\s*-->"
)
GENERATED_END = re.compile(r"<!--\s*(?:END\s+[^>]*?|[\w-]+:end|docs_claims:[\w-]+:end)\s*-->")

# (file, heading, first header cell) -> why its numbers are not measurements.
DEFINITIONS: dict[tuple[str, str, str], str] = {
    (
        "algorithms.md",
        "3. IsoLoCo (Horoi, Therien, Wolf, Belilovsky 2026, arXiv 2607.03011)",
        "method",
    ): "the paper's published hyperparameters",
    (
        "algorithms.md",
        "3.1 Presets, and when the outer step is stable",
        "preset",
    ): "the presets' settings (checked against ISOLOCO_PRESETS below)",
    (
        "compression.md",
        "Codecs (`flwr_isoloco.compression`)",
        "codec",
    ): "codec formats: error bounds and byte formulas",
    ("compression.md", "Arguments and run-config keys", "key"): "config keys and defaults",
    ("deployment.md", "5. Start a SuperNode (each institution)", "key"): "config keys",
    ("merging.md", "API", "rule"): "rule options and their defaults",
    ("merging.md", "Iso-C fast mode (`iso_c_ns`)", "step"): "Newton-Schulz coefficients",
    ("privacy.md", "Secure aggregation (SecAgg+)", "option"): "options",
    (
        "results-lm.md",
        "Horizon study: the claims at 3x and 5.4x the steps",
        "step",
    ): "the study's plan: run counts and CPU-hour estimates made before it ran",
    (
        "results-rwlora.md",
        "Plan and measured cost",
        "cells",
    ): "the sweep's plan: run counts and estimates made before it ran",
    (
        "results-rwlora.md",
        "Label skew: variants of the walk",
        "variant",
    ): "byte formulas of each variant",
    ("rwlora.md", "Graphs", "spec"): "graph specs",
    ("rwlora.md", "Transitions", "graph"): "transition probabilities, computed exactly",
    ("strategies.md", "Constructor arguments (keyword-only)", "argument"): "defaults",
    (
        "strategies.md",
        "Defaults: what they are for and when to tune",
        "preset",
    ): "the presets' settings (checked against ISOLOCO_PRESETS below)",
    (
        "strategies.md",
        "Run-config keys: `DiLoCo.from_run_config(context.run_config)`",
        "key",
    ): "defaults",
    (
        "strategies.md",
        "What is rejected (the reply is dropped, the round goes on)",
        "input",
    ): "example inputs that are rejected",
    ("strategies.md", "Robust aggregation (`robust`)", "`robust`"): "options and breakdown points",
    ("user-guide.md", "3. Strategy arguments and the formulas they set", "argument"): "defaults",
    ("user-guide.md", "Run-config keys", "key"): "defaults",
    ("user-guide.md", "Reading `results.json`", "key"): "the keys of results.json",
    (
        "results-lm.md",
        "Horizon study: the claims at 3x and 5.4x the steps",
        "corpus",
    ): "sizes of the installed corpora, counted from the packages (tests/test_lm_horizon.py)",
}

SKIPPED_HEADER = re.compile(
    r"^x |^x$|/.*\(updates\)$|share of|^in model copies$|^what it holds$|^where the peak is$"
)
"""Columns left out in every table, by header: ratios (``x memory pass``, ``x `mean```,
``x FedAvg``, ``RW-LoRA / gossip (updates)``), shares and sizes in model copies, computed from
the row's recorded cells; and prose columns that describe a row (``what it holds``)."""

# (file, heading, first header cell) -> records a table quotes that its section does not name.
EXTRA_RECORDS: dict[tuple[str, str, str], tuple[str, ...]] = {
    # "(4.514: the demo)": the LM app's demo run, docs/results-lm.md
    ("strategies.md", "Defaults: what they are for and when to tune", "strategy"): (
        "lm_experiments.json",
    ),
}

UNITS = {"ms": 1e-3, "%": 1e-2, "MB": 1e6, "kB": 1e3, "GB": 1e9}
"""A cell or header naming one of these units may also match the record in base units
(seconds, fractions, bytes): ``43.6 ms`` matches 0.0436."""

# (file, heading, first header cell) -> why a measured table has no record yet. The test fails
# once such a table matches its records (or is gone), so an entry can only be removed.
NO_RECORD: dict[tuple[str, str, str], str] = {
    (
        "deployment.md",
        "Measured (loopback, 2 shared cores)",
        "app",
    ): "benchmarks/faults/kill_experiment.py prints its result and keeps no record; a rerun needs the "
    "loopback TLS deployment (minutes of several processes)",
    (
        "algorithms.md",
        "3.1 Presets, and when the outer step is stable",
        "merge at lr 0.7, mu 0.9",
    ): "0.867 (`iso_c`, CNN IID seed 1) and 0.889 (`iso_c` on fc1 only, CNN IID seed 0) are in "
    "no record; isoloco_dropin.json keeps the other cells (seed 0's under `diagnosis`)",
    (
        "deployment.md",
        "When the coordinator fails (SuperLink restart)",
        "what was killed",
    ): "timings read off the logs of hand-run probes (the reproducing commands follow the table); "
    "the probes keep no record",
}


@dataclass(frozen=True)
class Table:
    file: str
    line: int  # 1-based line of the header row
    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    section: str  # the text from the heading above to the next heading
    generated: bool

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.file, self.heading, self.header[0].strip())


def _cells(line: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in line.strip().strip("|").split("|"))


def parse_tables(path: Path) -> list[Table]:
    lines = path.read_text(encoding="utf-8").splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"#{1,6}\s", line)]
    out, generated, fence, i = [], False, False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and GENERATED.search(line):
            generated = True
        if not fence and GENERATED_END.search(line):
            generated = False
        if (
            not fence
            and line.lstrip().startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\s*\|\s*:?-{2,}", lines[i + 1])
        ):  # a table, also one indented inside a list item
            start = i
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            above = [h for h in heads if h < start]
            below = [h for h in heads if h >= i]
            s, e = (above[-1] if above else 0), (below[0] if below else len(lines))
            heading = re.sub(r"^#+\s*", "", lines[s]) if above else ""
            out.append(
                Table(
                    path.name,
                    start + 1,
                    heading,
                    _cells(lines[start]),
                    tuple(rows),
                    "\n".join(lines[s:e]),
                    generated,
                )
            )
            continue
        i += 1
    return out


POOL_EXCLUDE: dict[str, tuple[str, ...]] = {
    # the diagnosis run's per-round, per-tensor norms and ratios (thousands of values in
    # [0, 10]): no table quotes them, and with them almost any 3-digit number would match
    "isoloco_dropin.json": ("rounds",),
}
"""JSON keys whose subtrees are left out of a record's numbers."""


def _numbers_of(value: object, out: list[float], exclude: tuple[str, ...] = ()) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            out.append(float(value))
    elif isinstance(value, dict):
        for k, v in value.items():
            if k in exclude:
                continue
            _numbers_of(k, out)
            _numbers_of(v, out, exclude)
    elif isinstance(value, list):
        for v in value:
            _numbers_of(v, out, exclude)
    elif isinstance(value, str):
        out.extend(_parse(m.group(0)) for m in NUMBER.finditer(value))


def _parse(text: str) -> float:
    return float(text.replace(",", ""))


@cache
def record_numbers(name: str) -> tuple[float, ...]:
    """Every number in one record (JSON values, keys and numbers inside strings; text files'
    numbers), sorted."""
    path = RESULTS / name
    text = path.read_text(encoding="utf-8")
    out: list[float] = []
    _numbers_of(
        json.loads(text) if path.suffix == ".json" else text, out, POOL_EXCLUDE.get(name, ())
    )
    return tuple(sorted(set(out)))


def records() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


@cache
def cited_records(section: str) -> list[str]:
    """The records a section names: by file name, or by the script that writes them."""
    names = records()
    cited = {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}", section)}
    for script in re.findall(r"benchmarks/(?:\w+/)?(\w+)\.py", section):
        cited.update(n for n in names if n.startswith(script + ".") or n.startswith(script + "_"))
    return sorted(cited)


def printed_matches(text: str, pool: list[tuple[float, ...]], scale: float = 1.0) -> bool:
    """``text`` (a number as printed) equals some recorded value rounded to its digits; with
    ``scale``, the printed number is ``scale`` x the recorded one (``ms``: 1e-3)."""
    if scale != 1.0 and printed_matches(text, [tuple(v / scale for v in vals) for vals in pool]):
        return True
    value = _parse(text)
    digits = 0 if "e" in text.lower() or "." not in text else len(text.split(".")[1])
    if "e" in text.lower():  # 1.6e-6: the mantissa's digits
        mant = text.lower().split("e")[0]
        digits_m = len(mant.split(".")[1]) if "." in mant else 0
        tol = 0.5 * 10 ** (-digits_m) * 10 ** math.floor(math.log10(abs(value))) if value else 0
    else:
        tol = 0.5 * 10**-digits
    tol = tol * (1 + 1e-9) + 1e-12
    for vals in pool:
        for v in (value, -value):
            j = bisect.bisect_left(vals, v - tol)
            if j < len(vals) and vals[j] <= v + tol:
                return True
    return False


def table_problems(t: Table) -> tuple[list[str], list[tuple[str, str]]]:
    """(problems, unmatched (file, number) pairs) of one table; empty when it is left out."""
    if t.generated or t.key in DEFINITIONS:
        return [], []
    keep = [j for j, h in enumerate(t.header) if not SKIPPED_HEADER.search(h.strip("`* "))]
    numbers = []  # (printed number, unit scale)
    for row in t.rows:
        for j in keep:
            if j >= len(row):
                continue
            cell = re.sub(r"\([^)]*\)", "", row[j]) if j == 0 else row[j]  # a label's (setting)
            units = [
                u
                for u in UNITS
                if re.search(rf"(?<![A-Za-z]){re.escape(u)}(?![A-Za-z])", cell + " " + t.header[j])
            ]
            numbers += [(m.group(0), units) for m in NUMBER.finditer(cell)]
    if not numbers:
        return [], []
    cited = sorted(set(cited_records(t.section)) | set(EXTRA_RECORDS.get(t.key, ())))
    if not cited:
        where = f"{t.file}:{t.line} ({t.heading!r})"
        return [
            f"{where}: a measured table whose section names no record (benchmarks/results/)"
        ], []
    pool = [record_numbers(n) for n in cited]
    missing = [
        (t.file, n)
        for n, units in numbers
        if not any(printed_matches(n, pool, UNITS[u]) for u in units)
        and not printed_matches(n, pool)
    ]
    return [], missing


@cache
def all_tables() -> tuple[Table, ...]:
    return tuple(t for path in DOCS for t in parse_tables(path))


def _failures(t: Table) -> list[str]:
    problems, missing = table_problems(t)
    if missing:
        problems = problems + [
            f"{t.file}:{t.line} ({t.heading!r}): {', '.join(n for _f, n in missing)} in none of "
            f"{sorted(set(cited_records(t.section)) | set(EXTRA_RECORDS.get(t.key, ())))}"
        ]
    return problems


def test_every_table_number_is_in_a_cited_record():
    problems = [p for t in all_tables() if t.key not in NO_RECORD for p in _failures(t)]
    assert not problems, "\n".join(problems)


def test_no_record_list_only_shrinks():
    """Each ``NO_RECORD`` table is still in the docs and still lacks a record."""
    failing = {t.key for t in all_tables() if _failures(t)}
    stale = [k for k in NO_RECORD if k not in failing]
    assert not stale, f"remove from NO_RECORD (now recorded, or gone from the docs): {stale}"


def test_every_exemption_names_a_table():
    keys = {t.key for t in all_tables()}
    for table in (DEFINITIONS, NO_RECORD, EXTRA_RECORDS):
        stale = [k for k in table if k not in keys]
        assert not stale, f"no such table (heading or header changed?): {stale}"


def test_a_planted_wrong_number_is_caught():
    """The check itself: a cell of a measured table changed in its last digit fails (in most
    cases: a wrong value can still equal another recorded number by chance, about 1 in 5 for
    3-digit accuracies against isoloco_dropin.json), and a table that cites nothing fails."""
    target = next(
        t
        for t in all_tables()
        if t.file == "strategies.md" and t.header[:2] == ("strategy", "IID s0")
    )
    assert table_problems(target) == ([], [])
    row = target.rows[0]  # FedAvg: 0.783 in the docs
    caught = 0
    for k in range(1, 10):
        wrong = f"{float(row[1]) + k / 1000:.3f}"
        planted = Table(
            target.file,
            target.line,
            target.heading,
            target.header,
            ((row[0], wrong, *row[2:]), *target.rows[1:]),
            target.section,
            False,
        )
        caught += table_problems(planted)[1] == [(target.file, wrong)]
    assert caught >= 6, f"only {caught} of 9 wrong values caught"
    bare = Table("x.md", 1, "h", ("a", "b"), (("r", "0.5"),), "## h\n", False)
    assert table_problems(bare)[0]


def test_printed_rounding():
    pool = [tuple(sorted([0.8416666388511658, 2.86, 1.6e-6, 4957336.0, -24.5213]))]
    assert printed_matches("0.842", pool) and printed_matches("0.84", pool)
    assert not printed_matches("0.843", pool)
    assert printed_matches("2.86", pool) and printed_matches("**2.86**".strip("*"), pool)
    assert printed_matches("1.6e-6", pool) and not printed_matches("1.8e-6", pool)
    assert printed_matches("4,957,336", pool)
    assert printed_matches("24.5213", pool)  # sign-insensitive: "-" is often a dash


def _docs_claims():
    spec = importlib.util.spec_from_file_location(
        "docs_claims", REPO / "benchmarks" / "docs" / "docs_claims.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_claims_match_their_records():
    stale = _docs_claims().stale()
    assert not stale, f"rerun `python benchmarks/docs/docs_claims.py`: {stale}"


def _source_presets() -> dict[str, tuple[str, float, float, bool]]:
    """``ISOLOCO_PRESETS`` as written in flwr_isoloco/strategies/diloco/presets.py (read with
    ``ast``: importing the package costs seconds of torch import). name -> (merge, outer lr, momentum, nesterov)."""
    tree = ast.parse(
        (REPO / "flwr_isoloco" / "strategies" / "diloco" / "presets.py").read_text(encoding="utf-8")
    )
    node = next(
        n.value
        for n in tree.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and "ISOLOCO_PRESETS"
        in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)
    )
    out = {}
    for value in node.values:
        args = [ast.literal_eval(a) for a in value.args]
        kw = {k.arg: ast.literal_eval(k.value) for k in value.keywords}
        name, merge, lr, mu, *rest = args
        out[name] = (merge, lr, mu, kw.get("nesterov", rest[0] if rest else True))
    return out


def _init_defaults(path: str, cls: str) -> dict[str, object]:
    """Keyword defaults of ``cls.__init__`` in ``path``, read with ``ast``."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    out = {}
    for arg, default in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True):
        if default is not None:
            try:
                out[arg.arg] = ast.literal_eval(default)
            except ValueError:
                out[arg.arg] = ast.unparse(default)
    return out


def test_preset_tables_match_the_code():
    """strategies.md "Defaults" and algorithms.md 3.1 give each preset's rule, lr and momentum
    as ``ISOLOCO_PRESETS`` holds them."""
    presets = _source_presets()
    assert set(presets) >= {"dropin", "isoloco-paper"}
    for file, heading in (
        ("strategies.md", "Defaults: what they are for and when to tune"),
        ("algorithms.md", "3.1 Presets, and when the outer step is stable"),
    ):
        table = next(t for t in all_tables() if t.key == (file, heading, "preset"))
        for name, (merge, lr, mu, _nesterov) in presets.items():
            row = next((r for r in table.rows if f'`"{name}"`' in r[0]), None)
            assert row is not None, f"{file}: no row for preset {name!r}"
            assert f"`{merge}`" in " | ".join(row[1:]), f"{file}: {name} merges with {merge}"
            nums = [_parse(m.group(0)) for m in NUMBER.finditer(" | ".join(row[2:]))]
            assert lr in nums and mu in nums, f"{file}: {name} is lr {lr}, momentum {mu}: {row}"


def test_user_guide_defaults_match_the_signatures():
    """docs/user-guide.md section 3 gives DiLoCo's defaults as its signature does, and IsoLoCo's
    as "the preset's" (or the default preset's value)."""
    diloco = _init_defaults("flwr_isoloco/strategies/diloco/diloco.py", "DiLoCo")
    isoloco = _init_defaults("flwr_isoloco/strategies/diloco/isoloco.py", "IsoLoCo")
    merge, lr, mu, nesterov = _source_presets()[isoloco["preset"]]
    from_preset = {"merge": merge, "outer_lr": lr, "outer_momentum": mu, "nesterov": nesterov}
    table = next(
        t
        for t in all_tables()
        if t.key == ("user-guide.md", "3. Strategy arguments and the formulas they set", "argument")
    )
    checked = set()
    for row in table.rows:
        names = re.findall(r"`(\w+)`", row[0])
        if len(names) != 1 or names[0] not in from_preset:
            continue
        name = names[0]
        d_text, _, i_text = row[1].partition(" / ")
        assert d_text.strip('`"') == str(diloco[name]), (name, d_text, diloco[name])
        i_text = i_text or d_text
        if "preset" not in i_text:
            assert i_text.strip('`"') == str(from_preset[name]), (name, i_text, from_preset[name])
        else:
            assert isoloco[name] is None, f"IsoLoCo's {name} is not taken from the preset"
        checked.add(name)
    assert checked == set(from_preset)


def test_bigram_record_is_of_the_current_default_preset():
    """The README's bigram sentence quotes `IsoLoCo()`: the record must have run the preset the
    code has now (else rerun benchmarks/dropin/swap_fedavg_bigram.py, then benchmarks/docs/docs_claims.py)."""
    isoloco = _init_defaults("flwr_isoloco/strategies/diloco/isoloco.py", "IsoLoCo")
    merge, lr, mu, _nesterov = _source_presets()[isoloco["preset"]]
    run = json.loads((RESULTS / "swap_fedavg_bigram.json").read_text())["runs"]["IsoLoCo()"]
    assert (run["merge"], run["outer-lr"], run["outer-momentum"]) == (merge, lr, mu)
