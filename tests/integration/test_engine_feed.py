"""``train --target-engine vllm`` against a stand-in server (``tests/data/fake_vllm_states.py``,
vLLM's conventions, computed with Transformers): the features reach the loss as the
colocated target's do, exactly once across a trainer's kill, through a server that dies
and comes back, and never wrong; nothing is left in the states folder. The real vLLM:
``make serve-check`` (``scripts/checks/serve_engine_states.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from engine_jobs import (
    LAYERS,
    StandIn,
    engine,
    losses,
    stand_in,
    target_dir,
    train,
)
from trainer_jobs import daemon, env

from trainer.vllm.process import free_port

__all__ = ["daemon", "stand_in", "target_dir"]  # the fixtures


#: The runs compared to 1e-6 take AdamW, whose update is fp32: the default Muon's goes
#: through bf16 (torch's Newton-Schulz), which rounds the features' 1e-7 apart into ~4e-6 of
#: the loss by step 4 (docs/TRAINER.md, "One objective, however a step is cut").
EXACT = ("--optimizer", "adamw")


def test_engine_features_train_the_colocated_run(daemon, stand_in, target_dir, tmp_path):
    """Packed rows (the daemon's default) and padded: the same losses step for step as the
    target in the trainer, and the states folder empty after the run."""
    for layout in ("packed", "padded"):
        colo = train(daemon.endpoint, tmp_path / f"colo-{layout}", target_dir, "--layout", layout,
                     *EXACT)  # fmt: skip
        assert colo.returncode == 0
        train(daemon.endpoint, tmp_path / f"eng-{layout}", target_dir, "--layout", layout,
              *EXACT, *engine(stand_in))  # fmt: skip
        want, got = losses(tmp_path / f"colo-{layout}"), losses(tmp_path / f"eng-{layout}")
        assert sorted(got) == sorted(want) == list(range(1, 7))
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=1e-6), (layout, step)
        assert stand_in.files() == []
    # --states-dtype: the cast on the wire moves the losses within its rounding, not more
    # (measured here: at most 1.3e-5 relative over the 6 steps in bf16, 6.0e-5 in fp8)
    for wire, tol in (("bf16", 1e-3), ("fp8", 1e-3)):
        train(daemon.endpoint, tmp_path / f"eng-{wire}", target_dir, "--layout", "padded",
              *EXACT, *engine(stand_in, "--states-dtype", wire))  # fmt: skip
        got = losses(tmp_path / f"eng-{wire}")
        rel = [abs(got[s] / loss - 1) for s, loss in want.items()]
        assert 0 < max(rel) <= tol, (wire, rel)
        assert stand_in.files() == []


def test_a_server_still_starting_is_waited_for(daemon, target_dir, tmp_path):
    """The trainer starts first; the server answers only some seconds later: waited for
    (one warning), then the run trains as usual."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    states = tmp_path / "states"
    states.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", daemon.endpoint,
           "--job", "late", "--run-dir", str(run_dir), "--steps", "2", "--block-size", "8",
           "--token-budget", "1024", "--max-seq-len", "256", "--num-eval-prompts", "0",
           "--no-progress", "--target", str(target_dir), "--layers", LAYERS,
           "--target-engine", "vllm", "--engine-url", url, "--engine-dir", str(states)]  # fmt: skip
    trainer = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env())
    time.sleep(4)
    late = StandIn.__new__(StandIn)
    late.target, late.states, late.port, late.url, late.proc = target_dir, states, port, url, None
    late.store = None
    try:
        late.start()
        _, err = trainer.communicate(timeout=240)
    finally:
        late.stop()
    assert trainer.returncode == 0, err[-3000:]
    assert err.count("is not answering") == 1 and "is answering again" in err
    assert sorted(losses(run_dir)) == [1, 2]


def test_the_next_micro_batch_is_asked_for_while_one_trains(target_dir, stand_in):
    """The feed itself, against the stand-in: with 3 documents a micro-batch and 2 in
    flight, every micro-batch it yields has the next one's first documents already asked
    for, so the engine computes while the step trains (not only when asked)."""
    import torch

    from trainer.engine.client import StateClient
    from trainer.engine.feed import EngineFeed
    from trainer.engine.target import EngineTarget
    from trainer.train.batches import ListSource

    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 500, (40,), generator=g).tolist(), [1] * 40) for _ in range(12)]
    source = ListSource(samples, rows=3, layout="packed", epochs=1)
    target = EngineTarget(target_dir, [0, 1, 3], "cpu", torch.float32)
    client = StateClient(stand_in.url, run="feed-0", rank=0, num_states=3, hidden_size=128,
                         inflight=2, states_dir=stand_in.states)  # fmt: skip
    feed = EngineFeed(source, target, client)
    asked_at_yield = []
    for k, batch in enumerate(feed):
        asked_at_yield.append(client.asked)  # documents asked for so far
        assert target.batch_features(batch).shape == (1, 120, 3 * 128)
        assert k == batch.step
    feed.close()
    assert len(asked_at_yield) == 4
    for k, asked in enumerate(asked_at_yield[:-1]):
        assert asked > 3 * (k + 1), (k, asked_at_yield)  # some of micro-batch k+1's asked
    assert stand_in.files() == []


