"""The engine client (``trainer.engine.client``) under careless and hostile input, against
the stand-in server (``tests/data/fake_vllm_states.py``) run in a thread on a real port,
writing real files through the connector's own writer:

1. nothing the run did not create is read as its own, changed or deleted: folders others
   can write to, folders someone else made under the run's name, replies naming paths
   outside the folder or files of other requests, other runs' and other programs' files;
   what the run left at an earlier start (a killed trainer, ranks gone) is removed;
2. a server that answers but is not the engine is reported as what it is, at once;
3. every wait is bounded and named (a FIFO, a server that never answers, a closing client,
   the backoff of a second outage);
4. states that cannot be right are refused, naming the document.
"""

from __future__ import annotations

import gc
import http.server
import importlib.util
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.engine import client as engine_client
from trainer.engine.client import EngineError, StateClient
from trainer.engine.folders import open_regular, own_folder, shared_folder
from trainer.vllm.process import free_port

pytestmark = pytest.mark.integration

_spec = importlib.util.spec_from_file_location(
    "fake_vllm_states", Path(__file__).resolve().parents[1] / "data" / "fake_vllm_states.py"
)
stand_in = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["fake_vllm_states"] = stand_in
_spec.loader.exec_module(stand_in)  # type: ignore[union-attr]

N, H = 3, 8
RUN = "0123456789ab-c0ffee"


def states(ids: list[int]) -> torch.Tensor:
    """A document's stand-in states: token t's value at column c is ids[t] + c / 10."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return (t + torch.arange(N)[None, :, None] / 10).expand(len(ids), N, H).contiguous()


@pytest.fixture
def target(tmp_path) -> Path:
    folder = tmp_path / "target"
    folder.mkdir()
    config = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": 99}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def folder(tmp_path) -> Path:
    f = tmp_path / "states"
    f.mkdir(mode=0o755)
    return f


class Running:
    """The stand-in serving in a thread (restartable on its port); ``mooncake``: the
    store's addresses, for its puts."""

    def __init__(self, folder: Path, model: Path, mooncake: dict | None = None, **faults) -> None:
        self.folder, self.model, self.port = folder, model, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults = stand_in.Faults(**faults)
        self.mooncake = mooncake
        self.server = None
        self.start()

    def start(self) -> None:
        self.server = stand_in.serve(self.port, self.folder, states, root=str(self.model),
                                     faults=self.faults, mooncake=self.mooncake)  # fmt: skip
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A Mooncake master (its HTTP metadata server, no etcd) for the module's tests."""
    from trainer.engine.mooncake import master

    with master(tmp_path_factory.mktemp("mooncake") / "master.log") as (address, url, _):
        yield {"master": address, "metadata": url}


@pytest.fixture
def running(folder, target, store):
    made: list[Running] = []

    def start(**faults) -> Running:
        made.append(Running(folder, target, store, **faults))
        return made[-1]

    yield start
    for r in made:
        r.stop()


def client(url: str, folder: Path | None, target: Path, transport: str = "files",
           **kw) -> StateClient:  # fmt: skip
    kw.setdefault("timeout_s", 5.0)
    run, rank = kw.pop("run", RUN), kw.pop("rank", 0)
    carrier = None
    if transport == "shm":
        from trainer.engine.shm import ShmTransport

        carrier = ShmTransport(folder, run=run, rank=rank, size_mb=kw.pop("size_mb", 4))
    elif transport == "mooncake":
        from trainer.engine.mooncake import MooncakeTransport

        carrier = MooncakeTransport(None, run=run, rank=rank, size_mb=kw.pop("size_mb", 16),
                                    **kw.pop("store"))  # fmt: skip
    return StateClient(url, run=run, rank=rank, num_states=N, hidden_size=H,
                       states_dir=folder, target=target, transport=carrier, **kw)  # fmt: skip


def mooncake(transport: str, store: dict) -> dict:
    return {"store": store} if transport == "mooncake" else {}


