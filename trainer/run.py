"""Assemble one rank's training run from the ``dflash-train train`` options.

Kept apart from the click layer so the steps (process group, target, drafter, loader client,
trainer) read in order and each can be swapped in tests. The options arrive as one
``trainer.options.RunOptions``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from loader_server.wire.spec import ANCHOR_RULE, COEFFICIENTS, check_fields, profile_fields
from trainer.data.regen import load_prompts
from trainer.data.tokenizer import load_tokenizer
from trainer.eval.sets import conversation, load_set, parse_sets, render
from trainer.files import check_output
from trainer.hf.folder import DrafterFolder, init_drafter, options_from_folder, read_drafter_folder
from trainer.model.attention import packed_attention, resolve_backend
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.sharding import flat_values
from trainer.model.target import Target, mask_token_id, target_record
from trainer.option_values import parse_layer_types
from trainer.options import TargetOptions
from trainer.sections import RunOptions
from trainer.train import stop
from trainer.train.batches import BatchSource
from trainer.train.checkpoint import (
    RunWriteError,
    latest_checkpoint,
    run_write_error,
    write_error_message,
)
from trainer.train.distributed import DistEnv, init_distributed, pick_device, shutdown
from trainer.train.guards import WRITE_ERRNOS
from trainer.train.loop import Trainer
from trainer.train.target_shard import load_run_target
from trainer.train.trackers import parse_names

log = logging.getLogger(__name__)


def parse_spec_pairs(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("buckets=[770,1216]", "order=shuffled")`` -> a dict (values parsed as JSON when
    they are JSON, else kept as strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--spec expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


SPEC_OPTIONS = ("token_budget", "max_batch_size", "max_seq_len", "layout", "grad_accum")


def loader_spec(opts: RunOptions) -> dict[str, Any]:
    """The BatchSpec fields the trainer asks for: its anchor rule (``ANCHOR_RULE``, always:
    the loader's cost model counts the block slots this trainer trains, and the spec the run
    records is what it does, not the daemon's defaults), with a cost model the kernel its
    packed rows run under (``packed_attention``), the ones the user set (flags, then
    ``--spec``); the daemon's configured spec supplies every other field. ``--spec`` may not
    contradict what the trainer does (grad_accum, the anchor rule, the kernel). Every field
    is checked as a daemon checks it (``loader_server.wire.spec.check_fields``), before the
    target loads: an unknown name (with the nearest known one) or a bad value costs a
    second, not a target's load."""
    set_by_flag = {k: getattr(opts, k) for k in SPEC_OPTIONS}
    spec = {k: v for k, v in set_by_flag.items() if v is not None}
    if opts.block_size is None:
        raise ValueError("block_size is unresolved: see resolve_init_drafter")
    rule = {k: getattr(opts, k) for k in ANCHOR_RULE}
    extra = parse_spec_pairs(opts.spec_pairs)
    profile = profile_fields(opts.cost_profile) if opts.cost_profile else {}
    mine = dict(rule)
    if profile or any(k in extra for k in (*COEFFICIENTS, "cost_budget")):
        mine["packed_attention"] = packed_kernel(opts)
    for key, value in (*mine.items(), ("grad_accum", spec.get("grad_accum"))):
        if key in extra and value is not None and extra[key] != value:
            flag = "--" + key.replace("_", "-")
            said = f"{flag} {value}"
            if key == "packed_attention":  # no flag of its own: --attention decides it
                flag, said = "--attention", f"--attention {opts.attention} ({value} here)"
            raise ValueError(
                f"--spec {key}={extra[key]} contradicts {said}: the loader must plan "
                f"with what this trainer does (set {flag} instead)"
            )
    spec = {**mine, **spec, **extra}
    if profile:
        _warn_other_profile(opts.cost_profile, profile, mine)
        spec = {**profile, **spec}
    check_fields(spec)  # a typo or a bad value is refused here, before the target loads
    return spec


def packed_kernel(opts: RunOptions) -> str:
    """What this trainer's packed rows' attention computes (``BatchSpec.packed_attention``),
    from ``--attention`` on the device it will run on."""
    device = pick_device(opts.device, 0, torch.cuda.is_available())
    return packed_attention(resolve_backend(opts.attention, device))


def _warn_other_profile(path: Any, profile: dict[str, Any], mine: dict[str, Any]) -> None:
    theirs = {k: profile[k] for k in mine if k in profile}
    if theirs != mine:
        log.warning(
            "cost profile %s was calibrated with %s, this trainer runs %s: its coefficients "
            "are applied to what this trainer does", path, theirs, mine,
        )  # fmt: skip


def resolve_mask_token(target: Target, opts: RunOptions) -> int | None:
    """The MASK token id (None: the opt-in learned vector). Refuses ids outside the
    target's embedding, and a target that names none without ``--mask-token-id``."""
    vocab = int(target.embed_tokens.weight.shape[0])
    if opts.learned_mask:
        if opts.mask_token_id is not None:
            raise ValueError("--learned-mask and --mask-token-id exclude each other")
        log.warning(
            "--learned-mask: the MASK slot is a trained vector; SGLang, vLLM and Transformers "
            "embed a mask token id instead, so this drafter cannot be served as trained"
        )
        return None
    found = opts.mask_token_id
    if found is None:
        found = mask_token_id(target, None if opts.tiny else opts.target)
    if found is None:
        raise ValueError(
            f"target {opts.target!r} names no mask token (no mask_token_id in its config, "
            "no mask token or <|MASK|> in its tokenizer): pass --mask-token-id ID, a token "
            "id the data never uses (or --learned-mask, which serving engines cannot load)"
        )
    if not 0 <= found < vocab:
        raise ValueError(f"mask token id {found} is outside the target's embedding ({vocab} rows)")
    return int(found)


def build_drafter(target: Target, opts: RunOptions, device: torch.device | str) -> DFlashDrafter:
    """The drafter ``opts`` describes (its depth and block size resolved already: see
    ``resolve_init_drafter``), seeded by ``--seed``, on ``device``."""
    if opts.drafter_layers is None or opts.block_size is None:
        raise ValueError("drafter_layers and block_size are unresolved: see resolve_init_drafter")
    mask_id = resolve_mask_token(target, opts)
    cfg = DrafterConfig.from_target(
        target.config,
        num_target_layers=len(target.layer_ids),
        num_layers=opts.drafter_layers,
        block_size=opts.block_size,
        mask_token_id=mask_id,
        layer_types=parse_layer_types(opts.layer_types, opts.sliding_window, opts.drafter_layers),
        sliding_window=opts.sliding_window,
        sliding_causal=not opts.sliding_bidirectional,
        **opts.dflash2_fields(),
    )
    log.info("drafter MASK: %s", "learned vector" if mask_id is None else f"token {mask_id}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)  # same init on every rank (DDP also broadcasts it)
        drafter = DFlashDrafter(cfg, init_std=opts.init_std)
    if drafter.mask_embedding is not None:
        with torch.no_grad():
            drafter.mask_embedding.copy_(target.embed_tokens.weight.float().mean(0).cpu())
    return drafter.to(device)


def eval_prompts(opts: RunOptions, vocab_size: int) -> list[torch.Tensor]:
    if opts.engine:  # the verifier needs the decoder, which runs in the engine
        log.info(
            "--target-engine %s: tau is not measured while training (measure an "
            "export with `dflash-train eval --engine vllm`)",
            opts.target_engine,
        )
        return []
    if opts.eval_prompts is not None:
        if opts.eval_prompts.is_dir():
            raise ValueError(f"--eval-prompts {opts.eval_prompts} is a folder, not a JSONL file")
        prompts = load_prompts(opts.eval_prompts, vocab_size=vocab_size)
        if not prompts:  # a tau of nothing would be no tau, silently
            raise ValueError(f"--eval-prompts {opts.eval_prompts}: no prompts (an empty set)")
        return prompts[: opts.num_eval_prompts]
    if opts.num_eval_prompts == 0:
        return []  # tau is not measured
    log.warning(
        "no --eval-prompts: tau is measured on %d random prompts, not held-out data",
        opts.num_eval_prompts,
    )
    g = torch.Generator().manual_seed(opts.seed + 1)
    return [torch.randint(0, vocab_size, (16,), generator=g) for _ in range(opts.num_eval_prompts)]


def eval_tokenizer(opts: RunOptions) -> Any:
    """The target folder's tokenizer, which renders ``--eval-sets`` with its chat template;
    one line naming the option when the target has no tokenizer or no chat template."""
    why = "--eval-sets renders its prompts with the target's tokenizer and chat template"
    if opts.tiny:
        raise ValueError(
            f"{why}: --target tiny has neither; give --target DIR, a model folder with a "
            "tokenizer (dflash-train save-target DIR --tokenizer TOK writes the tiny one)"
        )
    folder = Path(opts.target)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{why}: the target folder {folder} has no tokenizer")
    try:
        tok = load_tokenizer(folder)
    except ValueError as e:
        raise ValueError(f"{why}: {e}") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{why}: the tokenizer in {folder} has no chat template")
    return tok


def eval_set_prompts(opts: RunOptions, tokenizer: Any) -> dict[str, list[list[int]]]:
    """Each ``--eval-sets`` set's first ``--eval-set-limit`` prompts as token ids: the first
    user turn (in training a multi-turn set, MT-Bench, is measured on its first turn only)
    rendered with the chat template, ``enable_thinking`` as ``--eval-thinking`` says."""
    thinking = opts.eval_thinking == "on"
    out: dict[str, list[list[int]]] = {}
    for name, path in parse_sets(opts.eval_sets, "--eval-sets"):
        found = load_set(name, path, limit=opts.eval_set_limit)
        more = [p for p in found.prompts if len(p.turns) > 1]
        log.info("eval set %s%s", found.describe(), "; the first turn only" if more else "")
        out[name] = [
            render(tokenizer, conversation(p, 0, []), thinking=thinking) for p in found.prompts
        ]
    return out


def fitting_prompts(
    sets: dict[str, list[list[int]]], max_positions: int, opts: RunOptions
) -> dict[str, list[torch.Tensor]]:
    """The prompts of each set that leave room in the target's ``max_positions`` for
    ``--eval-new-tokens`` and a verification block (the last step may run past the new
    tokens by up to a block); the others are skipped, warned with the set and count."""
    assert opts.block_size is not None  # resolve_init_drafter
    longest = max_positions - opts.eval_new_tokens - opts.block_size
    out: dict[str, list[torch.Tensor]] = {}
    for name, prompts in sets.items():
        kept = [torch.tensor(ids) for ids in prompts if len(ids) <= longest]
        skipped = len(prompts) - len(kept)
        why = (
            f"longer than {longest} tokens (the target's {max_positions} positions less "
            f"--eval-new-tokens {opts.eval_new_tokens} and a block of {opts.block_size})"
        )
        if not kept:
            raise ValueError(f"--eval-sets {name}: all its {len(prompts)} prompts are {why}")
        if skipped:
            log.warning("--eval-sets %s: %d of its %d prompts are %s: skipped", name, skipped,
                        len(prompts), why)  # fmt: skip
        out[name] = kept
    return out


def check_run(opts: RunOptions) -> None:
    """What a run refuses before anything starts (the length, the dashboards) and what it
    says of options that have no effect."""
    if opts.block_size is None:
        raise ValueError("block_size is unresolved: see resolve_init_drafter")
    opts.check_length()
    parse_names(opts.report_to)  # an unknown tracker is refused before the target loads
    LossConfig.from_options(opts, opts.block_size)  # weights that would round to 0, refused
    if opts.loss_weighting == "dpace" and opts.gamma != RunOptions.gamma:
        log.warning("--gamma %g has no effect with --loss-weighting dpace (the default: "
                    "D-PACE's weights replace the position decay; --loss-weighting decay "
                    "uses it)", opts.gamma)  # fmt: skip
    if opts.loss_weighting == "decay" and opts.dpace_alpha != RunOptions.dpace_alpha:
        log.warning("--dpace-alpha %g has no effect with --loss-weighting decay",
                    opts.dpace_alpha)  # fmt: skip
    if opts.init_drafter is not None and opts.init_std is not None:
        log.warning("--init-std %g has no effect with --init-drafter (its weights replace the "
                    "start)", opts.init_std)  # fmt: skip


DEFAULT_DRAFTER_LAYERS, DEFAULT_BLOCK_SIZE = 1, 16


def resolve_init_drafter(opts: RunOptions) -> tuple[RunOptions, DrafterFolder | None]:
    """``(opts, folder)``: with ``--init-drafter DIR`` the folder's layer ids, drafter depth,
    block size and MASK token fill the options the user left out (``trainer.hf.folder``);
    without it the plain defaults. ``folder`` is None without ``--init-drafter``."""
    if opts.init_drafter is None:
        defaults = {"drafter_layers": DEFAULT_DRAFTER_LAYERS, "block_size": DEFAULT_BLOCK_SIZE}
        unset: dict[str, Any] = {k: v for k, v in defaults.items() if getattr(opts, k) is None}
        opts, folder = replace(opts, **unset), None
    else:
        folder = read_drafter_folder(opts.init_drafter)
        opts = options_from_folder(opts, folder)
    assert opts.drafter_layers is not None
    kinds = parse_layer_types(opts.layer_types, opts.sliding_window, opts.drafter_layers)
    if opts.sliding_bidirectional and kinds is None:
        raise ValueError("--sliding-bidirectional: no drafter layer is sliding (--sliding-window)")
    if opts.drafter is None:
        opts = replace(opts, drafter="dflash")
    opts.dflash2_fields()  # DFlash2 flags need --drafter dflash2
    return opts, folder


def init_from_folder(
    drafter: DFlashDrafter, folder: DrafterFolder, target: Target, opts: RunOptions
) -> None:
    """``--init-drafter``'s weights, unless ``--resume`` finds a checkpoint (which wins)."""
    found = latest_checkpoint(opts.run_dir) if opts.resume else None
    if found is not None:
        log.info("--resume: %s wins over --init-drafter %s", found, folder.path)
        return
    init_drafter(drafter, folder, target)


def weights_fingerprint(model: torch.nn.Module, samples: int = 64) -> str:
    """A short digest of a model's weights that identifies it wherever it lies: every
    tensor's name and shape and ``samples`` values spread over it, rounded to bf16 (so a
    target loaded in fp32 on CPU and in bf16 on a GPU agree, whole or sharded: a sharded
    tensor's values come from the ranks holding them, so every rank calls this). Cheap: no
    full pass."""
    h = hashlib.blake2b(digest_size=8)
    picked = []
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)};".encode())
        if t.is_floating_point() and t.numel():
            k = min(samples, t.numel())
            idx = torch.arange(k) * (t.numel() - 1) // max(k - 1, 1)
            picked.append(flat_values(t.detach(), idx).to(torch.bfloat16).float())
    if picked:
        h.update(torch.cat(picked).cpu().numpy().tobytes())
    return h.hexdigest()


