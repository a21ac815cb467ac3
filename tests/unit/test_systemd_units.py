"""systemd units and example config: `systemd-analyze verify` is clean, settings are present.

`systemd-analyze verify` exits 0 for most problems (unknown keys, bad values, typos in
section names) and only prints them, so the verify test fails on any output line that
names one of our units. It works without a running systemd (in containers, in CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib  # Python >= 3.11, as pyproject.toml requires
from conftest import ROOT

SYSTEMD_DIR = ROOT / "systemd"
LOADER_UNIT = "dflash-loader.service"
TRAINER_UNIT = "dflash-trainer@.service"
UNITS = (LOADER_UNIT, TRAINER_UNIT)
VENV_BIN = "/opt/dflash-loader/.venv/bin/"
TRUE = {"1", "yes", "y", "true", "t", "on"}

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (CI installs systemd; apt-get install systemd)",
)

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> key -> every value assigned, in order (keys like Environment= repeat)."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines, "").strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"assignment before any section: {line!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit(name: str) -> Unit:
    return parse_unit((SYSTEMD_DIR / name).read_text())


def last(section: dict[str, list[str]], key: str) -> str | None:
    values = section.get(key)
    return values[-1] if values else None


def words(section: dict[str, list[str]], key: str) -> list[str]:
    return " ".join(section.get(key, [])).split()


def load_config() -> dict:
    with open(SYSTEMD_DIR / "loader.toml", "rb") as f:
        return tomllib.load(f)


# --- systemd-analyze verify ---------------------------------------------------------------


def _stage(tmp_path: Path, names: tuple[str, ...], edit=lambda text: text) -> list[Path]:
    """Copy units into tmp_path, pointing /opt/... binaries at stub executables there.

    verify fails when an ExecStart binary is missing; the point here is our unit syntax,
    not whether this machine has the service installed.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    staged = []
    for name in names:
        text = (SYSTEMD_DIR / name).read_text()
        for exe in set(re.findall(re.escape(VENV_BIN) + r"([\w.-]+)", text)):
            stub = bin_dir / exe
            stub.write_text("#!/bin/sh\nexit 0\n")
            stub.chmod(0o755)
        text = text.replace(VENV_BIN, f"{bin_dir}/")
        path = tmp_path / name
        path.write_text(edit(text))
        staged.append(path)
    return staged


def _verify(paths: list[Path]) -> tuple[int, list[str]]:
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C"}
    proc = subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


def _about_our_units(lines: list[str]) -> list[str]:
    # Messages name either the file path or the unit (a template is verified as `name@i`).
    return [line for line in lines if "dflash-" in line]


@needs_systemd_analyze
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    paths = _stage(tmp_path, UNITS)
    rc, lines = _verify(paths)
    output = "\n".join(lines)
    assert rc == 0, f"systemd-analyze verify exited {rc}:\n{output}"
    assert _about_our_units(lines) == [], f"systemd-analyze verify warnings:\n{output}"


@needs_systemd_analyze
def test_verify_check_catches_a_bad_key(tmp_path: Path) -> None:
    """Control: the check above would notice a warning, so its silence means something."""
    paths = _stage(tmp_path, UNITS, edit=lambda t: t.replace("[Service]\n", "[Service]\nBogus=1\n"))
    _, lines = _verify(paths)
    flagged = _about_our_units(lines)
    assert any(LOADER_UNIT in line and "Bogus" in line for line in flagged), lines
    assert any("dflash-trainer@" in line and "Bogus" in line for line in flagged), lines


# --- required settings --------------------------------------------------------------------


def test_loader_unit_settings() -> None:
    svc = unit(LOADER_UNIT)["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "User": "dflash",
        "Group": "dflash",
        "RuntimeDirectory": "dflash-loader",
        "RuntimeDirectoryMode": "0750",
        "WatchdogSec": "30",
        "Restart": "on-failure",
        "RestartSec": "2",
        "KillSignal": "SIGTERM",
        "TimeoutStopSec": "30",
        "LimitNOFILE": "65536",
        "LimitMEMLOCK": "infinity",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "RemoveIPC": "no",
    }
    assert {k: last(svc, k) for k in expected} == expected
    assert last(svc, "ExecStart") == (
        f"{VENV_BIN}dflash-loader serve --config /etc/dflash-loader/loader.toml"
    )
    assert "/dev/shm" in words(svc, "ReadWritePaths")


