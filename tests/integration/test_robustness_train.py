"""Training that goes wrong stops in one line, and checkpoints cannot be torn silently.

Each case of issue 24's training side, against real components: `dflash-train train` in a
subprocess (its stderr's last line is the error, no traceback) fed by a real `dflash-loader
serve` subprocess, or the in-process ``Trainer`` on a ``ListSource`` where no daemon is
needed; the tiny target throughout. Cases: a huge --lr (NaN loss) stops after
--max-nonfinite-steps skipped steps and writes no non-finite checkpoint; a spec under which
no document holds a block stops naming the spec fields; --resume refuses another target;
negative counts are refused naming the flag; malformed --eval-prompts name the file and
line; a truncated newest checkpoint makes --resume and export fall back (with and without
a manifest); a full disk (a small tmpfs, else RLIMIT_FSIZE) and a read-only run folder
during a run are one line with the older checkpoints intact; a daemon killed mid-run ends
the run with one line naming the endpoint and the timeout, after a final checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from drafters import in_process

from client import LoaderUnavailableError
from loader_server.data.synth import SynthSpec, write_corpus
from scripts.servers.daemon_process import DaemonProcess
from trainer.cli import main
from trainer.hf.export import export_drafter
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.options import TargetOptions
from trainer.run import eval_prompts, run_meta
from trainer.sections import RunOptions
from trainer.train import checkpoint as ckpt
from trainer.train.batches import ListSource
from trainer.train.distributed import local_env
from trainer.train.guards import LoaderFailedError, TrainingError
from trainer.train.loop import Trainer
from trainer.train.metrics import metrics_path, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.heavy(21)]

B = 8
RUN_TIMEOUT_S = 120.0
FLAGS = (
    "--block-size", str(B), "--anchors-per-doc", "16", "--token-budget", "1024",
    "--max-seq-len", "256", "--lr", "3e-3", "--warmup", "2", "--num-eval-prompts", "0",
    "--no-progress",
)  # fmt: skip


# ---- a real daemon, and the trainer's command line -----------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.arrow"
    spec = SynthSpec(
        num_samples=600, seed=3, median_len=96, max_len=256, vocab_size=512, content="learnable"
    )
    write_corpus(path, spec)
    return path


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path_factory.mktemp("shm")
    d = base / f"dflash-robust-train-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_daemon(corpus: Path, workdir: Path, shm: Path, name: str = "loader") -> DaemonProcess:
    return DaemonProcess(
        corpus, f"ipc://{workdir}/{name}.sock", "--shm-dir", str(shm),
        log_path=workdir / f"{name}.log", ready_timeout_s=30.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def daemon(corpus, shm, tmp_path_factory):
    d = start_daemon(corpus, tmp_path_factory.mktemp("daemon"), shm)
    yield d
    d.stop()


def env(shm: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "DFLASH_LOADER_SHM_DIR": str(shm)}  # fmt: skip


def train(
    endpoint: str, run_dir: Path, shm: Path, *extra: str, job: str | None = None, **popen
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", endpoint,
           "--job", job or run_dir.name, "--run-dir", str(run_dir), *FLAGS, *extra]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env(shm), timeout=RUN_TIMEOUT_S, **popen
    )


def ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stderr[-4000:]


def error_line(res: subprocess.CompletedProcess) -> str:
    """The one-line error a failed command ends with (exit 1, no traceback)."""
    assert res.returncode == 1, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: "), res.stderr[-4000:]
    return line


def records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(metrics_path(run_dir))}


def assert_complete(path: Path) -> ckpt.CheckpointRecord:
    """A checkpoint that verifies against its manifest, loads, and holds finite weights."""
    assert ckpt.verify_checkpoint(path), f"{path} has no manifest"
    saved, _ = ckpt.load_checkpoint(path, local_env())
    assert ckpt.non_finite(saved.drafter) == []
    return saved


# ---- in process: the Trainer on hand-made batches ------------------------------------------


@pytest.fixture(scope="module")
def samples() -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(1, 511, (48,), generator=g).tolist(), [0] * 8 + [1] * 40)
            for _ in range(24)]  # fmt: skip


def make_trainer(target, source, run_dir: Path, meta: dict | None = None, **kw) -> Trainer:
    cfg = in_process(run_dir, LossConfig(block_size=B, anchors_per_doc=6),
                     **{"steps": 4, "lr": 3e-3, "warmup": 1, **kw})  # fmt: skip
    drafter_cfg = DrafterConfig.from_target(
        target.config, num_target_layers=len(target.layer_ids), block_size=B, mask_token_id=511
    )
    torch.manual_seed(0)
    return Trainer(
        cfg,
        target=target,
        drafter=DFlashDrafter(drafter_cfg),
        source=source,
        env=local_env(),
        meta=run_meta(TargetOptions(), target) if meta is None else meta,
    )


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


# ---- item 3: training that goes wrong stops ------------------------------------------------


def test_a_diverging_run_skips_non_finite_steps_then_stops(daemon, shm, tmp_path):
    run_dir = tmp_path / "run"
    res = train(daemon.endpoint, run_dir, shm, "--steps", "30", "--lr", "1e30",
                "--ckpt-every", "1", "--max-nonfinite-steps", "3")  # fmt: skip
    line = error_line(res)
    assert "training diverged" in line and "3 steps in a row" in line and "--lr" in line
    recs = records(run_dir)
    skipped = [s for s, r in recs.items() if r.get("skipped_nonfinite")]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    assert max(recs) == skipped[-1]  # it stopped right there
    assert all(recs[s]["loss"] is None for s in skipped)  # null in JSON, not NaN
    assert all("skipped_nonfinite" not in r for s, r in recs.items() if s not in skipped)
    saved = ckpt.list_checkpoints(run_dir)
    assert saved, "the steps before the divergence were checkpointed"
    for path in saved:
        assert_complete(path)


def test_non_finite_weights_are_never_written_nor_exported(target, samples, tmp_path):
    run_dir = tmp_path / "run"
    make_trainer(target, ListSource(samples, rows=4), run_dir, ckpt_every=2).run()
    good = ckpt.latest_checkpoint(run_dir)
    saved, mine = ckpt.load_checkpoint(good, local_env())
    name = next(iter(saved.drafter))
    bad = {**saved.drafter, name: saved.drafter[name].clone().fill_(float("nan"))}
    record = dataclasses.replace(saved, drafter=bad, step=9)
    with pytest.raises(ckpt.NonFiniteCheckpointError, match=rf"{name} is not finite"):
        ckpt.save_checkpoint(run_dir, 9, local_env(), record=record, per_rank=mine)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)][-1] == good.name
    assert not list(ckpt.checkpoint_dir(run_dir).glob("step-00000009*"))

    # One written by a trainer without that check (no manifest): export names it.
    old = ckpt.checkpoint_dir(run_dir) / "step-00000009"
    shutil.copytree(good, old)
    shared = torch.load(old / "model.pt", weights_only=True)
    shared["drafter"] = bad
    torch.save(shared, old / "model.pt")
    res = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert "step-00000009" in res.output and "not finite" in res.output
    assert "--step" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_spec_where_no_document_holds_a_block_stops_naming_the_fields(daemon, shm, tmp_path):
    run_dir = tmp_path / "run"
    # --max-seq-len 256: no document has 2 x 200 supervised tokens. (The position decay:
    # D-PACE's weights at offset 199 could round to 0, and that is refused first.)
    res = train(daemon.endpoint, run_dir, shm, "--steps", "50", "--block-size", "200",
                "--max-empty-steps", "3", "--loss-weighting", "decay")  # fmt: skip
    line = error_line(res)
    for field in ("--block-size", "--max-seq-len", "--token-budget", "loss mask", "3 steps"):
        assert field in line, line
    assert max(records(run_dir)) == 3
    assert ckpt.list_checkpoints(run_dir) == []  # no untrained drafter saved as a result


def test_a_run_that_trains_no_block_fails_and_its_checkpoint_is_not_exported(daemon, shm,
                                                                            tmp_path):  # fmt: skip
    """Shorter than --max-empty-steps, the run still fails: it trained nothing; its final
    checkpoint is marked so, and export refuses it."""
    run_dir = tmp_path / "run"
    res = train(daemon.endpoint, run_dir, shm, "--steps", "3", "--block-size", "200",
                "--loss-weighting", "decay")  # fmt: skip
    line = error_line(res)
    assert "the run trained no block in its 3 step(s)" in line, line
    for field in ("--block-size", "--max-seq-len", "--token-budget", "export refuses"):
        assert field in line, line
    (last,) = ckpt.list_checkpoints(run_dir)
    assert assert_complete(last).meta["trained"] == {"steps": 3, "blocks": 0, "empty_steps": 3}
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "export", str(run_dir), str(out)],
                         capture_output=True, text=True, env=env(shm), timeout=120)  # fmt: skip
    line = error_line(res)
    assert "trained no block in its 3 step(s)" in line and "nothing to export" in line, line
    assert not out.exists()


def test_a_run_of_mostly_empty_steps_warns_with_the_share(target, samples, tmp_path, caplog):
    short = [(ids[:10], [0] * 4 + [1] * 6) for ids, _ in samples[:12]]  # no block of 8 fits
    source = ListSource([*samples[:4], *short], rows=4)  # steps: one with blocks, three without
    tr = make_trainer(target, source, tmp_path, steps=4)
    with caplog.at_level(logging.WARNING, logger="trainer.train.guards"):
        tr.run()
    assert "3 of 4 steps (75%) trained no block" in caplog.text
    assert tr.tally.blocks and tr.tally.empty_steps == 3


def test_resume_refuses_another_target(daemon, shm, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(daemon.endpoint, run_dir, shm, "--steps", "2"))
    res = train(daemon.endpoint, run_dir, shm, "--steps", "4", "--resume", "--tiny-seed", "1")
    line = error_line(res)
    assert "step-00000002" in line and "--tiny-seed 0" in line and "--tiny-seed 1" in line
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step-00000002"]


def test_a_moved_target_resumes_with_a_warning(target, samples, tmp_path, caplog):
    meta = {**run_meta(TargetOptions(), target), "target": "/models/a"}
    make_trainer(target, ListSource(samples, rows=4), tmp_path, meta=meta, steps=2).run()
    # The same weights under another path: a warning, and the run resumes.
    moved = make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=3, resume=True,
                         meta={**meta, "target": "/models/b"})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trainer.train.guards"):
        assert moved.run()["resumed"]
    assert "target /models/a is now /models/b: the same weights" in caplog.text
    # Other weights under the same name: refused.
    meta = {**meta, "target": "/models/c", "target_weights": "0" * 16}
    other = make_trainer(target, ListSource(samples, rows=4), tmp_path, meta=meta, steps=4,
                         resume=True)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"against target /models/b, this run's target is /models/c"
    ):
        other.run()


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [
        ("num_eval_prompts", -1, "--num-eval-prompts"),
        ("eval_every", -1, "--eval-every"),
        ("ckpt_every", -2, "--ckpt-every"),
        ("keep_checkpoints", 0, "--keep-checkpoints"),
        ("eval_new_tokens", 0, "--eval-new-tokens"),
        ("cost_samples", -1, "--cost-samples"),
        ("timeout_s", 0.0, "--timeout-s"),
        ("steps", 0, "--steps"),
        ("epochs", -1, "--epochs"),
        ("lr", -1e-3, "--lr"),
        ("lr", float("nan"), "--lr"),
        ("max_nonfinite_steps", -1, "--max-nonfinite-steps"),
        ("max_empty_steps", -1, "--max-empty-steps"),
        ("token_budget", 0, "--token-budget"),
        ("init_std", -0.1, "--init-std"),
        ("init_std", float("nan"), "--init-std"),
    ],
)
def test_out_of_range_counts_are_refused_naming_the_flag(tmp_path, name, value, flag):
    with pytest.raises(ValueError, match=rf"^{flag} must be "):
        RunOptions(endpoint="unused", run_dir=tmp_path, **{name: value})


def test_a_negative_count_on_the_command_line_is_one_line(shm, tmp_path):
    res = train("ipc:///nowhere", tmp_path / "run", shm, "--steps", "2",
                "--num-eval-prompts", "-1")  # fmt: skip
    assert "--num-eval-prompts must be >= 0, got -1" in error_line(res)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("pair", "says"),
    [
        ("bogus=1", "unknown batch spec field 'bogus'"),
        (
            "token_budjet=4096",
            "unknown batch spec field 'token_budjet'; did you mean 'token_budget'?",
        ),
        ("composition=bogus", "composition must be one of bucketed, sorted, random; got 'bogus'"),
        ("seed=-3", "seed must be an integer in [0, "),
        ("buckets=[300,100]", "bucket bounds must be strictly increasing"),
    ],
)
def test_a_spec_typo_is_refused_before_the_target_loads(shm, tmp_path, pair, says):
    """The spec a trainer asks for is checked as the daemon checks it, before anything heavy:
    the target here is a folder with no model in it, which loading would refuse."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    res = train("ipc:///nowhere", tmp_path / "run", shm, "--steps", "2", "--target",
                str(empty), "--spec", pair)  # fmt: skip
    assert says in error_line(res)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("lines", "bad_line", "says"),
    [
        (['{"prompt": [1, 2]}', '{"prompt": "hello world"}'], 2, "non-empty 'prompt' list"),
        (['{"prompt": [1, 2]}', "", '{"prompt": [3, 512]}'], 3, "token id 512 is outside"),
        (['{"prompt": [-1, 4]}'], 1, "token id -1 is outside"),
        (['{"prompt": [1, "a"]}'], 1, "holds 'a', not a token id"),
        (['{"prompt": [1, true]}'], 1, "holds True, not a token id"),
        (['{"prompt": []}'], 1, "non-empty 'prompt' list"),
        (["[1, 2, 3]"], 1, "non-empty 'prompt' list"),
        (["not json"], 1, "not JSON"),
    ],
)
def test_malformed_eval_prompts_name_the_file_and_line(tmp_path, lines, bad_line, says):
    path = tmp_path / "heldout.jsonl"
    path.write_text("\n".join(lines) + "\n")
    opts = RunOptions(endpoint="unused", run_dir=tmp_path / "run", eval_prompts=path)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}:{bad_line}: .*{re.escape(says)}"
    ) as err:
        eval_prompts(opts, vocab_size=512)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_an_empty_eval_prompts_file_is_refused_not_a_run_without_tau(tmp_path, text):
    path = tmp_path / "heldout.jsonl"
    path.write_text(text)
    opts = RunOptions(endpoint="unused", run_dir=tmp_path / "run", eval_prompts=path)
    with pytest.raises(ValueError, match=rf"^--eval-prompts {re.escape(str(path))}: no prompts"):
        eval_prompts(opts, vocab_size=512)


