"""How a request's states file is written: under a name its request owns, whole or not at
all. Imports torch only: the connector (``dflash_hidden_states``, in vLLM's interpreter)
and the tests' stand-in server write through it alike.

safetensors' own ``save_file`` (0.8) writes a temporary ``.tmpXXXXXX`` in the target
folder and renames it: a server killed mid-write leaves a file no request can claim, which
a client could only sweep by guessing (and ``.tmp*`` in a shared folder is other programs'
too). Here the bytes go to ``NAME.part`` (``NAME`` is the request's own file name, which
starts with its request id), created exclusively with mode 0600, then renamed to ``NAME``:
whatever a killed writer leaves is named after the request that asked for it, and the run
that sent the request removes it. A write that fails leaves ``NAME.failed`` saying why.
The bytes are the safetensors format (an 8-byte header length, a JSON header padded to 8
bytes, the tensors' bytes in header order), written straight from the tensors' memory: no
serialized copy.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

PART = ".part"
#: Beside a request's file name: why its writer could not write it (UTF-8, at most
#: ``REASON_BYTES``); the client stops at once naming it, where a missing file is asked
#: for again.
FAILED = ".failed"
REASON_BYTES = 1024

#: safetensors' names of torch dtypes.
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code


def header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to 8 bytes) of
    ``tensors``, laid out in the dict's order."""
    meta, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        meta[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_states(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (CPU) to ``path`` as a safetensors file: into ``path.part``, then
    renamed. A ``path.part`` left by a killed writer of the same request is replaced."""
    part = path + PART
    flat = [t.detach().contiguous() for t in tensors.values()]
    with _exclusive(part) as fd:
        _write_all(fd, header(dict(zip(tensors, flat, strict=True))))
        for t in flat:
            if t.numel():
                _write_all(fd, t.reshape(-1).view(torch.uint8).numpy())
    os.rename(part, path)


def write_failure(path: str, reason: str) -> None:
    """Say beside ``path`` (``path.failed``) why its states could not be written."""
    with _exclusive(path + FAILED) as fd:
        _write_all(fd, reason.encode()[:REASON_BYTES])


class _exclusive:
    """``open(part, O_CREAT | O_EXCL)`` (a stale one of this request unlinked first),
    closed on leaving, and removed when the write failed."""

    def __init__(self, part: str) -> None:
        self.part = part
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(part, flags, 0o600)
        except FileExistsError:
            os.unlink(part)
            self.fd = os.open(part, flags, 0o600)

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, kind: object, *rest: object) -> None:
        os.close(self.fd)
        if kind is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.part)


def _write_all(fd: int, data: object) -> None:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    while view:
        view = view[os.write(fd, view) :]
