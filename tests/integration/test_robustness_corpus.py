"""Bad corpora: corrupt bytes and values the batches cannot hold.

A corrupt metadata byte must give a one-line error (``inspect``, ``serve``), never a
segfault. Token ids outside [0, 2^31) and mask values outside {0, 1} are never served
wrapped: a small corpus is refused at open (its values are scanned), a large one refuses
the batch that would hold such a value, naming file, row and value.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import ROOT, check_batch_tokens
from test_robustness_daemon import one_line_error, run_cli

from client import LoaderClient, LoaderRequestError
from loader_server.data.dataset import DatasetError, open_dataset
from loader_server.data.synth import SynthSpec, write_corpus
from loader_server.wire import protocol as P


def _write(path: Path, ids: list[list[int]], masks: list[list[int]], id_type, mask_type) -> Path:
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(id_type)),
            "loss_mask": pa.array(masks, type=pa.list_(mask_type)),
        }
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return path


def _corpus(tmp_path: Path, bad_id=None, bad_mask=None, id_type=None, mask_type=None,
            bad_row=29) -> Path:  # fmt: skip
    id_type, mask_type = id_type or pa.int64(), mask_type or pa.int16()
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(20, 200, size=40)]
    masks = [[1] * len(r) for r in ids]
    if bad_id is not None:
        ids[bad_row][5] = bad_id
    if bad_mask is not None:
        masks[bad_row][7] = bad_mask
    return _write(tmp_path / "values.arrow", ids, masks, id_type, mask_type)


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_id", "bad_mask", "id_type", "text"),
    [
        (2**31 + 5, None, pa.int64(), r"row 29: token id 2147483653 outside \[0, 2147483648\)"),
        (-3, None, pa.int64(), "row 29: token id -3 outside"),
        (2**32 - 1, None, pa.uint32(), "row 29: token id 4294967295 outside"),
        (None, 256, pa.int64(), "row 29: mask value 256 is not 0 or 1"),
    ],
)
def test_unservable_values_refuse_a_small_corpus_at_open(tmp_path, bad_id, bad_mask, id_type,
                                                         text):  # fmt: skip
    path = _corpus(tmp_path, bad_id, bad_mask, id_type)
    with pytest.raises(DatasetError, match=text):
        open_dataset(path)
    line = one_line_error(run_cli("inspect", str(path)))
    assert str(path) in line and "row 29" in line


@pytest.mark.integration
def test_unservable_values_of_a_large_corpus_are_refused_when_served(tmp_path, shm_dir):
    """Above the scan threshold (forced to 0 here) the fill checks every value it copies:
    the batch holding id 2^31 + 5 is refused (ids were served exactly until then)."""
    path = _corpus(tmp_path, bad_id=2**31 + 5)
    d = None
    try:
        from conftest import DaemonProcess

        d = DaemonProcess(path, tmp_path, shm_dir, "--value-scan-bytes", "0")
        ds = open_dataset(path, scan_bytes=0)
        client = LoaderClient(d.endpoint, job="v", rank=0, world_size=1, epochs=1)
        with pytest.raises(LoaderRequestError, match="token id 2147483653 does not fit") as e:
            for batch in client:  # either layout (a packed row holds several samples)
                check_batch_tokens(ds, batch)
        assert e.value.code == P.E_CORPUS and f"{path}, row 29" in str(e.value)
        assert d.proc.poll() is None
    finally:
        if d is not None:
            d.stop()


def test_in_range_wide_columns_are_served_exactly(tmp_path):
    path = _corpus(tmp_path, id_type=pa.uint32(), mask_type=pa.int64())
    ds = open_dataset(path)
    out = dict(input_ids=np.zeros(8192, np.int32), loss_mask=np.zeros(8192, np.uint8),
               lengths=np.zeros(40, np.int32), sample_ids_out=np.zeros(40, np.int64))  # fmt: skip
    tokens, _ = ds.fill(list(range(40)), 4096, **out)
    want = np.concatenate([ds.input_ids(i) for i in range(40)])
    assert np.array_equal(out["input_ids"][:tokens], want.astype(np.int32))


# --- corrupt files -----------------------------------------------------------------------------

_CORRUPTER = """
import sys
import numpy as np
from pathlib import Path
from loader_server.data.dataset import DatasetError, open_dataset
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
data = bytearray(src.read_bytes())
offsets = [int(x) for x in sys.argv[3].split(",")]
out = dict(input_ids=np.zeros(8192, np.int32), loss_mask=np.zeros(8192, np.uint8),
           lengths=np.zeros(64, np.int32), sample_ids_out=np.zeros(64, np.int64))