def test_eval_prompts_of_another_vocabulary_are_one_line_on_the_command_line(shm, tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [70000, 3]}\n')
    res = train("ipc:///nowhere", tmp_path / "run", shm, "--steps", "2",
                "--eval-prompts", str(path), "--num-eval-prompts", "2")  # fmt: skip
    assert f"{path}:2: token id 70000 is outside the target's vocabulary" in error_line(res)


# ---- item 4: checkpoints and outputs that cannot be torn silently --------------------------


def test_a_torn_newest_checkpoint_resume_and_export_fall_back(target, samples, tmp_path, caplog):
    run_dir = tmp_path / "run"
    first = make_trainer(target, ListSource(samples, rows=4), run_dir, steps=4, ckpt_every=2)
    first.run()
    _, step4 = ckpt.list_checkpoints(run_dir)
    truncate(step4 / "model.pt")
    with pytest.raises(ckpt.TornCheckpointError, match="truncated"):
        ckpt.verify_checkpoint(step4)

    again = make_trainer(target, ListSource(samples, rows=4), run_dir, steps=6, ckpt_every=2,
                         resume=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        again.run()
    assert "skipping checkpoint" in caplog.text and "step-00000004" in caplog.text
    assert "resuming from step-00000002" in caplog.text
    assert again.step == 6 and sorted(records(run_dir)) == list(range(7))
    # The replayed run wrote step 4 again, whole; all three verify.
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [
        "step-00000002", "step-00000004", "step-00000006"
    ]  # fmt: skip
    for path in ckpt.list_checkpoints(run_dir):
        assert_complete(path)

    # export: the newest is torn (and, like an old checkpoint, has no manifest) -> step 4.
    step6 = run_dir / "checkpoints" / "step-00000006"
    truncate(step6 / "model.pt")
    ckpt.manifest_path(step6).unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = export_drafter(run_dir, tmp_path / "out")
    assert json.loads((out / "dflash_export.json").read_text())["step"] == 4
    assert "skipping checkpoint" in caplog.text and "step-00000006" in caplog.text
    # Asked for by --step, a torn checkpoint is one line naming it.
    res = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "o6"), "--step", "6"])
    assert res.exit_code == 1 and "step-00000006" in res.output and "unreadable" in res.output
    assert len(res.output.strip().splitlines()) == 1

    # Every checkpoint torn: --resume is one line, it does not start over.
    for path in ckpt.list_checkpoints(run_dir):
        truncate(path / "rank-00000.pt")
    last = make_trainer(target, ListSource(samples, rows=4), run_dir, steps=8, resume=True)
    with pytest.raises(ckpt.TornCheckpointError, match="no complete checkpoint"):
        last.run()


