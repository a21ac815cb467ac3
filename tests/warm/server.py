"""The warm-start server (tests only; docs/TESTING.md, "Warm starts").

    python tests/warm/server.py FOLDER PADDING

Imports torch, transformers' Qwen3 and the trainer once, then serves
``FOLDER/sock``: each request (from ``hook/sitecustomize.py``, a process just started as
``python -m trainer.cli ...``) is forked into a process that takes on the requester's
environment, folder, limits, signal state, warning filters, standard streams and open
files, shows its command line in ``/proc/PID/cmdline`` (written over this process's own
argument area, which PADDING makes long enough) and runs the module as ``-m`` does (or
the script as ``python SCRIPT`` does). The
requester learns the pid at once and the wait status at the end; if it goes away first,
the forked process's group is killed. ``FOLDER/clients/PID`` names the forked process of
each requester while it runs, written by that process once its command line shows
(``tests/procs.py`` reads it: a test that signals a rank it found among its agent's
children reaches the rank itself). Single-threaded by design (no
thread to hold a lock across ``fork``); nothing here runs a torch operation, so no OpenMP
team exists to be lost in the fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import warnings
from pathlib import Path

#: Environment read when a module is imported (or by the C libraries as they load): a
#: request whose values differ from the server's starts cold.
_FIXED_PREFIXES = ("PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONUTF8", "PYTHONIOENCODING",
                   "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONSAFEPATH", "MKL_", "KMP_",
                   "OPENBLAS_", "GOMP_", "LD_", "MALLOC_", "TORCH_LOGS", "TORCHINDUCTOR_",
                   "TORCH_COMPILE", "TORCHDYNAMO_", "PYTORCH_", "CUDA_", "HF_",
                   "TRANSFORMERS_", "TOKENIZERS_", "ARROW_", "OMP_")  # fmt: skip
#: Read at run time, or applied to the fork below.
_FREE = {"OMP_NUM_THREADS"}
#: Flags the fork takes on from the request (the rest must match).
_FREE_FLAGS = {"dont_write_bytecode"}

_STARTUP_FILTERS = list(warnings.filters)
_STARTUP_ENV = dict(os.environ)
#: What this process was started with (the fork keeps the requester's open files instead).
_INHERITED = {int(n) for n in os.listdir("/proc/self/fd")} - {0, 1, 2}


def _log(folder: Path, text: str) -> None:
    with open(folder / "server.log", "a") as f:
        f.write(f"{os.getpid()}: {text}\n")


def _preimport() -> None:
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import torch
    import torch.distributed.run  # noqa: F401
    import transformers  # noqa: F401
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401
    from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: F401

    import trainer.cli
    import trainer.train.loop  # noqa: F401


def _imported_env() -> dict[str, str]:
    """What the pre-imports set in the environment (torch sets its compile cache's folder)."""
    return {k: v for k, v in os.environ.items() if _STARTUP_ENV.get(k) != v}


def _refusal(req: dict) -> str | None:
    """Why ``req`` cannot be run warm (None: it can)."""
    env = req["env"]
    for key in set(env) | set(_STARTUP_ENV):
        if key in _FREE or not key.startswith(_FIXED_PREFIXES):
            continue
        if env.get(key) != _STARTUP_ENV.get(key) and env.get(key) != _imported_env().get(key):
            return f"{key}={env.get(key)!r} (the server has {_STARTUP_ENV.get(key)!r})"
    for name, theirs in req["flags"].items():
        mine = getattr(sys.flags, name, None)
        if name not in _FREE_FLAGS and mine != theirs:
            return f"sys.flags.{name}={theirs} (the server has {mine})"
    if req["xoptions"] != {k: str(v) for k, v in sys._xoptions.items()}:
        return f"-X options {req['xoptions']}"
    return None


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head = b""
    while len(head) < 4:
        more = conn.recv(4 - len(head))
        if not more:
            raise OSError("the requester went away")
        head += more
    (size,) = struct.unpack("!I", head)
    body, fds, _flags, _addr = socket.recv_fds(conn, size, 255)
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise OSError("the requester went away")
        body += more
    return json.loads(body), fds


def _run_script(path: str) -> None:
    """Run ``path`` as ``python PATH`` does: in a fresh ``__main__`` whose ``__file__`` is its
    absolute path, ``sys.argv[0]`` left as it was given (``runpy.run_path`` would set it)."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


class Job:
    """What the forked process runs: the request, applied to this process."""

    def __init__(self, req: dict, fds: list[int], arg_area: tuple[int, int], folder: Path):
        self.req, self.fds, self.arg_area, self.folder = req, fds, arg_area, folder

    def run(self) -> None:
        import runpy

        req = self.req
        self._cmdline()
        # Named as the requester's only now, with its command line shown (tests/procs.py).
        (self.folder / "clients" / str(req["pid"])).write_text(str(os.getpid()))
        # A group of its own (the server kills the group), a session of its own if the
        # requester led one (started with start_new_session, as torchrun starts ranks).
        if req["session"]:
            os.setsid()
        else:
            os.setpgid(0, 0)
        self._signals()
        self._files()
        os.chdir(req["cwd"])
        os.umask(req["umask"])
        self._limits()
        # The requester's environment, and what the imports set in it (as they would have).
        added = _imported_env()
        os.environ.clear()
        os.environ.update(req["env"])
        for key, value in added.items():
            os.environ.setdefault(key, value)
        self._stdio()
        self._warnings()
        argv = req["argv"][1:]
        script = req["module"] if req["module"].endswith(".py") else None
        while argv[0] != "-m" and (script is None or os.path.realpath(argv[0]) != script):
            argv.pop(0)
        sys.orig_argv = req["argv"]
        # as Python starts a script (its folder first on the path) or a module (the cwd)
        sys.argv = argv if script else ["-m", *argv[2:]]
        sys.path[:] = [os.path.dirname(script) if script else req["cwd"], *req["path"]]
        sys.dont_write_bytecode = req["dont_write_bytecode"]
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        import random

        import numpy

        random.seed()
        numpy.random.seed()
        if req["faulthandler"]:
            import faulthandler

            faulthandler.enable()
        if script:
            _run_script(script)
        else:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)

    def _signals(self) -> None:
        signal.set_wakeup_fd(-1)
        ignored = set(self.req["ignored"])
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            if sig in ignored:
                handler = signal.SIG_IGN
            elif sig == signal.SIGINT:
                handler = signal.default_int_handler
            else:
                handler = signal.SIG_DFL
            try:
                signal.signal(sig, handler)
            except (OSError, ValueError):
                continue
        signal.pthread_sigmask(signal.SIG_SETMASK, self.req["blocked"])

    def _files(self) -> None:
        """The requester's open files at their numbers (received as ``self.fds``, in order
        of the numbers the requester listed)."""
        import fcntl

        targets = self.req["fds"]
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in self.fds]
        for fd in self.fds:
            os.close(fd)
        for fd in (_INHERITED | {0, 1, 2}) - set(targets):  # not open in the requester
            with contextlib.suppress(OSError):
                os.close(fd)
        for src, dst in zip(high, targets, strict=True):
            os.dup2(src, dst, inheritable=True)
            os.close(src)

    def _limits(self) -> None:
        import resource

        for name, (soft, hard) in self.req["limits"].items():
            which = getattr(resource, name)
            if resource.getrlimit(which) != (soft, hard):
                resource.setrlimit(which, (soft, hard))

    def _stdio(self) -> None:
        import io

        streams = []
        for fd, info in enumerate(self.req["stdio"]):
            if info is None:
                streams.append(None)
                continue
            encoding, errors, line_buffering, write_through, unbuffered = info
            mode = "rb" if fd == 0 else "wb"
            raw = io.FileIO(fd, mode, closefd=False)
            buffer = (
                raw
                if (unbuffered and fd)
                else (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw))
            )
            streams.append(io.TextIOWrapper(buffer, encoding=encoding, errors=errors,
                                            line_buffering=line_buffering,
                                            write_through=write_through))  # fmt: skip
        sys.stdin, sys.stdout, sys.stderr = streams
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams

    def _warnings(self) -> None:
        """The requester's start-up filters, under those the pre-imports added."""
        import builtins
        import re

        added = [f for f in warnings.filters if f not in _STARTUP_FILTERS]

        def pattern(p):
            return re.compile(p[0], p[1]) if isinstance(p, list) else p

        theirs = [
            (action, pattern(msg), getattr(builtins, category, Warning), pattern(module), lineno)
            for action, msg, category, module, lineno in self.req["warnings"]
        ]
        warnings.filters[:] = [*added, *theirs]
        warnings._filters_mutated()  # type: ignore[attr-defined]

    def _cmdline(self) -> None:
        start, end = self.arg_area
        data = b"\0".join(a.encode() for a in self.req["argv"]) + b"\0"
        data = data[: end - start - 1] + b"\0"
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _arg_area() -> tuple[int, int]:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    # Fields 48 and 49 of stat (arg_start, arg_end); fields[0] is field 3 (the state).
    return int(fields[45]), int(fields[46])


