"""serve-check's engine checks (``train --target-engine vllm``, ``trainer.engine``), with
the real vLLM:

* vLLM's hidden states of the held-out prompts, extracted for every layer of the target
  (so ids 0 and ``L - 1`` too; the last normed by the trainer), equal the target's own
  features (``Target.features``, Transformers, fp32) to ``STATES_TOL``, the same through
  every transport; asked for in bf16, they are the cast of its fp32 ones, and in fp8
  within e4m3's rounding of them (``--states-dtype``: the connector's cast); its states
  folder is empty once the client closed, and gone once the server stopped;
* ``ENGINE_DRAFTER``: the ``full attention`` drafter's run again, its features from a
  server the run starts (``--vllm-python``): the same losses step for step as that
  colocated run (``LOSS_TOL`` relative, over all of serve-check's steps), and its export
  served by vLLM like every drafter (``drafter_checks``: weights, output, acceptance equal
  to the verifier's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.checks.serve_harness import Check, Phases

#: Every way the states travel (the shm arena, files, a Mooncake store).
TRANSPORTS = ("shm", "files", "mooncake")
#: The dtypes a request may ask its states to travel in (``--states-dtype`` bf16, fp8).
WIRES = ("bfloat16", "float8_e4m3fn")
#: The colocated drafter whose run the engine-fed one repeats.
TWIN = "full attention"
ENGINE_DRAFTER = "full attention, features from vLLM"
STATES_TOL = 1e-5
#: Relative: fp32 features that agree to ~1e-6 (vLLM's kernels, not Transformers') move
#: the trained weights apart a little more each step.
LOSS_TOL = 1e-4


def engine_flags(vllm_python: str) -> list[str]:
    return ["--target-engine", "vllm", "--vllm-python", vllm_python]


def states_checks(
    args: argparse.Namespace, work: Path, phases: Phases, target: Path, prompts: list[list[int]]
) -> list[Check]:
    import torch

    from trainer.model.target import load_target

    with phases("engine: vLLM's hidden states == the target's features, every layer"):
        tgt = load_target(str(target))
        layers = list(range(tgt.num_layers))
        tgt = load_target(str(target), layer_ids=layers)
        got, left, folder = _fetch_all(args, work, target, tgt, prompts)
        wired = _wire_errors(got["shm"], got["bfloat16"], got["float8_e4m3fn"])
        same = all(torch.equal(a, b) for t in TRANSPORTS[1:]
                   for a, b in zip(got["shm"], got[t], strict=True))  # fmt: skip
        worst = _worst_by_layer(tgt, prompts, got["shm"])
        ok = max(worst) <= STATES_TOL and same and not left and not folder.exists()
        ok = ok and wired[0] and wired[1] <= 1.0
        detail = (
            f"{len(prompts)} prompts, through {', '.join(TRANSPORTS)} "
            f"({'equal' if same else 'DIFFER'}); bf16 on the wire "
            f"{'== the cast' if wired[0] else 'DIFFERS from the cast'}, fp8 at "
            f"{wired[1]:.2f} of e4m3's rounding bound (<= 1); "
            "max |diff| by layer "
            + ", ".join(f"{k}: {w:.1e}" for k, w in zip(layers, worst, strict=True))
            + f" (<= {STATES_TOL:g}); {len(left)} files left, folder "
            + ("removed" if not folder.exists() else "still there")
        )
        print(f"   {detail}")
    return [Check("engine: vLLM's states == the target's features (layers 0..L-1)", ok, detail)]


def _fetch_all(args: argparse.Namespace, work: Path, target: Path, tgt, prompts: list[list[int]]):
    """The prompts' states from one vLLM server, through every transport and, through the
    arena, in every wire dtype (float32 copies, by name); the names of what was left in
    the server's folder after each client closed; the folder (gone once the server is)."""
    import contextlib

    import torch

    from trainer.engine.mooncake import master
    from trainer.engine.supply import client_for, serving
    from trainer.engine.vllm import engine_layer_ids

    ids = engine_layer_ids(list(range(tgt.num_layers)), tgt.num_layers)
    got, left = {}, []
    with contextlib.ExitStack() as stack:
        address, url, _ = stack.enter_context(master(work / "mooncake-master-states.log"))
        store = {"master": address, "metadata": url}
        server, folder = stack.enter_context(
            serving(args.vllm_python, target, ids, work / "vllm-states.log", mooncake=store)
        )
        ways = [(t, "") for t in TRANSPORTS] + [("shm", w) for w in WIRES]
        for transport, wire in ways:  # every way the states travel, from one server
            client = client_for(server, folder, transport=transport, num_states=len(ids),
                                hidden_size=tgt.hidden_size, inflight=8, shm_mb=64, wire=wire,
                                mooncake=store if transport == "mooncake" else None)  # fmt: skip
            futures = [client.submit(torch.tensor(p)) for p in prompts]
            got[wire or transport] = [_widened(client.result(f)) for f in futures]
            client.close()
            left += sorted(p.name for p in folder.iterdir())
    return got, left, folder


