"""Issue 24, the data side: ``dflash-train tokenize`` and ``regen --server`` read their inputs
once and as they are, count every malformed row, cut a huge row before tokenizing it whole,
report failed rows by their reason and exit non-zero, and leave no worker or partial output
behind when they are killed. Real files, real ``python -m trainer.cli`` and
``scripts/servers/chat_server.py`` subprocesses (its fixed-delay backend)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, chat_server

from loader_server.data.dataset import open_dataset
from scripts.fixtures.tiny_chat import build_tokenizer, generate_conversations, write_jsonl
from trainer.cli import main
from trainer.data import token_spans
from trainer.data.server.journal import journal_path
from trainer.data.tokenize import tokenize_corpus
from trainer.options import TokenizeOptions

pytestmark = pytest.mark.heavy(22)  # seconds side by side; scheduled first (tests/conftest.py)

CLI = [sys.executable, "-m", "trainer.cli"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with the Qwen3-style chat template (think block)."""
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "qwen3", template="qwen3")


def fast_server(tmp: Path, *args: str):
    """A chat server answering after 5 ms, 8 requests at once (``args`` may override)."""
    return chat_server(tmp, "--fixed-delay", "0.005", "--max-concurrent", "8", *args)


def regen(*args: str) -> tuple[int, list[str], dict | None]:
    """``dflash-train regen ARGS`` in process: (exit code, output lines, stdout summary)."""
    res = CliRunner().invoke(main, ["regen", *args, "--no-progress"])
    out = res.stdout.strip().splitlines()
    summary = json.loads(out[-1]) if out and out[-1].startswith("{") else None
    lines = [x for x in res.output.strip().splitlines() if " INFO " not in x]
    return res.exit_code, lines, summary


def tokenize_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "tokenize", *args, "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, **kw)  # fmt: skip


def errors(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith("Error:")]


# ------------------------------------------------------------------ inputs read once (2a)


def test_a_symlink_loop_is_read_once_with_a_warning_naming_the_links(tok, tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", generate_conversations(5, seed=1, words=10))
    (data / "sub").mkdir()
    (data / "sub" / "up").symlink_to("..")  # a loop: data/sub/up/sub/up/...
    (data / "self").symlink_to(".")
    (data / "again.jsonl").symlink_to("a.jsonl")  # the same file under a second name
    res = tokenize_cli(str(data), str(tmp_path / "out"), "--tokenizer", str(tok))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["conversations"] == 5
    report = json.loads((tmp_path / "out" / "tokenize_report.json").read_text())
    assert report["rows_read"] == 5 and report["sources"] == [str(data / "a.jsonl")]
    warning = [x for x in res.stderr.splitlines() if "WARNING" in x]
    assert len(warning) == 1, res.stderr
    for link in ("sub/up", "self", "again.jsonl"):
        assert str(data / link) in warning[0]


# ------------------------------------------------------ malformed rows are counted (2c)


def test_rows_of_any_depth_and_type_are_counted_as_malformed(tok, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    good = list(generate_conversations(3, seed=2, words=10))
    user = {"role": "user", "content": "q"}
    bad = [
        '{"messages": ' + deep + "}",  # json.loads: RecursionError
        json.dumps({"messages": [{"role": "user", "content": "hi \ud800"}, user]}),  # surrogate
        json.dumps({"messages": [user, {"role": "assistant", "content": [1, [2, [3]]]}]}),
        json.dumps({"messages": [user, {"role": "assistant", "content": [{"text": 5}]}]}),
        json.dumps({"messages": [{"role": 5, "content": "x"}, user]}),
        json.dumps({"messages": [user, {"role": "assistant", "content": ["a" * 10**6]}]}),
        json.dumps({"messages": {"role": "user"}}),
        json.dumps([1, 2, 3]),
        json.dumps({"conversations": [[[[[]]]]]}),
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join([json.dumps(good[0]), *bad, *map(json.dumps, good[1:])]) + "\n")
    res = tokenize_cli(str(src), str(tmp_path / "out"), "--tokenizer", str(tok), "--workers", "2")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "out" / "tokenize_report.json").read_text())
    assert report["conversations"] == 3 and report["malformed_rows"] == len(bad)
    assert report["skipped"]["bad_json"]["first_row"] == 1
    assert report["skipped"]["bad_text"]["first_row"] == 2

    # A whole .json file nested too deeply: one line naming it.
    whole = tmp_path / "deep.json"
    whole.write_text(deep)
    res = tokenize_cli(str(whole), str(tmp_path / "out2"), "--tokenizer", str(tok))
    assert res.returncode == 1 and not (tmp_path / "out2").exists()
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith(f"Error: {whole}: JSON nested too deeply")