@pytest.mark.parametrize("name", UNITS)
def test_units_keep_gpus_and_shm(name: str) -> None:
    svc = unit(name)["Service"]
    # PrivateDevices hides /dev/nvidia* and gives a private /dev/shm (the rings must be
    # shared); DynamicUser implies RemoveIPC=yes, which deletes shm files on stop;
    # PrivateIPC would separate the units' IPC namespaces.
    for key in ("PrivateDevices", "DynamicUser", "PrivateIPC"):
        assert (last(svc, key) or "no").lower() not in TRUE, f"{name}: {key}= must stay off"
    assert last(svc, "DevicePolicy") in (None, "auto"), "closed/strict would drop the GPUs"
    assert last(svc, "RemoveIPC") == "no"
    assert last(svc, "LimitMEMLOCK") == "infinity"
    assert unit(name)["Install"]["WantedBy"] == ["multi-user.target"]


def test_loader_unit_has_no_device_allow_list() -> None:
    # The daemon opens no device, but ProtectClock's implicit DeviceAllow= (and any
    # DeviceAllow=) would make an allow-list that hides /dev/nvidia* from anything it runs.
    svc = unit(LOADER_UNIT)["Service"]
    assert "DeviceAllow" not in svc
    assert (last(svc, "ProtectClock") or "no").lower() not in TRUE


def test_trainer_device_allow_list_has_every_gpu_and_rdma_node() -> None:
    """An allow-list: it must name every NVIDIA driver node (nvidia0.., nvidiactl, -uvm,
    -caps, -nvswitch: all drivers whose /proc/devices name starts with nvidia) and the
    InfiniBand nodes NCCL opens, with read and write access."""
    allowed = dict(v.split() for v in unit(TRAINER_UNIT)["Service"]["DeviceAllow"])
    assert allowed == {
        "char-nvidia*": "rw",
        "char-infiniband_verbs": "rw",
        "char-gdrdrv": "rw",
        "/dev/infiniband/rdma_cm": "rw",
    }
    import fnmatch

    for driver in ("nvidia", "nvidia-frontend", "nvidia-uvm", "nvidia-caps", "nvidia-nvswitch"):
        assert fnmatch.fnmatch(driver, "nvidia*"), driver


def test_trainer_unit_hardening() -> None:
    svc = unit(TRAINER_UNIT)["Service"]
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "ProtectKernelModules": "yes",
        "RestrictNamespaces": "yes",
        "UMask": "0027",
    }
    assert {k: last(svc, k) for k in expected} == expected
    # Everything the job writes by default is a directory the unit creates for it.
    env = dict(v.split("=", 1) for v in svc["Environment"])
    state = ["/var/lib/" + d for d in words(svc, "StateDirectory")]
    cache = ["/var/cache/" + d for d in words(svc, "CacheDirectory")]
    assert env["RUN_DIR"] in state and last(svc, "WorkingDirectory") in state
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME"):
        assert any(env[key].startswith(c + "/") for c in cache), key
    # The user's home (README's useradd) is a StateDirectory too, so it is writable.
    readme = (SYSTEMD_DIR / "README.md").read_text()
    home = re.search(r"--home-dir (\S+) [^\n]*\n?[^\n]*dflash-train\b", readme)
    assert home is not None and home.group(1) in state, readme[:3000]


def test_trainer_stop_and_restart_timing() -> None:
    """A stop is a success (the launcher exits 0 after SIGTERM), and the restarts the start
    limit allows reach past the daemon's session timeout (an old run's session held by a
    stuck process refuses a new spec until then)."""
    u = unit(TRAINER_UNIT)
    svc = u["Service"]
    assert last(svc, "KillMode") == "mixed" and last(svc, "KillSignal") == "SIGTERM"
    assert "SuccessExitStatus" not in svc  # exit 1 is a crash, never a stop
    from loader_server.service.config import DaemonConfig

    timeout = DaemonConfig().session_timeout_s
    restart_s = int(last(svc, "RestartSec") or 0)
    burst = int(last(u["Unit"], "StartLimitBurst") or 5)
    assert (burst - 1) * restart_s > timeout
    assert int(last(svc, "TimeoutStopSec") or 0) >= 60  # a step and a checkpoint


