"""The checks run before serving or on new hardware: serve-check (``serve_check`` and its
parts, vLLM in the loop), the GPU check (``gpu_check``, with the load measurement
``target_load`` the benchmarks share), the systemd check (``systemd_check.sh``). May use
``scripts.servers`` and ``scripts.fixtures``."""
