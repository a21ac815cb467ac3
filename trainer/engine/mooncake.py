"""States through a Mooncake store (``--states-transport mooncake``): across machines, with
no folder shared between the server and the trainers (TCP here, RDMA where a cluster has
it: ``--mooncake-protocol``).

Each rank runs a store client that mounts ``--states-buffer-mb`` of its own memory as a
segment of the store, and keeps a receive buffer of the same size, registered once
(pinned when CUDA is present), whose room it gives to documents in submission order
(``trainer.engine.regions``). A request names its key (the request id) and the rank's
segment; the server's connector puts the document there (``trainer/vllm/connector/
dflash_states_mooncake.py``: the arena's region layout, keyed by the request id); the rank
waits for the key to exist, copies it into the document's region with ``get_into`` (a
local copy: the bytes are in its own segment already), removes the key, and reads the
states where they lie. A rank that dies takes its segment, and the keys put there, with
it (the master unmounts a client that stops beating). What a run removes: its own keys
of earlier starts (``remove_by_regex`` on ``^dflash-RUN-`` but this start's) and this
start's of the rank on closing; never another run's.

The master (``mooncake_master``, with its HTTP metadata server, no etcd) is started by
rank 0 beside a server the run starts (``master``), or by the user (``dflash-train
engine-command --states-transport mooncake`` prints it). A master that goes away is
waited for as a server that stops answering is: the run stops after a final checkpoint,
naming it, after ``--engine-timeout-s``; ``--resume`` continues.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.engine.errors import EngineError, unwritten
from trainer.engine.regions import Region, Room
from trainer.engine.seam import Attempt, Lost, pause
from trainer.vllm.connector import dflash_states_shm as layout
from trainer.vllm.process import free_port, stop_group, tail

log = logging.getLogger(__name__)

#: The master's HTTP metadata server's path.
METADATA_PATH = "/metadata"
#: How often a rank looks whether its key has been put (also: whether its server lives).
PROBE_S = 1.0
#: The store's code for a call whose RPC to the master failed (``RPC_FAIL``: what a lookup
#: or a get returns once the master has gone away).
RPC_FAIL = -900


def binary(name: str) -> Path:
    """A program the Mooncake wheel ships (``mooncake_master``), by the installed package."""
    try:
        import mooncake
    except ImportError as e:
        raise EngineError(
            "--states-transport mooncake needs the Mooncake wheel: pip install "
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), and "
            f"Debian's libibverbs1 and librdmacm1 ({e})"
        ) from None
    path = Path(mooncake.__file__).parent / name
    if not path.is_file():
        raise EngineError(f"{path}: the Mooncake wheel has no {name}")
    return path


def master_command(rpc_port: int, http_port: int, host: str = "0.0.0.0",
                   admin_port: int | None = None) -> list[str]:  # fmt: skip
    """``mooncake_master`` with its HTTP metadata server (no etcd); ``admin_port``: its
    metrics and admin server's (9003 unless said: two masters on one machine need two)."""
    cmd = [str(binary("mooncake_master")), f"--rpc_port={rpc_port}",
           "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
           f"--http_metadata_server_port={http_port}"]  # fmt: skip
    if admin_port is not None:
        cmd += [f"--metrics_port={admin_port}", f"--metrics_host={host}"]
    return cmd


def metadata_url(master: str, http_port: int) -> str:
    return f"http://{master.rsplit(':', 1)[0]}:{http_port}{METADATA_PATH}"


@contextlib.contextmanager
def master(log_path: Path, host: str = "127.0.0.1") -> Iterator[tuple[str, str, Any]]:
    """A master started here (its RPC address, its metadata URL and its process), stopped
    when the block ends or when this process dies."""
    from trainer.vllm.process import _end_with_parent

    rpc, http = free_port(), free_port()
    cmd = master_command(rpc, http, host, admin_port=free_port())
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_end_with_parent)  # fmt: skip
    address = f"{host}:{rpc}"
    url = metadata_url(address, http)
    try:
        _wait_listening(host, rpc, proc, log_path)
        _wait_listening(host, http, proc, log_path)
        yield address, url, proc
    finally:
        stop_group(proc)


