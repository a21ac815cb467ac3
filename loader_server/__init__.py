"""dflash-loader daemon side: dataset access, epoch planning, shared-memory rings, server.

Kept import-light: submodules are imported where used, so ``import loader_server`` costs
nothing and never pulls pyarrow into a process that only needs the protocol.
"""
