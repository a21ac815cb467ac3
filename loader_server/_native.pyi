# Type stubs for the C extension loader_server/_native.c.
from typing import Any as Buffer  # collections.abc.Buffer needs Python 3.12

def gather(
    dst: Buffer, dst_itemsize: int, width: int, pad: int, addrs: Buffer, lens: Buffer, src_kind: int
) -> int: ...
def positions(dst: Buffer, lens: Buffer) -> int: ...
