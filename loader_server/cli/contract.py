"""What every command of ``dflash-loader`` and ``dflash-train`` promises about failing.

* An error prints one line, ``Error: ...``, naming the offending value, file, column or
  row, and exits 1 (``EXIT_ERROR``): a user's mistake (``USER_ERRORS``: bad values,
  paths, corpora, endpoints) as itself, anything unexpected with its type and "(--debug
  shows where)". ``--debug`` (or ``<NAME>_DEBUG=1``) shows the traceback instead.
* A usage error (an unknown flag, a bad value click checks) exits 2 (``EXIT_USAGE``).
* Ctrl-C prints ``Error: interrupted`` and exits 130 (``EXIT_INTERRUPTED``); under
  ``stop_signals_raise`` SIGTERM and SIGHUP end a command the same way, with 128 + the
  signal's number.
* A command may add codes of its own (``regen --server``: 3 when some rows failed); its
  ``--help`` says so.

Both command groups are a ``OneLineGroup`` (each names its debug variable), and log
through ``setup_logging``. This module imports only click, zmq and the loader's two public
error types, so ``dflash-train`` reads it without loading the daemon's commands.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import click
import zmq

from loader_server.data.dataset import DatasetError
from loader_server.wire.protocol import LoaderError

#: What a user can cause and fix: printed as one line naming the file, flag or value.
USER_ERRORS: tuple[type[Exception], ...] = (
    ValueError,
    OSError,
    LoaderError,
    DatasetError,
    zmq.ZMQError,
)
EXIT_ERROR = 1
EXIT_USAGE = 2  # click's own
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class OneLineGroup(click.Group):
    """A command group whose errors keep the contract above. Subclasses name their debug
    variable (``debug_env``)."""

    debug_env: ClassVar[str] = ""

    def invoke(self, ctx: click.Context) -> object:
        debug = ctx.params.get("debug") or os.environ.get(self.debug_env) == "1"
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            if debug:
                raise
            click.echo("Error: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except USER_ERRORS as e:
            if debug:
                raise
            raise click.ClickException(one_line(e)) from e
        except Exception as e:
            if debug:
                raise
            raise click.ClickException(
                f"{type(e).__name__}: {one_line(e)} (--debug shows where)"
            ) from e
        return None


def one_line(e: BaseException) -> str:
    """An exception's message on one line (pyarrow and zmq messages may span several),
    naming the file of an OS error."""
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text or type(e).__name__


def setup_logging(verbose: bool = False, prefix: str = "") -> None:
    """Log to stderr, ``prefix`` before each level (a rank's ``[rank 3] ``); without
    timestamps under journald, which adds its own."""
    fmt = f"{prefix}%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stderr, force=True
    )


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command as Ctrl-C does: an exception in the main thread,
    so every cleanup runs (a command's private output folder is removed, its pools
    stopped, its journal closed) before it exits 128 + the signal's number with one line.
    A second signal during that cleanup is ignored; a signal already ignored (``nohup``)
    stays so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if caught:
            return
        caught.append(signum)
        raise SystemExit(128 + signum)

    # A signal ignored on purpose (nohup ignores SIGHUP) stays ignored.
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL]
    old = {sig: signal.signal(sig, handler) for sig in mine}
    try:
        yield
    except SystemExit:
        if caught:
            click.echo(f"Error: stopped by {signal.Signals(caught[0]).name}", err=True)
        raise
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
