"""The dependency ranges of pyproject.toml admit the releases we checked (issue 35, item 3).

``tests/data/fresh_env.json`` records a fresh venv that installed the newest releases the
registry offered (``pip install torch``, then ``pip install -e '.[dev]'``), ``pip check`` and
the unit tests it ran there; and, in the same venv, the newer transformers/datasets that the
resolver could not pick beside flwr-datasets (which caps datasets). This test keeps the
declared ranges admitting all of them and the versions installed in the test venv, and keeps
upper bounds off the packages that users upgrade on their own (torch above all: a cap makes
pip replace a user's torch, on a GPU machine by a multi-GB CUDA build).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
REQUIREMENTS = {
    canonicalize_name(r.name): r
    for r in map(Requirement, PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"])
}
RECORD = json.loads((REPO / "tests" / "data" / "fresh_env.json").read_text())

# Upgraded by users on their own; no release is known to break us, so no upper bound.
UNCAPPED = ["torch", "transformers", "peft", "datasets", "flwr-datasets"]


def _checked() -> list[tuple[str, str, str]]:
    out = []
    for step in ("resolved", "newest_forced"):
        out += [(step, n, v) for n, v in sorted(RECORD[step]["versions"].items())]
    return out


def test_the_record_holds_the_newest_torch_transformers_peft_datasets():
    resolved = RECORD["resolved"]["versions"]
    assert set(UNCAPPED) <= set(resolved), sorted(set(UNCAPPED) - set(resolved))
    assert RECORD["resolved"]["pip_check"] == "No broken requirements found."


@pytest.mark.parametrize("step,name,version", _checked(), ids=lambda x: str(x))
def test_declared_ranges_admit_the_checked_releases(step, name, version):
    req = REQUIREMENTS.get(canonicalize_name(name))
    if req is None:  # a dependency of a dependency: recorded, not declared by us
        return
    assert req.specifier.contains(Version(version), prereleases=True), (step, str(req), version)


def test_declared_ranges_admit_the_installed_versions():
    refused = {}
    for name, req in REQUIREMENTS.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not req.specifier.contains(Version(installed), prereleases=True):
            refused[name] = (str(req), installed)
    assert refused == {}


@pytest.mark.parametrize("name", UNCAPPED)
def test_no_upper_bound_where_no_break_is_known(name):
    spec = REQUIREMENTS[canonicalize_name(name)].specifier
    assert spec, name  # a lower bound is declared
    assert {s.operator for s in spec} <= {">=", ">", "!="}, str(spec)


def test_install_sh_pins_a_torch_the_range_admits():
    pins = re.findall(r"torch==([\w.+]+)", (REPO / "scripts" / "install.sh").read_text())
    assert pins, "scripts/install.sh no longer pins torch"
    for pin in pins:
        assert REQUIREMENTS["torch"].specifier.contains(Version(pin))
