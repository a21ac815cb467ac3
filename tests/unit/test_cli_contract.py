"""Both commands keep one error contract (``loader_server.cli.contract``): a user's mistake
is one line, anything else one line with its type, Ctrl-C exits 130, ``--debug`` or the
command's debug variable shows the traceback; and ``dflash-train`` reads the contract
without loading the daemon's commands."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from loader_server.cli.contract import EXIT_ERROR, EXIT_INTERRUPTED, one_line
from loader_server.cli.main import main as loader_main
from trainer.cli import main as train_main

GROUPS = {"DFLASH_LOADER_DEBUG": loader_main, "DFLASH_TRAIN_DEBUG": train_main}


def group_like(main: click.Group, raise_: BaseException) -> click.Group:
    """A group of ``main``'s class and options with one command that raises ``raise_``."""

    @click.command()
    def boom() -> None:
        raise raise_

    return type(main)(name="t", params=main.params, callback=lambda **_: None, commands=[boom])


@pytest.mark.parametrize("env", sorted(GROUPS))
@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (ValueError("bad --x 3:\n  must be > 4"), EXIT_ERROR, "Error: bad --x 3: must be > 4"),
        (FileNotFoundError(2, "No such file", "/a/b"), EXIT_ERROR, "Error: [Errno 2] No such"),
        (RuntimeError("boom"), EXIT_ERROR, "Error: RuntimeError: boom (--debug shows where)"),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "Error: interrupted"),
    ],
)
def test_errors_are_one_line_with_the_contract_s_exit_codes(env, error, code, line, monkeypatch):
    monkeypatch.delenv(env, raising=False)
    res = CliRunner().invoke(group_like(GROUPS[env], error), ["boom"])
    assert res.exit_code == code
    assert res.output.strip().splitlines() == [res.output.strip()]  # one line
    assert res.output.startswith(line)
    assert "Traceback" not in res.output


@pytest.mark.parametrize("env", sorted(GROUPS))
def test_debug_flag_or_variable_shows_the_exception(env, monkeypatch):
    error = RuntimeError("boom")
    res = CliRunner().invoke(group_like(GROUPS[env], error), ["--debug", "boom"])
    assert res.exception is error
    monkeypatch.setenv(env, "1")
    res = CliRunner().invoke(group_like(GROUPS[env], error), ["boom"])
    assert res.exception is error


def test_one_line_names_the_file_of_an_os_error_once():
    e = PermissionError(13, "Permission denied", "/run/x")
    assert one_line(e) == "[Errno 13] Permission denied: '/run/x'"

    class Quiet(OSError):  # a message that leaves the file out
        def __str__(self) -> str:
            return "denied"

    assert one_line(Quiet(13, "Permission denied", "/run/x")) == "/run/x: denied"
    assert one_line(OSError("cannot open /run/x")) == "cannot open /run/x"
    assert one_line(ValueError()) == "ValueError"


def test_the_trainer_reads_the_contract_without_the_daemon_s_commands():
    code = (
        "import sys, trainer.cli; "
        "bad = [m for m in ('loader_server.cli.main', 'loader_server.cli.service', "
        "'loader_server.cli.plan') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
