"""``dflash-train tokenize`` with the real Qwen3 tokenizer
(``scripts/fixtures/qwen3_tokenizer.py``) on the long real set
(``scripts/fixtures/real_chats.py``: 144 stdlib modules, 1.2K-9.4K tokens each).

* Work goes to the workers in chunks of a bounded size, not a fixed row count: the 144 long
  rows (2.3 MB) make dozens of chunks, so two workers share them (they made one chunk of
  256 rows, all of it one worker's).
* The shards (and the held-out prompts) are byte-identical for 1 and 2 workers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scripts.fixtures.qwen3_tokenizer import qwen3_tokenizer_dir
from scripts.fixtures.real_chats import long_set, write_jsonl
from trainer.data.corpus import HELDOUT_NAME
from trainer.data.messages import to_messages
from trainer.data.sources import CHUNK_ROWS, expand_sources, input_bytes, read_chunks
from trainer.data.tokenize import POOL_CHUNK_BYTES, chunk_bytes, tokenize_corpus
from trainer.data.tokenizer import load_tokenizer
from trainer.options import TokenizeOptions


@pytest.fixture(scope="module")
def qwen3() -> Path:
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def long_rows() -> list[dict]:
    return long_set()


def _chunks(path: Path, workers: int = 2) -> list:
    files = expand_sources([path])
    size = chunk_bytes(workers, input_bytes(files))
    return list(read_chunks(files, CHUNK_ROWS, None, size))


def test_chunk_size_follows_the_input_and_the_workers():
    lo, hi = POOL_CHUNK_BYTES
    assert chunk_bytes(2, 10_000) == lo and chunk_bytes(2, 10**12) == hi
    assert chunk_bytes(2, 2 * 16 * 100_000) == chunk_bytes(4, 4 * 16 * 100_000) == 100_000
    assert chunk_bytes(1, 10_000) == chunk_bytes(1, 10**12) > hi  # one big batch in process


def test_long_rows_make_many_chunks_in_input_order(long_rows, tmp_path):
    src = write_jsonl(long_rows, tmp_path / "long.jsonl")
    lines = src.read_bytes().splitlines(keepends=True)
    chunks = _chunks(src)
    assert len(chunks) >= 24  # about 16 for each of 2 workers (was 1 chunk of 256 rows)
    assert [line for _, payload in chunks for line in payload] == lines
    assert [w for where, _ in chunks for w in where] == [(str(src), i) for i in range(len(lines))]
    bound = chunk_bytes(2, src.stat().st_size)
    for _, payload in chunks[:-1]:  # each ends with the line that reaches the bound
        size = sum(map(len, payload))
        assert size >= bound > size - len(payload[-1])
    # Parquet and JSON rows count at their batch's or file's mean size: cut as finely
    table = pa.Table.from_pylist([{"messages": to_messages(r)} for r in long_rows])
    pq.write_table(table, tmp_path / "long.parquet")
    (tmp_path / "long.json").write_text(json.dumps(long_rows))
    for path in (tmp_path / "long.parquet", tmp_path / "long.json"):
        chunks = _chunks(path)
        assert len(chunks) >= 16
        assert [w for where, _ in chunks for w in where] == [
            (str(path), i) for i in range(len(long_rows))
        ]
        got = [r for _, p in chunks for r in (p.to_pylist() if isinstance(p, pa.Table) else p)]
        assert [to_messages(r) for r in got] == [to_messages(r) for r in long_rows]


def test_long_rows_byte_identical_for_one_and_two_workers(qwen3, long_rows, tmp_path):
    src = write_jsonl(long_rows, tmp_path / "long.jsonl")
    reports = {}
    for workers in (1, 2):
        options = TokenizeOptions(workers=workers, shard_rows=50, holdout=3)
        reports[workers] = tokenize_corpus(
            [src], tmp_path / f"w{workers}", tokenizer=qwen3, options=options, progress=False
        )
    one, two = reports[1], reports[2]
    assert one["shards"] == two["shards"] == [f"shard-0000{k}.arrow" for k in range(3)]
    for name in [*one["shards"], HELDOUT_NAME]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert one["conversations"] + one["heldout"] == len(long_rows) and one["malformed_rows"] == 0
    tok = load_tokenizer(str(qwen3))
    want = sum(
        len(tok.apply_chat_template(to_messages(r), tokenize=True)["input_ids"])
        for r in long_rows[:-3]
    )
    assert one["tokens"] == two["tokens"] == want
    # --limit ends inside a chunk: the same first rows
    options = TokenizeOptions(workers=2, limit=37)
    cut = tokenize_corpus([src], tmp_path / "cut", tokenizer=qwen3, options=options, progress=False)
    assert cut["rows_read"] == cut["conversations"] == 37


@pytest.mark.parametrize("workers", [1, 2])
def test_unbalanced_markup_is_kept_counted_and_reported(qwen3, tmp_path, workers):
    """A literal ``</think>`` in an ordinary reply (Qwen3's template reads it as the end of
    reasoning) is kept, masked as rendered, and counted in the report, by any worker."""
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    reply = "Close it with </think> here."
    odd = {
        "messages": [{"role": "user", "content": "tag?"}, {"role": "assistant", "content": reply}]
    }
    src = write_jsonl([ok, odd] * 300, tmp_path / "rows.jsonl")
    report = tokenize_corpus(
        [src], tmp_path / "out", tokenizer=str(qwen3),
        options=TokenizeOptions(workers=workers), progress=False,
    )  # fmt: skip
    assert report["conversations"] == 600
    assert report["template_notes"] == {"unbalanced_markup": 300}