def _worst_by_layer(tgt, prompts: list[list[int]], states: list) -> list[float]:
    """The largest |vLLM's state - the target's feature| of each layer over the prompts."""
    import torch

    layers = list(range(tgt.num_layers))
    worst = [0.0] * len(layers)
    for p, s in zip(prompts, states, strict=True):
        feats, _ = tgt.features(torch.tensor([p]))
        ours = feats[0].view(len(p), len(layers), -1)
        for k in layers:
            theirs = s[:, k].float()
            if k == tgt.num_layers - 1:  # vLLM's is before the final norm
                theirs = tgt.base.norm(theirs)
            worst[k] = max(worst[k], float((theirs - ours[:, k]).abs().max()))
    return worst


def _widened(states):
    """A client's states as a float32 copy (fp8's widened by their scales): the states
    themselves may be a view of the arena or the receive buffer, reused once released."""
    import torch

    from trainer.engine.states import Scaled
    from trainer.vllm.connector.dflash_states_wire import decode

    if isinstance(states, Scaled):
        return decode(states.values, states.scales, torch.float32)
    return states.to(torch.float32, copy=True)  # a view of the transport's memory until then


def _wire_errors(exact: list, bf16: list, fp8: list) -> tuple[bool, float]:
    """Whether bf16's states are the cast of the engine's, and fp8's worst error as a
    fraction of e4m3's bound (2^-4 of the value, or 2^-10 of its row's scale)."""
    import torch

    from trainer.vllm.connector.dflash_states_wire import FP8_MAX

    pairs = zip(bf16, exact, strict=True)
    cast = all(torch.equal(b, x.to(torch.bfloat16).float()) for b, x in pairs)
    worst = 0.0
    for f, x in zip(fp8, exact, strict=True):
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        bound = 2**-4 * x.abs() + 2**-10 * scale
        worst = max(worst, float(((f - x).abs() / bound).max()))
    return cast, worst


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("loss") is not None}


def training_check(work: Path, tag: str, twin_tag: str) -> Check:
    """The engine-fed run's losses against its colocated twin's."""
    ours, theirs = losses(work / f"run-{tag}"), losses(work / f"run-{twin_tag}")
    same_steps = sorted(ours) == sorted(theirs) and bool(ours)
    rel = [abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in theirs if s in ours]
    worst = max(rel, default=float("inf"))
    first = next((s for s in sorted(theirs) if s in ours and
                  abs(ours[s] - theirs[s]) / abs(theirs[s]) > 1e-6), None)  # fmt: skip
    detail = (
        f"{len(rel)} steps, max relative loss difference {worst:.1e} (<= {LOSS_TOL:g}); "
        f"step 1: {ours.get(1, float('nan')):.6f} vs {theirs.get(1, float('nan')):.6f}; "
        f"first step beyond 1e-6: {first}"
    )
    print(f"   {detail}")
    ok = same_steps and worst <= LOSS_TOL
    return Check(f"{ENGINE_DRAFTER}: losses == the colocated run's", ok, detail)


