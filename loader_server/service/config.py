"""Daemon configuration: one TOML file (``[daemon]`` and ``[spec]`` tables), CLI flags on top.

Precedence, lowest first: built-in defaults < the ``--config`` file < command-line flags.
Keys mirror the ``serve`` flags with underscores (``--metrics-port`` -> ``metrics_port``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from loader_server.data.dataset import SCAN_BYTES
from loader_server.planning.spec import INT32_MAX, BatchSpec, SpecLimits, expand_profile
from loader_server.wire.protocol import DEFAULT_ENDPOINT


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything ``dflash-loader serve`` needs. Units are in the names."""

    dataset: Path | None = None
    endpoint: str = DEFAULT_ENDPOINT
    slots: int = 4
    shm_dir: Path = Path("/dev/shm")
    shm_mode: int = 0o600
    group: str | None = None
    vocab_size: int | None = None
    check_values: bool = False
    value_scan_bytes: int = SCAN_BYTES
    pad_id: int = 0
    session_timeout_s: float = 120.0
    corpus_check_s: float = 0.5
    max_ring_bytes: int | None = None
    shm_budget_bytes: int | None = None
    max_sessions_per_peer: int = 8
    limit_token_budget: int = SpecLimits.max_token_budget
    limit_batch_size: int = SpecLimits.max_batch_size
    limit_seq_len: int = SpecLimits.max_seq_len
    limit_grad_accum: int = SpecLimits.max_grad_accum
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
    insecure_tcp: bool = False
    curve_secret_key_file: Path | None = None
    spec: BatchSpec = field(default_factory=BatchSpec)

    def __post_init__(self) -> None:
        self._check_types()
        if not 1 <= self.slots <= 64:
            raise ValueError(f"slots must be in [1, 64], got {self.slots}")
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
        for f in fields(self):
            value, want = getattr(self, f.name), _TYPES.get(f.name)
            if want is None or value is None:
                continue
            if (isinstance(value, bool) and bool not in want) or not isinstance(value, want):
                names = " or ".join(t.__name__ for t in want)
                raise ValueError(f"{f.name} must be {names}, got {value!r}")

    def with_overrides(self, daemon: dict[str, Any], spec: dict[str, Any]) -> DaemonConfig:
        """A copy with non-None ``daemon`` fields and ``spec`` fields replaced."""
        spec = expand_profile(spec)  # the profile's fields override the base spec's
        merged_spec = BatchSpec.from_dict({**self.spec.to_dict(), **spec}) if spec else self.spec
        values = {k: _coerce(k, v) for k, v in daemon.items() if v is not None}
        return replace(self, **values, spec=merged_spec)


_TYPES: dict[str, tuple[type, ...]] = {
    "dataset": (Path,),
    "endpoint": (str,),
    "slots": (int,),
    "shm_dir": (Path,),
    "shm_mode": (int,),
    "group": (str,),
    "vocab_size": (int,),
    "check_values": (bool,),
    "value_scan_bytes": (int,),
    "pad_id": (int,),
    "session_timeout_s": (int, float),
    "corpus_check_s": (int, float),
    "max_ring_bytes": (int,),
    "shm_budget_bytes": (int,),
    "max_sessions_per_peer": (int,),
    "limit_token_budget": (int,),
    "limit_batch_size": (int,),
    "limit_seq_len": (int,),
    "limit_grad_accum": (int,),
    "metrics_port": (int,),
    "metrics_host": (str,),
    "log_level": (str,),
    "insecure_tcp": (bool,),
    "curve_secret_key_file": (Path,),
    "spec": (BatchSpec,),
}
_DAEMON_KEYS = {f.name for f in fields(DaemonConfig)} - {"spec"}


def _coerce(key: str, value: Any) -> Any:
    if key == "shm_mode" and isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            raise ValueError(
                f"shm_mode must be an octal string like '0660', got {value!r}"
            ) from None
    if key in ("dataset", "shm_dir", "curve_secret_key_file") and isinstance(value, str):
        return Path(value)
    if key in ("max_ring_bytes", "shm_budget_bytes", "value_scan_bytes") and isinstance(value, str):
        return parse_bytes(value, key)
    return value


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, what: str = "size") -> int:
    """``"512M"``, ``"2G"``, ``"1048576"`` -> bytes (binary units, an optional ``B``/``iB``)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    if not number.isdigit():
        raise ValueError(f"{what} must be a size such as 64M, 2G or 1048576, got {text!r}")
    return int(number) * _UNITS[unit]


def load_config(path: str | Path | None) -> DaemonConfig:
    """Defaults, overlaid with the TOML file at ``path`` when given."""
    base = DaemonConfig()
    if path is None:
        return base
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    unknown_tables = sorted(set(data) - {"daemon", "spec"})
    if unknown_tables:
        raise ValueError(f"{path}: unknown table [{unknown_tables[0]}] (expected [daemon], [spec])")
    daemon = data.get("daemon", {})
    unknown = sorted(set(daemon) - _DAEMON_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown key {unknown[0]!r} in [daemon] (known: {sorted(_DAEMON_KEYS)})"
        )
    try:
        return base.with_overrides(daemon, data.get("spec", {}))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
