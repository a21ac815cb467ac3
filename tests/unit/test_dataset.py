"""Dataset layer: accepted layouts, zero-copy views, fingerprints, validation errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from loader_server.data.dataset import DatasetError, open_dataset
from loader_server.data.synth import SynthSpec, write_corpus

ROWS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
MASKS = [[0, 1, 1], [1], [0, 0, 1, 1, 1], [1, 0]]


def _table(rows=ROWS, masks=MASKS, id_type=None, mask_type=None) -> pa.Table:
    id_type, mask_type = id_type or pa.int32(), mask_type or pa.uint8()
    cols = {"input_ids": pa.array(rows, type=pa.list_(id_type))}
    if masks is not None:
        cols["loss_mask"] = pa.array(masks, type=pa.list_(mask_type))
    return pa.table(cols)


def _write(path: Path, table: pa.Table, *, stream: bool = False, max_chunksize=None) -> Path:
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, opener(sink, table.schema) as w:
        w.write_table(table, max_chunksize=max_chunksize)
    return path


def _assert_rows(ds, rows=ROWS, masks=MASKS):
    assert ds.num_samples == len(rows)
    assert ds.lengths.tolist() == [len(r) for r in rows]
    for i, r in enumerate(rows):
        assert ds.input_ids(i).tolist() == r
        want = masks[i] if masks is not None else [1] * len(r)
        assert ds.loss_mask(i).tolist() == want


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_single_file_round_trip(tmp_path, stream, chunk):
    ds = open_dataset(_write(tmp_path / "d.arrow", _table(), stream=stream, max_chunksize=chunk))
    _assert_rows(ds)
    assert ds.has_loss_mask


@pytest.mark.parametrize(
    ("id_type", "mask_type"),
    [
        (pa.int64(), pa.int8()),
        (pa.uint32(), pa.bool_()),
        (pa.int32(), pa.bool_()),
        (pa.int64(), pa.int64()),
    ],
)
def test_accepted_types(tmp_path, id_type, mask_type):
    masks = [[bool(v) for v in m] for m in MASKS] if mask_type == pa.bool_() else MASKS
    ds = open_dataset(
        _write(tmp_path / "d.arrow", _table(id_type=id_type, masks=masks, mask_type=mask_type))
    )
    _assert_rows(ds)


def test_large_list_and_sliced_batches(tmp_path):
    t = pa.table({"input_ids": pa.array(ROWS, type=pa.large_list(pa.int32()))})
    ds = open_dataset(_write(tmp_path / "d.arrow", t, max_chunksize=2))
    _assert_rows(ds, masks=None)
    assert not ds.has_loss_mask


def test_sharded_folder_in_name_order(tmp_path):
    _write(tmp_path / "b.arrow", _table(ROWS[2:], MASKS[2:]))
    _write(tmp_path / "a.arrow", _table(ROWS[:2], MASKS[:2]), stream=True)
    (tmp_path / "README.txt").write_text("ignored")
    ds = open_dataset(tmp_path)
    _assert_rows(ds)
    assert [p.name for p in ds.paths] == ["a.arrow", "b.arrow"]


def test_huggingface_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [list(range(n)) for n in (3, 7, 1, 12, 5, 9)]
    masks = [[i % 2 for i in range(len(r))] for r in rows]
    hf = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": masks, "id": list(range(6))})
    hf.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    ds = open_dataset(tmp_path / "hf")
    assert len(ds.paths) == 3
    _assert_rows(ds, rows, masks)


def test_state_json_order_wins_over_names(tmp_path):
    _write(tmp_path / "z.arrow", _table(ROWS[:2], MASKS[:2]), stream=True)
    _write(tmp_path / "a.arrow", _table(ROWS[2:], MASKS[2:]), stream=True)
    (tmp_path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "z.arrow"}, {"filename": "a.arrow"}]})
    )
    _assert_rows(open_dataset(tmp_path))


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_views_point_into_the_file_mapping(tmp_path):
    path = tmp_path / "c.arrow"
    write_corpus(path, SynthSpec(num_samples=300, seed=1, median_len=64, max_len=256))
    ds = open_dataset(path)
    ranges = _mapped_ranges(path.resolve())
    assert ranges, "the corpus file is not memory-mapped"
    for i in (0, 150, 299):
        for view in (ds.input_ids(i), ds.loss_mask(i)):
            addr = view.__array_interface__["data"][0]
            assert not view.flags.owndata
            assert any(lo <= addr < hi for lo, hi in ranges), f"sample {i} view is a copy"


def test_fingerprint_stable_and_content_sensitive(tmp_path):
    a = _write(tmp_path / "a.arrow", _table())
    assert open_dataset(a).fingerprint == open_dataset(a).fingerprint
    changed = [r[:] for r in ROWS]
    changed[2][1] = 99  # same lengths, different token
    b = _write(tmp_path / "b.arrow", _table(changed))
    assert open_dataset(b).fingerprint != open_dataset(a).fingerprint
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.arrow").write_bytes(a.read_bytes())
    assert open_dataset(copy / "a.arrow").fingerprint == open_dataset(a).fingerprint


def _outputs(tokens: int, rows: int, packed: bool = False) -> dict[str, np.ndarray]:
    """Slot-like outputs, pre-filled with junk so unwritten elements show."""
    out = {
        "input_ids": np.full(tokens, -7, np.int32),
        "loss_mask": np.full(tokens, 7, np.uint8),
        "lengths": np.full(rows, -7, np.int32),
        "sample_ids_out": np.full(rows, -7, np.int64),
    }
    if packed:
        out["position_ids"] = np.full(tokens, -7, np.int32)
        out["cu_seqlens"] = np.full(rows + 1, -7, np.int32)
    return out


def test_fill_padded_and_packed(tmp_path):
    ds = open_dataset(_write(tmp_path / "d.arrow", _table()))
    out = _outputs(12, 3)
    assert ds.fill([2, 0, 1], 4, width=4, pad_id=-1, **out) == (8, 4)
    assert out["input_ids"].reshape(3, 4).tolist() == [[5, 6, 7, 8], [1, 2, 3, -1], [4, -1, -1, -1]]
    assert out["loss_mask"].reshape(3, 4).tolist() == [[0, 0, 1, 1], [0, 1, 1, 0], [1, 0, 0, 0]]
    assert out["lengths"].tolist() == [4, 3, 1] and out["sample_ids_out"].tolist() == [2, 0, 1]
    out = _outputs(7, 3, packed=True)  # one more element than needed: left alone
    assert ds.fill([3, 0, 1], 8, **out) == (6, 3)
    assert out["input_ids"].tolist() == [10, 11, 1, 2, 3, 4, -7]
    assert out["loss_mask"].tolist() == [1, 0, 0, 1, 1, 1, 7]
    assert out["position_ids"].tolist() == [0, 1, 0, 1, 2, 0, -7]
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 6]


def _oracle(ds, sample_ids, max_len, width):
    """What fill must produce, built from the per-sample views with plain numpy."""
    ids = [ds.input_ids(i)[:max_len].astype(np.int32) for i in sample_ids]
    masks = [ds.loss_mask(i)[:max_len].astype(np.uint8) for i in sample_ids]
    if width == 0:
        return np.concatenate(ids), np.concatenate(masks)
    out_ids = np.full((len(ids), width), 9, np.int32)
    out_mask = np.zeros((len(ids), width), np.uint8)
    for r, (a, m) in enumerate(zip(ids, masks, strict=True)):
        out_ids[r, : a.size], out_mask[r, : m.size] = a, m
    return out_ids.ravel(), out_mask.ravel()


@pytest.mark.parametrize(
    ("id_type", "mask_type"),
    [
        (pa.int32(), pa.uint8()),
        (pa.int64(), pa.int8()),
        (pa.uint32(), pa.bool_()),
        (pa.int64(), pa.int64()),
        (pa.int32(), pa.int16()),
        (pa.int32(), pa.uint32()),
        (pa.int32(), None),
    ],
)
@pytest.mark.parametrize("large", [False, True], ids=["list", "large_list"])
def test_fill_matches_per_sample_views(tmp_path, id_type, mask_type, large):
    """Every stored type, sliced multi-chunk files, shards, truncation, padded and packed."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50_000, rng.integers(0, 40)).tolist() for _ in range(60)]
    masks = [(rng.integers(0, 2, len(r)) == 1).tolist() for r in rows]
    lt = pa.large_list if large else pa.list_
    for k, part in enumerate((slice(0, 25), slice(25, 60))):
        cols = {"input_ids": pa.array(rows[part], type=lt(id_type))}
        if mask_type is not None:
            cols["loss_mask"] = pa.array(masks[part], type=lt(pa.bool_())).cast(lt(mask_type))
        _write(tmp_path / f"s{k}.arrow", pa.table(cols), max_chunksize=7)
    ds = open_dataset(tmp_path)
    sel = rng.permutation(60)[:17]
    for width in (0, 40):
        for max_len in (40, 9):
            want_ids, want_mask = _oracle(ds, sel, max_len, width)
            out = _outputs(want_ids.size, sel.size, packed=width == 0)
            tokens, longest = ds.fill(sel, max_len, width=width, pad_id=9, **out)
            want_lens = np.minimum(ds.lengths[sel], max_len)
            assert (tokens, longest) == (want_lens.sum(), want_lens.max())
            np.testing.assert_array_equal(out["input_ids"], want_ids)
            np.testing.assert_array_equal(out["loss_mask"], want_mask)
            np.testing.assert_array_equal(out["lengths"], want_lens)
            np.testing.assert_array_equal(out["sample_ids_out"], sel)
            if width == 0:
                starts = np.repeat(np.cumsum(want_lens) - want_lens, want_lens)
                np.testing.assert_array_equal(out["position_ids"], np.arange(tokens) - starts)


