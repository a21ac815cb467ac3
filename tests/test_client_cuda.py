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
