"""Registering a shared-memory ring with CUDA so host-to-device copies are DMA.

``Tensor.pin_memory()`` would copy every batch into a new pinned buffer; instead the whole
read-only mapping is page-locked once with ``cudaHostRegister`` (slow: do it once per
mapping, never per batch). Copies from it with ``non_blocking=True`` then run at pinned
speed (~55 GB/s on Gen5 versus 10-17 GB/s pageable). Without CUDA this is a no-op.

Such a copy is only queued when ``to`` returns, so the slot must not be handed back to the
daemon before it has run: ``record_copy_event`` marks the end of the copies, and the client
synchronizes on that event before releasing the slot (the CUDA copy rule, ``client.loader``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h).
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08
REGISTER_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY


def region(buf: np.ndarray) -> tuple[int, int]:
    """(address, bytes) of a contiguous mapping."""
    if not buf.flags.c_contiguous:
        raise ValueError("only a contiguous mapping can be registered")
    return int(buf.__array_interface__["data"][0]), int(buf.nbytes)


def register(buf: np.ndarray) -> bool:
    """Page-lock ``buf`` for DMA when a GPU is present; True if it was registered."""
    if buf.nbytes == 0 or not torch.cuda.is_available():
        return False
    addr, size = region(buf)
    err = torch.cuda.cudart().cudaHostRegister(addr, size, REGISTER_FLAGS)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of %d bytes failed (error %s); copies stay pageable", size, err
        )
        return False
    return True


def unregister(buf: np.ndarray) -> None:
    if buf.nbytes and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(region(buf)[0])


def record_copy_event(device: torch.device) -> torch.cuda.Event:
    """An event on ``device``'s current stream, complete once the copies queued so far are."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
