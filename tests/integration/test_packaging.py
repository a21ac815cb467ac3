"""Packaging by role: the daemon host installs and runs without torch.

The base install (and ``[daemon]``) must not pull torch; ``[client]`` and ``[train]`` do.
The daemon's commands (synth, inspect, plan, serve, stats) run in subprocesses where
``import torch`` fails, as on a host that never installed it: a ``torch`` package that
raises ImportError is first on their ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomllib
from conftest import ROOT

from scripts.servers.daemon_process import DaemonProcess


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_daemon_install_has_no_torch_and_trainer_extras_do():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "torch" not in _names(project["dependencies"])
    assert "torch" not in _names(extras["daemon"])
    assert {"torch"} <= _names(extras["client"])
    assert {"torch", "transformers"} <= _names(extras["train"])


@pytest.fixture
def torchless_env(tmp_path) -> dict[str, str]:
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError('torch is not installed on this (simulated) daemon host')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), str(ROOT)])
    return env


def _run(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "loader_server", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_blocker_really_blocks(torchless_env):
    out = subprocess.run(
        [sys.executable, "-c", "import torch"], env=torchless_env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "not installed" in out.stderr


def test_daemon_commands_run_without_torch(torchless_env, tmp_path, shm_dir):
    corpus = tmp_path / "corpus"
    _run(torchless_env, "synth", str(corpus), "--samples", "300", "--median-len", "100",
         "--max-len", "400")  # fmt: skip
    assert "samples 300" in _run(torchless_env, "inspect", str(corpus))
    assert "padding efficiency" in _run(
        torchless_env, "plan", str(corpus), "--token-budget", "2048", "--max-seq-len", "512"
    )
    endpoint = f"ipc://{tmp_path}/loader.sock"
    daemon = DaemonProcess(
        corpus,
        endpoint,
        "--shm-dir",
        str(shm_dir),
        log_path=tmp_path / "daemon.log",
        env=torchless_env,
    )
    try:
        assert "300 samples" in _run(torchless_env, "stats", "--endpoint", endpoint)
    finally:
        assert daemon.stop() == 0
    assert "ModuleNotFoundError" not in daemon.log() and "ImportError" not in daemon.log()
