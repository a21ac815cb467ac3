"""Target features from a vLLM server (``trainer.engine``) against the target's forward in
the trainer, on the same documents, and the trainer's data wait when fed by the engine.

    .venv/bin/python benchmarks/bench_engine.py --vllm-python VENV/bin/python \\
        [--docs 256 --inflight 1,8,32,64 --targets tiny,larger --train-steps 20]

For each target (``tiny``: the 4-layer, 128-wide Qwen3 of the tests; ``larger``: 8 layers,
512 wide, vocabulary 8192, fp32 on CPU), ``--docs`` documents of lengths drawn around 200
tokens (40 to 600):

* colocated: ``Target.train_features`` over packed rows of up to 2,048 tokens (what a
  rank runs per micro-batch), every layer up to the deepest feature; tokens/s;
* engine: the same documents through ``StateClient`` (one request each, through the
  default one-machine transport, shm: each rank's arena) with ``k`` requests in flight,
  against one vLLM server started for the target (``trainer.engine.supply.serving``: fp32,
  eager); tokens/s and the ratio to colocated.

With ``--transports`` (e.g. ``shm,files,mooncake``), an engine-fed training run of the
``wide`` target (the tiny one widened to 1,024 with Qwen3's vocabulary of 151,936) on
samples of 2K-8K tokens (one a micro-batch), through each transport (a Mooncake master
started beside the server), against the same run colocated: median step time and
``data_wait_frac``, ``--wide-steps`` steps each.

Then (``--train-steps`` > 0) the tiny target's training run, colocated and engine-fed
(``--vllm-python``: the run starts its server) with each ``--train-inflight`` read-ahead,
on the loader daemon with a synthetic corpus: median step time, median
``data_wait_frac`` and the losses' largest relative difference; one thread each (a
server beside the trainer on the same cores: two OpenMP pools spinning on 2 cores slow
the trainer's step 17x). Everything shares this machine's cores: on 2 cores the server,
the client and the trainer take turns, so the ratios here are of a CPU box, not of a GPU
server beside GPU trainers (docs/TRAINER.md).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts.servers

SPECS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "larger": {"vocab_size": 8192, "hidden_size": 512, "num_layers": 8, "num_heads": 8,
               "num_kv_heads": 4, "intermediate_size": 1536},
    # the tiny target widened, with Qwen3's vocabulary (the transports' run)
    "wide": {"vocab_size": 151936, "hidden_size": 1024, "num_layers": 4, "num_heads": 8,
             "num_kv_heads": 4, "intermediate_size": 3072},
}  # fmt: skip


def documents(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(200), 0.5, n).astype(int), 40, 600)
    return [rng.integers(0, vocab, int(k)).tolist() for k in lens]


def packed_rows(docs: list[list[int]], budget: int = 2048) -> list[list[list[int]]]:
    rows: list[list[list[int]]] = [[]]
    for d in docs:
        if sum(map(len, rows[-1])) + len(d) > budget and rows[-1]:
            rows.append([])
        rows[-1].append(d)
    return rows


def colocated(target, docs: list[list[int]]) -> float:
    import torch

    rows = packed_rows(docs)
    tensors = [
        (torch.tensor([[t for d in r for t in d]]), torch.cat([torch.arange(len(d)) for d in r]))
        for r in rows
    ]
    tensors = [(ids, pos[None]) for ids, pos in tensors]
    target.train_features(*tensors[0])  # warm-up
    t0 = time.perf_counter()
    for ids, pos in tensors:
        target.train_features(ids, pos)
    return sum(map(len, docs)) / (time.perf_counter() - t0)


def through_engine(client_of, docs: list[list[int]], inflight: int) -> float:
    import torch

    client = client_of(inflight=inflight)
    try:
        warm = client.submit(torch.tensor(docs[0]))
        client.result(warm)
        client.release(warm)
        t0 = time.perf_counter()
        futures = [client.submit(torch.tensor(d)) for d in docs]
        for f in futures:
            client.result(f)
            client.release(f)
        return sum(map(len, docs)) / (time.perf_counter() - t0)
    finally:
        client.close()


def features_table(vllm_python: str, names: list[str], n_docs: int, inflights: list[int],
                   work: Path) -> list[dict]:  # fmt: skip
    import torch

    from trainer.engine.supply import client_for, serving
    from trainer.engine.vllm import engine_layer_ids
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model

    rows = []
    for name in names:
        spec = TinyTargetSpec(**SPECS[name])
        folder = work / f"target-{name}"
        model = build_tiny_model(spec)
        model.save_pretrained(folder)
        torch.set_num_threads(os.cpu_count() or 1)
        target = Target(model)
        docs = documents(n_docs, spec.vocab_size)
        base = colocated(target, docs)
        rows.append({"target": name, "mode": "colocated", "inflight": "-", "tok_s": base,
                     "ratio": 1.0})  # fmt: skip
        print(f"{name:7s} colocated          {base:9.0f} tok/s", flush=True)
        ids = engine_layer_ids(target.layer_ids, target.num_layers)
        with serving(vllm_python, folder, ids, work / f"vllm-{name}.log",
                     kv_cache_memory_bytes=1 << 30) as (server, where):  # fmt: skip
            client_of = functools.partial(client_for, server, where, num_states=len(ids),
                                          hidden_size=spec.hidden_size)  # fmt: skip
            for k in inflights:
                tok_s = through_engine(client_of, docs, k)
                rows.append({"target": name, "mode": "engine", "inflight": k, "tok_s": tok_s,
                             "ratio": tok_s / base})  # fmt: skip
                print(f"{name:7s} engine, {k:3d} in flight {tok_s:9.0f} tok/s  "
                      f"{tok_s / base:5.2f}x colocated", flush=True)  # fmt: skip
    return rows


def training(vllm_python: str, steps: int, work: Path, inflights: list[int]) -> list[dict]:
    from loader_server.data.synth import SynthSpec
    from trainer.model.target import TinyTargetSpec

    corpus = SynthSpec(num_samples=2000, seed=3, median_len=200, max_len=600, vocab_size=512,
                       content="learnable")  # fmt: skip
    modes: list[tuple[str, list[str]]] = [("colocated", [])]
    modes += [(f"engine-{k}", ["--engine-inflight", str(k)]) for k in inflights]
    return _runs(vllm_python, steps, work, TinyTargetSpec(), corpus, modes,
                 ["--token-budget", "2048", "--max-seq-len", "600"], [])  # fmt: skip


def transports_run(vllm_python: str, steps: int, work: Path, transports: list[str]) -> list[dict]:
    """The ``wide`` target on 2K-8K-token samples, colocated and through each transport."""
    from loader_server.data.synth import SynthSpec
    from trainer.model.target import TinyTargetSpec

    corpus = SynthSpec(num_samples=64, seed=5, median_len=4096, sigma=0.4, min_len=2048,
                       max_len=8192, vocab_size=151936)  # fmt: skip
    modes: list[tuple[str, list[str]]] = [("colocated", [])]
    modes += [(t, ["--states-transport", t]) for t in transports]
    shape = ["--token-budget", "8192", "--max-seq-len", "8192"]
    return _runs(vllm_python, steps, work, TinyTargetSpec(**SPECS["wide"]), corpus, modes,
                 shape, ["--anchors-per-doc", "16", *shape])  # fmt: skip


def _runs(vllm_python: str, steps: int, work: Path, spec, corpus_spec, modes, shape: list[str],
          flags: list[str]) -> list[dict]:  # fmt: skip
    """One training run per mode (its name, its engine flags; ``colocated``: none) on one
    synthetic corpus and target: the median step time and data wait of steps 3 on, and the
    losses; printed against the first (colocated)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from loader_server.data.synth import write_corpus
    from scripts.servers.daemon_process import DaemonProcess
    from trainer.model.target import build_tiny_model

    tag = f"h{spec.hidden_size}"
    corpus = work / f"corpus-{tag}.arrow"
    write_corpus(corpus, corpus_spec)
    target = work / f"target-train-{tag}"
    build_tiny_model(spec).save_pretrained(target)
    out = []
    engine = ["--target-engine", "vllm", "--vllm-python", vllm_python]
    for mode, extra in modes:
        endpoint = f"ipc://{work}/loader-{tag}-{mode}.sock"
        daemon = DaemonProcess(corpus, endpoint, *shape, log_path=work / f"daemon-{mode}.log")
        run_dir = work / f"run-{tag}-{mode}"
        more = [*engine, *extra] if mode != "colocated" else []
        try:
            cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", endpoint,
                   "--job", mode, "--run-dir", str(run_dir), "--steps", str(steps),
                   "--target", str(target), "--block-size", "8", "--num-eval-prompts", "0",
                   "--cost-samples", "0", "--no-progress", *flags, *more]  # fmt: skip
            with open(work / f"train-{tag}-{mode}.log", "wb") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        finally:
            daemon.stop()
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if r.get("loss") is not None]
        later = recs[2:] or recs  # the first steps start the server's and the trainer's caches
        out.append({
            "target": tag, "mode": mode,
            "step_s": statistics.median(r["step_time_s"] for r in later),
            "wait_frac": statistics.median(r["data_wait_frac"] for r in later),
            "losses": {r["step"]: r["loss"] for r in recs},
        })  # fmt: skip
    colo = out[0]
    for r in out:
        worst = max(abs(r["losses"][s] - v) / abs(v) for s, v in colo["losses"].items())
        print(f"train {tag} {r['mode']:10s} step {r['step_s']:.3f} s (median, steps 3..) "
              f"{r['step_s'] / colo['step_s']:.2f}x colocated, data_wait_frac "
              f"{r['wait_frac']:.3f}, losses within {worst:.1e}", flush=True)  # fmt: skip
    return out