def two_ranks_check(args: argparse.Namespace, work: Path, phases: Phases, corpus: Path,
                    target: Path) -> Check:  # fmt: skip
    """Two ranks (torchrun, gloo) fed by one server rank 0 starts: the run trains its steps,
    and when it ends no vLLM process and no states folder is left."""
    import os
    import subprocess
    import sys

    from scripts.checks.serve_harness import sh
    from scripts.servers.daemon_process import DaemonProcess
    from trainer.engine.supply import run_id, states_folder

    run_dir = work / "run-engine-two-ranks"
    with phases("engine: two ranks fed by one server the run starts"):
        endpoint = f"ipc://{work}/loader-engine-two.sock"
        daemon = DaemonProcess(corpus, endpoint, "--token-budget", "2048", "--max-seq-len", "512",
                               log_path=work / "daemon-engine-two.log")  # fmt: skip
        try:
            sh(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "trainer.cli", "train", "--endpoint", endpoint, "--target", str(target),
               "--job", "engine-two", "--run-dir", str(run_dir), "--steps", "8",
               "--block-size", "8", "--no-progress", "--cost-samples", "0",
               *engine_flags(args.vllm_python), log=work / "train-engine-two.log",
               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        finally:
            daemon.stop()
        steps = sorted(losses(run_dir))
        left = subprocess.run(["pgrep", "-f", f"api_server --model {target}"],
                              capture_output=True, text=True).stdout.split()  # fmt: skip
        folder = states_folder(run_id(run_dir))
    ok = steps == list(range(1, 9)) and not left and not folder.exists()
    detail = (f"steps {steps[:1]}..{steps[-1:]} trained; vLLM processes left {len(left)}; "
              f"states folder {'left' if folder.exists() else 'removed'}")  # fmt: skip
    print(f"   {detail}")
    return Check("engine: two ranks, one server the run starts and stops", ok, detail)


def across_nodes_check(args: argparse.Namespace, work: Path, phases: Phases, corpus: Path,
                       target: Path) -> Check:  # fmt: skip
    """Two ranks fed by a server and a Mooncake master that run apart from them (a server
    a user runs, on "another node": the trainers are given its URL and the master's
    address, no folder): the run trains its steps, and leaves no key in the store and no
    file in the server's folder."""
    import contextlib
    import os
    import sys

    from scripts.checks.serve_harness import sh
    from scripts.servers.daemon_process import DaemonProcess
    from trainer.engine.mooncake import master
    from trainer.engine.supply import run_id, serving
    from trainer.engine.vllm import engine_layer_ids
    from trainer.model.target import load_target
    from trainer.vllm.connector.dflash_states_mooncake import connect

    run_dir = work / "run-engine-across-nodes"
    with phases("engine: two ranks fed through Mooncake by a server on another node"):
        tgt = load_target(str(target))
        ids = engine_layer_ids(tgt.layer_ids, tgt.num_layers)
        endpoint = f"ipc://{work}/loader-engine-nodes.sock"
        with contextlib.ExitStack() as stack:
            address, url, _ = stack.enter_context(master(work / "mooncake-master-nodes.log"))
            server, folder = stack.enter_context(serving(
                args.vllm_python, target, ids, work / "vllm-nodes.log", max_model_len=513,
                mooncake={"master": address, "metadata": url}))  # fmt: skip
            daemon = DaemonProcess(corpus, endpoint, "--token-budget", "2048", "--max-seq-len",
                                   "512", log_path=work / "daemon-engine-nodes.log")  # fmt: skip
            stack.callback(daemon.stop)
            sh(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "trainer.cli", "train", "--endpoint", endpoint, "--target", str(target),
               "--job", "engine-nodes", "--run-dir", str(run_dir), "--steps", "8",
               "--block-size", "8", "--no-progress", "--cost-samples", "0",
               "--target-engine", "vllm", "--engine-url", server.url, "--states-transport",
               "mooncake", "--mooncake-master", address, "--mooncake-metadata", url,
               log=work / "train-engine-nodes.log",
               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
            files = sorted(p.name for p in folder.iterdir())
            probe = connect(master=address, metadata=url, protocol="tcp", local_host="127.0.0.1")
            keys = probe.remove_by_regex(f"^dflash-{run_id(run_dir)}-", True)
            probe.close()
        steps = sorted(losses(run_dir))
    ok = steps == list(range(1, 9)) and not files and keys == 0
    detail = (f"steps {steps[:1]}..{steps[-1:]} trained; keys left in the store {keys}; "
              f"files left in the server's folder {len(files)}")  # fmt: skip
    print(f"   {detail}")
    return Check("engine: two ranks fed through Mooncake from another node", ok, detail)
