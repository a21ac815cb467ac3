"""``python benchmarks/bench_loader.py``: this service against its baselines, side by side,
in one run.

Kept import-light: ``consumer`` runs in client processes and must not pull in pyarrow.
"""
