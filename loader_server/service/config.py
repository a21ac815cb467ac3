"""Daemon configuration: one TOML file (``[daemon]`` and ``[spec]`` tables), CLI flags on top.

Precedence, lowest first: built-in defaults < the ``--config`` file < command-line flags.
Keys mirror the ``serve`` flags with underscores (``--metrics-port`` -> ``metrics_port``).

``DaemonConfig`` is the one statement of the daemon's settings: each field's type, default
and ``setting(...)`` metadata (help, how it is written as text) give the ``[daemon]`` keys,
their parsing and type checks, and the ``serve`` flags with their help (``SETTINGS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

from loader_server.data.dataset import SCAN_BYTES
from loader_server.service.limits import SpecLimits
from loader_server.wire.files import read_toml
from loader_server.wire.protocol import DEFAULT_ENDPOINT
from loader_server.wire.spec import INT32_MAX, BatchSpec, expand_profile

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, what: str = "size") -> int:
    """``"512M"``, ``"2G"``, ``"1048576"`` -> bytes (binary units, an optional ``B``/``iB``)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    if not number.isdigit():
        raise ValueError(f"{what} must be a size such as 64M, 2G or 1048576, got {text!r}")
    return int(number) * _UNITS[unit]


def format_bytes(n: int) -> str:
    """The shortest exact spelling ``parse_bytes`` reads back: 268435456 -> ``"256M"``."""
    for unit, size in reversed(_UNITS.items()):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)  # 0


def parse_octal(text: str, what: str = "mode") -> int:
    """``"0660"`` -> 0o660."""
    try:
        return int(text, 8)
    except ValueError:
        raise ValueError(f"{what} must be an octal string like '0660', got {text!r}") from None


def _parse_path(text: str, what: str) -> Path:
    return Path(text)


@dataclass(frozen=True)
class Kind:
    """How a setting is written as text (a TOML string, a flag's value, the help's default).

    ``parse`` reads text given for a setting whose type is not ``str`` (``None``: such text is
    refused by the type check); ``show`` writes a value back for the help text.
    """

    name: str
    parse: Callable[[str, str], Any] | None = None
    show: Callable[[Any], str] = str


TEXT = Kind("text")
INTEGER = Kind("integer")
NUMBER = Kind("number", show=lambda v: f"{v:g}")  # 120.0 -> "120"
SWITCH = Kind("switch")
PATH = Kind("path", _parse_path)
DIRECTORY = Kind("directory", _parse_path)
#: A file that must exist: the CLI checks before starting; from the config file, the
#: daemon's open of it says what is wrong.
FILE = Kind("file", _parse_path)
SIZE = Kind("size", parse_bytes, format_bytes)  # bytes, or "512M", "4G"
OCTAL = Kind("octal", parse_octal, lambda v: f"{v:04o}")  # file mode bits, "0660"

#: The kind of a setting whose metadata names none, by its type.
_KIND_OF_TYPE: dict[type, Kind] = {
    str: TEXT,
    int: INTEGER,
    float: NUMBER,
    bool: SWITCH,
    Path: PATH,
}


@dataclass(frozen=True)
class _Doc:
    help: str
    kind: Kind | None
    shown_default: str | None
    flag: str | None
    file_only: bool


_META = "setting"


def setting(
    help: str,
    *,
    kind: Kind | None = None,
    shown_default: str | None = None,
    flag: str | None = None,
    file_only: bool = False,
) -> dict[str, _Doc]:
    """The ``field(metadata=...)`` making a ``DaemonConfig`` field a ``[daemon]`` key and a
    ``serve`` flag.

    Args:
        help: one phrase, no final period (the help adds ``[default: ...]`` and the period).
        kind: how it is written as text, where its type does not say (``SIZE``, ``OCTAL``...).
        shown_default: the help's default when the field's is ``None`` for "decided at start".
        flag: click's declaration, where not ``--`` + the name with dashes.
        file_only: no flag: set in the config file only.
    """
    return {_META: _Doc(help, kind, shown_default, flag, file_only)}


