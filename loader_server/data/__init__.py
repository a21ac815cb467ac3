"""The data room: the memory-mapped Arrow corpus, its shards and change watch, the native
row gather, synthetic corpora and corpus summaries."""
