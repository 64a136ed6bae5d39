"""Every shell command of docs/deployment.md names a program, flags and arguments that exist.

Nothing is started: each ```bash block is split into commands, and each command is checked
against what it names. ``scripts/deploy/*.sh`` and other repository files exist (a script is
executable and given as many arguments as it requires, at most as many as it reads);
``flower-superlink`` / ``flower-supernode`` arguments parse with Flower's own argument parsers
and every flag is one their ``--help`` shows; ``flwr <command>`` arguments parse with the
installed ``flwr`` CLI (click, as ``flwr <command> --help`` describes it);
``python -m flwr_isoloco.data.packages`` runs with ``--dry-run``; each ``--run-config`` string
given to ``scripts/deploy/run_app.sh`` parses as Flower parses it and passes the app's own
checks (:func:`flwr_isoloco.runconfig.precheck_app_config`). A command this file does not know
fails the test, so a new kind of command gets a check here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "deployment.md"
PLACEHOLDERS = {"run-id": "1", "node-id": "1"}
"""``<run-id>`` in a command stands for a number: checked as one."""
GENERIC = {
    "python3": {"-m venv"},
    "python": {"-m venv", "-m build"},
    "pip": {"install", "wheel"},
    ".": set(),
}
"""Programs outside this project checked only for their subcommand (``pip install``, ...)."""


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """Simple commands of a block: lines joined at ``\\``, comments dropped, split at ``&&`` /
    ``;`` / ``|``, leading ``NAME=value`` assignments removed; ``<run-id>`` -> ``1``."""
    text = block.replace("\\\n", " ")
    text = re.sub(r"<([a-z-]+)>", lambda m: PLACEHOLDERS.get(m.group(1), m.group(0)), text)
    out = []
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        words, cmd = list(lex), []
        for w in [*words, ";"]:
            if w in (";", "&&", "|", "||"):
                while cmd and re.fullmatch(r"[A-Z_]+=.*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def page_commands() -> list[list[str]]:
    return [c for b in bash_blocks(PAGE.read_text(encoding="utf-8")) for c in commands(b)]


# ----------------------------------------------------------------------------- per program
def _script_arity(path: Path) -> tuple[int, int]:
    """(required, read) positional arguments of a shell script: ``${N:?`` and ``${N`` / ``$N``;
    a script that reads ``$@`` takes any number more."""
    text = path.read_text(encoding="utf-8")
    required = {int(n) for n in re.findall(r"\$\{(\d+):\?", text)}
    read = {int(n) for n in re.findall(r"\$\{?(\d+)", text)} - {0}
    if "$@" in text:
        return (max(required, default=0), 1 << 30)
    return (max(required, default=0), max(read, default=0))


def check_script(argv: list[str]) -> None:
    path = REPO / argv[0]
    assert path.is_file(), f"{argv[0]}: no such file"
    assert path.stat().st_mode & 0o111, f"{argv[0]}: not executable"
    required, read = _script_arity(path)
    n = len(argv) - 1
    assert required <= n <= read, f"{shlex.join(argv)}: {n} arguments, wants {required}..{read}"
    if path.name == "run_app.sh" and n >= 3:
        check_run_config(argv[1], argv[3])


def check_run_config(app: str, run_config: str) -> None:
    from flwr.common.config import parse_config_args

    from flwr_isoloco.runconfig import _declared, precheck_app_config

    overrides = parse_config_args([run_config])
    declared, _ = _declared(REPO / app)
    unknown = sorted(set(overrides) - set(declared))
    assert not unknown, f"{app}: run-config keys not declared: {unknown}"
    assert precheck_app_config(REPO / app, overrides) == [], run_config


def _flower_parser(program: str) -> argparse.ArgumentParser:
    if program == "flower-superlink":
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

        return _parse_args_run_superlink()
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    return _parse_args_run_supernode()


def check_flower_server(argv: list[str]) -> None:
    parser = _flower_parser(argv[0])
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", parser.format_help()))
    for flag in (a.split("=")[0] for a in argv[1:] if a.startswith("--")):
        assert flag in shown, f"{argv[0]} --help shows no {flag}"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{shlex.join(argv)}: {err.getvalue()}")


def check_flwr(argv: list[str]) -> None:
    import click
    import typer.main
    from flwr.cli.app import app

    cmd, args, name = typer.main.get_command(app), argv[1:], ["flwr"]
    while isinstance(cmd, click.Group):
        assert args and args[0] in cmd.commands, f"{shlex.join(argv)}: no such flwr command"
        name.append(args[0])
        cmd, args = cmd.commands[args[0]], args[1:]
    visible = {
        o
        for p in cmd.params
        if not getattr(p, "hidden", False)
        for o in (*p.opts, *p.secondary_opts)
    }
    for flag in (a.split("=")[0] for a in args if a.startswith("-")):
        assert flag in visible, f"{' '.join(name)} --help shows no {flag}"
    try:
        cmd.make_context(" ".join(name), list(args))
    except click.ClickException as exc:
        pytest.fail(f"{shlex.join(argv)}: {exc.format_message()}")


def check_python(argv: list[str]) -> None:
    if argv[1:3] == ["-m", "flwr_isoloco.data.packages"]:
        from flwr_isoloco.data.packages import main

        args = argv[3:]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*args, "--dry-run"] if "--install" in args else args) == 0, argv
        return
    assert " ".join(argv[1:3]) in GENERIC[argv[0]], f"{shlex.join(argv)}: not checked here"


def check_command(argv: list[str]) -> None:
    program = argv[0]
    if program.startswith("scripts/"):
        check_script(argv)
    elif program in ("flower-superlink", "flower-supernode"):
        check_flower_server(argv)
    elif program == "flwr":
        check_flwr(argv)
    elif program in ("python", "python3"):
        check_python(argv)
    elif program == "pytest":
        for a in argv[1:]:
            assert a.startswith("-") or a in ("deployment",) or (REPO / a).exists(), argv
    elif program == "bash":
        assert (REPO / argv[1]).is_file(), argv
    elif program == "pip":
        assert argv[1] in GENERIC["pip"], argv
    elif program == ".":
        assert argv[1:] == [".venv/bin/activate"], argv
    elif program == "mkdir":
        assert argv[1] == "-p" and all(a.startswith("/") for a in argv[2:]), argv
    else:
        pytest.fail(f"docs/deployment.md: {shlex.join(argv)}: no check for {program!r} here")


# ----------------------------------------------------------------------------- tests
def test_the_page_has_the_commands_of_every_step():
    programs = {c[0] for c in page_commands()}
    want = {
        "scripts/deploy/make_certs.sh",
        "scripts/deploy/make_supernode_keys.sh",
        "scripts/deploy/start_superlink.sh",
        "scripts/deploy/write_cli_config.sh",
        "scripts/deploy/register_supernode.sh",
        "scripts/deploy/start_supernode.sh",
        "scripts/deploy/run_app.sh",
        "flower-superlink",
        "flower-supernode",
        "flwr",
        "pip",
    }
    assert want <= programs, want - programs
    text = PAGE.read_text(encoding="utf-8")
    assert "strategy.quorum" in text and "strategy.grace-s" in text


def test_every_command_of_the_page_names_what_exists():
    cmds = page_commands()
    assert len(cmds) > 20
    for argv in cmds:
        check_command(argv)


def test_the_quorum_run_is_on_the_page_and_valid():
    runs = [c for c in page_commands() if c[0] == "scripts/deploy/run_app.sh" and len(c) > 3]
    quorum = [c for c in runs if "strategy.quorum" in c[3] and "strategy.grace-s" in c[3]]
    assert quorum, "no run_app.sh command with strategy.quorum and strategy.grace-s"
    from flwr.common.config import parse_config_args

    overrides = parse_config_args([quorum[0][3]])
    assert overrides["strategy.quorum"] != 1.0 and overrides["strategy.grace-s"] > 0


@pytest.mark.parametrize(
    "argv, wrong",
    [
        (["flower-supernode", "--superlink", "a:1", "--no-such-flag"], "--no-such-flag"),
        (["flower-superlink", "--port"], "--port"),
        (["flwr", "supernode", "rgister", "k.pub"], "rgister"),
        (["flwr", "log", "1", "federation", "--follow"], "--follow"),
        (["scripts/deploy/start_supernode.sh", "ca.crt", "a:1"], "arguments"),
        (["scripts/deploy/run_app.sh", "simulations/isoloco-lm", "f", "strategy.quorum=0.0"], ""),
        (["scripts/deploy/run_app.sh", "simulations/isoloco-lm", "f", "strategy.qorum=1.0"], ""),
        (["uv", "pip", "install", "."], "uv"),
    ],
)
def test_a_wrong_command_is_caught(argv, wrong):
    with pytest.raises((AssertionError, pytest.fail.Exception)) as err:
        check_command(argv)
    assert wrong in str(err.value)