for off in offsets:
    for value in (0x00, 0xFF, 0x7F):
        d = bytearray(data)
        d[off] = value
        dst.write_bytes(d)
        try:
            ds = open_dataset(dst)
            for i in range(ds.num_samples):
                ds.fill([i], 128, **out)
            ds.close()
        except DatasetError:
            pass
print("survived", len(offsets))
"""


def _small(tmp_path: Path) -> Path:
    spec = SynthSpec(num_samples=40, seed=1, median_len=20, max_len=60, chunk_samples=16)
    return write_corpus(tmp_path / "c.arrow", spec)[0]


def test_corrupt_metadata_bytes_never_crash_open(tmp_path):
    """Every byte of the schema, the first record batch header and the footer, set to three
    values: the open (and a fill of every sample) raises DatasetError or works."""
    src = _small(tmp_path)
    size = src.stat().st_size
    offsets = [*range(0, 0x240), *range(size - 500, size)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _CORRUPTER, str(src), str(tmp_path / "bad.arrow"),
                        ",".join(map(str, offsets))], capture_output=True, text=True,
                       timeout=240, env=env)  # fmt: skip
    assert p.returncode == 0 and "survived" in p.stdout, p.stderr[-3000:]


@pytest.mark.integration
def test_corrupt_metadata_is_one_line_for_inspect_and_serve(tmp_path, shm_dir):
    src = _small(tmp_path)
    data = bytearray(src.read_bytes())
    data[543] = 0x7F  # segfaulted pyarrow's column access before the batch was validated
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(data)
    for args in (
        ["inspect", str(bad)],
        [
            "serve",
            "--dataset",
            str(bad),
            "--endpoint",
            f"ipc://{tmp_path}/x.sock",
            "--shm-dir",
            str(shm_dir),
        ],
    ):
        line = one_line_error(run_cli(*args))
        assert str(bad) in line and "corrupt" in line


# --- corpora no session could train on -------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "flags", "why"),
    [
        ([0] * 30, (), "all 30 samples are empty (0 tokens)"),
        ([300] * 12 + [0] * 3, ("--max-seq-len", "128", "--overlong", "drop"),
         "all 12 non-empty samples are longer than max_seq_len 128 and overlong = drop"),
        ([40] * 5, ("--grad-accum", "8"), "fewer than one step of grad_accum 8 on one rank"),
    ],
)  # fmt: skip
def test_an_unservable_corpus_is_refused_before_ready(tmp_path, shm_dir, lengths, flags, why):
    ids = [list(range(1, n + 1)) for n in lengths]
    path = _write(tmp_path / "c.arrow", ids, [[1] * n for n in lengths], pa.int32(), pa.int8())
    ep = f"ipc://{tmp_path}/l.sock"
    p = run_cli("serve", "--dataset", str(path), "--endpoint", ep, "--shm-dir", str(shm_dir),
                *flags)  # fmt: skip
    line = one_line_error(p)
    assert f"{path}: cannot be served under the daemon's [spec]" in line and why in line, line
    assert "READY" not in p.stderr + p.stdout
    assert not (tmp_path / "l.sock").exists()
