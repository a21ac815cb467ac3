"""The batching experiment (sorted vs shuffled vs stratified batches): a research tool, not
part of the installed product. Run ``python -m benchmarks.experiment OUT``."""
