"""``train --eval-sets`` and ``export --best``, for real: a tiny target folder with a trained
BPE tokenizer and Qwen3's chat template (``save-target --tokenizer``), a GSM8K and an
MT-Bench file written here, and one ``dflash-train train`` run (in process) against a real
``dflash-loader serve`` subprocess that measures both sets at its evaluated steps; then the
plot, and ``export --best`` on the run and on copies whose metrics say otherwise. The
in-training evaluator (batched, held-out prompts and sets) against the one-prompt reference,
with a drafter trained until it is accepted. The prompts: turn 0
rendered with the target's template, thinking off or on, the long ones skipped with a
warning; a target without a tokenizer or template is one line naming the option."""

from __future__ import annotations

import json
import logging
import shutil
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from drafters import greedy_samples, train_run, trained_drafter
from trainer_jobs import Daemon, private_shm

from loader_server.data.synth import SynthSpec, write_corpus
from scripts.fixtures.tiny_chat import build_tokenizer
from trainer.cli import main
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.verifier import DrafterProposer, evaluate_tau
from trainer.run import eval_set_prompts, eval_tokenizer, fitting_prompts
from trainer.sections import RunOptions
from trainer.train.distributed import local_env
from trainer.train.evaluation import Evaluator
from trainer.train.metrics import metrics_path, read_metrics

pytestmark = pytest.mark.integration

