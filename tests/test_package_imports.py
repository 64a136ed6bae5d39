"""Every subpackage exports its names by plain imports (IDEs, ``help()`` and static tools see
them; no lazy module ``__getattr__``), importing it in a fresh interpreter has no cycle, and
no two modules of the package or of an app import each other (read from the source)."""

import ast
import importlib
import pkgutil
import pydoc
import subprocess
import sys
from pathlib import Path

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
    init = Path(__file__).resolve().parents[1] / "flwr_isoloco" / "clients" / "__init__.py"
    (listed,) = [
        n.value
        for n in ast.parse(init.read_text()).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"
    ]
    assert out.stdout.strip() == str(len(listed.elts))  # every name, none lost in a cycle


def find_cycles(graph):
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_sees_a_type_only_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


# ---- no import cycles, counted statically ----------------------------------------------------
# Every import statement counts: at the top, inside a function (lazy) and under TYPE_CHECKING,
# so two modules that import each other only lazily are still a cycle (issue 35 found four such
# pairs: merging/options <-> rules, models/classifier <-> export, strategies/diloco <->
# train_round, the LM app's node_data <-> task).
REPO = Path(__file__).resolve().parents[1]


def _app_packages() -> list[tuple[Path, str]]:
    """(folder on sys.path, package) of every Flower app of the repository."""
    found = []
    for pyproject in sorted(REPO.glob("*/*/pyproject.toml")):
        if pyproject.parts[-3] not in ("examples", "simulations", "tests"):
            continue
        for init in sorted(pyproject.parent.glob("*/__init__.py")):
            found.append((pyproject.parent, init.parent.name))
    return found


PACKAGE_ROOTS = [(REPO, "flwr_isoloco"), *_app_packages()]


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _nearest(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def source_import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source (``from pkg import
    name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``)."""
    mods = _modules(root, package)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(_nearest(a.name, mods) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    head = base[: len(base) - node.level + 1]
                    module = ".".join(head + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for a in node.names:
                    sub = f"{module}.{a.name}"
                    targets.add(sub if sub in mods else _nearest(module, mods))
        graph[name] = targets - {None, name}
    return graph


def test_the_apps_are_found():
    names = {pkg for _, pkg in PACKAGE_ROOTS}
    assert {"flwr_isoloco", "isoloco_lm", "rwlora_sentiment", "hf_causal_lm", "digits"} <= names


@pytest.mark.parametrize("root,package", PACKAGE_ROOTS, ids=[p for _, p in PACKAGE_ROOTS])
def test_no_import_cycle_lazy_imports_counted(root, package):
    graph = source_import_graph(root, package)
    assert len(graph) > 1
    assert find_cycles(graph) == []


def test_the_cycle_check_sees_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n"
    )
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("from pkg import a\n")
    graph = source_import_graph(tmp_path, "pkg")
    assert graph["pkg.e"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
