"""The wire: everything both the daemon and its clients read (messages, ring layout, the
ring's counters extension). Imports msgpack and the C extension only: no torch, numpy or
pyarrow."""
