"""Service commands: ``serve`` runs the daemon, ``stats`` asks a running one what it does."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import zmq

from loader_server.cli.spec_flags import pop_spec_overrides, spec_options
from loader_server.service.config import load_config
from loader_server.service.daemon import Daemon, EndpointBusyError
from loader_server.wire import protocol as P


def _daemon_options(f: Any) -> Any:
    opts = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(dir_okay=False, path_type=Path),
            help="TOML config ([daemon], [spec]); flags override it.",
        ),
        click.option(
            "--dataset",
            # Not exists=True: click calls an unreadable path "does not exist"; the daemon
            # says which of the two it is.
            type=click.Path(path_type=Path),
            help="Arrow file or shard folder to serve.",
        ),
        click.option("--endpoint", help=f"ZeroMQ endpoint [default: {P.DEFAULT_ENDPOINT}]."),
        click.option("--slots", type=int, help="Ring slots per session [default: 4]."),
        click.option(
            "--shm-dir",
            type=click.Path(file_okay=False, path_type=Path),
            help="Where rings live [default: /dev/shm].",
        ),
        click.option("--shm-mode", help="Ring file mode, octal [default: 0600]."),
        click.option("--group", help="Group owning ring files (with --shm-mode 0660)."),
        click.option("--vocab-size", type=int, help="Token ids must be below this."),
        click.option(
            "--check-values/--no-check-values",
            default=None,
            help="Scan every token at start (ids < vocab, mask in {0,1}).",
        ),
        click.option(
            "--value-scan-bytes",
            help="Scan every value at start for corpora with at most this much token data "
            "(larger ones are checked as served) [default: 256M].",
        ),
        click.option("--pad-id", type=int, help="Padding token id [default: 0]."),
        click.option(
            "--session-timeout-s",
            type=float,
            help="Drop a session silent this long [default: 120].",
        ),
        click.option(
            "--corpus-check-s",
            type=float,
            help="How often the corpus files are checked for changes [default: 0.5].",
        ),
        click.option(
            "--max-ring-bytes",
            help="Shared memory one session may take (64M, 1G...) [default: min(1G, budget/8)].",
        ),
        click.option(
            "--shm-budget-bytes",
            help="Shared memory all sessions may take [default: 3/4 of the shm dir's free space].",
        ),
        click.option(
            "--max-sessions-per-peer",
            type=int,
            help="Sessions one client connection may hold [default: 8].",
        ),
        click.option(
            "--limit-grad-accum",
            type=int,
            help="Largest grad_accum a client may ask for [default: 4096].",
        ),
        click.option(
            "--limit-token-budget",
            type=int,
            help="Largest token_budget a client may ask for [default: 16777216].",
        ),
        click.option(
            "--limit-batch-size",
            type=int,
            help="Largest max_batch_size a client may ask for [default: 65536].",
        ),
        click.option(
            "--limit-seq-len",
            type=int,
            help="Largest max_seq_len a client may ask for [default: 1048576].",
        ),
        click.option("--metrics-port", type=int, help="Prometheus port; 0 = off [default: 0]."),
        click.option(
            "--curve-secret-key-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="ZeroMQ CURVE certificate (zmq.auth.create_certificates) securing tcp://.",
        ),
        click.option(
            "--insecure-tcp",
            is_flag=True,
            default=None,
            help="Allow a tcp:// endpoint without CURVE (loopback only; testing).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@click.command()
@_daemon_options
@spec_options(overrides_only=True)
def serve(config_path: Path | None, **kw: Any) -> None:
    """Run the loader daemon: map the dataset, plan epochs, serve batches over shared memory.

    Logs one `READY endpoint=...` line when it can serve (and tells systemd, under
    Type=notify). SIGTERM or SIGINT: stop accepting, tell clients, unlink shared memory,
    exit 0. Spec flags set the defaults for sessions that do not send their own values.
    """
    from loader_server.cli import setup_logging

    spec = pop_spec_overrides(kw)
    config = load_config(config_path).with_overrides(kw, spec)
    setup_logging(config.log_level == "debug")
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
        )
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