def fetch(c: StateClient, ids: list[int], what: str = "sample 7") -> torch.Tensor:
    future = c.submit(torch.tensor(ids), what)
    try:
        return c.result(future).clone()
    finally:
        c.release(future)


TRANSPORTS = ["files", "shm", "mooncake"]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


# ---- 1. nothing the run did not create ------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_states_arrive_checked_and_the_folder_ends_as_it_began(running, folder, target,
                                                                    transport, store):  # fmt: skip
    """Other programs' files (safetensors' ``.tmp*`` among them) and another run's files
    sharing the folder are there before and after, unchanged; the run's own are gone."""
    mine_before = {
        ".tmpAbCdEf": b"other program",
        "notes.txt": b"mine",
        "cmpl-dflash-feedbeefcafe-aaaaaa-r0-3-0-xy.safetensors": b"another run",
    }
    for name, data in mine_before.items():
        (folder / name).write_bytes(data)
    before = snapshot(folder)
    r = running()
    c = client(r.url, folder, target, transport, **mooncake(transport, store))
    got = [fetch(c, [5, 6, 7, 8]), fetch(c, list(range(20)))]
    if transport == "mooncake":  # each key removed once read
        assert [c.transport.store.is_exist(f"{c.prefix}-{k}") for k in range(2)] == [0, 0]
    c.close()
    assert torch.equal(got[0], states([5, 6, 7, 8])) and got[1].shape == (20, N, H)
    assert snapshot(folder) == before


@pytest.mark.parametrize("transport", ["files", "shm"])
def test_what_the_run_left_at_an_earlier_start_is_removed_and_nothing_else(
    running, folder, target, transport
):
    """A killed trainer's files, a dead rank's (an elastic shrink) and a killed writer's
    ``.part`` are removed once the folder is known; this start's other ranks' files and
    other runs' stay."""
    run_id = RUN.split("-")[0]
    old = [f"cmpl-dflash-{run_id}-0ld000-r0-4-0-aa.safetensors",
           f"cmpl-dflash-{run_id}-0ld000-r0-4-0-aa.safetensors.lock",
           f"cmpl-dflash-{run_id}-0ld000-r3-9-0-bb.safetensors",  # rank 3, gone now
           f"cmpl-dflash-{run_id}-0ld000-r1-2-0-cc.safetensors.part",
           f"arena-dflash-{run_id}-0ld000-r2"]  # a killed trainer's arena  # fmt: skip
    kept = [f"cmpl-dflash-{RUN}-r1-0-0-dd.safetensors",  # rank 1 of this start, in flight
            f"arena-dflash-{RUN}-r1",  # rank 1's arena of this start
            "cmpl-dflash-otherrun0000-0ld000-r0-4-0-ee.safetensors", ".tmp123456",
            "arena-dflash-otherrun0000-0ld000-r0"]  # fmt: skip
    for name in old + kept:
        (folder / name).write_bytes(b"x")
    r = running()
    c = client(r.url, folder, target, transport)
    mine = [f"arena-dflash-{RUN}-r0"] if transport == "shm" else []
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept + mine)
    fetch(c, [1, 2, 3])
    c.close()
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)


@pytest.mark.parametrize("where", ["outside", "foreign"])
def test_a_reply_naming_a_file_not_its_own_is_refused_and_the_file_untouched(
    running, folder, target, tmp_path, where
):
    victim = tmp_path / "precious.safetensors"
    victim.write_bytes(b"not yours")
    victim_mtime = victim.stat().st_mtime_ns
    r = running(bad=f"{where}@1", victim=str(victim))
    foreign = folder / "cmpl-dflash-other-0-r0-1-0-abcd.safetensors"
    foreign.write_bytes(b"another request's")
    c = client(r.url, None, target)  # no --engine-dir: the reply says where
    with pytest.raises(EngineError, match="refusing to read or remove it") as e:
        fetch(c, [1, 2, 3], "sample 11 (epoch 0 step 2 micro 0)")
    c.close()
    assert "sample 11" in str(e.value)
    assert victim.read_bytes() == b"not yours" and victim.stat().st_mtime_ns == victim_mtime
    assert foreign.read_bytes() == b"another request's"