def test_a_loader_failure_mid_step_saves_the_step_before(target, samples, tmp_path):
    class Outage(ListSource):
        """The daemon goes away when micro-batch ``die_at`` is asked for."""

        endpoint = "ipc:///test/loader.sock"

        def __iter__(self):
            for batch in super().__iter__():
                if self.position > 5:  # micro 1 of step 3 (2 micro-batches a step)
                    raise LoaderUnavailableError(f"no loader daemon answered on {self.endpoint}")
                yield batch

    tr = make_trainer(target, Outage(samples, rows=2, grad_accum=2), tmp_path, steps=6)
    with pytest.raises(LoaderFailedError, match=r"after step 2: no loader daemon .*test/loader"):
        tr.run()
    path = ckpt.latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step-00000002"
    _, mine = ckpt.load_checkpoint(path, local_env())
    assert mine["loader"]["position"] == 4  # step 2's micro 0, not the half-served step
    assert_complete(path)


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if not _can_mount():
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True)  # fmt: skip
    return res.returncode == 0


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: writing past the limit fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_full_disk_or_a_read_only_run_folder_is_one_line(daemon, shm, tmp_path):
    mnt = tmp_path / "mnt"
    mounted = _mount_tmpfs(mnt, "3m")  # one checkpoint (~1.9 MiB) fits, not two
    run_dir = mnt / "run"
    try:
        if mounted:
            res = train(daemon.endpoint, run_dir, shm, "--steps", "3", "--ckpt-every", "1")
            line = error_line(res)
            assert "No space left on device" in line and "needs about" in line, line
            assert " free" in line
        else:  # no tmpfs here: a file size limit (EFBIG) in the child instead
            ok(train(daemon.endpoint, run_dir, shm, "--steps", "1"))
            res = train(daemon.endpoint, run_dir, shm, "--steps", "2", "--resume",
                        preexec_fn=_file_size_limit(1 << 20))  # fmt: skip
            line = error_line(res)
            assert "File too large" in line, line
        assert "step-00000002" in line and "previous checkpoints are intact" in line
        assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step-00000001"]
        assert_complete(run_dir / "checkpoints" / "step-00000001")
        assert not list((run_dir / "checkpoints").glob("*.tmp"))

        # The same run folder, read-only: --resume says so in one line.
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        else:
            os.chmod(run_dir, 0o555)
            if os.geteuid() == 0:
                pytest.skip("root ignores permissions and this machine has no tmpfs mounts")
        res = train(daemon.endpoint, run_dir, shm, "--steps", "2", "--resume")
        line = error_line(res)
        assert f"cannot write the run folder {run_dir}" in line, line
        assert "Read-only file system" in line or "Permission denied" in line
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        elif run_dir.exists():
            os.chmod(run_dir, 0o755)


