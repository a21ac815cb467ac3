"""dflash-loader client side: the iterator trainers use (no pyarrow, no planner imports).

    from client import LoaderClient
    for batch in LoaderClient("ipc:///run/dflash-loader/loader.sock", job="run1",
                              rank=rank, world_size=world):
        ...

``LoaderClient`` and ``Batch`` are imported lazily: the daemon imports ``client.protocol``
(the shared wire module) and must not pay for importing torch.
"""

from typing import TYPE_CHECKING, Any

from client.protocol import (
    LoaderError,
    LoaderRequestError,
    LoaderUnavailableError,
    ProtocolError,
)

if TYPE_CHECKING:
    from client.loader import Batch, LoaderClient

__all__ = [
    "Batch",
    "LoaderClient",
    "LoaderError",
    "LoaderRequestError",
    "LoaderUnavailableError",
    "ProtocolError",
]


def __getattr__(name: str) -> Any:
    if name in ("Batch", "LoaderClient"):
        from client import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