def test_folders_others_can_write_to_are_refused(running, target, tmp_path):
    """``/tmp`` and ``/dev/shm`` themselves, and any folder of mode o+w: as --engine-dir,
    and as the folder a server's reply names."""
    for shared in (Path("/tmp"), Path("/dev/shm")):
        if shared.is_dir():
            with pytest.raises(EngineError, match="any user can write to this folder"):
                shared_folder(shared)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(EngineError, match=r"any user can write .*drwxrwxrwx"):
        shared_folder(open_to_all)
    r = Running(open_to_all, target)
    try:
        with pytest.raises(EngineError, match="any user can write to this folder"):
            fetch(client(r.url, None, target), [1, 2, 3])
    finally:
        r.stop()
    assert list(open_to_all.iterdir()) == [] or all(
        p.name.endswith((".lock", ".safetensors")) for p in open_to_all.iterdir()
    )  # the server's own writes; the client removed and read nothing there


def test_the_runs_own_folder_is_private_and_one_it_did_not_make_is_refused(tmp_path):
    made = own_folder(tmp_path / "shm" / "dflash-engine-abc")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert own_folder(made) == made  # a resumed run finds its own again
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(EngineError, match="can be entered by other users"):
        own_folder(loose)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
        with pytest.raises(EngineError, match=r"belongs to another user .*uid 65534"):
            own_folder(theirs)
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(EngineError, match="is a symbolic link"):
        own_folder(link)
    assert sorted(p.name for p in made.iterdir()) == []


def test_a_file_this_process_may_not_read_is_named_with_its_owner_and_mode():
    """A real EACCES: a child process that dropped to another user opens a 0600 file (in
    a folder it can enter)."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    base = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    base.chmod(0o755)
    secret = base / "cmpl-x.safetensors"
    secret.write_bytes(b"states")
    secret.chmod(0o600)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user, then the open
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            with open_regular(secret, "the states file of sample 3"):
                msg = "opened"
        except EngineError as e:
            msg = str(e)
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        os.write(write, msg.encode())
        os._exit(0)
    os.close(write)
    said = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    shutil.rmtree(base)
    assert "may not read the states file of sample 3" in said, said
    assert "owner uid 0, mode -rw-------" in said and "uid 65534" in said


# ---- 2. a server that is not the engine --------------------------------------------------


@pytest.mark.parametrize(
    ("status", "says"),
    [(404, "not a vLLM OpenAI server"), (401, "wants credentials"), (405, "no such")],
)
def test_a_web_server_is_reported_at_once(running, folder, target, status, says):
    r = running(status=status)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        client(r.url, folder, target, timeout_s=60)
    assert time.monotonic() - t0 < 5  # not 60 s of retries
    assert f"{r.url}/v1/models answered HTTP {status}" in str(e.value) and says in str(e.value)


def test_a_5xx_is_waited_for_then_named(running, folder, target):
    r = running(status=502)
    with pytest.raises(EngineError, match=r"no answer for 2 s .*HTTP 502"):
        client(r.url, folder, target, timeout_s=2)


def test_a_page_that_is_not_json_is_reported_at_once(folder, target):
    port = free_port()

    class Page(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            body = b"<html><body>It works!</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineError, match=r"not JSON \('<html><body>It works"):
            client(f"http://127.0.0.1:{port}", folder, target, timeout_s=60)
    finally:
        server.shutdown()
        server.server_close()


def test_a_proxy_from_the_environment_is_not_put_in_front_of_loopback(
    running, folder, target, monkeypatch
):
    """``http_proxy`` set (as on many clusters) and no ``no_proxy``: a loopback server is
    still reached directly; the proxy (a server that would answer 502) sees nothing."""
    seen = []
    port = free_port()

    class Proxy(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(502)
            self.end_headers()

        do_POST = do_GET

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", port), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{port}")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    try:
        r = running()
        c = client(r.url, folder, target)
        assert fetch(c, [4, 5, 6]).shape == (3, N, H)
        c.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert seen == []
    from trainer.engine.http import via

    assert "through the proxy" in via("http://trainer-host.example:8000")
    assert via("http://localhost:8000") == via("http://127.0.0.1:8000") == ""


def test_another_model_is_reported_at_once(running, folder, target, tmp_path):
    other = tmp_path / "Qwen3-0.6B"
    other.mkdir()
    config = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
              "vocab_size": 151936}  # fmt: skip
    (other / "config.json").write_text(json.dumps(config))
    r = running(root=str(other))
    with pytest.raises(EngineError) as e:
        client(r.url, folder, target)
    said = str(e.value)
    assert f"serves {other}, another model than the run's target {target}" in said
    assert "hidden_size 1024 (the target's 8)" in said


def test_a_dead_server_is_reported_with_the_line_that_says_why():
    """vLLM 0.32's own log of a server whose worker refused the target's head size (20) on
    its first request: the line is the worker's exception, not the shutdown at the end."""
    from trainer.vllm.process import cause, died

    log = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32.0-died-head-dim-20.log"
    line = "RuntimeError: Unsupported CPU attention configuration: head_dim=20 isa=1"
    assert cause(log).startswith(line)
    said = died(log)
    assert said.splitlines()[0].startswith(line) and "resource_tracker" in said


