"""The warm-start client (tests only; docs/TESTING.md, "Warm starts").

Python imports ``sitecustomize`` at start-up from ``sys.path``; the test suite puts this
folder on ``PYTHONPATH`` and names a warm server in ``DFLASH_TEST_WARM``. A process started
as ``python [-u] -m trainer.cli ...``, ``-m torch.distributed.run ...`` or ``python [-u]
SCRIPT`` for a script of ``SCRIPTS`` then hands its
command line, environment, working folder, limits and open files to the server, which forks
an interpreter that has torch and transformers imported already and runs the same module
there; this process stays as its stand-in: it forwards the signals it is sent and exits as
the forked one did (the same code, or killed by the same signal). If it is killed, the
server kills the forked one. Anything the server cannot reproduce exactly is refused, and
the process then starts as usual (cold). Only the standard library, and nothing when the
variable is unset: every process the tests start imports this file.
"""

import os
import sys

#: The signals a stand-in forwards to its fork (by name: ``signal`` is imported only when
#: the process starts warm).
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
             "SIGCONT")  # fmt: skip


#: Scripts of the test suite's own that import torch, which the server runs as ``python
#: SCRIPT`` does (paths under ``tests/``): the loader's consumers, the ranks of the step
#: objective's workers, the vLLM stand-in the engine tests start and restart.
SCRIPTS = ("workers/consume.py", "workers/step_gradient.py", "workers/empty_slots.py",
           "data/fake_vllm_states.py")  # fmt: skip


def _command() -> "str | None":
    """The module this interpreter was started to run, if it is one the server runs, or
    the real path of a script of ``SCRIPTS`` (ending in ``.py``; a module name cannot)."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    while argv and argv[0] in ("-u", "-B"):
        argv.pop(0)
    if argv and argv[0].endswith(".py"):
        tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
        script = os.path.realpath(argv[0])
        extra = os.environ.get("DFLASH_TEST_WARM_SCRIPTS", "").split(",")  # test_warm's probe
        return script if script in {os.path.join(tests, s) for s in SCRIPTS} | {*extra} else None
    if len(argv) < 2 or argv[0] != "-m":
        return None
    module, args = argv[1], argv[2:]
    if module == "trainer.cli" and "tokenize" not in args:  # tokenize: its memory is measured
        return module
    if module in ("torch.distributed.run", "trainer.train.launch"):
        return module
    if module in os.environ.get("DFLASH_TEST_WARM_MODULES", "").split(","):  # test_warm's probe
        return module
    return None


def _open_fds(skip: int) -> list:
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != skip:
            try:
                os.fstat(fd)
            except OSError:
                continue  # the listing's own descriptor, closed by now
            out.append(fd)
    return sorted(out)


def _request(module: str, fds: list) -> dict:
    import resource
    import signal
    import warnings

    limits = {}
    for name in ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE"):
        if hasattr(resource, name):
            limits[name] = list(resource.getrlimit(getattr(resource, name)))
    ignored = [int(s) for s in signal.valid_signals() if signal.getsignal(s) is signal.SIG_IGN]

    def pattern(p):  # a compiled pattern, a plain string (the defaults' "__main__") or None
        return [p.pattern, p.flags] if hasattr(p, "pattern") else p

    filters = [[f[0], pattern(f[1]), f[2].__name__, pattern(f[3]), f[4]] for f in warnings.filters]
    umask = os.umask(0)
    os.umask(umask)

    def stream(s) -> list:
        if s is None:
            return None
        raw = not hasattr(s.buffer, "raw")  # -u: the text layer writes to the file itself
        return [s.encoding, s.errors, s.line_buffering, s.write_through, raw]

    return {
        "pid": os.getpid(),
        "session": os.getsid(0) == os.getpid(),
        "fds": fds,
        "module": module,
        "argv": list(sys.orig_argv),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "umask": umask,
        "limits": limits,
        "ignored": ignored,
        "blocked": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "warnings": filters,
        "flags": {n: getattr(sys.flags, n) for n in dir(sys.flags) if n[0] != "_" and n[0].islower()
                  and not callable(getattr(sys.flags, n)) and not n.startswith("n_")},
        "xoptions": {k: str(v) for k, v in sys._xoptions.items()},
        "stdio": [stream(sys.stdin), stream(sys.stdout), stream(sys.stderr)],
        "faulthandler": "faulthandler" in sys.modules and sys.modules["faulthandler"].is_enabled(),
        "dont_write_bytecode": sys.dont_write_bytecode,
    }  # fmt: skip


def _exit_as(status: int) -> None:
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process: exit as a shell reports it
    os._exit(os.waitstatus_to_exitcode(status))


def _run(folder: str, module: str) -> None:
    import json
    import socket
    import struct

    # Empty while this process waits for its fork; then the fork's pid (the server writes
    # it); removed when this process starts cold (tests/warm/__init__.py reads it).
    marker = os.path.join(folder, "clients", str(os.getpid()))
    try:
        open(marker, "x").close()
    except OSError:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _wait_for_server(folder)
        sock.connect(os.path.join(folder, "sock"))
    except OSError:
        sock.close()
        os.unlink(marker)
        return  # no server (it stopped, or is not started yet): start cold
    held: set = set()
    try:
        fds = _open_fds(sock.fileno())
        body = json.dumps(_request(module, fds)).encode()  # the signal mask as started
        # Held from here until the stand-in forwards them: one sent once the fork runs (it
        # may already be printing) would otherwise end this process before its handlers
        # are set, and the server would then kill the fork (seen under load).
        held = _hold()
        sock.sendall(struct.pack("!I", len(body)))
        socket.send_fds(sock, [body], fds)
        reader = sock.makefile("rb")
        first = reader.readline().split()
    except OSError:
        first = []
    if not first or first[0] != b"P":
        _release(held)
        sock.close()
        os.unlink(marker)
        return  # refused: the reason is in the server's log
    try:
        _stand_in(int(first[1]), reader, held)
    finally:  # the module ran (or is running) in the fork: never a second time here
        os._exit(70)


def _wait_for_server(folder: str) -> None:
    """Wait while the server is still importing (its pid alive, its socket not there yet):
    the first processes of a test session would otherwise start cold beside it, each
    importing torch as it does."""
    import time

    try:
        with open(os.path.join(folder, "server.pid")) as f:
            server = int(f.read())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "sock")) and time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{server}") or _zombie(server):
            return
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _hold() -> set:
    """Block the forwarded signals not blocked already; the ones it blocked."""
    import signal

    blocked = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    held = {getattr(signal, name) for name in FORWARDED} - blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    return held


def _release(held: set) -> None:
    """Unblock what ``_hold`` blocked (a signal sent meanwhile is delivered now)."""
    if held:
        import signal

        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _stand_in(child: int, reader, held: set) -> None:
    """Be process ``child`` to whoever started this one, until it ends; ``held``: the
    signals blocked until the forwarding is set (then let through, and forwarded)."""
    import contextlib
    import signal

    leader = os.getpgrp() == os.getpid()

    def forward(sig, _frame):
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if leader else os.kill)(child, sig)

    for sig in (getattr(signal, name) for name in FORWARDED):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, forward)
    _release(held)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank: dies with its agent, as the rank does
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    while True:
        try:
            line = reader.readline().split()
        except OSError:
            line = []
        if line and line[0] == b"S":
            _exit_as(int(line[1]))
        if not line:  # the server died: so did (or will) the forked process
            os._exit(70)


def _main() -> None:
    folder = os.environ.get("DFLASH_TEST_WARM")
    if not folder:
        return
    module = _command()
    if module is not None:
        _run(folder, module)


_main()