def serve(folder: Path) -> Job | None:
    """Serve until told to stop (returns None) or, in a forked process, return its job."""
    (folder / "clients").mkdir(exist_ok=True)
    _preimport()
    arg_area = _arg_area()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "sock.new"))
    listener.listen(128)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    stop = []
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    gc.collect()
    gc.freeze()  # the fork shares these pages: no collection writes to them
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(r, selectors.EVENT_READ)
    conns: dict[int, tuple[socket.socket, int]] = {}  # child pid -> (conn, requester pid)
    by_conn: dict[socket.socket, int] = {}
    os.rename(folder / "sock.new", folder / "sock")  # ready
    _log(folder, "ready")
    while not stop:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(10.0)  # a requester sends at once; one that hangs is dropped
                try:
                    req, fds = _receive(conn)
                except (OSError, ValueError) as e:
                    _log(folder, f"bad request: {e}")
                    conn.close()
                    continue
                why = _refusal(req)
                if why is not None:
                    _log(folder, f"cold {req['argv'][1:4]}: {why}")
                    conn.sendall(b"C\n")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)  # before its descriptor closes (and is reused)
                    sel.close()
                    listener.close()
                    os.close(r)
                    os.close(w)
                    for other in by_conn:
                        other.close()
                    conn.close()
                    return Job(req, fds, arg_area, folder)
                for fd in fds:
                    os.close(fd)
                _log(folder, f"warm {pid} {req['argv'][1:4]}")
                conn.sendall(b"P %d\n" % pid)
                conns[pid] = (conn, req["pid"])
                by_conn[conn] = pid
                sel.register(conn, selectors.EVENT_READ)
            elif key.fileobj is r:
                while True:
                    try:
                        if not os.read(r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(folder, conns, by_conn, sel)
            else:
                conn = key.fileobj
                try:
                    gone = not conn.recv(64)
                except OSError:
                    gone = True
                if gone:  # the requester died (or was killed): so does its process
                    pid = by_conn.pop(conn)
                    sel.unregister(conn)
                    conn.close()
                    _kill(pid)
                    conns[pid] = (None, conns[pid][1])
    for pid in list(conns):
        _kill(pid)
    return None


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _reap(folder: Path, conns: dict, by_conn: dict, sel) -> None:
    while conns:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn, requester = conns.pop(pid, (None, None))
        with contextlib.suppress(OSError):
            (folder / "clients" / str(requester)).unlink()
        if conn is not None:
            by_conn.pop(conn, None)
            sel.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(b"S %d\n" % status)
            conn.close()


def main() -> None:
    folder = Path(sys.argv[1])
    if sys.platform.startswith("linux"):  # the server ends with the test process that started it
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    job = serve(folder)
    if job is not None:
        job.run()


if __name__ == "__main__":
    main()