def test_trainer_unit_settings() -> None:
    u = unit(TRAINER_UNIT)
    deps, svc = u["Unit"], u["Service"]
    assert LOADER_UNIT in words(deps, "Wants")
    assert LOADER_UNIT in words(deps, "After")
    # A loader restart must not stop or restart the trainers.
    for key in ("Requires", "BindsTo", "PartOf", "Requisite"):
        assert LOADER_UNIT not in words(deps, key), f"{key}= would tie trainers to the loader"
    assert last(svc, "Restart") == "on-failure"
    assert last(svc, "RestartSec")
    assert "dflash" in words(svc, "SupplementaryGroups")
    assert last(svc, "EnvironmentFile") == "/etc/dflash-loader/trainer-%i.env"
    exec_start = last(svc, "ExecStart") or ""
    assert exec_start.startswith(f"{VENV_BIN}dflash-torchrun --nproc-per-node ${{NPROC}} ")
    assert f"{VENV_BIN}dflash-train train --resume " in exec_start
    # Every venv binary a unit runs is one of our console scripts (or torch's torchrun).
    with open(SYSTEMD_DIR.parent / "pyproject.toml", "rb") as f:
        scripts = set(tomllib.load(f)["project"]["scripts"])
    for name in UNITS:
        text = (SYSTEMD_DIR / name).read_text()
        for exe in re.findall(re.escape(VENV_BIN) + r"([\w.-]+)", text):
            assert exe in scripts, f"{name} runs {exe}, which pyproject.toml does not install"


def test_units_agree_with_loader_toml() -> None:
    daemon = load_config()["daemon"]
    loader, trainer = unit(LOADER_UNIT)["Service"], unit(TRAINER_UNIT)["Service"]
    endpoint = daemon["endpoint"]
    assert endpoint.startswith("ipc:///run/")
    # The ipc socket lives in the unit's RuntimeDirectory.
    assert os.path.dirname(endpoint.removeprefix("ipc://")) == "/run/" + last(
        loader, "RuntimeDirectory"
    )
    assert f"LOADER_ENDPOINT={endpoint}" in trainer["Environment"]
    read_only = [p.lstrip("-") for p in words(loader, "ReadOnlyPaths")]
    assert daemon["dataset"] in read_only
    assert daemon["shm_dir"] in words(loader, "ReadWritePaths")
    assert daemon["group"] == last(loader, "Group")
    assert daemon["group"] in words(trainer, "SupplementaryGroups")


# --- loader.toml --------------------------------------------------------------------------

DAEMON_KEYS = {
    "dataset": str,
    "endpoint": str,
    "slots": int,
    "shm_dir": str,
    "shm_mode": str,
    "group": str,
    "vocab_size": int,
    "metrics_port": int,
    "metrics_host": str,
    "log_level": str,
}
SPEC_KEYS = {
    "token_budget": int,
    "max_batch_size": int,
    "max_seq_len": int,
    "overlong": str,
    "buckets": str,
    "target_efficiency": float,
    "layout": str,
    "composition": str,
    "order": str,
    "seed": int,
    "cost_c0": float,
    "cost_tok": float,
    "cost_attn": float,
    "cost_slot": float,
    "cost_doc": float,
    "cost_budget": float,
    "block_size": int,
    "anchors_per_doc": int,
    "tokens_per_anchor": int,
    "max_anchors": int,
}


def test_loader_toml_has_the_schema_keys() -> None:
    config = load_config()
    assert set(config) == {"daemon", "spec"}
    for table, schema in (("daemon", DAEMON_KEYS), ("spec", SPEC_KEYS)):
        assert set(config[table]) == set(schema), table
        for key, kind in schema.items():
            assert type(config[table][key]) is kind, f"[{table}] {key}"
    assert int(config["daemon"]["shm_mode"], 8) == 0o660
    assert config["daemon"]["metrics_port"] == 0
    assert config["spec"]["token_budget"] == 65536


def test_loader_toml_is_accepted_by_the_daemon_config() -> None:
    config_module = pytest.importorskip("loader_server.service.config")
    config = config_module.load_config(SYSTEMD_DIR / "loader.toml")
    assert config.shm_mode == 0o660
    assert config.spec.token_budget == 65536


def test_every_loader_toml_key_is_commented() -> None:
    previous = ""
    for line in (SYSTEMD_DIR / "loader.toml").read_text().splitlines():
        stripped = line.strip()
        if re.match(r"^[a-z_]+\s*=", stripped):
            assert previous.startswith("#"), f"no comment above: {stripped}"
        previous = stripped


def test_trainer_env_example_is_plain_assignments() -> None:
    for line in (SYSTEMD_DIR / "trainer.env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.match(r"^[A-Z_][A-Z0-9_]*=", line), f"not KEY=value: {line!r}"
