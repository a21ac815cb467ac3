"""dflash-loader client side: the iterator trainers use (no pyarrow, no planner imports).

    from client import LoaderClient
    for batch in LoaderClient("ipc:///run/dflash-loader/loader.sock", job="run1",
                              rank=rank, world_size=world):
        ...

The daemon never imports this package (it shares only ``loader_server.wire`` with it), so
importing torch here costs the daemon nothing.
"""

from client.batch import Batch
from client.loader import LoaderClient
from loader_server.wire.protocol import (
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
