"""`make serve-check`: vLLM in the loop, before serving a drafter (docs/SERVING.md).

Run by ``scripts/checks/serve_check.sh`` (which makes the vLLM virtualenv once) with the
project's ``.venv``; vLLM runs in its own virtualenv (``--vllm-python``), as subprocesses:

1. data: tiny chat conversations and a byte-level BPE tokenizer with Qwen3's template, and
   a tiny random-weight Qwen3 target saved with it (``dflash-train save-target``), as in the
   demo;
2. vLLM's OpenAI server serves the target: ``dflash-train regen --server`` regenerates every
   reply through it (the training corpus and the held-out prompts); the first rows again
   through ``scripts/servers/chat_server.py``, the stand-in the tests use, must give the same
   replies; vLLM's plain greedy output on the held-out prompts is kept (token ids);
3. a drafter trains on that corpus (the loader daemon and ``dflash-train train``, one
   process) and is exported (``dflash-train export``, bf16);
4. vLLM serves the target with the exported drafter as its DFlash speculator, and:

   * weights: every tensor of the export was read by vLLM and its values are in one of the
     drafter's parameters, and every parameter of vLLM's drafter holds checkpoint values
     (or is the target's own embedding / LM head, or one vLLM does not use). vLLM's DFlash
     loader does not report a missing tensor (it serves the drafter with ~0 acceptance),
     so a probe in vLLM's processes (``sitecustomize`` on ``PYTHONPATH``) records what it
     loaded and compares the values;
   * output: speculative greedy == plain greedy == the trainer's verifier, token ids, on
     every held-out prompt;
   * acceptance: vLLM's spec-decode counters (``/metrics``: drafts, accepted tokens, per
     position) over those requests == the trainer's verifier on the same prompts
     (``trainer.model.verifier``: ``tau_served``; its ``tau`` is z-lab's statistic), and
     above 1, so that the comparison means something;

5. a table of the checks and of the time each phase took; exit status 1 naming what failed.

``python -m scripts.checks.serve_check --vllm-python VENV/bin/python [--work DIR]``: without
``--work`` everything goes to a temporary folder, removed when every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.servers.chat_server import running
from scripts.servers.daemon_process import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TRAIN = [PY, "-m", "trainer.cli"]
SERVED = "target"  # --served-model-name
BLOCK = 8  # drafter block size: B - 1 = 7 speculative tokens
SLIDING_WINDOW = 16  # the sliding drafter's window: shorter than most prompts

# The probe: vLLM imports sitecustomize at start-up in every process (API server, engine
# core, worker). It wraps AutoWeightsLoader.load_weights (the vLLM parameter names each
# model's loader filled), DFlashQwen3ForCausalLM.load_weights (the checkpoint tensors
# vLLM read and, right after, where their values lie among the drafter's parameters:
# before process_weights_after_loading, which on CPU packs every linear weight for oneDNN
# and leaves an empty tensor behind) and the speculator's load_model (which parameters are
# the target's by then: the shared embedding and LM head); it writes the report to
# $DFLASH_SERVE_CHECK_REPORT.
PROBE = r'''
"""serve-check's probe in vLLM's processes: what vLLM's DFlash drafter loaded."""
import importlib.abc
import importlib.machinery
import json
import os
import sys

_REPORT = os.environ.get("DFLASH_SERVE_CHECK_REPORT")
_SEEN = {"checkpoint": [], "loaded": {}}