def test_a_daemon_outage_ends_with_a_final_checkpoint_and_one_line(corpus, shm, tmp_path):
    d = start_daemon(corpus, tmp_path, shm, name="doomed")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", d.endpoint, "--job", "out",
           "--run-dir", str(run_dir), *FLAGS, "--steps", "100000", "--timeout-s", "3"]  # fmt: skip
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, text=True, env=env(shm))
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (metrics_path(run_dir).exists() and max(records(run_dir)) >= 3):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.05)
        d.kill()
        proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        d.stop(signal.SIGKILL)
    res = subprocess.CompletedProcess(cmd, proc.returncode, "", log.read_text())
    line = error_line(res)
    assert d.endpoint in line and "for 3 s" in line and "--resume" in line, line
    last = max(records(run_dir))
    assert f"saved checkpoint step-{last:08d}" in line, line
    saved = assert_complete(ckpt.latest_checkpoint(run_dir))
    assert saved.step == last


def test_a_corpus_of_another_vocabulary_is_one_error_naming_the_samples(target, tmp_path):
    wide = [([*range(40), 600], [1] * 41)] * 8  # 600: beyond the tiny 512-id vocabulary
    trainer = make_trainer(target, ListSource(wide, rows=4), tmp_path, steps=2)
    with pytest.raises(TrainingError, match=r"token id 600 is outside the target's vocabulary "
                       r"\(512 ids; samples \[0, 1, 2, 3\]\)"):  # fmt: skip
        trainer.run()