def test_native_fill_refuses_bad_arguments(tmp_path):
    ds = open_dataset(_write(tmp_path / "d.arrow", _table()))
    out = _outputs(8, 2)

    def fill(sample_ids, **kw):
        return ds.fill(sample_ids, kw.pop("max_len", 8), **{**out, **kw})

    with pytest.raises(ValueError, match="input_ids holds 8 elements, the micro-batch needs 10"):
        fill([0, 2], width=5)
    with pytest.raises(ValueError, match="row 1 has 5 tokens, more than width 4"):
        fill([0, 2], width=4)
    with pytest.raises(IndexError, match="sample id 4 outside the dataset's 4 samples"):
        fill([0, 4])
    with pytest.raises(IndexError, match="sample id -1 outside"):
        fill([-1])
    with pytest.raises(ValueError, match="lengths holds 2 elements, the micro-batch needs 3"):
        fill([0, 1, 3])
    with pytest.raises(TypeError, match="input_ids must hold 4-byte integers"):
        fill([0], input_ids=np.zeros(8, np.int64))
    frozen = np.zeros(8, np.int32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fill([0], input_ids=frozen)
    assert (out["input_ids"] == -7).all() and (out["lengths"] == -7).all()  # nothing written
    assert fill([1, 0], max_len=2) == (3, 2)
    assert out["input_ids"][:3].tolist() == [4, 1, 2] and out["lengths"].tolist() == [1, 2]


def test_shards_must_share_column_types(tmp_path):
    _write(tmp_path / "a.arrow", _table())
    _write(
        tmp_path / "b.arrow",
        _table(masks=[[bool(x) for x in m] for m in MASKS], mask_type=pa.bool_()),
    )
    msg = _error(tmp_path)
    assert "b.arrow: column 'loss_mask' is bool but" in msg and "a.arrow has uint8" in msg
    (tmp_path / "b.arrow").unlink()
    _write(tmp_path / "b.arrow", _table(id_type=pa.int64()))
    assert "column 'input_ids' is int64 but" in _error(tmp_path)


# --- validation errors: one line naming file, column and row ---------------------------


def _error(path) -> str:
    with pytest.raises(DatasetError) as e:
        open_dataset(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_input_ids(tmp_path):
    p = _write(tmp_path / "d.arrow", pa.table({"tokens": pa.array(ROWS)}))
    assert "missing required column 'input_ids'" in _error(p) and "d.arrow" in _error(p)


def test_wrong_types(tmp_path):
    p = _write(tmp_path / "d.arrow", pa.table({"input_ids": pa.array(["a", "b"])}))
    assert "column 'input_ids' has type string" in _error(p)
    p = _write(tmp_path / "f.arrow", _table(rows=[[1.5], [2.0]], masks=None, id_type=pa.float32()))
    assert "list<float>" in _error(p)
    p = _write(tmp_path / "m.arrow", _table(mask_type=pa.float32()))
    assert "column 'loss_mask' has type list<float>" in _error(p)


def test_mask_length_mismatch_names_row(tmp_path):
    masks = [m[:] for m in MASKS]
    masks[2] = [1, 1]
    msg = _error(_write(tmp_path / "d.arrow", _table(masks=masks), max_chunksize=2))
    assert "column 'loss_mask', row 2: length 2 differs from input_ids length 5" in msg


def test_nulls_name_row(tmp_path):
    rows = [r[:] for r in ROWS]
    rows[1] = None
    assert "column 'input_ids', row 1: null list" in _error(
        _write(tmp_path / "a.arrow", _table(rows))
    )
    rows = [r[:] for r in ROWS]
    rows[3] = [1, None]
    assert "row 3: null value" in _error(_write(tmp_path / "b.arrow", _table(rows)))


def test_empty_dataset(tmp_path):
    t = _table(rows=[], masks=[])
    assert "empty" in _error(_write(tmp_path / "d.arrow", t))
    (tmp_path / "dir").mkdir()
    assert "no Arrow shards" in _error(tmp_path / "dir")


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_truncated_file(tmp_path, stream):
    p = tmp_path / "d.arrow"
    write_corpus(
        p,
        SynthSpec(num_samples=200, median_len=50, max_len=100, chunk_samples=50),
        stream_format=stream,
    )
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    msg = _error(p)
    assert "d.arrow" in msg and "truncated, corrupt or not an Arrow IPC" in msg


def test_a_stream_cut_between_record_batches_is_refused(tmp_path):
    # a writer killed between batches leaves a stream that reads cleanly, half of it
    p = _write(tmp_path / "d.arrow", _table(), stream=True, max_chunksize=1)
    data = p.read_bytes()
    assert data.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    whole = pa.ipc.open_stream(pa.py_buffer(data)).read_all().num_rows
    sink = pa.BufferOutputStream()  # the same stream, never closed: no end-of-stream marker
    w = pa.ipc.new_stream(sink, _table().schema)
    for batch in _table().to_batches(max_chunksize=1)[:2]:
        w.write_batch(batch)
    p.write_bytes(sink.getvalue().to_pybytes())
    assert pa.ipc.open_stream(p.read_bytes()).read_all().num_rows == 2 < whole  # pyarrow: fine
    msg = _error(p)
    assert "d.arrow: Arrow IPC stream has no end-of-stream marker" in msg
    assert "after 2 record batches (2 rows)" in msg


def test_a_column_twice_is_refused(tmp_path):
    ids = pa.array(ROWS, pa.list_(pa.int32()))
    _write(tmp_path / "d.arrow", pa.Table.from_arrays([ids, ids], names=["input_ids", "input_ids"]))
    assert "column 'input_ids' appears 2 times" in _error(tmp_path / "d.arrow")


def test_not_arrow(tmp_path):
    p = tmp_path / "d.arrow"
    p.write_text("input_ids,loss_mask\n1,1\n")
    assert "not an Arrow IPC stream" in _error(p)
    (tmp_path / "empty.arrow").write_bytes(b"")
    assert "empty file" in _error(tmp_path / "empty.arrow")


def test_token_ids_outside_vocab(tmp_path):
    p = _write(tmp_path / "d.arrow", _table(), max_chunksize=2)
    with pytest.raises(
        DatasetError, match=r"column 'input_ids', row 3: token id 11 outside \[0, 11\)"
    ):
        open_dataset(p, vocab_size=11)
    open_dataset(p, vocab_size=12)
    neg = _write(tmp_path / "n.arrow", _table(rows=[[1, -4], [2]], masks=None))
    with pytest.raises(DatasetError, match="row 0: token id -4"):
        open_dataset(neg, check_values=True)


@pytest.mark.parametrize("mask_type", [pa.uint8(), pa.int64()])
def test_mask_values_checked(tmp_path, mask_type):
    masks = [[0, 1, 1], [1], [0, 0, 1, 1, 1], [1, 2]]
    p = _write(tmp_path / "d.arrow", _table(masks=masks, mask_type=mask_type), max_chunksize=3)
    with pytest.raises(DatasetError, match="row 3: mask value 2 is not 0 or 1"):
        open_dataset(p, check_values=True)


@pytest.mark.parametrize("mask_type", [pa.uint8(), pa.bool_(), None])
def test_populate_maps_each_sample_once(tmp_path, mask_type):
    masks = {None: None, pa.uint8(): MASKS}.get(mask_type, [[x == 1 for x in m] for m in MASKS])
    ds = open_dataset(_write(tmp_path / "d.arrow", _table(masks=masks, mask_type=mask_type)))
    assert ds.needs_populate(np.array([0, 2]))
    assert ds.populate(np.array([0, 2]), 8) == 2
    assert not ds.needs_populate(np.array([2, 0])) and ds.needs_populate(np.array([0, 1]))
    assert ds.populate(np.array([0, 1, 2, 3]), 8) == 2  # 0 and 2 were done already
    with pytest.raises(IndexError, match="sample id 4 outside"):
        ds.populate(np.array([4]), 8)
    out = _outputs(11, 4, packed=True)  # populating changes nothing that fill writes
    assert ds.fill([0, 1, 2, 3], 8, **out) == (11, 5)
    assert out["input_ids"].tolist() == list(range(1, 12))


def test_readahead_thread_populates_until_nothing_is_left(tmp_path):
    import time

    from loader_server.service.readahead import Readahead

    ds = open_dataset(_write(tmp_path / "d.arrow", _table()))
    ra = Readahead(ds)
    try:
        assert ra.active
        ra.submit(np.array([0, 1]), 8)
        ra.submit(np.array([1, 2, 3]), 8)
        deadline = time.monotonic() + 10
        while ra.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ra.active and not ds.needs_populate(np.arange(4))
    finally:
        ra.close()


@pytest.mark.parametrize(
    ("offsets", "what"),
    [
        ([0, 5_000_000, 100], "row 1: corrupt list offsets (they decrease)"),
        ([0, 50, 10, 100], "row 1: corrupt list offsets (they decrease)"),
    ],
)
def test_corrupt_offsets_are_refused(tmp_path, offsets, what):
    """The native fill trusts offsets, so a corrupt file must fail at open, not be read."""
    values = pa.array(np.arange(100, dtype=np.int32))
    ids = pa.Array.from_buffers(
        pa.list_(pa.int32()), len(offsets) - 1, [None, pa.py_buffer(np.array(offsets, np.int32))],
        children=[values],
    )  # fmt: skip
    p = _write(tmp_path / "bad.arrow", pa.table({"input_ids": ids}))
    msg = _error(p)
    assert "bad.arrow: column 'input_ids'" in msg and what in msg