# ---- 3. every wait bounded and named ------------------------------------------------------


def test_a_fifo_for_a_states_file_is_refused_not_waited_on(running, folder, target):
    r = running(bad="fifo@1")
    c = client(r.url, folder, target, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"the states file of sample 7 is not a regular file"):
        fetch(c, [1, 2, 3])
    assert time.monotonic() - t0 < 5
    c.close()
    assert list(folder.iterdir()) == []


def test_a_server_that_never_answers_is_given_up_and_named(folder, target):
    """It accepts the connection and says nothing: the request gives up at its timeout."""
    import socket

    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)
    url = f"http://127.0.0.1:{hang.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no answer for 2 s .*no reply within"):
            client(url, folder, target, timeout_s=2)
        assert time.monotonic() - t0 < 10
    finally:
        hang.close()


def test_a_hung_request_and_a_closing_client_are_both_bounded(running, folder, target,
                                                               monkeypatch):  # fmt: skip
    """A request stuck where no timeout reaches (a read in the kernel on a dead mount,
    stood in for here by a worker that never returns): ``result`` gives up naming the
    document and its stage, and ``close`` returns after its grace instead of hanging."""
    monkeypatch.setattr(engine_client, "STUCK_S", 0.5)
    monkeypatch.setattr(engine_client, "CLOSE_GRACE_S", 1.0)
    r = running()
    c = client(r.url, folder, target, timeout_s=1)
    stuck = threading.Event()

    def never(request):  # the hang: the worker never comes back
        request.stage = "reading /mnt/dead/cmpl-x.safetensors"
        stuck.wait()

    monkeypatch.setattr(c, "_states", never)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"sample 7: its request has been reading "
                                          r"/mnt/dead/cmpl-x.safetensors for \d+ s"):  # fmt: skip
        fetch(c, [1, 2, 3])
    assert time.monotonic() - t0 < 6
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 4
    stuck.set()