def test_a_server_gone_for_good_stops_the_run_after_a_final_checkpoint(daemon, target_dir,
                                                                        tmp_path):  # fmt: skip
    """The server exits after 60 replies (three steps' documents) and never comes back: one
    line naming the URL and the timeout, the checkpoint that holds the last step, and how
    to go on."""
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_DIE_AFTER="60")
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir,
                    *engine(s, "--engine-timeout-s", "3"), check=False)  # fmt: skip
    finally:
        s.stop()
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert s.url in last and "no answer for 3 s (--engine-timeout-s" in last, last
    assert "bring the vLLM server back" in last and "--resume" in last, last
    assert "checkpoint step-" in last, last
    assert "Traceback" not in res.stderr


def test_nan_states_stop_the_run_at_once_naming_the_sample(daemon, target_dir, tmp_path):
    """A run fed NaN states trained on them and exited 0: now one line names the sample,
    the token and the layer column, and no file is left. (The other refusals, another
    dtype, a web server at the URL, ...: tests/integration/test_engine_client.py.)"""
    says = "are not finite (token"
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_BAD="nan@5")
    t0 = time.monotonic()
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir,
                    *engine(s, "--engine-timeout-s", "120"), check=False)  # fmt: skip
    finally:
        s.stop()
    assert res.returncode != 0 and time.monotonic() - t0 < 100
    last = res.stderr.strip().splitlines()[-1]
    assert says in last, last
    assert "Traceback" not in res.stderr
    assert s.files() == []


def test_states_of_other_tokens_are_refused(daemon, target_dir, tmp_path):
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_WRONG_TOKENS="1")
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir, *engine(s), check=False)
    finally:
        s.stop()
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "returned states for other tokens than sample" in last, last
    assert "refusing a wrong feature" in last


@pytest.mark.parametrize(
    ("transport", "says"),
    [("files", "which is not in {elsewhere} here: give --engine-dir"),
     ("shm", "cannot put sample .* in this rank's arena {elsewhere}/arena-dflash-.*No such "
             "file or directory.*give --engine-dir the folder the server writes to")],
)  # fmt: skip
def test_an_engine_dir_where_the_server_does_not_write_is_named(
    daemon, stand_in, target_dir, tmp_path, transport, says
):
    """The server writes where this machine does not look (files), or cannot reach this
    rank's arena (shm): one line naming the folder and --engine-dir, at the first document
    (not 300 s of retries), and the server goes on serving."""
    import re

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = train(daemon.endpoint, tmp_path / "run", target_dir, "--target-engine", "vllm",
                "--engine-url", stand_in.url, "--engine-dir", str(elsewhere),
                "--states-transport", transport, check=False)  # fmt: skip
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(says.format(elsewhere=re.escape(str(elsewhere))), last), last
    assert "Traceback" not in res.stderr and "not answering" not in res.stderr
    assert stand_in.proc is not None and stand_in.proc.poll() is None
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--target-engine", "vllm", "--target", "tiny"], "save-target DIR"),
        (["--target-engine", "vllm"], "needs one of --engine-url"),
        (["--engine-url", "http://x"], "--engine-url is an engine option"),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--target-shard", "fsdp"],
            "no decoder to shard",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--eval-sets", "humaneval"],
            "dflash-train eval --engine vllm",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--engine-inflight", "0"],
            "--engine-inflight must be >= 1",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "localhost:8000"],
            "give the server's URL, e.g. http://HOST:8000",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--engine-dir", "/nowhere/x"],
            "'/nowhere/x' does not exist",
        ),
    ],
)
def test_engine_options_that_do_not_go_together(flags, says, target_dir, tmp_path):
    if "--target" not in flags:
        flags = [*flags, "--target", str(target_dir)]
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", "ipc:///nowhere",
           "--run-dir", str(tmp_path / "run"), "--steps", "1", *flags]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120)
    assert res.returncode != 0
    assert says in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_engine_command_prints_the_server_the_run_expects(target_dir, stand_in):
    """``dflash-train engine-command``: vLLM's ids for the run's --layers (ours + 1), the
    connector on PYTHONPATH, its folder, prefix caching off; bad layers refused."""
    cmd = [sys.executable, "-m", "trainer.cli", "engine-command", str(target_dir), "--layers",
           LAYERS, "--states-dir", str(stand_in.states), "--max-model-len", "513"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=60)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("PYTHONPATH=") and "trainer/vllm/connector" in line
    assert '"eagle_aux_hidden_state_layer_ids": [1, 2, 4]' in line
    assert f'"shared_storage_path": "{stand_in.states}"' in line
    assert "--no-enable-prefix-caching" in line and "--max-model-len 513" in line
    bad = subprocess.run([*cmd[:6], "0,4", *cmd[7:]], capture_output=True, text=True,
                         env=env(), timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--layers: layer ids [0, 4] must be in 0..3" in bad.stderr
    # Mooncake: the master's command (its own metadata server), the server's with the
    # store's addresses, and the flags every trainer adds
    more = subprocess.run([*cmd, "--states-transport", "mooncake", "--host", "node-a"],
                          capture_output=True, text=True, env=env(), timeout=60)  # fmt: skip
    assert more.returncode == 0, more.stderr
    lines = [x for x in more.stdout.splitlines() if not x.startswith("#")]
    assert lines[0].endswith("mooncake_master --rpc_port=50051 --enable_http_metadata_server="
                             "true --http_metadata_server_host=0.0.0.0 "
                             "--http_metadata_server_port=8080")  # fmt: skip
    assert '"mooncake_master": "node-a:50051"' in lines[1]
    assert '"mooncake_metadata": "http://node-a:8080/metadata"' in lines[1]
    assert lines[2].endswith("--engine-url http://node-a:8000 --states-transport mooncake "
                             "--mooncake-master node-a:50051")  # fmt: skip
