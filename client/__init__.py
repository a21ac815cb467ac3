"""dflash-loader client side: the iterator trainers use (no pyarrow, no planner imports).

from client import LoaderClient
for batch in LoaderClient("ipc:///run/dflash-loader/loader.sock", job="run1",
                          rank=rank, world_size=world):
    ...
"""

from client.loader import Batch, LoaderClient
from client.protocol import (
    LoaderError,
    LoaderRequestError,
    LoaderUnavailableError,
    ProtocolError,
)

__all__ = [
    "Batch",
    "LoaderClient",
    "LoaderError",
    "LoaderRequestError",
    "LoaderUnavailableError",
    "ProtocolError",
]
