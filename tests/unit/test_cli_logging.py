"""`dflash-loader -v serve` logs at debug: the group's -v/--debug is not reset by serve's
own logging set-up (which follows the config's log_level)."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from loader_server.cli.main import main
from loader_server.service import daemon


@pytest.mark.parametrize(
    ("args", "config", "want"),
    [
        (["-v"], "", logging.DEBUG),
        (["--debug"], "", logging.DEBUG),
        ([], "", logging.INFO),
        ([], '[daemon]\nlog_level = "debug"\n', logging.DEBUG),
    ],
)
def test_serve_keeps_the_requested_log_level(tmp_path, monkeypatch, args, config, want):
    seen: list[int] = []

    def run(self) -> int:  # the daemon itself is not under test here: its logging set-up is
        seen.append(logging.getLogger().getEffectiveLevel())
        return 0

    monkeypatch.setattr(daemon.Daemon, "run", run)
    toml = tmp_path / "loader.toml"
    toml.write_text(config)
    res = CliRunner().invoke(main, [*args, "serve", "--config", str(toml), "--dataset", "x"])
    assert res.exit_code == 0, res.output
    assert seen == [want]
