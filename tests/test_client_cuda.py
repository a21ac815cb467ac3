"""cudaHostRegister path of the client: checked as far as this machine allows.

On a CPU-only machine registration must be a no-op that leaves copies working; the address
arithmetic is checked against the mapping itself. With a GPU, the real registration and a
non-blocking copy from a registered read-only mapping are exercised.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from client import cuda


def _mapping(tmp_path, nbytes=1 << 20):
    path = tmp_path / "ring"
    path.write_bytes(np.arange(nbytes // 4, dtype=np.int32).tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    return mm, np.frombuffer(mm, np.uint8)


def test_region_is_the_mapping(tmp_path):
    mm, buf = _mapping(tmp_path)
    addr, size = cuda.region(buf)
    assert size == len(mm) and addr == buf.ctypes.data
    with pytest.raises(ValueError, match="contiguous"):
        cuda.region(buf[::2])


def test_flags_are_portable_read_only():
    assert cuda.REGISTER_FLAGS == 0x01 | 0x08


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_register_is_a_noop_without_cuda(tmp_path):
    _, buf = _mapping(tmp_path)
    assert cuda.register(buf) is False
    cuda.unregister(buf)  # must not raise either


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_registered_mapping_copies_to_gpu(tmp_path):
    _, buf = _mapping(tmp_path)
    assert cuda.register(buf) is True
    host = torch.from_numpy(buf.view(np.int32).copy())
    dev = torch.from_numpy(buf.view(np.int32)).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)
    cuda.unregister(buf)


# --- the CUDA copy rule: a slot goes back to the daemon only after copies from it ran -------


def _consumed(client) -> int:
    """The control page's ``consumed`` counter, as the daemon reads it."""
    from client import _ring
    from client import protocol as P

    return int(_ring.load(client._ring._ctl, P.CONSUMED))


class _StandInEvent:
    """Stands in for a ``torch.cuda.Event`` (CPU machine): it only records the client's
    ``consumed`` counter at the moment ``synchronize()`` is called. The CUDA event itself is
    not under test here; the client's ordering (wait first, then release) is."""

    def __init__(self, client) -> None:
        self.client = client
        self.seen: list[int] = []

    def synchronize(self) -> None:
        self.seen.append(_consumed(self.client))


@pytest.mark.integration
def test_cpu_target_records_nothing_and_release_works(daemons, monkeypatch):
    """``to("cpu", non_blocking=True)`` is no copy: no event, no CUDA call, the ring views
    keep the slot's guard; ``clone`` drops it; releasing the slot works as before."""
    from client import LoaderClient
    from client import cuda as client_cuda

    def no_cuda(device):
        raise AssertionError("a CPU target must not record a CUDA event")

    monkeypatch.setattr(client_cuda, "record_copy_event", no_cuda)
    d = daemons()
    with LoaderClient(d.endpoint, job="cpu", rank=0, world_size=1, epochs=1) as client:
        batch = next(client)
        moved = batch.to("cpu", non_blocking=True)
        assert moved.input_ids.data_ptr() == batch.input_ids.data_ptr()  # the ring itself
        assert moved._guard is batch._guard is not None
        assert batch._guard.pending == []
        assert batch.clone()._guard is None
        assert torch.equal(moved.input_ids, batch.input_ids)
        assert _consumed(client) == 0
        second = next(client)
        assert _consumed(client) == 1 and second.position != batch.position
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()  # the CPU path never initialised CUDA


@pytest.mark.integration
def test_pending_copies_are_waited_for_before_the_slot_is_released(daemons):
    """A copy pending on the held slot's guard is synchronized before ``consumed`` is stored
    (``next()``) and before the ring is unmapped (``close()``); the guard is then empty.
    ``_StandInEvent`` stands in for the CUDA event (see its docstring)."""
    from client import LoaderClient

    d = daemons()
    client = LoaderClient(d.endpoint, job="order", rank=0, world_size=1, epochs=1)
    first = next(client)
    event = _StandInEvent(client)
    first._guard.pending.append(event)
    second = next(client)
    assert event.seen == [0]  # waited while the slot was still held
    assert _consumed(client) == 1
    assert first._guard.pending == []
    assert second._guard is not first._guard  # another slot, another guard

    third = next(client)
    assert event.seen == [0]  # cleared: not synchronized again
    late = _StandInEvent(client)
    third._guard.pending.append(late)
    ring = client._ring
    client.close()
    assert late.seen == [2]  # before the session (and the mapping) went away
    assert third._guard.pending == [] and client._ring is None
    assert all(not g.pending for g in ring.guards)


@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_non_blocking_cuda_copy_records_an_event_that_release_waits_for(daemons):
    from client import LoaderClient

    d = daemons()
    with LoaderClient(d.endpoint, job="gpu", rank=0, world_size=1, epochs=1) as client:
        batch = next(client)
        host = batch.clone()
        synced = batch.to("cuda")  # synchronous: nothing to wait for
        assert batch._guard.pending == [] and synced._guard is None
        dev = batch.to("cuda", non_blocking=True)
        assert dev._guard is None and len(batch._guard.pending) == 1
        event = batch._guard.pending[0]
        next(client)
        assert event.query() and batch._guard.pending == []
        assert torch.equal(dev.input_ids.cpu(), host.input_ids)