def test_closing_beside_a_server_the_run_started_drops_the_read_ahead(running, folder,
                                                                     target):  # fmt: skip
    """With a server the run started (``alive``: it is stopped next, its folder with it), a
    closing client waits ``OWNED_GRACE_S`` for requests the server is still computing (the
    read-ahead past the run's last step), not ``CLOSE_GRACE_S``."""
    slow = threading.Event()
    r = running()
    c = client(r.url, folder, target, alive=lambda: None)
    for f in [c.submit(torch.tensor([1, 2, 3])) for _ in range(3)]:
        c.result(f)
        c.release(f)
    c._states = lambda request: slow.wait()  # the server still computing: never answers
    more = [c.submit(torch.tensor([4, 5])) for _ in range(2)]
    time.sleep(0.2)
    t0 = time.monotonic()
    c.close()
    took = time.monotonic() - t0
    assert engine_client.OWNED_GRACE_S <= took < engine_client.CLOSE_GRACE_S / 2, took
    assert not any(f.done() for f in more)
    slow.set()


def test_the_backoff_starts_anew_with_each_outage(folder, target):
    """Two outages: the second's first wait is the backoff's first (0.5 s at most), not the
    2 s the first outage had grown to."""
    r = Running(folder, target)
    c = client(r.url, folder, target, timeout_s=30)
    try:
        r.stop()
        first = c.submit(torch.tensor([1, 2, 3]))
        deadline = time.monotonic() + 20
        while max(c.waits, default=0.0) <= 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)  # several tries: the waits grow towards their cap
        r.start()
        c.result(first)
        grown = list(c.waits)
        assert max(grown) > 1.0, grown
        r.stop()
        second = c.submit(torch.tensor([4, 5, 6]))
        time.sleep(1.0)
        r.start()
        c.result(second)
        again = c.waits[len(grown)]
        assert again <= 0.5, (grown, c.waits)
    finally:
        c.close()
        r.stop()


# ---- 4. states that cannot be right ---------------------------------------------------------


@pytest.mark.parametrize(("transport", "kind", "says"), [
    ("files", "nan", r"are not finite \(token 1, layer column 0: nan\)"),
    ("files", "dtype", r"dtype torch.bfloat16 for sample 7, expected torch.float32"),
    ("files", "shape", r"shape \(3, 2, 8\) for sample 7, expected \(3, 3, 8\)"),
    # the checks are the client's, whatever the transport: each carries a wrong one to it
    ("shm", "dtype", r"dtype torch.bfloat16 for sample 7, expected torch.float32"),
    ("mooncake", "nan", r"are not finite \(token 1, layer column 0: nan\)"),
])  # fmt: skip
def test_states_that_cannot_be_right_are_refused_naming_the_document(
    running, folder, target, kind, says, transport, store
):
    r = running(bad=f"{kind}@2")
    c = client(r.url, folder, target, transport, **mooncake(transport, store))
    fetch(c, [9, 9, 9])  # the first document: fine (and the engine's dtype, float32)
    with pytest.raises(EngineError, match=says):
        fetch(c, [1, 2, 3])
    c.close()
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_write_the_connector_could_not_make_is_named_at_once(running, folder, target,
                                                               transport, store):  # fmt: skip
    """The connector's write fails (here: states of a dtype it cannot carry): it says why
    beside the file, in the region or in the store's value, and the trainer stops at once
    naming the document and the reason, instead of asking again until its deadline (a file
    or region left unwritten) or waiting the deadline out for a key never put; the reason
    is removed with the request."""
    r = running(bad="unwritable@2")
    c = client(r.url, folder, target, transport, timeout_s=30, **mooncake(transport, store))
    fetch(c, [9, 9, 9])
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"the server's connector could not write sample 7's "
                       r"states \(.*dflash-.*-r0-1.*\): .*complex64"):  # fmt: skip
        fetch(c, [1, 2, 3])
    assert time.monotonic() - t0 < 5
    c.close()
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_states_travel_in_the_dtype_asked_for_and_fp8_s_nan_is_refused(
    running, folder, target, transport, store
):
    """``--states-dtype``: bf16 arrives as the cast of the engine's states, fp8 as its
    values and scales (``Scaled``), within e4m3's rounding, through each transport; a NaN
    is refused through its scale, naming the document."""
    from trainer.engine.states import Scaled
    from trainer.vllm.connector.dflash_states_wire import decode

    r = running(bad="nan@3")
    ids = list(range(30))
    kw = mooncake(transport, store)
    with_bf16 = client(r.url, folder, target, transport, wire="bfloat16", **kw)
    assert torch.equal(fetch(with_bf16, ids), states(ids).to(torch.bfloat16))
    with_bf16.close()
    c = client(
        r.url, folder, target, transport, wire="float8_e4m3fn", run="0123456789ab-beef01", **kw
    )
    future = c.submit(torch.tensor(ids), "sample 7")
    got = c.result(future)
    assert isinstance(got, Scaled) and got.values.dtype == torch.float8_e4m3fn
    exact = states(ids)
    widened = decode(got.values, got.scales, torch.float32)
    assert float(((widened - exact).abs() / exact.abs().clamp_min(1e-3)).max()) <= 2**-4
    c.release(future)
    with pytest.raises(EngineError, match=r"states of sample 8 are not finite \(token 15, "
                                          r"layer column 0: scale nan\)"):  # fmt: skip
        c.result(c.submit(torch.tensor(ids), "sample 8"))
    c.close()
    assert list(folder.iterdir()) == []