# ---------------------------------------------- a huge row is cut before it is expanded (2d)


def _row(user: str, reply: str, second: str | None = None) -> dict:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if second is not None:
        messages += [{"role": "user", "content": "more?"}, {"role": "assistant", "content": second}]
    return {"messages": messages}


def _huge_rows(n_chars: int) -> list[dict]:
    """Rows whose long part is ``n_chars`` characters of text (the same text at any size:
    a smaller size is a prefix of a larger one)."""
    rows = generate_conversations(40, seed=4)
    words = " ".join(json.dumps(r) for r in rows).replace('"', "")
    text = ((words + " ") * (1 + n_chars // (len(words) + 1)))[:n_chars]
    normal = list(generate_conversations(3, seed=5, words=30))
    return [
        normal[0],
        _row("Tell me everything.", text),  # truncated in its reply
        _row(text, "the answer"),  # no supervised token within the limit
        _row("short", "a short reply", second=text),  # the second reply is cut
        *normal[1:],
    ]


def _corpus(path: Path) -> list[tuple[list[int], list[int]]]:
    ds = open_dataset(path)
    return [(ds.input_ids(i).tolist(), ds.loss_mask(i).tolist()) for i in range(len(ds))]


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_a_huge_row_under_max_length_is_cut_exactly(tok, tmp_path, monkeypatch, overflow):
    opts = TokenizeOptions(max_length=512, overflow=overflow)
    big = write_jsonl(tmp_path / "big.jsonl", _huge_rows(20_000_000))
    small = write_jsonl(tmp_path / "small.jsonl", _huge_rows(60_000))

    def run(src: Path, name: str) -> dict:
        return tokenize_corpus([src], tmp_path / name, tokenizer=tok, options=opts,
                               progress=False)  # fmt: skip

    fast = run(big, "fast")
    monkeypatch.setattr(token_spans, "PREFIX_CHARS_PER_TOKEN", False)  # tokenize whole
    slow = run(small, "slow")
    assert _corpus(tmp_path / "fast") == _corpus(tmp_path / "slow")
    want = (5, 1, 2) if overflow == "truncate" else (3, 3, 0)  # kept, too long, truncated
    for report in (fast, slow):
        assert (report["conversations"], report["dropped_too_long"], report["truncated"]) == want


#: Runs argv and prints its peak RSS (kB). A child's ru_maxrss starts at its parent's high
#: water mark and survives exec: measured from the test process (hundreds of MB by then),
#: it would be that process's, so a small process in between forks the command.
_PEAK_RSS = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
    "_, s, u = os.wait4(p.pid, 0); print(u.ru_maxrss); sys.exit(os.waitstatus_to_exitcode(s))"
)


def test_a_huge_row_costs_little_memory(tok, tmp_path):
    """The whole command on a 20 MB row: tokenizing it whole took ~2 GB and ~12 s here."""
    src = write_jsonl(tmp_path / "big.jsonl", _huge_rows(20_000_000)[:2])
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *CLI, "tokenize", str(src), str(tmp_path / "out"),
         "--tokenizer", str(tok), "--max-length", "4096", "--workers", "1", "--no-progress"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True,
    )  # fmt: skip
    peak_kb = int(out.stdout.split()[-1])
    # memory, not time, tells the paths apart (time depends on how busy the machine is)
    assert peak_kb < 900 * 1024, f"peak RSS {peak_kb / 1024:.0f} MB"


# --------------------------------------------------- workers die with their parent (5)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped


def _slow_source(tmp_path: Path) -> Path:
    """Enough rows for a few seconds of tokenizing with two workers."""
    lines = [json.dumps(r) for r in generate_conversations(2000, seed=6, words=120)]
    src = tmp_path / "many.jsonl"
    src.write_text("\n".join(lines * 40) + "\n")
    return src


