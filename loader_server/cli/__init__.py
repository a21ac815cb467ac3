"""``dflash-loader``'s command line: the group (``main``), a module per area (``data``,
``plan``, ``service``, with the batch-spec flags of ``spec_flags``), and the error contract
both this command and ``dflash-train`` keep (``contract``). Importing this package loads
none of them, so ``dflash-train`` reads the contract without the daemon's commands."""
