"""``DaemonConfig`` is the one statement of the daemon's settings: its fields give the
``[daemon]`` keys, their parsing and checks, and ``serve``'s flags with their help. These
tests hold each derived surface to the dataclass, through the real click command and TOML
loader (the same path ``serve`` takes, up to starting the daemon)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from loader_server.cli.service import resolve_config, serve
from loader_server.cli.spec_flags import SPEC_FIELDS
from loader_server.service.config import (
    SETTINGS,
    DaemonConfig,
    format_bytes,
    load_config,
    parse_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
#: Settings serve has never had a flag for (set in the config file).
FILE_ONLY = {"metrics_host", "log_level"}
#: Settings the documented config file leaves out on purpose.
NOT_IN_LOADER_TOML = {"insecure_tcp": "a testing switch, never part of a deployed config"}
DEFAULT = DaemonConfig()


def _options() -> dict[str, click.Option]:
    return {p.name: p for p in serve.params if isinstance(p, click.Option) and p.name}


def _config(*args: str) -> DaemonConfig:
    """What ``serve ARGS`` would run with."""
    params = serve.make_context("serve", list(args)).params
    return resolve_config(params.pop("config_path"), params)


def _toml(tmp_path: Path, daemon: str) -> Path:
    path = tmp_path / "loader.toml"
    path.write_text(f"[daemon]\n{daemon}\n")
    return path


def test_every_field_is_a_toml_key_and_all_but_the_file_only_are_flags():
    fields = [f.name for f in dataclasses.fields(DaemonConfig)]
    assert list(SETTINGS) == [n for n in fields if n != "spec"]
    flags = {name for name, s in SETTINGS.items() if s.flag is not None}
    assert set(SETTINGS) - flags == FILE_ONLY
    # serve's parameters: --config, one per flagged setting, the spec's
    assert set(_options()) == {"config_path", "cost_profile", *flags, *SPEC_FIELDS}


def _toml_literal(name: str, value: Any) -> str:
    """``value`` as the config file writes it: text for what the kind parses (sizes,
    modes, paths), else a TOML literal."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float) and SETTINGS[name].kind.parse is None:
        return repr(value)
    return json.dumps(SETTINGS[name].kind.show(value))


@pytest.mark.parametrize("name", [n for n in SETTINGS if getattr(DEFAULT, n) is not None])
def test_each_key_is_read_from_the_file(tmp_path, name):
    # Its default, written into the file, reads back as the default.
    line = f"{name} = {_toml_literal(name, getattr(DEFAULT, name))}"
    assert getattr(load_config(_toml(tmp_path, line)), name) == getattr(DEFAULT, name), line


def test_flag_names_are_the_keys_with_dashes():
    for name, s in SETTINGS.items():
        if s.flag is not None:
            assert s.flag.split("/")[0] == "--" + name.replace("_", "-")


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("endpoint", "ipc:///run/dflash-loader/loader.sock"),
        ("slots", "4"),
        ("shm_dir", "/dev/shm"),
        ("shm_mode", "0600"),
        ("value_scan_bytes", "256M"),
        ("session_timeout_s", "120"),
        ("corpus_check_s", "0.5"),
        ("limit_grad_accum", "4096"),
        ("metrics_port", "0"),
        ("max_ring_bytes", "min(1G, budget/8)"),  # decided at start: a description
    ],
)
def test_help_shows_the_dataclass_default(name, shown):
    assert SETTINGS[name].shown_default == shown
    assert f"[default: {shown}]." in (_options()[name].help or "")


@pytest.mark.parametrize(
    "name", [n for n, s in SETTINGS.items() if s.flag and s.shown_default and s.default is not None]
)
def test_the_default_in_the_help_given_as_the_flag_is_the_default(name):
    s = SETTINGS[name]
    assert s.flag is not None and s.shown_default is not None
    assert getattr(_config(s.flag, s.shown_default), name) == getattr(DEFAULT, name)


def test_no_default_shown_for_switches_and_unset_settings():
    for name in ("dataset", "group", "vocab_size", "check_values", "insecure_tcp"):
        assert "[default:" not in (_options()[name].help or ""), name


def test_help_text_is_the_field_s():
    wide = {"terminal_width": 200, "max_content_width": 200}  # one line per option
    help_text = CliRunner().invoke(serve, ["--help"], **wide).output
    for name, s in SETTINGS.items():
        if s.flag is not None:
            assert s.help in help_text, name


# One setting of each kind: (TOML line, value it gives, flag args, value they give).
ROUND_TRIPS = [
    ("max_ring_bytes = '512M'", 512 << 20, ["--max-ring-bytes", "1G"], 1 << 30),
    ("value_scan_bytes = 1048576", 1 << 20, ["--value-scan-bytes", "64KiB"], 64 << 10),
    ("shm_mode = '0660'", 0o660, ["--shm-mode", "0640"], 0o640),
    ("shm_mode = 0o640", 0o640, ["--shm-mode", "600"], 0o600),
    ("dataset = '/data/a'", Path("/data/a"), ["--dataset", "/data/b"], Path("/data/b")),
    ("shm_dir = '/tmp/shm'", Path("/tmp/shm"), ["--shm-dir", "/tmp"], Path("/tmp")),
    ("vocab_size = 151936", 151936, ["--vocab-size", "32000"], 32000),
    ("check_values = true", True, ["--no-check-values"], False),
    ("insecure_tcp = false", False, ["--insecure-tcp"], True),
    ("session_timeout_s = 30", 30, ["--session-timeout-s", "2.5"], 2.5),
    ("endpoint = 'ipc:///x/a.sock'", "ipc:///x/a.sock", ["--endpoint", "ipc:///y"], "ipc:///y"),
    ("slots = 6", 6, ["--slots", "2"], 2),
]


