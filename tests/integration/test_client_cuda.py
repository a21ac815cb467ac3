"""The client's CUDA path: batches are private copies, pinned once CUDA is in use.

A batch never views the ring, so a non-blocking copy to the GPU reads memory nobody else
writes, and PyTorch's pinned-memory cache keeps the block until that copy has run even when
the batch is dropped at once. On a CPU-only machine the client must never touch CUDA; with a
GPU, pinning and a non-blocking copy of a batch dropped right away are exercised.
"""

from __future__ import annotations

import pytest
import torch

from client import LoaderClient

pytestmark = pytest.mark.integration


def _consumed(client) -> int:
    """The control page's ``consumed`` counter, as the daemon reads it."""
    from loader_server.wire import _ring
    from loader_server.wire import ring as R

    return int(_ring.load(client._ring._ctl, R.CONSUMED))


def test_the_slot_goes_back_as_soon_as_the_batch_is_copied(daemons):
    d = daemons()
    with LoaderClient(d.endpoint, job="cpu", rank=0, world_size=1, epochs=1) as client:
        batch = next(client)
        assert _consumed(client) == 1  # nothing of the ring is held by the batch
        assert batch.to("cpu").input_ids.data_ptr() == batch.input_ids.data_ptr()
        second = next(client)
        assert _consumed(client) == 2 and second.position != batch.position
        if not torch.cuda.is_available():
            assert not batch.input_ids.is_pinned()
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()  # the CPU path never initialised CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_once_cuda_is_initialized_and_dropped_batches_copy_right(daemons):
    d = daemons()
    torch.cuda.init()
    with LoaderClient(d.endpoint, job="gpu", rank=0, world_size=1, epochs=1) as client:
        batch = next(client)
        assert batch.input_ids.is_pinned()
        host = batch.clone()
        dev = batch.to("cuda", non_blocking=True)
        del batch  # the pinned block must survive until the DMA ran
        for _ in range(8):
            next(client)
        torch.cuda.synchronize()
        assert torch.equal(dev.input_ids.cpu(), host.input_ids)
        assert torch.equal(dev.loss_mask.cpu(), host.loss_mask)
