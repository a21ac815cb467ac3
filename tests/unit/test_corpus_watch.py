"""CorpusWatch without a daemon: what counts as a change of a served corpus file."""

from __future__ import annotations

import logging
import os

import pytest

from loader_server.data.corpus_watch import CorpusWatch
from loader_server.data.dataset import open_dataset
from loader_server.data.synth import SynthSpec, write_corpus


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "corpus.arrow"
    write_corpus(path, SynthSpec(num_samples=300, seed=3, median_len=100, max_len=400))
    ds = open_dataset(path)
    yield path, ds, CorpusWatch(ds.shards)
    ds.close()


def test_unchanged_corpus_passes(served):
    _, _, watch = served
    assert watch.check() is None and watch.check() is None


def test_truncation_and_growth_are_changes(served):
    path, _, watch = served
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"x")
    assert f"grew ({size:,} -> {size + 1:,} bytes)" in watch.check()
    os.truncate(path, 100)
    assert f"was truncated ({size:,} -> 100 bytes)" in watch.check()


def test_in_place_write_is_a_change(served):
    path, _, watch = served
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"\0" * 8)
    os.utime(path, ns=(0, 10**18))  # another mtime
    assert "was modified in place (mtime" in watch.check()


def test_write_with_the_mtime_restored_is_a_change(served):
    path, _, watch = served
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"\0" * 8)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "was rewritten in place (same size and mtime, other content)" in watch.check()


def test_chmod_is_not_a_change(served, caplog):
    path, _, watch = served
    os.chmod(path, 0o600)
    with caplog.at_level(logging.INFO):
        assert watch.check() is None
    assert "metadata changed, content unchanged" in caplog.text
    assert watch.check() is None


def test_atomic_replacement_is_not_a_change_of_the_served_file(served, tmp_path, caplog):
    path, ds, watch = served
    new = tmp_path / "new.arrow"
    write_corpus(new, SynthSpec(num_samples=300, seed=4, median_len=100, max_len=400))
    before = ds.input_ids(7).copy()
    os.replace(new, path)
    with caplog.at_level(logging.WARNING):
        assert watch.check() is None
    assert "now names another file" in caplog.text
    assert (ds.input_ids(7) == before).all()  # the opened inode is still what is mapped
