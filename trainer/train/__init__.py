"""One rank's training: ``loop`` (``Trainer``), ``step`` (a step's sums and peaks),
``guards`` (what stops a run), ``batches`` (what it reads), ``checkpoint`` (atomic, per
rank, verified, the record's keys in one place), ``costlog``/``cost_records`` (micro-batch
timings for calibration), ``metrics``, ``distributed``, ``stop`` (clean SIGTERM),
``launch`` (``dflash-torchrun``), ``hostmem`` (the CPU allocator policy)."""
