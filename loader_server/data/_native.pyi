# Type stubs for the C extension loader_server/data/_native.c.
from typing import Any as Buffer  # collections.abc.Buffer needs Python 3.12

def fill(
    sample_ids: Buffer,
    lengths: Buffer,
    ids_addr: Buffer,
    ids_kind: int,
    mask_addr: Buffer | None,
    mask_kind: int,
    max_len: int,
    width: int,
    pad: int,
    out_ids: Buffer,
    out_mask: Buffer,
    out_lengths: Buffer,
    out_sample_ids: Buffer,
    out_positions: Buffer | None,
    out_cu: Buffer | None,
) -> tuple[int, int]: ...
def populate(
    sample_ids: Buffer,
    lengths: Buffer,
    ids_addr: Buffer,
    ids_kind: int,
    mask_addr: Buffer | None,
    mask_kind: int,
    max_len: int,
    done: Buffer,
) -> int: ...

class BadValue(ValueError):
    """args: (sample, column, index): a value that would not be served exactly."""

class Fault(OSError):
    """A corpus page could not be read (SIGBUS); ``sample`` names the sample."""

    sample: int