def test_a_dtype_the_server_does_not_carry_is_refused_at_once(running, folder, target,
                                                              monkeypatch):  # fmt: skip
    with pytest.raises(ValueError, match="states dtype 'float16': this torch carries"):
        client("http://127.0.0.1:9", folder, target, wire="float16")
    # a server whose torch has no fp8 (the stand-in's copy of the connector's table)
    monkeypatch.delitem(sys.modules["dflash_states_wire"].WIRE, "float8_e4m3fn")
    r = running()
    c = client(r.url, folder, target, wire="float8_e4m3fn")
    with pytest.raises(EngineError, match=r"refused sample 7: dflash_dtype 'float8_e4m3fn'"):
        fetch(c, [1, 2])
    c.close()
    assert list(folder.iterdir()) == []


# ---- the arena ---------------------------------------------------------------------------


def test_the_arena_gives_room_in_submission_order_and_refuses_a_document_too_big(folder):
    """Room is given oldest first: a younger document never takes room the oldest still
    waits for (the feed waits for the oldest: that would never end); room comes back when
    a document is released; one larger than the arena is refused at once, naming the flag;
    the arena is this rank's file of this start, removed on closing."""
    from trainer.engine.seam import Attempt
    from trainer.engine.shm import ShmTransport

    arena = ShmTransport(folder, run=RUN, rank=0, size_mb=1)
    assert [p.name for p in folder.iterdir()] == [f"arena-dflash-{RUN}-r0"]

    def soon(what: str, s: float = 0.3) -> Attempt:
        return Attempt(what, time.monotonic() + s, lambda: False, lambda text: None)

    a, b, c = (arena.place(n) for n in (600_000, 600_000, 100_000))
    arena.ready(a, soon("a"))
    with pytest.raises(EngineError, match=r"c: no room in the 1 MiB arena"):
        arena.ready(c, soon("c"))  # room enough for c, but b is older and waits
    got = threading.Thread(target=arena.ready, args=(b, soon("b", 10)))
    got.start()
    time.sleep(0.2)
    assert b.offset < 0  # still waiting for a's room
    arena.release(a)
    got.join(5)
    assert b.offset >= 0
    arena.ready(c, soon("c"))
    assert c.offset >= b.offset + 600_000
    with pytest.raises(
        EngineError, match=r"does not fit the 1 MiB arena .*: raise --states-buffer-mb"
    ):
        arena.place(2 << 20)
    d = arena.place(10)
    arena.release(d)  # never given room: it no longer waits
    arena.release(b)
    arena.release(c)
    assert arena.room.free == [(0, 1 << 20)]
    arena.close()
    assert list(folder.iterdir()) == []