def _patch_utils(mod):
    orig = mod.AutoWeightsLoader.load_weights

    def load_weights(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        names = _SEEN["loaded"].setdefault(type(self.module).__name__, set())
        names.update(out or ())
        return out

    mod.AutoWeightsLoader.load_weights = load_weights


def _patch_dflash(mod):
    orig = mod.DFlashQwen3ForCausalLM.load_weights

    def load_weights(self, weights):
        tensors = {}

        def named():
            for name, tensor in weights:
                tensors[name] = tensor.detach().clone()
                yield name, tensor

        out = orig(self, named())
        # Before process_weights_after_loading: on CPU it packs every linear weight for
        # oneDNN and leaves an empty tensor in its place.
        _SEEN["checkpoint"] = list(tensors)
        _SEEN["values"] = _compare(self, tensors)
        return out

    mod.DFlashQwen3ForCausalLM.load_weights = load_weights


def _matches(param, tensor):
    """Row offsets where ``tensor`` lies in ``param`` (stacked along dim 0), exactly."""
    import torch

    p, t = param.detach().float(), tensor.float()
    if p.dim() != t.dim() or p.dim() == 0 or p.shape[1:] != t.shape[1:] or len(p) < len(t):
        return []
    n = len(t)
    first = (p == t[0]) if p.dim() == 1 else (p == t[0]).all(dim=1)
    offsets = [int(o) for o in first.nonzero().flatten() if o + n <= len(p)]
    return [o for o in offsets if torch.equal(p[o : o + n], t)]


def _compare(drafter, tensors):
    """Where each checkpoint tensor's values lie among the drafter's parameters."""
    params = dict(drafter.named_parameters())
    covered = {n: set() for n in params}
    found = {}
    for tname, tensor in tensors.items():
        hits = []
        for pname, param in params.items():
            for o in _matches(param, tensor):
                hits.append([pname, o])
                covered[pname].update(range(o, o + len(tensor)))
        found[tname] = hits
    rows = {n: int(p.shape[0]) if p.dim() else 1 for n, p in params.items()}
    return {
        "tensors_found": found,
        "rows": rows,
        "rows_covered": {n: len(c) for n, c in covered.items()},
        "shapes": {n: list(p.shape) for n, p in params.items()},
    }


def _report(proposer, target_model):
    drafter = proposer.model
    target = {id(p): n for n, p in target_model.named_parameters()}
    loaded = _SEEN["loaded"].get(type(drafter).__name__, set())
    values = _SEEN.get("values")
    if values is None:
        return {"error": "DFlashQwen3ForCausalLM.load_weights was not called"}
    separate_mask = getattr(getattr(drafter, "model", None), "has_separate_mask_embedding", True)
    out = {}
    for n, p in drafter.named_parameters():
        out[n] = {
            "shape": values["shapes"].get(n, list(p.shape)),
            "loaded": n in loaded,
            "shared_with_target": target.get(id(p)),
            "rows": values["rows"].get(n, 0),
            "rows_covered": values["rows_covered"].get(n, 0),
            "unused": n.endswith("mask_embedding") and not separate_mask,
        }
    return {
        "drafter_class": type(drafter).__name__,
        "proposer_class": type(proposer).__name__,
        "checkpoint_names": _SEEN["checkpoint"],
        "tensors_found": values["tensors_found"],
        "params": out,
    }


def _patch_proposer(mod):
    orig = mod.SpecDecodeBaseProposer.load_model

    def load_model(self, target_model):
        orig(self, target_model)
        try:
            report = _report(self, target_model)
        except Exception as e:  # the check reports it; serving goes on
            report = {"error": repr(e)}
        if _REPORT:
            with open(_REPORT + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(_REPORT + ".tmp", _REPORT)

    mod.SpecDecodeBaseProposer.load_model = load_model


_PATCHES = {
    "vllm.model_executor.models.utils": _patch_utils,
    "vllm.model_executor.models.qwen3_dflash": _patch_dflash,
    "vllm.v1.spec_decode.llm_base_proposer": _patch_proposer,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _REPORT:
    sys.meta_path.insert(0, _Finder())
'''


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class Phases:
    """Wall time of each phase, printed as it ends and in the closing table."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.times.append((name, dt))
            print(f"   {name}: {dt:.1f} s", flush=True)


def sh(*args: str, log: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command; its output goes to ``log`` (or is returned). Raises on failure with
    the output's end."""
    shown = " ".join(a.replace(PY, "python") for a in args)
    print(f"   $ {shown}", flush=True)
    out = subprocess.run(
        args, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    if log is not None:
        log.write_text(out.stdout)
    if out.returncode != 0:
        raise RuntimeError(f"`{shown}` exited with {out.returncode}:\n{out.stdout[-3000:]}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up after {timeout:.0f} s:\n{tail(log)}")
        time.sleep(0.5)


def tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this script started (vLLM's engine core and worker are
    children of its API server), SIGKILL what is left after 30 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent


def vllm_command(
    vllm_python: str, target: Path, port: int, drafter: Path | None, speculators: bool = False,
    num_speculative_tokens: int = BLOCK - 1,
) -> list[str]:  # fmt: skip
    """The vLLM OpenAI server for the target (docs/SERVING.md): fp32 on CPU, no
    torch.compile (--enforce-eager), a KV cache of a fixed size (the CPU backend otherwise
    reserves --gpu-memory-utilization of the machine's memory and refuses to start when
    that much is not free); with ``drafter``, its DFlash speculator. ``speculators``: the
    drafter is a speculators-dialect folder, which vLLM takes as ``--model`` (it serves the
    verifier its config names, with the drafter); ``num_speculative_tokens``: the drafter's
    block size - 1."""
    if speculators and drafter is not None:
        target, drafter = drafter, None
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
           "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0"]  # fmt: skip
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter),
                "num_speculative_tokens": num_speculative_tokens}  # fmt: skip
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


@contextlib.contextmanager
def vllm_server(
    vllm_python: str, target: Path, log: Path, drafter: Path | None = None,
    speculators: bool = False, num_speculative_tokens: int = BLOCK - 1, **env: str,
) -> Iterator[str]:  # fmt: skip
    port = free_port()
    cmd = vllm_command(vllm_python, target, port, drafter, speculators, num_speculative_tokens)
    print("   $ " + " ".join(c if " " not in c else f"'{c}'" for c in cmd), flush=True)
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_http(url + "/health", proc, log, timeout=600)
        print(f"   vLLM up in {time.perf_counter() - t0:.1f} s ({log})", flush=True)
        yield url
    finally:
        stop_group(proc)


def stand_in_server(target: Path, log: Path) -> contextlib.AbstractContextManager[str]:
    return running(["--model", str(target), "--batch", "16"], log, python=PY)


def spec_counters(url: str) -> dict[str, Any]:
    """vLLM's spec-decode counters from ``/metrics`` (Prometheus text)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in names:
            out[names[base]] += float(value)
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + float(value)
    return out


def complete(
    url: str, prompts: list[list[int]], max_tokens: int, stops: list[list[int]] | None = None
) -> list[list[int]]:
    """Greedy completions of token-id prompts, one request at a time (a batch of one:
    nothing depends on what else is in flight), each also ending at its ``stops`` (vLLM's
    ``stop_token_ids``: finished like an EOS, the token kept); the generated token ids."""
    out = []
    for k, p in enumerate(prompts):
        body = {"model": SERVED, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "stop_token_ids": stops[k] if stops else []}  # fmt: skip
        out.append(
            [int(t) for t in http_json(url + "/v1/completions", body)["choices"][0]["token_ids"]]
        )
    return out


def journal_replies(out: Path) -> dict[int, list[dict[str, str]]]:
    from trainer.data.server.journal import journal_path

    recs: dict[int, list[dict[str, str]]] = {}
    for line in journal_path(out).read_text().splitlines()[1:]:
        rec = json.loads(line)
        recs[int(rec["row"])] = rec["messages"]
    return recs


def regen(src: Path, out: Path, url: str, target: Path, holdout: int, log: Path) -> dict[str, Any]:
    text = sh(*TRAIN, "regen", str(src), str(out), "--server", url, "--tokenizer", str(target),
              "--max-tokens", "40", "--concurrency", "16", "--holdout", str(holdout),
              "--no-progress", log=log)  # fmt: skip
    return dict(json.loads(text.strip().splitlines()[-1]))


# ---- the checks ------------------------------------------------------------------------


def check_weights(report_path: Path, export: Path, drafter: str) -> Check:
    from safetensors import safe_open

    name = f"{drafter}: vLLM loaded every drafter weight"
    if not report_path.exists():
        return Check(name, False, f"the probe wrote no report ({report_path}): vLLM's loading "
                     "path changed (serve-check's PROBE needs updating)")  # fmt: skip
    rep = json.loads(report_path.read_text())
    if "error" in rep:
        return Check(name, False, f"the probe failed: {rep['error']}")
    exported: set[str] = set()
    for file in sorted(export.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            exported.update(f.keys())
    problems = []
    unread = exported - set(rep["checkpoint_names"])
    if unread:
        problems.append(f"not read by vLLM: {sorted(unread)}")
    lost = sorted(t for t, hits in rep["tensors_found"].items() if not hits)
    if lost:
        problems.append(f"values in no vLLM parameter: {lost}")
    params = rep["params"]
    shared = sorted(n for n, p in params.items() if p["shared_with_target"])
    unused = sorted(n for n, p in params.items() if p["unused"])
    missing = sorted(
        n for n, p in params.items()
        if not p["shared_with_target"] and not p["unused"]
        and not (p["loaded"] and p["rows_covered"] == p["rows"])
    )  # fmt: skip
    if missing:
        problems.append(f"vLLM parameters not from the checkpoint: {missing}")
    if problems:
        return Check(name, False, "; ".join(problems))
    filled = len(params) - len(shared) - len(unused)
    return Check(
        name, True,
        f"{len(exported)} exported tensors -> {filled} {rep['drafter_class']} parameters "
        f"(values equal); shared with the target: {', '.join(shared) or 'none'}; "
        f"unused by vLLM: {', '.join(unused) or 'none'}",
    )  # fmt: skip


class Verifier:
    """The trainer's verifier (``trainer.model.verifier``) with the exported drafter, its
    weights as the folder holds them, and the target's EOS ids as the trainer takes them."""

    def __init__(self, target_dir: Path, export: Path) -> None:
        import torch
        from transformers import GenerationConfig

        from trainer.hf.folder import config_from_folder, init_drafter, read_drafter_folder
        from trainer.model.drafter import DFlashDrafter
        from trainer.model.target import load_target
        from trainer.model.verifier import DrafterProposer, eos_ids

        torch.set_num_threads(2)
        folder = read_drafter_folder(export)
        target = load_target(str(target_dir), layer_ids=folder.target_layer_ids)
        cfg = config_from_folder(folder, target)
        drafter = DFlashDrafter(cfg)
        init_drafter(drafter, folder, target)
        drafter.eval()
        generation = GenerationConfig.from_pretrained(target_dir)
        self.eos = tuple(dict.fromkeys(eos_ids(target.config) + eos_ids(generation)))
        self.target, self.block = target, cfg.block_size
        self.proposer = DrafterProposer(target, drafter)

    def run(
        self, prompts: list[list[int]], max_new: int, stops: list[list[int]]
    ) -> tuple[Any, list[list[int]], dict[int, int]]:
        """The TauReport over ``prompts`` (each also ending at its ``stops``), the output
        tokens, and the accepted drafts by position over the served steps (as vLLM's
        ``spec_decode_num_accepted_tokens_per_pos`` counts them)."""
        import torch

        from trainer.model.verifier import TauReport, speculative_generate

        rep, tokens, per_pos = TauReport(), [], {}
        for p, stop in zip(prompts, stops, strict=True):
            r = speculative_generate(
                self.target, self.proposer, torch.tensor(p), block_size=self.block,
                max_new_tokens=max_new, eos_token_ids=self.eos + tuple(stop),
            )  # fmt: skip
            rep.add(r)
            tokens.append(r.tokens.tolist())
            for length in r.acceptance_lengths[: r.served_steps]:
                for k in range(length - 1):
                    per_pos[k] = per_pos.get(k, 0) + 1
        return rep, tokens, per_pos


def speculators_parity(
    args: argparse.Namespace,
    work: Path,
    tag: str,
    name: str,
    run_dir: Path,
    export: Path,
    target: Path,
    tokens: list[int],
) -> Check:
    """speculators' converter on the export (validated by it), then speculators' own
    DFlash forward on a held-out sequence against the trainer's drafter, slot for slot
    (``scripts/checks/speculators_check.py``, in the vLLM virtualenv)."""
    import torch

    from trainer.model.drafter import DraftBlocks

    check = f"{name}: speculators converts it; its forward == the drafter's"
    ours_dialect = work / f"drafter-{tag}-speculators"
    sh(*TRAIN, "export", str(run_dir), str(ours_dialect), "--dtype", "fp32", "--format",
       "speculators")  # fmt: skip
    verifier = Verifier(target, export)
    ids = torch.tensor(tokens)
    feats, _ = verifier.target.features(ids[None])
    inputs, outputs = work / f"speculators-in-{tag}.pt", work / f"speculators-out-{tag}.pt"
    torch.save({"features": feats, "input_ids": ids[None], "num_anchors": 6,
                "loss_mask": torch.ones(1, ids.numel(), dtype=torch.long)}, inputs)  # fmt: skip
    try:
        sh(args.vllm_python, str(ROOT / "scripts" / "checks" / "speculators_check.py"),
           str(export), str(target), str(work / f"speculators-{tag}"), str(inputs),
           str(outputs), str(ours_dialect), log=work / f"speculators-{tag}.log")  # fmt: skip
    except RuntimeError as e:
        return Check(check, False, str(e)[-300:])
    theirs = torch.load(outputs)
    anchors = theirs["anchors"][theirs["valid"]].tolist()
    drafter = verifier.proposer.drafter
    with torch.no_grad():
        blocks = DraftBlocks.one_document(feats, anchors, ids[anchors])
        ours = drafter(verifier.target.embed_tokens, blocks)
    diff = float((ours - theirs["hidden"][: ours.shape[0]]).abs().max())
    scale = float(ours.abs().max())
    sliding = drafter.config.layer_types is not None
    detail = (
        f"{theirs['speculators_model_type']} checkpoint, aux_hidden_state_layer_ids "
        f"{theirs['aux_hidden_state_layer_ids']}; {len(anchors)} blocks at anchors {anchors}: "
        f"max |ours - speculators'| {diff:.2e} (hidden states up to {scale:.1f})"
    )
    mine = theirs["ours"]
    differ = dict(mine["config_differs"])
    note = ""
    # speculators' DFlash converter always writes sliding_window_non_causal false (its
    # default), which vLLM turns into dflash_config.causal true for every layer: full and
    # bidirectional layers served causal. Ours says true there (what was trained).
    if differ.get("sliding_window_non_causal") == [True, False]:
        del differ["sliding_window_non_causal"]
        note = (
            " (but sliding_window_non_causal: ours true, the converter's false, which vLLM "
            "serves as causal in every layer)"
        )
    detail += (
        f"; our --format speculators export: {mine['tensors']} tensors "
        f"{'equal' if mine['weights_equal'] else 'DIFFER'}, {mine['config_keys']} config keys"
        + (f", differ: {differ}" if differ else " equal")
        + note
    )
    if not mine["weights_equal"] or differ:
        return Check(check, False, detail)
    selector = drafter.candidate_selector
    if selector is not None:  # DFlash2: the selector's teacher-forced candidate scores
        b = drafter.config.block_size
        with torch.no_grad():
            logits = verifier.target.lm_head(ours).float()
            cands = logits.topk(selector.top_k, dim=-1).indices
            block = ids[torch.tensor(anchors)[:, None] + torch.arange(b)]
            prev = torch.cat([block[:, :1], block[:, :-1]], 1).reshape(-1)
            scores = logits.gather(1, cands) + selector.transitions(ours, prev, cands)
        n = scores.shape[0]
        same_ids = torch.equal(cands, theirs["candidates"][:n])
        score_d = float((scores - theirs["scores"][:n]).abs().max())
        detail += (
            f"; selector scores of the top-{selector.top_k}: max |ours - speculators'| "
            f"{score_d:.2e}, candidate ids {'equal' if same_ids else 'DIFFER'}"
        )
        if not same_ids or score_d > 1e-4 * max(float(scores.abs().max()), 1.0):
            return Check(check, False, detail)
    if sliding:  # speculators trains another sliding rule (docs/TRAINER.md): not compared
        return Check(f"{name}: speculators converts and validates it", True,
                     detail + " (not an equality: speculators masks sliding layers by "
                     "another rule than vLLM serves)")  # fmt: skip
    return Check(check, diff <= 1e-5 * max(scale, 1.0), detail)


def vllm_dflash2_parity(
    args: argparse.Namespace, work: Path, name: str, export: Path, target: Path,
    tokens: list[int],
) -> Check:  # fmt: skip
    """vLLM's ``DFlash2Qwen3ForCausalLM`` loads the export on CPU and its convolutions,
    candidate logits and selector edges equal the trainer's on the same inputs
    (``scripts/checks/vllm_dflash2_check.py``, in the vLLM virtualenv)."""
    import torch

    from trainer.model.dflash2 import softcap_logits
    from trainer.model.drafter import DraftBlocks

    check = f"{name}: vLLM's DFlash2 model class loads it; its pieces == the drafter's"
    verifier = Verifier(target, export)
    drafter, tgt = verifier.proposer.drafter, verifier.target
    cfg, selector = drafter.config, drafter.candidate_selector
    assert selector is not None
    g = torch.Generator().manual_seed(0)
    rows, hid = 2 * cfg.block_size, cfg.hidden_size
    conv_in = [torch.randn(rows, hid, generator=g) for _ in drafter.layers]
    conv_out = [torch.randn(rows, hid, generator=g) for _ in drafter.layers]
    ids = torch.tensor(tokens)
    anchor = min(12, ids.numel() - 1)
    feats, _ = tgt.features(ids[None])
    with torch.no_grad():
        blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
        hidden = drafter(tgt.embed_tokens, blocks)[1:]
        logits = softcap_logits(tgt.lm_head(hidden).float(), cfg.output_multiplier,
                                cfg.final_logit_softcapping)  # fmt: skip
        unary, cands = logits.topk(selector.top_k, dim=-1)
        edges = selector.edges(hidden, unary, cands, int(ids[anchor]))
        ours_conv = []
        for i, layer in enumerate(drafter.layers):
            for conv in (layer.attention_conv, layer.mlp_conv):
                y, c = conv.prepare(conv_in[i])
                ours_conv.append((y, conv.finish(conv_out[i], c)))
    inputs, outputs = work / "vllm-dflash2-in.pt", work / "vllm-dflash2-out.pt"
    torch.save({"block": cfg.block_size, "conv_in": conv_in, "conv_out": conv_out,
                "hidden": hidden, "candidates": cands, "unary": unary,
                "anchor": ids[anchor : anchor + 1], "lm_head": tgt.lm_head.weight},
               inputs)  # fmt: skip
    try:
        sh(args.vllm_python, str(ROOT / "scripts" / "checks" / "vllm_dflash2_check.py"),
           str(target), str(export), str(inputs), str(outputs),
           log=work / "vllm-dflash2.log")  # fmt: skip
    except RuntimeError as e:
        return Check(check, False, str(e)[-300:])
    theirs = torch.load(outputs)
    problems = []
    # vLLM's parameters all filled from the export, but the target's embedding and LM head
    # (nested loaders also report their own, unprefixed names: only the model's count)
    theirs["loaded"] = sorted(set(theirs["loaded"]) & set(theirs["params"]))
    unfilled = sorted(
        n for n in set(theirs["params"]) - set(theirs["loaded"]) - set(theirs["unused"])
        if not n.endswith(("embed_tokens.weight", "lm_head.weight"))
    )  # fmt: skip
    if unfilled:
        problems.append(f"vLLM parameters not from the export: {unfilled}")
    dflash2 = [n for n in theirs["loaded"] if "conv" in n or "candidate_selector" in n]
    conv = max(
        float((a - b).abs().max())
        for mine, their in zip(ours_conv, theirs["convs"], strict=True)
        for a, b in zip(mine, their, strict=True)
    )
    if not torch.equal(theirs["candidates"], cands):
        problems.append("candidates differ")
    unary_d = float((theirs["unary"] - unary).abs().max())
    edge_d = float((theirs["edges"] - edges).abs().max())
    for label, d in (("convolutions", conv), ("candidate logits", unary_d), ("edges", edge_d)):
        if d > 1e-4:
            problems.append(f"{label} differ by {d:.2e}")
    detail = (
        f"{theirs['architectures']}: {len(theirs['exported'])} exported tensors -> "
        f"{len(theirs['loaded'])} of {len(theirs['params'])} parameters ({len(dflash2)} "
        f"convolution and selector ones; not filled: the target's embedding and LM head, "
        f"unused {theirs['unused'] or 'none'}); "
        f"max |ours - vLLM's|: convolutions {conv:.1e}, "
        f"top-{theirs['top_k']} candidate logits {unary_d:.1e} (same ids), selector edges "
        f"{edge_d:.1e}"
    )
    return Check(check, not problems, "; ".join(problems) if problems else detail)


def stop_token(output: list[int], start: int = 8) -> list[int]:
    """A stop token for a second pass: the first token of ``output`` at index >= ``start``
    that does not occur before it (so the response ends there), or none."""
    for i in range(start, len(output) - 1):
        if output[i] not in output[:i]:
            return [output[i]]
    return []


def cut_at(output: list[int], stop: list[int]) -> list[int]:
    return output[: output.index(stop[0]) + 1] if stop else output


# ---- the run ---------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path, phases: Phases) -> list[Check]:
    from trainer.data.regen import load_prompts

    checks: list[Check] = []
    chat, target, corpus = work / "chat", work / "target", work / "corpus"
    with phases("data: conversations, tokenizer, tiny Qwen3 target"):
        sh(PY, "-m", "scripts.fixtures.tiny_chat", str(chat), "--conversations",
           str(args.conversations), "--words", "40", "--template", "qwen3")  # fmt: skip
        sh(*TRAIN, "save-target", str(target), "--tiny-vocab", "1024",
           "--tokenizer", str(chat / "tokenizer"))  # fmt: skip
    conversations = chat / "conversations.jsonl"
    head = work / "head.jsonl"
    head.write_text("".join(conversations.read_text().splitlines(True)[: args.compare_rows]))

    with (
        phases("vLLM serves the target: regen, plain greedy"),
        vllm_server(args.vllm_python, target, work / "vllm-target.log") as url,
    ):
        summary = regen(conversations, corpus, url, target, args.prompts, work / "regen.log")
        ok = summary["failed"] == 0 and summary["regenerated"] > 0
        checks.append(Check(
                "regen --server through vLLM", ok,
                f"{summary['regenerated']} conversations regenerated, {summary['failed']} "
                f"failed, {summary['corpus']['conversations']} in the corpus, "
                f"{summary['holdout']} held out",
            ))  # fmt: skip
        heldout = corpus / "heldout.jsonl"
        prompts = [p.tolist() for p in load_prompts(heldout)][: args.prompts]
        plain = complete(url, prompts, args.max_tokens)
        # a second pass ends each response at a stop token of its own, inside a step
        stops = [stop_token(o) for o in plain]
        plain_stop = [cut_at(o, s) for o, s in zip(plain, stops, strict=True)]

    with phases("stand-in (scripts/servers/chat_server.py) regen of the first rows"):
        with stand_in_server(target, work / "chat-server.log") as url:
            regen(head, work / "corpus-stand-in", url, target, 0, work / "regen-stand-in.log")
        ours, theirs = journal_replies(corpus), journal_replies(work / "corpus-stand-in")
        rows = sorted(theirs)
        differ = [r for r in rows if ours.get(r) != theirs[r]]
        checks.append(Check(
            "stand-in replies == vLLM replies", not differ and bool(rows),
            f"{len(rows) - len(differ)} of {len(rows)} conversations identical"
            + (f"; differ: rows {differ[:10]}" if differ else ""),
        ))  # fmt: skip

    for name, flags in DRAFTERS.items():
        checks += drafter_checks(
            args, work, phases, name, flags, corpus, target, prompts, plain, plain_stop, stops
        )
    checks += dflash2_checks(args, work, phases, corpus, target, prompts, plain)
    return checks


#: One row per drafter served: its tau (vLLM's and the verifier's) and training costs.
COMPARISON: list[dict[str, Any]] = []

#: The drafters served: the first DFlash (full attention), and a sliding-window one (all
#: layers sliding: vLLM's V1 runner, the one its CPU build has, serves no mix of sliding
#: and full layers: "Model Runner V1 does not support: mixed sliding/full dflash drafts").
DRAFTERS: dict[str, list[str]] = {
    "full attention": ["--drafter-layers", "2"],
    "sliding window": ["--drafter-layers", "2", "--sliding-window", str(SLIDING_WINDOW)],
    "sliding, bidirectional": [
        "--drafter-layers", "2", "--sliding-window", str(SLIDING_WINDOW),
        "--sliding-bidirectional",
    ],
}  # fmt: skip


def train_and_export(
    args: argparse.Namespace, work: Path, phases: Phases, name: str, tag: str,
    flags: list[str], corpus: Path, target: Path,
) -> tuple[Path, Path, dict[str, Any], float]:  # fmt: skip
    """The drafter ``flags`` describe, trained on ``corpus`` (the loader daemon and
    ``dflash-train train``) and exported (bf16): run folder, export, summary, peak RSS."""
    run_dir, export = work / f"run-{tag}", work / f"drafter-{tag}"
    with phases(f"{name}: train the drafter ({args.steps} steps) and export it"):
        endpoint = f"ipc://{work}/loader-{tag}.sock"
        daemon = DaemonProcess(corpus, endpoint, "--token-budget", "2048", "--max-seq-len", "512",
                               log_path=work / f"daemon-{tag}.log")  # fmt: skip
        try:
            sh(*TRAIN, "train", "--endpoint", endpoint, "--target", str(target), "--job", tag,
               "--run-dir", str(run_dir), "--steps", str(args.steps), "--block-size", str(BLOCK),
               "--anchors-per-doc", "16", "--token-budget", "2048", "--max-seq-len", "512",
               "--lr", "3e-3", "--num-eval-prompts", "0", "--cost-samples", "0",
               "--no-progress", *flags, log=work / f"train-{tag}.log")  # fmt: skip
        finally:
            daemon.stop()
        sh(*TRAIN, "export", str(run_dir), str(export))
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rss = max(r.get("rss_peak_gb", 0.0) for r in records)
        print(  # tau is the verifier's, below (the run evaluates none)
            f"   training: loss {summary['first_loss']:.2f} -> {summary['last_loss']:.2f}, "
            f"{summary.get('steps', '?')} steps"
        )
    return run_dir, export, summary, rss


#: vLLM's CPU build (V1 model runner only) refuses a DFlash2 drafter with this line.
DFLASH2_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"
#: The DFlash2 drafter (full-attention layers: speculators' sliding mask is another rule).
DFLASH2_FLAGS = ["--drafter", "dflash2", "--drafter-layers", "2", "--selector-rank", "64"]


def dflash2_checks(
    args: argparse.Namespace,
    work: Path,
    phases: Phases,
    corpus: Path,
    target: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
) -> list[Check]:
    """A DFlash2 drafter, trained and exported as the others. vLLM's CPU build refuses to
    serve it (``DFLASH2_REFUSAL``, quoted), so: vLLM's DFlash2 model class loads it and its
    convolutions, candidate logits and selector edges equal ours; speculators' DFlash2
    model loads it and its forward equals ours; our verifier (the selector's greedy walk,
    plain greedy verification) is lossless against vLLM's plain greedy output."""
    name, tag, checks = "DFlash2", "dflash2", []
    run_dir, export, summary, rss = train_and_export(
        args, work, phases, name, tag, DFLASH2_FLAGS, corpus, target
    )
    log = work / "vllm-dflash2-serve.log"
    with phases(f"{name}: vLLM's CPU build is asked to serve it"):
        try:
            with vllm_server(args.vllm_python, target, log, export):
                served = "vLLM served it (its CPU build now runs DFlash2: serve-check it fully)"
                checks.append(Check(f"{name}: vLLM's CPU build refuses it", False, served))
        except RuntimeError:
            said = DFLASH2_REFUSAL in log.read_text(errors="replace")
            checks.append(Check(
                f"{name}: vLLM's CPU build refuses it, for the known reason", said,
                f'"{DFLASH2_REFUSAL}" (its V2 runner, which serves DFlash2, needs Triton)'
                if said else f"vLLM failed otherwise: {tail(log, 8)}",
            ))  # fmt: skip
    full = work / f"drafter-{tag}-fp32"
    sh(*TRAIN, "export", str(run_dir), str(full), "--dtype", "fp32")
    with phases(f"{name}: vLLM's model class and speculators' model load it"):
        checks.append(vllm_dflash2_parity(args, work, name, full, target, prompts[0] + plain[0]))
        checks.append(speculators_parity(args, work, tag, name, run_dir, full, target,
                                         prompts[0] + plain[0]))  # fmt: skip
    with phases(f"{name}: the trainer's verifier (the selector's walk) on the same prompts"):
        rep, tokens, _ = Verifier(target, export).run(prompts, args.max_tokens,
                                                      [[] for _ in prompts])  # fmt: skip
    same = sum(1 for t, g in zip(tokens, plain, strict=True) if t == g)
    checks.append(Check(
        f"{name}: verifier output == vLLM's plain greedy", same == len(prompts),
        f"{same}/{len(prompts)} prompts; tau {rep.tau_served:.3f} served, {rep.tau:.3f} z-lab's",
    ))  # fmt: skip
    COMPARISON.append({
        "drafter": name, "flags": " ".join(DFLASH2_FLAGS), "vllm_tau": None,
        "tau_served": rep.tau_served, "tau": rep.tau, "last_loss": summary["last_loss"],
        "step_s": summary["median_step_time_s"], "rss_peak_gb": rss,
    })  # fmt: skip
    return checks


#: The drafters vLLM also serves from their speculators-dialect export (``--format
#: speculators``, given to vLLM as ``--model``).
SPECULATORS_SERVED = {"full attention"}


def speculators_served(
    args: argparse.Namespace, work: Path, name: str, tag: str, run_dir: Path, target: Path,
    prompts: list[list[int]], spec: list[list[int]], counters: list[dict[str, Any]],
) -> Check:  # fmt: skip
    """vLLM serves the speculators-dialect export of the same drafter (bf16, as the DFlash
    one): its output and spec-decode counters equal the DFlash dialect's."""
    folder = work / f"drafter-{tag}-speculators-bf16"
    sh(*TRAIN, "export", str(run_dir), str(folder), "--format", "speculators")
    with vllm_server(args.vllm_python, target, work / f"vllm-speculators-{tag}.log", folder,
                     speculators=True) as url:  # fmt: skip
        before = spec_counters(url)
        out = complete(url, prompts, args.max_tokens)
        after = spec_counters(url)
    theirs = {k: round(after[k] - before[k]) for k in ("drafts", "accepted")}
    ours = {k: round(counters[1][k] - counters[0][k]) for k in ("drafts", "accepted")}
    same = sum(1 for a, b in zip(out, spec, strict=True) if a == b)
    return Check(
        f"{name}: vLLM serves the --format speculators export alike",
        same == len(prompts) and theirs == ours,
        f"vllm serve SPECULATORS_FOLDER (the verifier from its config): {same}/{len(prompts)} "
        f"outputs equal the DFlash folder's; drafts {theirs['drafts']}/{ours['drafts']}, "
        f"accepted {theirs['accepted']}/{ours['accepted']}",
    )  # fmt: skip


def drafter_checks(
    args: argparse.Namespace,
    work: Path,
    phases: Phases,
    name: str,
    flags: list[str],
    corpus: Path,
    target: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
    plain_stop: list[list[int]],
    stops: list[list[int]],
) -> list[Check]:
    """Train the drafter ``flags`` describe, export it, serve it with vLLM and compare
    vLLM's output and acceptance with plain greedy and the trainer's verifier."""
    checks: list[Check] = []
    tag = name.replace(",", "").replace(" ", "-")
    no_stops: list[list[int]] = [[] for _ in prompts]
    run_dir, export, summary, rss = train_and_export(args, work, phases, name, tag, flags, corpus,
                                                     target)  # fmt: skip

    report = work / f"vllm-weights-{tag}.json"
    with phases(f"{name}: vLLM serves the target with the DFlash drafter"):
        probe = work / "probe"
        probe.mkdir(exist_ok=True)
        (probe / "sitecustomize.py").write_text(PROBE)
        pythonpath = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
        with vllm_server(args.vllm_python, target, work / f"vllm-dflash-{tag}.log", export,
                         PYTHONPATH=pythonpath,
                         DFLASH_SERVE_CHECK_REPORT=str(report)) as url:  # fmt: skip
            counters = [spec_counters(url)]
            spec = complete(url, prompts, args.max_tokens)
            counters.append(spec_counters(url))
            spec_stop = complete(url, prompts, args.max_tokens, stops)
            counters.append(spec_counters(url))
        checks.append(check_weights(report, export, name))

    with phases(f"{name}: the trainer's verifier on the same prompts"):
        verifier = Verifier(target, export)
        passes = [
            ("max_tokens", spec, plain, *verifier.run(prompts, args.max_tokens, no_stops)),
            ("stop tokens", spec_stop, plain_stop, *verifier.run(prompts, args.max_tokens, stops)),
        ]

    with phases(f"{name}: speculators converts the export and drafts with it"):
        # fp32: speculators' converter casts the target's embedding it adds to the export's
        # dtype, which bf16 would round
        full = work / f"drafter-{tag}-fp32"
        sh(*TRAIN, "export", str(run_dir), str(full), "--dtype", "fp32")
        checks.append(speculators_parity(args, work, tag, name, run_dir, full, target,
                                         prompts[0] + plain[0]))  # fmt: skip

    outputs, acceptance, taus = [], [], []
    equal_out = equal_acc = True
    for k, (label, served, greedy, rep, verified, per_pos) in enumerate(passes):
        same = [i for i, t in enumerate(served) if t == greedy[i] == verified[i]]
        equal_out &= len(same) == len(prompts)
        differ = [i for i in range(len(prompts)) if i not in same]
        outputs.append(
            f"{label}: {len(same)}/{len(prompts)} prompts ({sum(map(len, served))} tokens)"
            + (f", differ: {differ[:10]}" if differ else "")
        )
        before, after = counters[k], counters[k + 1]
        drafts = round(after["drafts"] - before["drafts"])
        accepted = round(after["accepted"] - before["accepted"])
        v_pos = {p: round(v - before["per_pos"].get(p, 0.0)) for p, v in after["per_pos"].items()}
        v_pos = {p: v for p, v in v_pos.items() if v}
        ours_acc = rep.served_accepted - rep.served_steps
        same_acc = (drafts, accepted) == (rep.served_steps, ours_acc) and v_pos == per_pos
        equal_acc &= same_acc
        tau_vllm = 1 + accepted / drafts if drafts else 0.0
        acceptance.append(
            f"{label}: drafts {drafts}/{rep.served_steps}, accepted {accepted}/{ours_acc}, "
            f"per position {'equal' if v_pos == per_pos else f'{v_pos} vs {per_pos}'}, "
            f"tau {tau_vllm:.3f}/{rep.tau_served:.3f} (z-lab's tau {rep.tau:.3f}, "
            f"tokens per step {rep.tau_committed:.3f})"
        )
        taus.append((label, tau_vllm, rep))
    stopped = sum(1 for s in stops if s)
    if name in SPECULATORS_SERVED:
        with phases(f"{name}: vLLM serves its --format speculators export"):
            checks.append(speculators_served(args, work, name, tag, run_dir, target, prompts,
                                             spec, counters[:2]))  # fmt: skip
    checks.append(Check(
        f"{name}: speculative == plain greedy == verifier", equal_out and stopped > 0,
        "; ".join(outputs) + f"; {stopped} prompts end at their stop token",
    ))  # fmt: skip
    checks.append(Check(
        f"{name}: vLLM acceptance == trainer's verifier", equal_acc,
        "vLLM/verifier (tau: 1 + accepted/drafts / tau_served) " + "; ".join(acceptance),
    ))  # fmt: skip
    label, tau_vllm, rep = taus[0]
    COMPARISON.append({
        "drafter": name, "flags": " ".join(flags) or "-", "vllm_tau": tau_vllm,
        "tau_served": rep.tau_served, "tau": rep.tau, "last_loss": summary["last_loss"],
        "step_s": summary["median_step_time_s"], "rss_peak_gb": rss,
    })  # fmt: skip
    checks.append(Check(
        f"{name}: acceptance above 1 (a meaningful comparison)", tau_vllm >= args.min_tau,
        f"{tau_vllm:.3f} >= {args.min_tau} ({label}; the verifier's z-lab tau {rep.tau:.3f}, "
        f"pooled {rep.tau_pooled:.3f}, served {rep.tau_served:.3f}, "
        f"committed {rep.tau_committed:.3f})",
    ))  # fmt: skip
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="Python of the vLLM virtualenv.")
    p.add_argument("--work", type=Path, help="Working folder (kept) [a temporary one].")
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--compare-rows", type=int, default=32, help="Rows the stand-in regenerates.")
    p.add_argument("--prompts", type=int, default=16, help="Held-out prompts.")
    p.add_argument("--max-tokens", type=int, default=48, help="Tokens per held-out prompt.")
    p.add_argument("--steps", type=int, default=120, help="Training steps.")
    p.add_argument("--min-tau", type=float, default=1.1)
    args = p.parse_args(argv)
    # SIGTERM/SIGHUP end the check as Ctrl-C does: through the finally blocks that stop the
    # servers (vLLM's run in sessions of their own, so no signal reaches them otherwise).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    keep = args.work is not None
    work = (args.work or Path(tempfile.mkdtemp(prefix="serve-check-"))).resolve()
    if keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    t0 = time.perf_counter()
    try:
        checks = run(args, work, phases)
    except RuntimeError as e:
        checks = [Check("serve-check ran to the end", False, str(e))]
    total = time.perf_counter() - t0
    print("\nserve-check (vLLM in the loop):")
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}")
    if COMPARISON:
        print("drafters (same data, same steps; tau of the max_tokens pass):")
        print(f"  {'drafter':<24} {'flags':<64} {'vLLM tau':>8} {'served':>7} {'z-lab':>6} "
              f"{'loss':>6} {'step s':>7} {'RSS GB':>7}")  # fmt: skip
        for r in COMPARISON:
            vllm_tau = "n/a" if r["vllm_tau"] is None else f"{r['vllm_tau']:.3f}"
            print(
                f"  {r['drafter']:<24} {r['flags']:<64} {vllm_tau:>8} "
                f"{r['tau_served']:>7.3f} {r['tau']:>6.3f} {r['last_loss']:>6.2f} "
                f"{r['step_s']:>7.3f} {r['rss_peak_gb']:>7.2f}"
            )
    print("phases:")
    for name, dt in phases.times:
        print(f"  {dt:7.1f} s  {name}")
    print(f"  {total:7.1f} s  total")
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"serve-check FAILED: {'; '.join(failed)} (logs: {work})")
        return 1
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"serve-check passed: {len(checks)} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
