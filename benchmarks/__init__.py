"""Benchmarks and research tools (not installed): run from the repository root."""