def run_meta(opts: TargetOptions, target: Target) -> dict[str, Any]:
    """What checkpoints record about the target (``dflash-train export`` reads it;
    ``--resume`` compares it: ``target_weights`` tells another target from a moved one)."""
    meta: dict[str, Any] = {
        "target": opts.target,
        "layer_ids": target.layer_ids,
        "target_config": target_record(target.config),
        "target_weights": weights_fingerprint(target.weights_module),
    }
    if opts.tiny:
        tiny = [f.name for f in fields(TargetOptions) if f.name != "target"]
        meta["target_options"] = {k: getattr(opts, k) for k in tiny}
    return meta


def check_run_dir(opts: RunOptions) -> None:
    """The run folder is the run's own: it must not be, contain or lie inside what the
    run reads (the target, ``--init-drafter``, ``--eval-prompts``, ``--eval-sets``,
    ``--cost-profile``)."""
    inputs = [opts.init_drafter, opts.eval_prompts, opts.cost_profile]
    inputs += [path for _, path in parse_sets(opts.eval_sets, "--eval-sets")]
    if not opts.tiny:
        inputs.append(Path(opts.target))
    check_output(opts.run_dir, inputs=[p for p in inputs if p is not None])
    check_writable(opts.run_dir)


def check_writable(run_dir: Path) -> None:
    """The run folder can be made and written (checked before minutes of loading, and
    leaving nothing behind): one line if not (read-only, no permission, no space)."""
    base = Path(run_dir)
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise RunWriteError(f"--run-dir {run_dir}: {base} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=base))
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        err = OSError(e.errno, e.strerror)  # without the probe's name
        msg = write_error_message(err, f"the run folder {run_dir}", None, path=base)
        raise RunWriteError(msg) from None


def _writing(write: Any, run_dir: Path) -> None:
    """``write()``, a failed write into the run folder said in one line."""
    try:
        write()
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise run_write_error(e, run_dir) from None


def _warn_collective_timeout(opts: RunOptions, warn: bool) -> None:
    """While one rank's client waits for its daemon (``--timeout-s``), the others wait in a
    collective: a shorter collective timeout ends the job before the loader's own error."""
    t = opts.collective_timeout_s
    if warn and t is not None and opts.engine and t <= opts.engine_timeout_s:
        log.warning(
            "--collective-timeout-s %g is not longer than --engine-timeout-s %g: a rank "
            "waiting for the engine leaves the others in a collective until it fails, "
            "before the engine's own error (and the final checkpoint)", t, opts.engine_timeout_s,
        )  # fmt: skip
    if warn and t is not None and t <= opts.timeout_s:
        log.warning(
            "--collective-timeout-s %g is not longer than --timeout-s %g: a rank whose loader "
            "is away fails the job's collectives before its own loader error (and the final "
            "checkpoint) can stop every rank together", t, opts.timeout_s,
        )  # fmt: skip


def run_training(opts: RunOptions) -> dict[str, Any] | None:
    """Run one rank; returns the summary on rank 0 (None elsewhere). SIGTERM stops it
    cleanly after the current step (``trainer.train.stop``)."""
    stop.install()
    if not opts.tiny and Path(opts.target).is_dir():  # as config.json and checkpoints
        opts = replace(opts, target=str(Path(opts.target).resolve()))  # name it: from anywhere
    check_run_dir(opts)
    opts, folder = resolve_init_drafter(opts)
    opts = replace(opts, lr=opts.peak_lr())  # config.json and the trackers record the rate
    check_run(opts)  # before anything is started
    spec = loader_spec(opts)
    named = parse_sets(opts.eval_sets, "--eval-sets")
    sets = eval_set_prompts(opts, eval_tokenizer(opts)) if named else {}  # before the target
    env = init_distributed(opts.device, opts.collective_timeout_s)
    _warn_collective_timeout(opts, env.is_main and env.distributed)
    try:
        with contextlib.ExitStack() as stack:
            target: Target
            if opts.engine:  # the decoder in a vLLM server, its head here (trainer.engine)
                from trainer.engine.supply import engine_side

                target, feed = stack.enter_context(engine_side(opts, env))
                target_memory: dict[str, Any] = {}
            else:
                target, target_memory = load_run_target(opts, env)  # --target-shard
            drafter = build_drafter(target, opts, env.device)
            if folder is not None:
                init_from_folder(drafter, folder, target, opts)
            from client import LoaderClient

            client = LoaderClient(
                opts.endpoint,
                job=opts.job,
                rank=env.rank,
                world_size=env.world_size,
                spec=spec,
                epochs=opts.epochs,
                timeout_s=opts.timeout_s,
            )
            source: BatchSource = feed(client) if opts.engine else client
            stack.callback(source.close)  # before the engine side: its requests end first
            return _train(opts, env, spec, target, drafter, source, sets, target_memory)
    finally:
        shutdown(env)


def _train(
    opts: RunOptions, env: DistEnv, spec: dict[str, Any], target: Target,
    drafter: DFlashDrafter, source: BatchSource, sets: dict[str, list[list[int]]],
    target_memory: dict[str, Any],
) -> dict[str, Any] | None:  # fmt: skip
    """The run itself, once its target, drafter and source are there."""
    meta = run_meta(opts, target)
    trainer = Trainer(
        opts,
        target=target,
        drafter=drafter,
        source=source,
        env=env,
        eval_prompts=eval_prompts(opts, target.vocab_size),
        eval_sets=fitting_prompts(sets, target.config.max_position_embeddings, opts),
        meta=meta,
    )

    def accepted() -> None:  # only now: a refused run leaves config.json as it was
        if env.is_main:
            _writing(lambda: opts.write(spec, env.world_size), opts.run_dir)

    summary = trainer.run(accepted)
    if env.is_main:
        summary["world_size"] = env.world_size
        summary["pid"] = os.getpid()
        summary["target_memory"] = target_memory
        text = json.dumps(summary, indent=2) + "\n"
        _writing(lambda: (opts.run_dir / "summary.json").write_text(text), opts.run_dir)
        return summary
    return None