def test_a_writer_slower_than_a_thousand_polls_is_waited_for(folder):
    """A writer that holds its region's lock for 3 s (a long document on a busy server:
    over 1,000 polls) is waited for at ``POLL_S`` a poll; before, the 1,031st pause
    (``0.0002 * 2**k``) overflowed a float and the request failed with OverflowError."""
    from trainer.engine.seam import POLL_S, Attempt, pause
    from trainer.engine.shm import ShmTransport
    from trainer.vllm.connector.dflash_states_shm import Arenas

    assert pause(0) == 0.0002 and pause(3) == 0.0016 and pause(10**6) == POLL_S
    arena = ShmTransport(folder, run=RUN, rank=0, size_mb=1)
    region = arena.place(4096)
    attempt = Attempt("sample 7", time.monotonic() + 30, lambda: False, lambda text: None)
    arena.ready(region, attempt)
    req_id = f"dflash-{RUN}-r0-0"
    where = arena.params(region, req_id)["dflash_shm"]
    writer = Arenas(str(folder))
    target = stand_in.target_of(where["arena"], where["offset"], where["nbytes"], req_id)
    writer.lock(target)
    tensors = {"hidden_states": states([1, 2]), "token_ids": torch.tensor([1, 2])}
    late = threading.Timer(3.0, writer.write, args=(target, req_id, tensors))
    late.start()
    t0 = time.monotonic()
    got = arena.fetch(region, req_id, attempt)
    assert time.monotonic() - t0 >= 2.9 and torch.equal(got["hidden_states"], states([1, 2]))
    del got
    arena.release(region)
    arena.close()


# ---- the Mooncake store -------------------------------------------------------------------


def test_mooncake_keys_of_earlier_starts_go_and_no_one_else_s(running, folder, target, store):
    """Keys a killed start of this run left (any rank's) are removed when a rank starts;
    this start's other ranks' keys, another run's, and a key of another program stay; on
    closing, this rank's of this start go; nothing is on disk."""
    from trainer.vllm.connector.dflash_states_mooncake import Writer, connect

    probe = connect(master=store["master"], metadata=store["metadata"], protocol="tcp",
                    local_host="127.0.0.1", segment=64 << 20)  # fmt: skip
    writer = Writer(protocol="tcp", local_host="127.0.0.1", **store)
    run_id = RUN.split("-")[0]
    old = [f"dflash-{run_id}-0ld000-r0-4", f"dflash-{run_id}-0ld000-r3-9"]
    kept = [f"dflash-{RUN}-r1-0", "dflash-otherrun0000-0ld000-r0-4", "not-ours-at-all"]
    for key in old + kept:
        writer.put(
            key,
            probe.get_hostname(),
            {"hidden_states": states([1, 2]), "token_ids": torch.tensor([1, 2])},
        )
    assert all(probe.is_exist(k) == 1 for k in old + kept)
    r = running()
    c = client(r.url, folder, target, "mooncake", store=store)
    assert [probe.is_exist(k) for k in old] == [0, 0]
    assert all(probe.is_exist(k) == 1 for k in kept)
    assert torch.equal(fetch(c, [3, 4, 5]), states([3, 4, 5]))
    c.close()
    assert all(probe.is_exist(k) == 1 for k in kept)
    for key in kept:
        probe.remove(key, True)
    probe.close()
    assert list(folder.iterdir()) == []