@dataclass(frozen=True)
class Setting:
    """One ``[daemon]`` key (and, unless file-only, ``serve`` flag), from its field."""

    name: str
    help: str
    kind: Kind
    default: Any
    #: The help's ``[default: ...]``; ``None``: no default worth showing (off, or a switch).
    shown_default: str | None
    #: click's declaration; ``None``: set in the config file only.
    flag: str | None

    def parse(self, value: Any) -> Any:
        """A TOML or flag value as the field holds it (the type check comes after)."""
        if isinstance(value, str) and self.kind.parse is not None:
            return self.kind.parse(value, self.name)
        return value


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything ``dflash-loader serve`` needs. Units are in the names.

    The field order is the ``serve --help`` order.
    """

    dataset: Path | None = field(
        default=None, metadata=setting("Arrow file or shard folder to serve")
    )
    endpoint: str = field(default=DEFAULT_ENDPOINT, metadata=setting("ZeroMQ endpoint"))
    slots: int = field(default=4, metadata=setting("Ring slots per session"))
    shm_dir: Path = field(
        default=Path("/dev/shm"), metadata=setting("Where rings live", kind=DIRECTORY)
    )
    shm_mode: int = field(default=0o600, metadata=setting("Ring file mode, octal", kind=OCTAL))
    group: str | None = field(
        default=None, metadata=setting("Group owning ring files (with --shm-mode 0660)")
    )
    vocab_size: int | None = field(default=None, metadata=setting("Token ids must be below this"))
    check_values: bool = field(
        default=False,
        metadata=setting(
            "Scan every token at start (ids < vocab, mask in {0,1})",
            flag="--check-values/--no-check-values",
        ),
    )
    value_scan_bytes: int = field(
        default=SCAN_BYTES,
        metadata=setting(
            "Scan every value at start for corpora with at most this much token data "
            "(larger ones are checked as served)",
            kind=SIZE,
        ),
    )
    pad_id: int = field(default=0, metadata=setting("Padding token id"))
    session_timeout_s: float = field(
        default=120.0, metadata=setting("Drop a session silent this long")
    )
    corpus_check_s: float = field(
        default=0.5, metadata=setting("How often the corpus files are checked for changes")
    )
    max_ring_bytes: int | None = field(
        default=None,
        metadata=setting(
            "Shared memory one session may take (64M, 1G...)",
            kind=SIZE,
            shown_default="min(1G, budget/8)",
        ),
    )
    shm_budget_bytes: int | None = field(
        default=None,
        metadata=setting(
            "Shared memory all sessions may take",
            kind=SIZE,
            shown_default="3/4 of the shm dir's free space",
        ),
    )
    max_sessions_per_peer: int = field(
        default=8, metadata=setting("Sessions one client connection may hold")
    )
    limit_grad_accum: int = field(
        default=SpecLimits.max_grad_accum,
        metadata=setting("Largest grad_accum a client may ask for"),
    )
    limit_token_budget: int = field(
        default=SpecLimits.max_token_budget,
        metadata=setting("Largest token_budget a client may ask for"),
    )
    limit_batch_size: int = field(
        default=SpecLimits.max_batch_size,
        metadata=setting("Largest max_batch_size a client may ask for"),
    )
    limit_seq_len: int = field(
        default=SpecLimits.max_seq_len, metadata=setting("Largest max_seq_len a client may ask for")
    )
    metrics_port: int = field(default=0, metadata=setting("Prometheus port; 0 = off"))
    # metrics_host and log_level are file-only, as they always were: serve has no flag for them.
    metrics_host: str = field(
        default="127.0.0.1",
        metadata=setting("Address the metrics endpoint binds to", file_only=True),
    )
    log_level: str = field(
        default="info", metadata=setting("debug, info, warning or error", file_only=True)
    )
    curve_secret_key_file: Path | None = field(
        default=None,
        metadata=setting(
            "ZeroMQ CURVE certificate (zmq.auth.create_certificates) securing tcp://", kind=FILE
        ),
    )
    insecure_tcp: bool = field(
        default=False,
        metadata=setting("Allow a tcp:// endpoint without CURVE (loopback only; testing)"),
    )
    # Not a setting: the [spec] table, with its own flags (cli/spec_flags.py).
    spec: BatchSpec = field(default_factory=BatchSpec)

    def __post_init__(self) -> None:
        self._check_types()
        if not 1 <= self.slots <= 64:
            raise ValueError(f"slots must be in [1, 64], got {self.slots}")
        if not 0 <= self.shm_mode <= 0o777:  # a TOML integer 660 is decimal: 0o1224
            raise ValueError(
                f"shm_mode must be permission bits in [0, 0o777], got {self.shm_mode} "
                f'(octal {self.shm_mode:o}): write it as a string, shm_mode = "0660", or in '
                "TOML's octal, shm_mode = 0o660"
            )
        if self.session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {self.session_timeout_s}")
        if self.corpus_check_s <= 0:
            raise ValueError(f"corpus_check_s must be positive, got {self.corpus_check_s}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        for name in ("max_ring_bytes", "shm_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive size, got {value}")
        if self.value_scan_bytes < 0:
            raise ValueError(f"value_scan_bytes must be >= 0, got {self.value_scan_bytes}")
        if self.max_sessions_per_peer < 1:
            raise ValueError(
                f"max_sessions_per_peer must be >= 1, got {self.max_sessions_per_peer}"
            )
        if not 0 <= self.pad_id <= INT32_MAX:
            raise ValueError(f"pad_id must be a token id in [0, {INT32_MAX}], got {self.pad_id}")
        for name in ("limit_token_budget", "limit_batch_size", "limit_seq_len", "limit_grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

    def limits(self) -> SpecLimits:
        """What one client's spec may ask of this daemon."""
        return SpecLimits(
            max_token_budget=self.limit_token_budget,
            max_batch_size=self.limit_batch_size,
            max_seq_len=self.limit_seq_len,
            max_grad_accum=self.limit_grad_accum,
        )

    def _check_types(self) -> None:
        for name, (base, optional) in _FIELD_TYPES.items():
            value, want = getattr(self, name), _WIDENED.get(base, (base,))
            if value is None and optional:
                continue
            if (isinstance(value, bool) and bool not in want) or not isinstance(value, want):
                names = " or ".join(t.__name__ for t in want)
                raise ValueError(f"{name} must be {names}, got {value!r}")

    def with_overrides(self, daemon: dict[str, Any], spec: dict[str, Any]) -> DaemonConfig:
        """A copy with non-None ``daemon`` settings (TOML or flag values) and ``spec`` fields
        replaced."""
        spec = expand_profile(spec)  # the profile's fields override the base spec's
        merged_spec = BatchSpec.from_dict({**self.spec.to_dict(), **spec}) if spec else self.spec
        values = {k: SETTINGS[k].parse(v) for k, v in daemon.items() if v is not None}
        return replace(self, **values, spec=merged_spec)