@click.command()
@click.option("--vllm-python", required=True, help="Python of vLLM's virtualenv.")
@click.option("--docs", default=256, show_default=True)
@click.option("--inflight", default="1,8,32,64", show_default=True)
@click.option("--targets", default="tiny,larger", show_default=True)
@click.option("--train-steps", default=20, show_default=True, help="0: no training runs.")
@click.option("--features/--no-features", default=True, help="The features/s table.")
@click.option("--train-inflight", default="1,8,32", show_default=True,
              help="--engine-inflight of the engine-fed training runs.")  # fmt: skip
@click.option("--transports", default="", help="The wide target's run through each (e.g. "
              "shm,files,mooncake); empty: not run.")  # fmt: skip
@click.option("--wide-steps", default=6, show_default=True, help="Steps of each wide run.")
@click.option("--json-out", type=click.Path(path_type=Path), help="Also write the rows as JSON.")
def main(vllm_python: str, docs: int, inflight: str, targets: str, train_steps: int,
         features: bool, train_inflight: str, transports: str, wide_steps: int,
         json_out: Path | None) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        work = Path(tmp)
        ks = [int(k) for k in inflight.split(",")]
        rows = features_table(vllm_python, targets.split(","), docs, ks, work) if features else []
        train_ks = [int(k) for k in train_inflight.split(",")]
        runs = training(vllm_python, train_steps, work, train_ks) if train_steps else []
        wide = transports_run(vllm_python, wide_steps, work, transports.split(",")) if (
            transports) else []  # fmt: skip
    if json_out is not None:
        out = {"features": rows, "training": runs, "transports": wide}
        json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