B = 8
NEW_TOKENS = 8
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
GSM8K = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A train goes 60 miles in one hour. How far does it go in 3 hours?",
    "Sara reads 12 pages a day. How many pages does she read in a week?",
    "There are 4 boxes with 6 pens each. How many pens are there?",
]
MT_BENCH = [
    ["Write a short poem about the sea.", "Now make every line start with the letter S."],
    ["Explain what a number is to a child.", "Now explain it to a mathematician."],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the other trainer tests (``target`` in conftest): on a busy
    machine a second thread waits more than it works."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """The tiny target (vocab 1024) saved with a BPE tokenizer and Qwen3's template."""
    root = tmp_path_factory.mktemp("chat-target")
    tok = build_tokenizer(root / "tokenizer", vocab_size=1024, template="qwen3")
    res = CliRunner().invoke(main, ["save-target", str(root / "target"), "--tiny-vocab", "1024",
                                    "--tokenizer", str(tok)])  # fmt: skip
    assert res.exit_code == 0, res.output
    return root / "target"


@pytest.fixture(scope="module")
def set_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sets")
    gsm8k, mt_bench = root / "test.jsonl", root / "question.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in GSM8K))
    mt_bench.write_text("".join(
        json.dumps({"question_id": 81 + i, "category": "writing", "turns": t}) + "\n"
        for i, t in enumerate(MT_BENCH)
    ))  # fmt: skip
    return {"gsm8k": gsm8k, "mt-bench": mt_bench}


def opts_for(target: Path | str, set_files: dict[str, Path], **over) -> RunOptions:
    specs = ",".join(f"{name}={path}" for name, path in set_files.items())
    base = dict(endpoint="unused", run_dir=Path("unused"), target=str(target), eval_sets=(specs,),
                block_size=B, eval_new_tokens=NEW_TOKENS)  # fmt: skip
    return RunOptions(**{**base, **over})


def invoke(*args: str) -> Result:
    """``dflash-train ARGS`` in this process, its SIGTERM handler (``train``) undone after."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        signal.signal(signal.SIGTERM, handler)


def last_line(res: Result) -> str:
    """The one-line error a failed command ends with."""
    return res.output.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def run(chat_target, set_files, tmp_path_factory) -> Path:
    """4 steps against a real daemon, both sets measured at steps 0, 2, 4, checkpoints at
    2 and 4."""
    tmp = tmp_path_factory.mktemp("eval-run")
    corpus = tmp / "corpus.arrow"
    write_corpus(corpus, SynthSpec(num_samples=150, seed=5, median_len=96, max_len=256,
                                   vocab_size=512, content="learnable"))  # fmt: skip
    shm = private_shm(tmp)
    specs = [f"--eval-sets={name}={path}" for name, path in set_files.items()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_LOADER_SHM_DIR", str(shm))  # the client maps the daemon's rings there
        daemon = Daemon(corpus, tmp, shm)
        try:
            res = invoke(
                "train", "--endpoint", daemon.endpoint, "--job", "eval-sets",
                "--run-dir", str(tmp / "run"), "--target", str(chat_target), "--steps", "4",
                "--block-size", str(B), "--anchors-per-doc", "16", "--token-budget", "1024",
                "--max-seq-len", "256", "--lr", "3e-3", "--warmup", "2",
                "--num-eval-prompts", "2", "--eval-new-tokens", str(NEW_TOKENS),
                "--eval-every", "2", "--ckpt-every", "2", "--eval-set-limit", "3",
                "--eval-batch", "2", "--cost-samples", "0", "--no-progress", *specs,
            )  # fmt: skip
        finally:
            daemon.stop()
            shutil.rmtree(shm, ignore_errors=True)
    assert res.exit_code == 0, res.output
    return tmp / "run"


def by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(metrics_path(run_dir))}


# ---- the prompts ------------------------------------------------------------------------


def test_turn_0_is_rendered_with_the_target_s_template(chat_target, set_files):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_target)
    opts = opts_for(chat_target, set_files, eval_set_limit=3)
    sets = eval_set_prompts(opts, eval_tokenizer(opts))
    assert list(sets) == ["gsm8k", "mt-bench"] and len(sets["gsm8k"]) == 3  # the limit
    text = tok.decode(sets["mt-bench"][1], skip_special_tokens=False)
    assert text == f"<|im_start|>user\n{MT_BENCH[1][0]}<|im_end|>\n" + EMPTY_THINK
    assert MT_BENCH[1][1] not in text  # in training: the first turn only
    gsm8k = tok.decode(sets["gsm8k"][0], skip_special_tokens=False)
    assert gsm8k.startswith(f"<|im_start|>user\n{GSM8K[0]}\nPlease reason step by step")
    on = eval_set_prompts(opts_for(chat_target, set_files, eval_thinking="on"), tok)
    assert tok.decode(on["gsm8k"][0]).endswith("<|im_start|>assistant\n")
    assert on["gsm8k"][0] == sets["gsm8k"][0][: len(on["gsm8k"][0])]


def test_prompts_too_long_for_the_target_are_skipped_with_a_warning(chat_target, set_files,
                                                                    caplog):  # fmt: skip
    opts = opts_for(chat_target, set_files)
    sets = eval_set_prompts(opts, eval_tokenizer(opts))
    lengths = sorted(len(ids) for ids in sets["gsm8k"])
    positions = lengths[1] + NEW_TOKENS + B  # room for the two shortest gsm8k prompts
    with caplog.at_level(logging.WARNING):
        fit = fitting_prompts(sets, positions, opts)
    short = [n for n in map(len, sets["gsm8k"]) if n <= lengths[1]]
    assert [len(p) for p in fit["gsm8k"]] == short
    says = f"--eval-sets gsm8k: 2 of its 4 prompts are longer than {lengths[1]} tokens"
    assert says in caplog.text
    assert all(isinstance(p, torch.Tensor) for p in fit["mt-bench"])
    with pytest.raises(ValueError, match=r"^--eval-sets gsm8k: all its 4 prompts are longer"):
        fitting_prompts(sets, lengths[0] + NEW_TOKENS + B - 1, opts)


def test_a_target_without_tokenizer_or_template_is_one_line_naming_the_option(
    chat_target, set_files, tmp_path
):
    res = invoke("train", "--endpoint", "ipc:///nowhere", "--run-dir", str(tmp_path / "run"),
                 "--steps", "1", "--eval-sets", f"gsm8k={set_files['gsm8k']}")  # fmt: skip
    assert res.exit_code == 1
    assert last_line(res).endswith(
        "--eval-sets renders its prompts with the target's tokenizer and chat template: "
        "--target tiny has neither; give --target DIR, a model folder with a tokenizer "
        "(dflash-train save-target DIR --tokenizer TOK writes the tiny one)"
    )
    bare = shutil.copytree(chat_target, tmp_path / "no-template")
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=f"^--eval-sets .*: the tokenizer in {bare} has no chat"):
        eval_tokenizer(opts_for(bare, set_files))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(ValueError, match=f"the target folder {bare} has no tokenizer$"):
        eval_tokenizer(opts_for(bare, set_files))


# ---- the run ------------------------------------------------------------------------------


def test_the_sets_are_measured_at_every_evaluated_step(run):
    recs = by_step(run)
    assert sorted(recs) == [0, 1, 2, 3, 4]
    keys = ("tau/gsm8k", "tau_pooled/gsm8k", "tau/mt-bench", "tau_pooled/mt-bench")
    for step in (0, 2, 4):
        assert all(1.0 <= recs[step][k] <= B for k in keys), recs[step]
        assert 1.0 <= recs[step]["tau"] <= B  # the held-out prompts, as before
    assert not any(k in recs[s] for s in (1, 3) for k in keys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_tau/gsm8k"] == recs[4]["tau/gsm8k"]
    assert RunOptions.read(run).eval_set_limit == 3


@pytest.fixture(scope="module")
def learned(target, tmp_path_factory):
    """A drafter trained 30 steps on the tiny target's greedy continuations of 8 prompts
    (it is accepted on them), and those prompts."""
    samples = greedy_samples(target, 511)
    cfg = DrafterConfig.from_target(target.config, num_target_layers=3, block_size=B,
                                    mask_token_id=511)  # fmt: skip
    torch.manual_seed(0)
    run_dir = train_run(target, samples, tmp_path_factory.mktemp("learned"), DFlashDrafter(cfg),
                        LossConfig(block_size=B, anchors_per_doc=8), 30)  # fmt: skip
    return trained_drafter(run_dir), [torch.tensor(ids[:8]) for ids, _ in samples]


def test_the_evaluator_equals_the_reference_prompt_for_prompt(target, learned):
    drafter, seen = learned
    g = torch.Generator().manual_seed(1)
    groups = {None: [p[:5] for p in seen[:3]], "seen": seen[3:],
              "random": [torch.randint(1, 500, (n,), generator=g) for n in (1, 9, 4)]}  # fmt: skip
    want: dict[str, float] = {}
    for name, prompts in groups.items():
        rep = evaluate_tau(target, DrafterProposer(target, drafter), prompts, block_size=B,
                           max_new_tokens=16).metrics()  # fmt: skip
        keys = rep if name is None else {"tau": 0, "tau_pooled": 0}
        want.update({(k if name is None else f"{k}/{name}"): rep[k] for k in keys})
    assert want["tau/seen"] > 1.5  # the drafter is really accepted
    sets = {k: v for k, v in groups.items() if k is not None}
    got = Evaluator(target, drafter, groups[None], env=local_env(), max_new_tokens=16, every=0,
                    sets=sets, batch=3).evaluate()  # fmt: skip
    assert got == want


def test_the_plot_draws_tau_per_set(run, tmp_path):
    import matplotlib.pyplot as plt

    from trainer.ops import plot

    res = invoke("plot", str(run), "--out", str(tmp_path / "plots"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "plots" / "tau.png").stat().st_size > 1000
    fig, ax = plt.subplots()
    plot._tau(ax, read_metrics(metrics_path(run)), "run")
    labels = [line.get_label() for line in ax.lines]
    assert labels[2:] == ["tau: gsm8k", "tau: mt-bench"]
    plt.close(fig)


# ---- export --best --------------------------------------------------------------------------


def export(run_dir: Path, out: Path, *args: str) -> tuple[Result, dict]:
    res = invoke("export", str(run_dir), str(out), "--dtype", "fp32", *args)
    info = json.loads((out / "dflash_export.json").read_text()) if res.exit_code == 0 else {}
    return res, info


def with_metrics(run: Path, dest: Path, taus: dict[int, float | None]) -> Path:
    """A copy of ``run`` whose ``tau/gsm8k`` at each step in ``taus`` is replaced (None:
    removed)."""
    shutil.copytree(run, dest)
    recs = read_metrics(metrics_path(dest))
    for rec in recs:
        if rec["step"] in taus:
            rec.pop("tau/gsm8k", None)
            if taus[rec["step"]] is not None:
                rec["tau/gsm8k"] = taus[rec["step"]]
    metrics_path(dest).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return dest


def test_export_best_exports_the_kept_checkpoint_with_the_highest_tau(run, tmp_path):
    recs = by_step(run)
    want = max((2, 4), key=lambda s: (recs[s]["tau/mt-bench"], s))
    res, info = export(run, tmp_path / "real", "--best", "mt-bench")
    assert res.exit_code == 0, res.output
    assert info["step"] == want and info["chosen"]["by"] == "tau/mt-bench"
    assert info["chosen"]["value"] == recs[want]["tau/mt-bench"]

    # step 0 measured best but has no checkpoint; of the kept ones step 2 wins
    copy = with_metrics(run, tmp_path / "copy", {0: 7.5, 2: 3.25, 4: 2.0})
    res, info = export(copy, tmp_path / "best", "--best", "gsm8k")
    assert res.exit_code == 0, res.output
    assert info["step"] == 2 and info["checkpoint"].endswith("step-00000002")
    assert info["chosen"]["reason"] == "best tau/gsm8k = 3.25 at step 2"
    assert "(step 2: best tau/gsm8k = 3.25 at step 2)" in (tmp_path / "best/README.md").read_text()


def test_export_best_errors_name_the_set_and_the_steps(run, tmp_path):
    res, _ = export(run, tmp_path / "a", "--best", "humaneval")
    assert res.exit_code == 1
    assert last_line(res).endswith(
        f"--best humaneval: {metrics_path(run)} holds no tau/humaneval; the sets measured: "
        "gsm8k, mt-bench"
    )
    copy = with_metrics(run, tmp_path / "copy", {2: None, 4: None})
    res, _ = export(copy, tmp_path / "b", "--best", "gsm8k")
    assert res.exit_code == 1
    assert ("no kept checkpoint has a tau/gsm8k measurement (tau/gsm8k measured at steps 0; "
            "checkpoints kept at steps 2, 4)") in res.output  # fmt: skip
    res, _ = export(run, tmp_path / "c", "--best", "gsm8k", "--step", "2")
    assert res.exit_code == 2 and "--best and --step exclude each other" in res.output