#: Types a field's value may have beyond its annotation: TOML writes 120.0 s as 120.
_WIDENED: dict[type, tuple[type, ...]] = {float: (int, float)}


def _field_types() -> dict[str, tuple[type, bool]]:
    """Field -> (its type, whether it may be None), from the annotations."""
    out = {}
    for name, hint in get_type_hints(DaemonConfig).items():
        args = get_args(hint) or (hint,)
        (base,) = (a for a in args if a is not type(None))
        out[name] = (base, type(None) in args)
    return out


_FIELD_TYPES = _field_types()


def _setting(f: Field[Any], doc: _Doc) -> Setting:
    kind = doc.kind or _KIND_OF_TYPE[_FIELD_TYPES[f.name][0]]
    shown = doc.shown_default
    if shown is None and f.default is not None and kind is not SWITCH:
        shown = kind.show(f.default)
    flag = None if doc.file_only else doc.flag or "--" + f.name.replace("_", "-")
    return Setting(f.name, doc.help, kind, f.default, shown, flag)


#: Every ``[daemon]`` key, in field order (``spec`` is the ``[spec]`` table).
SETTINGS: dict[str, Setting] = {
    f.name: _setting(f, f.metadata[_META]) for f in fields(DaemonConfig) if _META in f.metadata
}


def load_config(path: str | Path | None) -> DaemonConfig:
    """Defaults, overlaid with the TOML file at ``path`` when given."""
    base = DaemonConfig()
    if path is None:
        return base
    path = Path(path)
    try:
        data = read_toml(path, "a TOML config ([daemon], [spec])")
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    unknown_tables = sorted(set(data) - {"daemon", "spec"})
    loose = [k for k in unknown_tables if not isinstance(data[k], dict)]
    if loose:  # `dataset = ...` above any [table] header
        where = "[daemon]" if loose[0] in SETTINGS else "[daemon] or [spec]"
        raise ValueError(f"{path}: key {loose[0]!r} is outside any table: put it under {where}")
    if unknown_tables:
        raise ValueError(f"{path}: unknown table [{unknown_tables[0]}] (expected [daemon], [spec])")
    daemon, spec = data.get("daemon", {}), data.get("spec", {})
    for name, table in (("daemon", daemon), ("spec", spec)):
        if not isinstance(table, dict):
            raise ValueError(
                f"{path}: [{name}] must be a table of keys, got a {type(table).__name__} "
                f"({name} = {table!r})"
            )
    unknown = sorted(set(daemon) - SETTINGS.keys())
    if unknown:
        raise ValueError(
            f"{path}: unknown key {unknown[0]!r} in [daemon] (known: {sorted(SETTINGS)})"
        )
    try:
        return base.with_overrides(daemon, spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