def _default_sigint() -> None:
    """A suite started in the background (``cmd &`` without job control) runs with SIGINT
    ignored, which children inherit and Python then leaves ignored: the tokenizer under
    test gets the default disposition, as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_with_workers(args: list[str]) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        kids = [int(x) for x in out.stdout.split()]
        if len(kids) >= 2:
            return proc, kids
        assert proc.poll() is None, f"tokenize ended early: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no workers started"
        time.sleep(0.02)


def _gone_soon(pids: list[int], within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_tokenize_workers_die_when_the_parent_is_killed(tok, tmp_path):
    src = _slow_source(tmp_path)
    out = tmp_path / "out"
    proc, kids = _start_with_workers(
        ["tokenize", str(src), str(out), "--tokenizer", str(tok), "--workers", "2", "--no-progress"]
    )
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert _gone_soon(kids) == [], "tokenize workers outlived their killed parent"
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_tokenize_leaves_nothing_behind(tok, tmp_path, sig):
    src = _slow_source(tmp_path)
    where = tmp_path / "outputs"
    where.mkdir()
    (where / "mine.txt").write_text("a user's file")
    before = sorted(p.name for p in where.iterdir())
    proc, kids = _start_with_workers(
        ["tokenize", str(src), str(where / "out"), "--tokenizer", str(tok), "--workers", "2",
         "--no-progress"]
    )  # fmt: skip
    assert any(p.name.endswith(".dflash-tmp") for p in where.iterdir())  # it is writing
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    assert errors(err.strip().splitlines()) == [err.strip().splitlines()[-1]]
    assert _gone_soon(kids) == []
    assert sorted(p.name for p in where.iterdir()) == before
    assert (where / "mine.txt").read_text() == "a user's file"


def test_ctrl_c_while_the_pool_starts_ends_as_interrupted(tok, tmp_path, monkeypatch):
    """The window the test above hits by chance (2 of ~1,400 runs under load): Ctrl-C after
    the pool forked its workers and before its manager thread started. Here it lands there
    every time; the run must end as interrupted, workers and output gone."""
    from concurrent.futures import process

    forked: list[int] = []
    start = process._ExecutorManagerThread.start

    def ctrl_c_then_start(thread):
        forked.extend(thread.processes)  # the workers are forked by now
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: inside the window
        start(thread)

    monkeypatch.setattr(process._ExecutorManagerThread, "start", ctrl_c_then_start)
    src = write_jsonl(tmp_path / "conv.jsonl", generate_conversations(50, seed=3, words=20))
    out = tmp_path / "out"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tokenize_corpus(
                [src], out, tokenizer=tok, options=TokenizeOptions(workers=2), progress=False
            )
    finally:
        signal.signal(signal.SIGINT, before)
    assert len(forked) == 2
    assert _gone_soon(forked) == []
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["conv.jsonl"]


# ------------------------------------------------ regen --server: inputs and journal (2b)


def test_regen_resume_refuses_a_changed_input_naming_it_and_restart_starts_over(tok, tmp_path):
    src = write_jsonl(tmp_path / "conv.jsonl", generate_conversations(6, seed=7, words=12))
    out = tmp_path / "corpus"
    flags = ["--tokenizer", str(tok), "--holdout", "1", "--concurrency", "4"]
    log = tmp_path / "requests.log"
    with fast_server(tmp_path, "--log-requests", str(log)) as url:
        code, lines, summary = regen(str(src), str(out), "--server", url, *flags)
        assert code == 0, lines
        assert summary["regenerated"] == 5
        header = json.loads(journal_path(out).read_text().splitlines()[0])
        assert header["inputs"][str(src.resolve())]["size"] == src.stat().st_size

        os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: same content
        code, lines, summary = regen(str(src), str(out), "--server", url, *flags)
        assert code == 0 and summary["resumed"] == 5 and summary["regenerated_this_run"] == 0

        # Rewritten under the same path (same size even): refused, one line naming it.
        rows = list(generate_conversations(6, seed=7, words=12))
        rows[0]["messages"][0]["content"] = rows[0]["messages"][0]["content"][::-1]
        write_jsonl(src, rows)
        code, lines, _ = regen(str(src), str(out), "--server", url, *flags)
        assert code == 1 and errors(lines) == lines, lines
        assert lines[0].startswith(f"Error: {src.resolve()} changed content")
        assert "--restart" in lines[0]

        requests_before = len(log.read_text().splitlines())
        code, lines, summary = regen(str(src), str(out), "--server", url, *flags, "--restart")
        assert code == 0, lines
        assert summary["resumed"] == 0 and summary["regenerated_this_run"] == 5
        asked = [json.loads(x)["id"] for x in log.read_text().splitlines()[requests_before:]]
        assert {i.split(":")[1] for i in asked} == {"0", "1", "2", "3", "4"}
        records = [json.loads(x) for x in journal_path(out).read_text().splitlines()[1:]]
        first = next(r for r in records if r["row"] == 0)
        assert len(records) == 5
        assert first["messages"][0]["content"] == rows[0]["messages"][0]["content"]

        # A journal an older version wrote (no fingerprints): refused with the hint.
        lines_ = journal_path(out).read_text().splitlines()
        old = json.loads(lines_[0])
        del old["inputs"]
        journal_path(out).write_text("\n".join([json.dumps(old), *lines_[1:]]) + "\n")
        code, lines, _ = regen(str(src), str(out), "--server", url, *flags)
        assert code == 1 and len(lines) == 1 and "no fingerprints" in lines[0]
        assert "--restart" in lines[0]


@pytest.mark.parametrize(
    "bad",
    [
        "[1, 2, 3]",
        '"a string"',
        '{"file": 3, "row": 0, "status": "ok", "messages": []}',
        '{"file": "f", "row": "0", "status": "failed", "reason": "x", "detail": "y"}',
        '{"file": "f", "row": 0, "status": "ok", "messages": [["user", "hi"]]}',
        '{"file": "f", "row": 0, "status": "done"}',
    ],
)
def test_a_journal_line_of_the_wrong_type_is_one_line_naming_it(tok, tmp_path, bad):
    src = write_jsonl(tmp_path / "conv.jsonl", generate_conversations(3, seed=8, words=10))
    out = tmp_path / "corpus"
    flags = ["--tokenizer", str(tok), "--holdout", "1"]
    with fast_server(tmp_path) as url:
        code, lines, _ = regen(str(src), str(out), "--server", url, *flags)
        assert code == 0, lines
        good = journal_path(out).read_text().splitlines()
        journal_path(out).write_text("\n".join([good[0], good[1], bad, *good[2:]]) + "\n")
        code, lines, _ = regen(str(src), str(out), "--server", url, *flags)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {journal_path(out)}:3: ")


# ----------------------------------------------------- regen --server: failures (2e)


def test_regen_where_every_request_failed_names_the_http_status(tok, tmp_path):
    src = write_jsonl(tmp_path / "conv.jsonl", generate_conversations(4, seed=9, words=10))
    with fast_server(tmp_path, "--fail-first", "1000", "--fail-status", "503") as url:
        code, lines, _ = regen(str(src), str(tmp_path / "out"), "--server", url, "--tokenizer",
                               str(tok), "--holdout", "1", "--retries", "0")  # fmt: skip
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("Error: no row was regenerated: 3 of 3 rows failed (http_503: 3)")
    assert "injected failure" in lines[0] and not (tmp_path / "out").exists()


def test_regen_where_some_rows_failed_exits_3_and_says_so_last(tok, tmp_path):
    rows = list(generate_conversations(6, seed=10, words=10))
    rows[2]["messages"][-2]["content"] += " MAGIC"  # the server refuses it: a permanent 400
    src = write_jsonl(tmp_path / "conv.jsonl", rows)
    out = tmp_path / "out"
    with fast_server(tmp_path, "--reject-containing", "MAGIC") as url:
        code, lines, summary = regen(str(src), str(out), "--server", url, "--tokenizer",
                                     str(tok), "--holdout", "1")  # fmt: skip
    assert code == 3, lines
    assert summary["failed"] == 1 and summary["regenerated"] == 4
    assert lines[-1].startswith("regen: 1 of 5 rows failed (http_400: 1); first: ")
    assert f"{src.resolve()} row 2: http_400" in lines[-1]
    report = json.loads((out / "tokenize_report.json").read_text())
    assert report["conversations"] == 4 and report["regen_failed"] == 1
    assert report["regen_first_failed"].startswith(f"{src.resolve()} row 2: http_400")


def test_a_stopped_regen_leaves_its_journal_resumable(tok, tmp_path):
    """SIGTERM mid-run: requests in flight are dropped at once (not waited for), the
    journal keeps every finished row whole, and a rerun resumes from it."""
    rows = [_row(f"question {i}?", f"answer {i}") for i in range(20)]  # one request each
    src = write_jsonl(tmp_path / "conv.jsonl", rows)
    out = tmp_path / "corpus"
    flags = ["--tokenizer", str(tok), "--holdout", "1", "--concurrency", "4"]
    with fast_server(tmp_path, "--fixed-delay", "6", "--max-concurrent", "4") as url:
        proc = subprocess.Popen([*CLI, "regen", str(src), str(out), "--server", url, *flags,
                                 "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        journal = journal_path(out)
        deadline = time.monotonic() + 60
        while not journal.exists() or len(journal.read_text().splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "regen did not start"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # 4 more requests have just been sent (6 s each)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        # well under the 6 s a request in flight takes: the exit did not wait for them
        assert time.monotonic() - t0 < 4, "requests in flight held the exit up"
    assert proc.returncode == 143 and err.strip().endswith("Error: stopped by SIGTERM"), err
    assert not out.exists()
    text = journal.read_text()
    assert text.endswith("\n")
    done = [json.loads(x) for x in text.splitlines()[1:]]
    assert all(r["status"] == "ok" for r in done) and 1 <= len(done) < 19
    with fast_server(tmp_path) as url:  # the URL may change between runs
        code, lines, summary = regen(str(src), str(out), "--server", url, *flags)
    assert code == 0, lines
    assert summary["resumed"] == len(done) and summary["regenerated"] == 19