def test_the_mooncake_writer_reuses_its_staging_buffers_whatever_their_sizes(store):
    """The connector's writer keeps a pool of registered staging buffers: documents of
    several sizes, then again, each put whole through the smallest buffer that fits. (A
    pool of buffers of two sizes failed a put whose buffer was not the first: ``list.remove``
    compared the tensors with ``==``, and their sizes did not match.)"""
    from trainer.vllm.connector.dflash_states_mooncake import Writer, connect
    from trainer.vllm.connector.dflash_states_shm import read_region

    probe = connect(master=store["master"], metadata=store["metadata"], protocol="tcp",
                    local_host="127.0.0.1", segment=64 << 20)  # fmt: skip
    writer = Writer(protocol="tcp", local_host="127.0.0.1", **store)
    sizes = [3, 35000, 35000, 15000, 3, 15000, 35000]  # tokens: 1 and 3.5 MiB buffers
    for k, n in enumerate(sizes):
        ids = list(range(n))
        key = f"pool-test-{k}"
        writer.put(key, probe.get_hostname(),
                   {"hidden_states": states(ids), "token_ids": torch.tensor(ids)})  # fmt: skip
        buf = torch.empty(probe.get_size(key), dtype=torch.uint8)
        probe.register_buffer(buf.data_ptr(), buf.numel())
        assert probe.get_into(key, buf.data_ptr(), buf.numel()) == buf.numel()
        _, got = read_region(buf.numpy().data, 0)
        assert torch.equal(got["hidden_states"], states(ids)), n
        probe.unregister_buffer(buf.data_ptr())
        probe.remove(key, True)
    assert sorted(b.numel() >> 20 for b in writer._free) == [1, 3]  # two, reused
    probe.close()


def test_a_mooncake_reply_naming_another_key_is_refused(running, folder, target, store):
    r = running(bad="outside@1")
    c = client(r.url, folder, target, "mooncake", store=store)
    with pytest.raises(EngineError, match=r"under '.*-other', not request .* key: .*refusing it"):
        fetch(c, [1, 2, 3])
    c.close()


def test_a_mooncake_master_that_is_not_there_is_named(folder, target):
    """No master at the address: at once, naming it, not a hang."""
    from trainer.engine.mooncake import MooncakeTransport

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=rf"master at 127.0.0.1:{port} does not answer .*is "
                                          "mooncake_master running there"):  # fmt: skip
        MooncakeTransport(None, run=RUN, rank=0, size_mb=4, master=f"127.0.0.1:{port}",
                          metadata=f"http://127.0.0.1:{free_port()}/metadata")  # fmt: skip
    assert time.monotonic() - t0 < 10


def test_a_master_gone_between_the_lookup_and_the_get_is_named(folder, target, tmp_path):
    """The master goes away after the store listed a document's key and before the trainer
    got it: the error names the master, as when it is gone at the lookup, and not only the
    server that then waits on it too. (Seen under load in the master test of
    ``test_engine_transports.py``: its line named the server.) A real master, stopped from
    around the real store's lookup."""
    from engine_jobs import Master

    from trainer.engine import mooncake as transport

    master = Master(tmp_path)
    r = Running(folder, target, master.store)
    c = client(r.url, folder, target, "mooncake", store=master.store, timeout_s=2.0)
    real = c.transport.store

    def is_exist(key: str) -> int:
        found = real.is_exist(key)
        if found == 1:
            master.stop()
        return found

    try:
        assert torch.equal(fetch(c, [1, 2]), states([1, 2]))  # the store works
        c.transport.store = SimpleNamespace(is_exist=is_exist, get_into=real.get_into,
                                            remove=real.remove)  # fmt: skip
        # (named by the rank's last lookup, or after the server's deadline by its health)
        named = rf"the Mooncake master {master.address} (does not answer|has not answered)"
        with pytest.raises(EngineError, match=named):
            fetch(c, [3, 4])
    finally:
        c.transport.store = real
        master.start()  # back on its ports, for the teardowns below
        c.close()
        r.stop()
    # A command ends without the teardown of a store whose master went away (it waits on
    # the dead master); this test process goes on: the teardowns now, its master back (the
    # stand-in's writer is in its server's reference cycle: collected).
    assert [real] == transport._ABANDONED
    transport._ABANDONED.clear()
    real = r = None
    gc.collect()
    master.stop()
