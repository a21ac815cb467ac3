"""A peer trainer run beside ours (``benchmarks/bench_vs_speculators.py``): our corpus in its
format and back, the settings both run with, and its CPU launcher."""
