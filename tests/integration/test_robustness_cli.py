"""Every CLI mistake is one line naming the offending value, a non-zero exit, no traceback
(``--debug`` shows it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_robustness_daemon import one_line_error, run_cli

from loader_server.cli.main import main


def _serve(corpus: Path, tmp: Path, shm: Path, *extra: str) -> list[str]:
    return ["serve", "--dataset", str(corpus), "--endpoint", f"ipc://{tmp}/cli.sock",
            "--shm-dir", str(shm), *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "value"),
    [
        (lambda c, t, s: ["stats", "--endpoint", "garbage"], "garbage"),
        (lambda c, t, s: ["stats", "--endpoint", f"ipc://{t}/nobody.sock", "--timeout-s", "0.3"],
         "nobody.sock does not exist: no daemon is serving"),
        (lambda c, t, s: ["serve", "--dataset", str(c), "--endpoint", "tcp://localhost:notaport",
                          "--insecure-tcp", "--shm-dir", str(s)], "notaport"),
        (lambda c, t, s: ["serve", "--dataset", str(c), "--endpoint", "tcp://0.0.0.0:5999",
                          "--insecure-tcp", "--shm-dir", str(s)], "0.0.0.0"),
        (lambda c, t, s: ["serve", "--dataset", str(c), "--endpoint", "ipc://" + "x" * 200],
         "longer than"),
        (lambda c, t, s: _serve(c, t, s, "--group", "no-such-group-xyz"), "no-such-group-xyz"),
        (lambda c, t, s: _serve(c, t, s, "--max-ring-bytes", "12Q"), "12Q"),
        (lambda c, t, s: _serve(c, t, s, "--shm-mode", "999"), "999"),
        (lambda c, t, s: _serve(c, t, s, "--pad-id", "-1"), "pad_id"),
        (lambda c, t, s: _serve(c, t, s, "--limit-grad-accum", "0"), "limit_grad_accum"),
        (lambda c, t, s: _serve(c, t, s, "--slots", "0"), "slots"),
        (lambda c, t, s: ["serve", "--endpoint", f"ipc://{t}/x.sock"], "--dataset"),
        (lambda c, t, s: ["synth", "/proc/no/such/dir", "--samples", "10"], "/proc/no"),
        (lambda c, t, s: ["synth", str(t / "x"), "--samples", "-5"], "-5"),
        (lambda c, t, s: ["inspect", "/dev/null"], "/dev/null"),
        (lambda c, t, s: ["plan", str(c), "--token-budget", "5"], "token_budget 5"),
        (lambda c, t, s: ["plan", str(c), "--buckets", "9,3"], "[9, 3]"),
    ],
)  # fmt: skip
def test_cli_mistakes_are_one_line(tmp_path, shm_dir, corpus_path, make, value):
    args = make(corpus_path, tmp_path, shm_dir)
    if args[0] == "serve":  # a real process: the daemon sets signal handlers
        result = run_cli(*args)
    else:  # the same main() in this process: no interpreter start-up per case
        r = CliRunner().invoke(main, args)
        result = subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)
    line = one_line_error(result)
    assert value in line, line


def test_bad_config_file_is_one_line(tmp_path, shm_dir, corpus_path):
    cfg = tmp_path / "loader.toml"
    cfg.write_text("[daemon]\nslots = 4\nshm_budget_bytes = 'lots'\n")
    line = one_line_error(run_cli(*_serve(corpus_path, tmp_path, shm_dir, "--config", str(cfg))))
    assert str(cfg) in line and "'lots'" in line
    cfg.write_text("[daemon]\nslot = 4\n")
    assert "'slot'" in one_line_error(run_cli(*_serve(corpus_path, tmp_path, shm_dir, "--config",
                                                      str(cfg))))  # fmt: skip


def test_debug_shows_the_traceback():
    p = run_cli("--debug", "stats", "--endpoint", "garbage")
    assert p.returncode != 0 and "Traceback" in p.stderr and "garbage" in p.stderr