def _wait_listening(host: str, port: int, proc: Any, log_path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise EngineError(f"mooncake_master exited with {proc.returncode}: {tail(log_path, 8)}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise EngineError(f"mooncake_master did not listen on {host}:{port} in {timeout_s} s")
        time.sleep(0.1)


def reachable_host(master_address: str) -> str:
    """The address of this machine that the master's side reaches it by: the one its
    packets to the master leave from (127.0.0.1 for a master on this machine)."""
    host = master_address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class MooncakeTransport:
    """``trainer.engine.seam.Transport`` through a Mooncake store whose master is at
    ``master`` (``HOST:PORT``) and metadata server at ``metadata``; ``size_mb``: this
    rank's segment and receive buffer. ``folder`` is not used (nothing on disk)."""

    name = "mooncake"

    def __init__(
        self, folder: Path | None, *, run: str, rank: int, size_mb: int = 2048,
        master: str | None = None, metadata: str | None = None, protocol: str = "tcp",
        device: str = "", **_: Any,
    ) -> None:  # fmt: skip
        if not master:
            raise EngineError(
                "--states-transport mooncake needs the store's master: --mooncake-master "
                "HOST:PORT (`dflash-train engine-command --states-transport mooncake` prints "
                "how to start one), or a server the run starts"
            )
        binary("mooncake_master")  # the wheel is there (its error says what to install)
        self.run, self.run_id = run, run.split("-")[0]
        self.prefix = f"dflash-{run}-r{rank}-"
        self.master, self.protocol, self.device = master, protocol, device
        self.metadata = metadata or metadata_url(master, 8080)
        self.host = reachable_host(master)
        self.size = int(size_mb) << 20
        self.store = self._connect()
        self.segment = str(self.store.get_hostname())
        self.buffer = torch.empty(self.size, dtype=torch.uint8,
                                  pin_memory=torch.cuda.is_available())  # fmt: skip
        if self.store.register_buffer(self.buffer.data_ptr(), self.size) != 0:
            raise EngineError(f"the Mooncake store refused this rank's {size_mb} MiB buffer")
        self.mem = self.buffer.numpy().data  # a memoryview of the buffer
        self.room = Room(self.size, "Mooncake receive buffer", "--states-buffer-mb")
        self._master_gone = False  # the master's last answer to this rank was an error
        self.sweep()

    def _connect(self) -> Any:
        from trainer.vllm.connector.dflash_states_mooncake import connect

        try:
            return connect(master=self.master, metadata=self.metadata, protocol=self.protocol,
                           local_host=self.host, device=self.device,
                           segment=self.size)  # fmt: skip
        except RuntimeError as e:
            raise EngineError(f"{e} (--mooncake-master, --mooncake-metadata)") from None

    def connector(self) -> dict[str, Any]:
        return connector_config(self.master, self.metadata, self.protocol, self.device)

    # ---- room, as the arena's -----------------------------------------------------------

    def place(self, nbytes: int) -> Region:
        return self.room.place(nbytes)

    def ready(self, region: Region, attempt: Attempt) -> None:
        attempt.stage(f"waiting for {region.nbytes >> 20} MiB of room in the receive buffer")
        self.room.ready(region, attempt.what, attempt.deadline, attempt.closing)

    def release(self, region: Region, handle: Any = None) -> None:
        self.room.release(region)

    # ---- one request -------------------------------------------------------------------

    def params(self, region: Region, req_id: str) -> dict[str, Any]:
        return {"dflash_mooncake": {"key": req_id, "segment": self.segment}}

    def locate(self, region: Region, placed: dict[str, Any], req_id: str, url: str,
               what: str) -> str:  # fmt: skip
        said = (placed.get("dflash_mooncake") or {}).get("key")
        if said != req_id:
            raise EngineError(
                f"{url} says it put {what}'s states under {said!r}, not request {req_id}'s "
                "key: is the server's connector --states-transport mooncake's? refusing it"
            )
        return req_id

    def fetch(self, region: Region, key: str, attempt: Attempt) -> dict[str, torch.Tensor]:
        """The key's value once it exists, copied into ``region`` and removed from the
        store; its tensors are views of the receive buffer. ``Lost`` when the server
        stopped answering before putting it."""
        attempt.stage(f"waiting for {key} in the Mooncake store (master {self.master})")
        probe = time.monotonic() + PROBE_S
        k = 0
        while (found := self.store.is_exist(key)) != 1:
            self._master_gone = found < 0
            if found < 0:  # the master does not answer: waited for, but not while closing
                self._waiting_for_master(found, key, attempt)
            if attempt.grace_over() or (found < 0 and attempt.closing()):
                raise EngineError(f"{key}: not put yet (closing)")  # (a late put would stay)
            if time.monotonic() > attempt.deadline:
                raise EngineError(
                    f"{key}: not in the Mooncake store past its deadline (--engine-timeout-s; "
                    f"master {self.master})"
                )
            if time.monotonic() > probe:
                probe = time.monotonic() + PROBE_S
                if attempt.gone():
                    raise Lost(f"{key} was not put before its server stopped answering")
            time.sleep(pause(k))
            k += 1
        attempt.stage(f"copying {key} out of the Mooncake store")
        got = self.store.get_into(key, self.buffer.data_ptr() + region.offset, region.nbytes)
        self.store.remove(key, True)
        if got < 0:
            # listed, then not got: a master gone in between says so in the code (a lookup
            # now would say it too, after the store's 4 s of retries)
            self._master_gone = got == RPC_FAIL
            raise Lost(f"{key}: the store's get failed (code {got})")
        found_region = layout.read_region(self.mem, region.offset)
        if found_region is None or found_region[0] != layout.key_of(key):
            unwritten(attempt.what, key, layout.failure(self.mem, region.offset, key))
            raise Lost(f"{key}: its value is not a whole document")
        return found_region[1]

    def _waiting_for_master(self, code: int, key: str, attempt: Attempt) -> None:
        if time.monotonic() > attempt.deadline:
            raise EngineError(
                f"the Mooncake master {self.master} has not answered for {key} (code {code}) "
                "past its deadline (--engine-timeout-s)",
                fix="bring the Mooncake master back",
            )

    def discard(self, region: Region, key: Any) -> None:
        if key is not None:
            self.store.remove(key, True)

    # ---- the store ---------------------------------------------------------------------

    def health(self) -> str | None:
        """Whether the store's master answered this rank's last lookup (the store's own
        ``health_check`` said 0 with its master gone, and a fresh lookup can stall)."""
        return f"the Mooncake master {self.master} does not answer" if self._master_gone else None

    def sweep(self) -> None:
        """This run's keys of its earlier starts (a killed trainer's, gone ranks')."""
        inc = self.run.split("-")[1]
        self.store.remove_by_regex(f"^dflash-{self.run_id}-(?!{inc}-)", True)

    def close(self) -> None:
        """This start's keys of the rank removed, the store client closed (its segment,
        and anything put there late, goes with it). Once: the store is gone after it."""
        store, self.store = self.store, None
        if store is None:
            return
        if self._master_gone:
            # A store whose master went away stalls every call, its teardown's unmount
            # included: never closed, kept here, and the command ends without the store's
            # teardown at exit (``abandoned``), which waited 18 s on the dead master
            # (measured); the process's end frees its memory, and a master that comes back
            # knows it not.
            _ABANDONED.append(store)
            return
        with contextlib.suppress(Exception):
            store.remove_by_regex(f"^{self.prefix}", True)
            store.unregister_buffer(self.buffer.data_ptr())
            store.close()


#: Store clients whose master went away (``Mooncake.close``).
_ABANDONED: list[Any] = []


def abandoned() -> bool:
    """Whether this process holds a store client whose master went away: the command then
    ends without the store library's teardown (``trainer.cli``), which would wait on the
    dead master."""
    return bool(_ABANDONED)


def connector_config(master: str, metadata: str, protocol: str = "tcp", device: str = "",
                     local_host: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The connector's settings for the Mooncake transport (``kv_connector_extra_config``);
    ``local_host``: the server's machine as the store's others reach it [its address
    towards the master, from here]."""
    host = local_host or reachable_host(master)
    return {"mooncake_master": master, "mooncake_metadata": metadata,
            "mooncake_protocol": protocol, "mooncake_device": device,
            "mooncake_local_host": host}  # fmt: skip