@pytest.mark.parametrize(("line", "from_file", "flag", "from_flag"), ROUND_TRIPS)
def test_file_value_then_flag_override(tmp_path, line, from_file, flag, from_flag):
    name = line.split("=")[0].strip()
    cfg = str(_toml(tmp_path, line))
    assert getattr(_config("--config", cfg), name) == from_file
    assert getattr(_config("--config", cfg, *flag), name) == from_flag
    assert getattr(_config(*flag), name) == from_flag  # over the default alone too
    # a flag not given leaves the file's value, and other settings keep their defaults
    other = _config("--config", cfg, "--pad-id", "7")
    assert (getattr(other, name), other.pad_id) == (from_file, 7)


def test_existing_file_flag(tmp_path):
    key = tmp_path / "server.key_secret"
    key.write_text("")
    cfg = str(_toml(tmp_path, f"curve_secret_key_file = '{tmp_path}/other'"))
    assert _config("--config", cfg).curve_secret_key_file == tmp_path / "other"
    assert (
        _config("--config", cfg, "--curve-secret-key-file", str(key)).curve_secret_key_file == key
    )
    with pytest.raises(click.BadParameter, match="does not exist"):
        _config("--curve-secret-key-file", str(tmp_path / "missing"))


def test_flags_alone_are_the_defaults():
    assert _config() == DEFAULT


def test_unknown_key_names_the_file_and_key_and_lists_the_known(tmp_path):
    path = _toml(tmp_path, "slot = 4")
    with pytest.raises(ValueError) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}: unknown key 'slot' in [daemon]")
    known = re.search(r"\(known: \[(.*)\]\)", message)
    assert known is not None
    assert known.group(1).replace("'", "").split(", ") == sorted(SETTINGS)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("dataset = 5", "dataset must be Path, got 5"),
        ("slots = true", "slots must be int, got True"),
        ("slots = '4'", "slots must be int, got '4'"),
        ("check_values = 1", "check_values must be bool, got 1"),
        ("session_timeout_s = 'long'", "session_timeout_s must be int or float, got 'long'"),
        ("shm_budget_bytes = 'lots'", "shm_budget_bytes must be a size such as 64M"),
        ("shm_mode = 'rw'", "shm_mode must be an octal string like '0660', got 'rw'"),
        ("log_level = 'loud'", "log_level must be debug|info|warning|error"),
        # a TOML integer is decimal: 660 would be 0o1224, world-writable sockets
        ("shm_mode = 660", "shm_mode must be permission bits in [0, 0o777], got 660 (octal 1224)"),
        ("shm_mode = '7777'", "shm_mode must be permission bits in [0, 0o777], got 4095"),
    ],
)
def test_bad_values_name_the_file_and_key(tmp_path, line, error):
    path = _toml(tmp_path, line)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {error}")):
        load_config(path)


def test_an_octal_mode_reads_as_written(tmp_path):
    assert load_config(_toml(tmp_path, "shm_mode = 0o660")).shm_mode == 0o660
    assert load_config(_toml(tmp_path, "shm_mode = '0640'")).shm_mode == 0o640


def test_a_key_above_every_table_says_where_it_goes(tmp_path):
    path = tmp_path / "loader.toml"
    path.write_text('dataset = "/x"\n[daemon]\nslots = 4\n')
    with pytest.raises(
        ValueError,
        match=re.escape(f"{path}: key 'dataset' is outside any table: put it under [daemon]"),
    ):
        load_config(path)


def test_bad_flag_values_name_the_setting():
    with pytest.raises(ValueError, match=r"max_ring_bytes must be a size .* got '12Q'"):
        _config("--max-ring-bytes", "12Q")
    with pytest.raises(ValueError, match=r"shm_mode must be an octal string .* got '999'"):
        _config("--shm-mode", "999")


def test_none_only_where_the_field_is_optional():
    assert DaemonConfig(vocab_size=None).vocab_size is None
    with pytest.raises(ValueError, match="slots must be int, got None"):
        DaemonConfig(slots=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 1000, 1 << 10, 3 << 20, (1 << 30) + 1, 5 << 40])
def test_sizes_round_trip(n: Any):
    assert parse_bytes(format_bytes(n)) == n


def test_sizes_take_the_largest_exact_unit():
    assert [format_bytes(n) for n in (256 << 20, 1536 << 20, 1 << 40, 1000)] == [
        "256M",
        "1536M",
        "1T",
        "1000",
    ]


def test_the_documented_config_file_names_every_setting():
    text = (ROOT / "systemd" / "loader.toml").read_text()
    daemon = text.split("[daemon]")[1].split("[spec]")[0]
    written = set(re.findall(r"^#?([a-z_]+) = ", daemon, re.MULTILINE))
    assert written == set(SETTINGS) - set(NOT_IN_LOADER_TOML)
    assert load_config(ROOT / "systemd" / "loader.toml").group == "dflash"


def test_the_documented_config_file_s_commented_values_load(tmp_path):
    # Uncommenting every documented key gives a file the daemon accepts.
    text = (ROOT / "systemd" / "loader.toml").read_text()
    path = tmp_path / "loader.toml"
    path.write_text(re.sub(r"^#([a-z_]+ = )", r"\1", text, flags=re.MULTILINE))
    config = load_config(path)
    assert config.max_ring_bytes == 1 << 30 and config.shm_budget_bytes == 8 << 30
    assert config.curve_secret_key_file == Path("/etc/dflash-loader/curve/server.key_secret")
