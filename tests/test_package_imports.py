"""Every subpackage exports its names by plain imports (IDEs, ``help()`` and static tools see
them; no lazy module ``__getattr__``), and importing it in a fresh interpreter has no cycle."""

import importlib
import pkgutil
import pydoc
import subprocess
import sys

import pytest

import flwr_isoloco

PACKAGES = sorted(
    m.name for m in pkgutil.walk_packages(flwr_isoloco.__path__, "flwr_isoloco.") if m.ispkg
)


def test_the_packages_are_found():
    assert {"flwr_isoloco.clients", "flwr_isoloco.strategies", "flwr_isoloco.merging"} <= set(
        PACKAGES
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_exports_are_plain_attributes_listed_by_help(name):
    mod = importlib.import_module(name)
    assert "__getattr__" not in vars(mod), f"{name} has a lazy module __getattr__"
    names = getattr(mod, "__all__", [])
    assert all(n in vars(mod) for n in names), sorted(set(names) - set(vars(mod)))
    text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
    assert [n for n in names if n not in text] == []


@pytest.mark.parametrize("name", ["flwr_isoloco.clients", "flwr_isoloco.clients.query"])
def test_fresh_import_has_no_cycle(name):
    code = f"import {name}, flwr_isoloco.clients as c; print(len(c.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"
