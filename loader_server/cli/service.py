"""Service commands: ``serve`` runs the daemon, ``stats`` asks a running one what it does."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import zmq

from loader_server.cli.spec_flags import pop_spec_overrides, spec_options
from loader_server.service.config import (
    DIRECTORY,
    FILE,
    INTEGER,
    NUMBER,
    PATH,
    SETTINGS,
    SWITCH,
    DaemonConfig,
    Kind,
    Setting,
    load_config,
)
from loader_server.service.daemon import Daemon, EndpointBusyError
from loader_server.wire import protocol as P

#: click's type per kind of setting; the other kinds reach the config as text and are read
#: there (sizes, octal modes), exactly as the same text in the config file would be.
_CLICK_TYPES: dict[Kind, Any] = {
    INTEGER: int,
    NUMBER: float,
    # Not exists=True: click calls an unreadable path "does not exist"; the daemon says which
    # of the two it is.
    PATH: click.Path(path_type=Path),
    DIRECTORY: click.Path(file_okay=False, path_type=Path),
    FILE: click.Path(exists=True, dir_okay=False, path_type=Path),
}


def _flag(s: Setting, decl: str) -> Callable[[Any], Any]:
    """The ``serve`` option ``decl`` of one setting. Its default is None: only a flag that is
    given overrides the config file."""
    shown = "" if s.shown_default is None else f" [default: {s.shown_default}]"
    kw: dict[str, Any] = {"default": None, "help": f"{s.help}{shown}."}
    if s.kind is SWITCH:
        kw["is_flag"] = True
    else:
        kw["type"] = _CLICK_TYPES.get(s.kind)
    return click.option(decl, s.name, **kw)


def _daemon_options(f: Any) -> Any:
    """``--config`` and one flag per ``DaemonConfig`` setting (those not file-only)."""
    flags = [_flag(s, s.flag) for s in SETTINGS.values() if s.flag is not None]
    for opt in reversed(flags):
        f = opt(f)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="TOML config ([daemon], [spec]); flags override it.",
    )(f)


def resolve_config(config_path: Path | None, options: dict[str, Any]) -> DaemonConfig:
    """The daemon's config: defaults < the ``--config`` file < the flags given (``options``:
    ``serve``'s keyword arguments, None where a flag was not given; the spec's are taken out)."""
    spec = pop_spec_overrides(options)
    return load_config(config_path).with_overrides(options, spec)


@click.command()
@_daemon_options
@spec_options(overrides_only=True)
def serve(config_path: Path | None, **kw: Any) -> None:
    """Run the loader daemon: map the dataset, plan epochs, serve batches over shared memory.

    Logs one `READY endpoint=...` line when it can serve (and tells systemd, under
    Type=notify). SIGTERM or SIGINT: stop accepting, tell clients, unlink shared memory,
    exit 0. Spec flags set the defaults for sessions that do not send their own values.
    """
    from loader_server import faults
    from loader_server.cli.contract import setup_logging

    try:
        faults.check()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    config = resolve_config(config_path, kw)
    # `dflash-loader -v serve` (debug already on) is debug whatever the configured level.
    setup_logging(logging.getLogger().isEnabledFor(logging.DEBUG) or config.log_level == "debug")
    try:
        sys.exit(Daemon(config).run())
    except EndpointBusyError as e:
        raise click.ClickException(str(e)) from e


def _request_stats(endpoint: str, timeout_s: float) -> dict[str, Any]:
    problem = P.ipc_problem(endpoint)
    if problem is not None:  # ZeroMQ would keep retrying in silence: say why now
        raise click.ClickException(problem[1])
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encode("stats"))
        if not sock.poll(int(timeout_s * 1000)):
            raise click.ClickException(f"no daemon answered on {endpoint} within {timeout_s} s")
        return P.decode(sock.recv(), max_bytes=P.MAX_STATS_BYTES)
    finally:
        sock.close()


def format_stats(st: dict[str, Any]) -> str:
    lines = [
        f"daemon pid {st['pid']} instance {st['instance']} up {st['uptime_s']:.0f} s, "
        f"dataset {st['dataset']} ({st['samples']:,} samples), errors {st['errors']}",
        f"{'job':<16}{'rank':>6}{'epoch':>7}{'step':>8}{'micro':>6}{'ring':>7}"
        f"{'batches':>10}{'tokens/s':>12}{'wait s':>9}",
    ]
    for s in sorted(st["sessions"], key=lambda s: (s["job"], s["rank"])):
        e, step, micro = s["pos"]
        lines.append(
            f"{s['job'][:15]:<16}{s['rank']:>4}/{s['world_size']:<1}{e:>7}{step:>8}{micro:>6}"
            f"{s['ring_fill']:>4}/{s['slots']:<2}{s['batches']:>10}{s['tokens_per_s']:>12,.0f}"
            f"{s['client_wait_s']:>9.2f}"
            + (f"  (rest of the epoch after {len(s['legs'])} shape change(s))"
               if s.get("legs") else "")
        )  # fmt: skip
    if not st["sessions"]:
        lines.append("(no sessions)")
    return "\n".join(lines)


@click.command()
@click.option("--endpoint", default=P.DEFAULT_ENDPOINT, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", type=float, default=None, help="Refresh every N seconds.")
@click.option("--timeout-s", type=float, default=2.0, show_default=True)
def stats(endpoint: str, as_json: bool, watch: float | None, timeout_s: float) -> None:
    """Show a running daemon's jobs, ranks, positions, ring fill, throughput and waits."""
    while True:
        st = _request_stats(endpoint, timeout_s)
        st.pop("t", None)
        st.pop("v", None)
        click.echo(json.dumps(st, indent=2) if as_json else format_stats(st))
        if watch is None:
            return
        time.sleep(watch)
        click.echo()


COMMANDS = [serve, stats]
