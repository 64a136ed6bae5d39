"""Shell scripts with awkward paths (issue 8, B10): quotes, backslashes, tabs, newlines.

``scripts/deploy/write_cli_config.sh`` must write TOML that reads back to the exact path (it
wrote paths unescaped: a ``"`` broke the file, a ``\\t`` became a tab); ``scripts/run_app.sh``
must hand Flower the exact output dir (with a ``'`` the run silently wrote elsewhere). The
run_app.sh checks use its ``RUN_APP_DRY_RUN=1`` mode (overrides checked and read back with
Flower's own parser, nothing started); the real run into an awkward dir is the swap-fedavg
example's (tests/test_swap_fedavg_example.py::test_example_through_flwr_run).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
WRITE_CLI = REPO / "scripts" / "deploy" / "write_cli_config.sh"
RUN_APP = REPO / "scripts" / "run_app.sh"
TINY_APP = REPO / "tests" / "deploy-app"

# a double quote, a literal backslash-t, a backslash, a single quote, a space, a real tab,
# a real newline and a non-ASCII letter
AWKWARD = "q\"uo\\te\\d 'it'\tx\ny é"


def _run(cmd, env=None, timeout=60):
    return subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---- write_cli_config.sh ------------------------------------------------------------------


def test_write_cli_config_round_trips_awkward_paths(tmp_path):
    folder = tmp_path / AWKWARD
    folder.mkdir()
    ca = folder / "ca.crt"
    ca.write_text("not a real certificate")
    home = tmp_path / "home"
    env = {"FLWR_HOME": str(home)}
    proc = _run(["bash", WRITE_CLI, "site-a", 'host"x:9093', ca], env)
    assert proc.returncode == 0, proc.stderr
    proc = _run(["bash", WRITE_CLI, "site_b", "10.0.0.2:9093", ca], env)
    assert proc.returncode == 0, proc.stderr
    cfg = tomllib.loads((home / "config.toml").read_text(encoding="utf-8"))
    assert cfg["superlink"]["default"] == "site-a"
    assert cfg["superlink"]["site-a"] == {
        "address": 'host"x:9093',
        "root-certificates": os.path.realpath(ca),
    }
    assert cfg["superlink"]["site_b"]["root-certificates"] == os.path.realpath(ca)
    assert cfg["superlink"]["site_b"]["address"] == "10.0.0.2:9093"


@pytest.mark.parametrize("name", ["a.b", "x]", "two words", 'q"'])
def test_write_cli_config_refuses_a_name_that_is_not_a_bare_key(tmp_path, name):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    proc = _run(["bash", WRITE_CLI, name, "h:1", ca], {"FLWR_HOME": str(tmp_path / "home")})
    assert proc.returncode == 2
    assert f"connection name '{name}' must be letters, digits, '-' or '_' only" in proc.stderr
    assert not (tmp_path / "home" / "config.toml").exists()


@pytest.mark.skipif(shutil.which("iconv") is None, reason="needs iconv")
def test_write_cli_config_refuses_a_path_that_is_not_utf8(tmp_path):
    folder = os.fsencode(tmp_path) + b"/bad\xff"
    os.mkdir(folder)
    ca = folder + b"/ca.crt"
    Path(os.fsdecode(ca)).write_text("x")
    proc = subprocess.run(
        [b"bash", os.fsencode(WRITE_CLI), b"site", b"h:1", ca],
        capture_output=True,
        env={**os.environ, "FLWR_HOME": str(tmp_path / "home")},
        timeout=60,
    )
    assert proc.returncode == 2
    assert b"CA_CERT path is not valid UTF-8, so it cannot be written to TOML" in proc.stderr
    assert not (tmp_path / "home" / "config.toml").exists()


# ---- run_app.sh ---------------------------------------------------------------------------


def _dry_run(out, *overrides, env=None, cwd=None):
    return subprocess.run(
        ["bash", str(RUN_APP), str(TINY_APP), str(out), *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "RUN_APP_DRY_RUN": "1", **(env or {})},
    )


def _overrides(proc):
    line = next(x for x in proc.stdout.splitlines() if "dry run, run-config overrides: " in x)
    return json.loads(line.split("overrides: ", 1)[1])


def test_run_app_passes_an_awkward_output_dir_exactly(tmp_path):
    out = tmp_path / AWKWARD / "it's out"
    proc = _dry_run(out, "num-server-rounds=3", "lr=0.5")
    assert proc.returncode == 0, proc.stderr
    assert _overrides(proc) == {"num-server-rounds": 3, "lr": 0.5, "output-dir": str(out)}
    assert out.is_dir()
    assert not (out / "flwr-run.log").exists()  # nothing was started


def test_run_app_relative_output_dir_becomes_absolute(tmp_path):
    proc = _dry_run("rel'ative", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _overrides(proc) == {"output-dir": str(tmp_path / "rel'ative")}


@pytest.mark.parametrize(
    "out,overrides,env,message",
    [
        (
            "o",
            ["output-dir='/elsewhere'"],
            {},
            "run_app: output-dir is set by the second argument (<output-dir>); drop the override",
        ),
        ("o", [], {"NUM_SUPERNODES": "4 x=1"}, "run_app: NUM_SUPERNODES=4 x=1 must be a positive"),
        ("o", [], {"CPUS_PER_CLIENT": "0"}, "run_app: CPUS_PER_CLIENT=0 must be a positive"),
        ("o", [], {"GPUS_PER_CLIENT": "1 x=2"}, "run_app: GPUS_PER_CLIENT=1 x=2 must be a number"),
        ("o", ["lr=0.1", "steps=3"], {}, "run_app: unknown run-config key 'steps'"),
        # issue 17: types are checked here too, before anything starts (they used to pass the
        # dry run and fail only once the ServerApp read them)
        (
            "o",
            ["lr='fast'"],
            {},
            "run_app: run-config key 'lr' has value 'fast' of type str; expected float "
            "(declared 0.1)",
        ),
        (
            "o",
            ["num-server-rounds=2.5"],
            {},
            "run_app: run-config key 'num-server-rounds' has value 2.5 of type float; "
            "expected int (declared 2)",
        ),
    ],
)
def test_run_app_refuses_with_a_message(tmp_path, out, overrides, env, message):
    proc = _dry_run(tmp_path / out, *overrides, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "dry run" not in proc.stdout


def test_run_app_refuses_an_output_dir_that_is_not_utf8(tmp_path):
    out = os.fsencode(tmp_path) + b"/bad\xff"
    proc = subprocess.run(
        [b"bash", os.fsencode(RUN_APP), os.fsencode(TINY_APP), out],
        capture_output=True,
        timeout=120,
        env={**os.environ, "RUN_APP_DRY_RUN": "1"},
    )
    assert proc.returncode == 2
    assert b"is not valid UTF-8, so it cannot be passed to Flower" in proc.stderr


# The real run into an awkward dir (the ServerApp writes into that very dir, nothing beside it)
# is tests/test_swap_fedavg_example.py::test_example_through_flwr_run: one Ray run for both.
