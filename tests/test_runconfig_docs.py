"""The run-config key tables (docs/user-guide.md, simulations/rwlora-sentiment/README.md) list
every key both apps declare, with the declared default and the app's own one-line meaning
(``config_docs.KEY_DOCS``), and are what ``python scripts/runconfig_docs.py`` writes now.
docs/strategies.md's run-config section names every DiLoCo / IsoLoCo strategy key."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "runconfig_docs", REPO / "scripts" / "runconfig_docs.py"
)
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


@pytest.mark.parametrize("app", gen.APPS)
def test_every_declared_key_has_a_one_line_meaning(app):
    assert gen.problems(app) == []
    assert len(gen.declared_literals(REPO / app)) > 40


@pytest.mark.parametrize("name", sorted(gen.TARGETS))
def test_the_tables_are_current(name):
    text = (REPO / name).read_text(encoding="utf-8")
    assert gen.render(text, gen.TARGETS[name], name) == text, (
        f"{name}: the run-config key table is stale; run python scripts/runconfig_docs.py"
    )


def _table_keys(text: str) -> dict[str, list[str]]:
    """App -> the keys in the block's table, read from the markdown (not from the generator)."""
    block = gen.BLOCK.search(text).group(0)
    out: dict[str, list[str]] = {}
    app = None
    for line in block.splitlines():
        if m := re.match(r"\| \*\*`([^`]+)`\*\*", line):
            app = m.group(1)
        elif m := re.match(r"\| `([^`]+)` \| `([^`]*(?:`[^|]*)?)` \| (.+) \|$", line):
            out.setdefault(app, []).append(m.group(1))
    return out


def test_the_user_guide_lists_every_key_of_both_apps_once():
    keys = _table_keys((REPO / "docs" / "user-guide.md").read_text(encoding="utf-8"))
    assert set(keys) == set(gen.APPS)
    for app in gen.APPS:
        assert keys[app] == list(gen.declared_literals(REPO / app)), app
    lm = set(keys["simulations/isoloco-lm"])
    assert {
        "strategy.quorum",
        "strategy.grace-s",
        "strategy.merge-device",
        "strategy.buffers",
    } <= lm


def test_the_rwlora_readme_lists_its_keys():
    keys = _table_keys((REPO / "simulations/rwlora-sentiment/README.md").read_text("utf-8"))
    assert keys == {None: list(gen.declared_literals(REPO / "simulations/rwlora-sentiment"))}


def test_a_key_without_a_meaning_or_a_stale_table_is_caught(monkeypatch):
    app = "simulations/isoloco-lm"
    docs = gen.key_docs(REPO / app)
    del docs["strategy.quorum"]
    monkeypatch.setattr(gen, "key_docs", lambda app_dir: dict(docs))
    assert gen.problems(app) == [
        f"{app}: key 'strategy.quorum' has no line in config_docs.KEY_DOCS"
    ]
    monkeypatch.undo()
    text = (REPO / "docs" / "user-guide.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `strategy.grace-s` |"))
    stale = text.replace(row + "\n", "", 1)
    assert gen.render(stale, gen.APPS) != stale


def test_strategies_md_names_every_strategy_key():
    from flwr_isoloco.strategies import DiLoCo, IsoLoCo
    from flwr_isoloco.strategies.diloco.sections import run_config_defaults

    text = (REPO / "docs" / "strategies.md").read_text(encoding="utf-8")
    section = text.split("\n## Run-config keys", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`strategy\.([a-z-]+)`", section))
    keys = set(run_config_defaults(DiLoCo)) | set(run_config_defaults(IsoLoCo))
    assert keys - named == set(), "docs/strategies.md's run-config table lacks these keys"


# ----------------------------------------------------------------------------- README timings
_st = importlib.util.spec_from_file_location(
    "suite_time", REPO / "benchmarks" / "docs" / "suite_time.py"
)
suite_time = importlib.util.module_from_spec(_st)
_st.loader.exec_module(suite_time)
TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|sec|seconds?|min|minutes?|h|hours?)\b|\bminutes?\b")


def test_the_readme_test_times_are_the_record_s():
    record = json.loads(suite_time.RECORD.read_text())
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert suite_time.render_readme(text, record) == text, (
        "README.md's suite-time sentence is stale: run python benchmarks/docs/suite_time.py --readme"
    )


def test_every_timing_in_the_readme_is_generated_from_a_record():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    prose = re.sub(
        r"<!--\s*(BEGIN [\w-]+|docs_claims:[\w-]+:begin).*?-->.*?<!--.*?-->", "", text, flags=re.S
    )
    assert TIMING.findall(prose) == [], "a timing in README.md outside a generated block"


def test_the_readme_quotes_only_green_runs():
    green = {
        "marker": "",
        "exit-code": 0,
        "failed": 0,
        "passed": 9,
        "cpus": 2,
        "load-avg-1min-before": 1.0,
        "wall-time-s": 100.0,
        "date": "2026-12-06T00:00:00Z",
    }
    red = {**green, "exit-code": 1, "failed": 2, "wall-time-s": 777.0}
    assert "777" not in suite_time.sentence({"runs": [green, red]})
    assert "100 s" in suite_time.sentence({"runs": [green, red]})
    assert "No green run" in suite_time.sentence({"runs": [red]})
