"""What a process sees of how it was started, as JSON on stdout (tests/integration/test_warm.py
runs it cold and warm and compares). ``--exit N`` then exits N; ``--die SIG`` kills itself
with SIG; ``--wait`` prints, then sleeps until signalled (SIGTERM: exits 143 after saying so)."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import warnings


def seen() -> dict:
    def disposition(sig: int) -> str:
        h = signal.getsignal(sig)
        return {signal.SIG_IGN: "ign", signal.SIG_DFL: "dfl"}.get(h, getattr(h, "__name__", "?"))

    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False  # the listing's own descriptor, closed by now
        return True

    fds = [fd for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")) if is_open(fd)]
    umask = os.umask(0)
    os.umask(umask)
    return {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("PROBE_", "OMP_NUM"))},
        "umask": umask,
        "fsize": resource.getrlimit(resource.RLIMIT_FSIZE),
        "signals": {s.name: disposition(s) for s in (signal.SIGINT, signal.SIGTERM,
                                                      signal.SIGPIPE, signal.SIGHUP)},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
        "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.errors],
        "fds": fds,
        "warnings": [(f[0], f[2].__name__) for f in warnings.filters[-3:]],
        "main": __name__,
        "file": __file__,
        "session_leader": os.getsid(0) == os.getpid(),
    }  # fmt: skip


def main() -> None:
    args = sys.argv[1:]
    start = seen()  # before this process sets a handler of its own

    def stop(_sig, _frame):
        print("stopping", flush=True)
        sys.exit(143)

    if "--wait" in args:
        signal.signal(signal.SIGTERM, stop)
    print(json.dumps(start), flush=True)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:  # the one thing that differs
        print("warm" if b"warm/server.py" in f.read() else "cold", file=sys.stderr, flush=True)
    while "--wait" in args:
        time.sleep(0.05)
    if "--die" in args:
        sig = int(args[args.index("--die") + 1])
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    if "--exit" in args:
        sys.exit(int(args[args.index("--exit") + 1]))


if __name__ == "__main__":
    main()
