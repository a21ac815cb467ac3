"""Every ``dflash-train train`` option, in sections (as torchtitan's ``JobConfig``): the run
itself (``JobSection``), the target, the drafter, the loss, the optimizer, the loader spec,
evaluation, output. Each section declares its options once (flag, help, default, choices:
``trainer.options.opt``) and the methods that read them into typed values (``--layers`` as
integers, the run's length in steps); ``RunOptions`` is all of them, the one object the
command line, a config file and a run's ``config.json`` make and the trainer takes
(``trainer.train.loop.Trainer``). A new option is a field of one section; its flag, its
config-file key and its ``config.json`` key follow.

Fields keep their ``--help`` groups and config-file tables (``section=``): the loss's are
listed with the drafter's (``[drafter]``), the output's with evaluation's, the run's first.

Imports only the trainer's foundation (``trainer.options``, ``trainer.option_values``); no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from loader_server.wire.files import read_json
from trainer.engine_options import EngineSection
from trainer.option_values import parse_int_list
from trainer.options import (
    CONFIG_FILE,
    DFLASH2_DEFAULTS,
    DRAFTER,
    EVAL,
    OPTIM,
    RUN_FACTS,
    SPEC,
    TARGET,
    Options,
    TargetOptions,
    opt,
    renamed,
    spec_choices,
    spec_help,
)


@dataclass(frozen=True, kw_only=True)
class JobSection(Options):
    """The run itself: the loader it reads from, its folder, where it runs and how long
    it waits (the top of a config file)."""

    endpoint: str = opt(help="Loader endpoint, e.g. ipc:///run/dflash-loader/loader.sock.")
    job: str = opt("train", "Job name (a session per rank).")
    run_dir: Path = opt(help="Where checkpoints, metrics and config.json go.")
    resume: bool = opt(
        False,
        "Continue from the newest checkpoint, if any; also on another number of ranks or "
        "--grad-accum (the rest of the epoch is planned afresh for them).",
    )
    device: str | None = opt(
        None,
        "Default: cuda:LOCAL_RANK when a GPU is present, else cpu; cuda with no index is "
        "cuda:LOCAL_RANK too.",
        section=EVAL,
    )
    timeout_s: float = opt(60.0, "How long to wait for the loader daemon.", section=EVAL, above=0)
    collective_timeout_s: float | None = opt(
        None,
        "Seconds a collective waits for a rank before the step fails (a frozen node under "
        "torchrun --nnodes MIN:MAX is noticed then); longer than the slowest rank's target "
        "load and checkpoint save [default: torch's, 10 min NCCL, 30 min gloo].",
        section=EVAL,
        above=0,
    )


@dataclass(frozen=True, kw_only=True)
class TargetSection(TargetOptions):
    """The target: ``TargetOptions`` (shared with ``regen`` and ``save-target``) and how a
    run holds it."""

    target_shard: str = opt(
        "none",
        "Shard the frozen target's decoder layers over the ranks (FSDP2) so that none holds "
        "it whole: fsdp, or auto (when it does not fit next to the drafter); none: whole on "
        "every rank.",
        choices=("none", "fsdp", "auto"), section=TARGET,  # trainer.model.sharding.SHARD_MODES
        before="none",
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DrafterSection(Options):
    """The drafter's shape, where it starts from and its kernels."""

    layers: str | None = opt(
        None, "Target layer ids for the features, e.g. 0,1,2 (default: spread).", section=DRAFTER
    )
    drafter_layers: int | None = opt(  # None: resolved by trainer.run.resolve_init_drafter
        None,
        "Drafter decoder layers [1; --init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )
    block_size: int | None = opt(  # None: resolved by trainer.run.resolve_init_drafter
        None,
        "Block size [16; --init-drafter: its own].",
        section=DRAFTER,
        at_least=2,
    )
    layer_types: str | None = opt(
        None,
        "Attention of each drafter layer, comma-separated: full or sliding (the config's "
        "full_attention / sliding_attention), e.g. sliding,sliding,full [all full; with "
        "--sliding-window alone, all sliding; --init-drafter: its own].",
        section=DRAFTER,
    )
    sliding_window: int | None = opt(
        None,
        "Positions a sliding layer sees (its own included), causally inside the block, as "
        "SGLang and vLLM serve it [--init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )
    sliding_bidirectional: bool = opt(
        False,
        "Sliding layers see every block slot within the window, not only earlier ones "
        "(exported as is_causal false, as DFlash2's reference drafter is) [--init-drafter: "
        "its own].",
        section=DRAFTER,
    )
    drafter: str | None = opt(
        None,
        "Drafter generation: dflash, or dflash2 (grouped convolutions around each sublayer "
        "and a candidate selector over the LM head's top-K; served as DFlash2DraftModel) "
        "[dflash; --init-drafter: its own].",
        choices=("dflash", "dflash2"), section=DRAFTER,  # trainer.model.dflash2.VARIANTS
    )  # fmt: skip
    conv_kernel_size: int | None = opt(
        None, "DFlash2: taps of each block convolution [2; --init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )  # fmt: skip
    conv_group_size: int | None = opt(
        None, "DFlash2: hidden channels sharing one dynamic tap [16; --init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )  # fmt: skip
    selector_rank: int | None = opt(
        None,
        "DFlash2: rank of the selector's codebooks (two [vocab, rank] tables) [256; "
        "--init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )
    selector_top_k: int | None = opt(
        None, "DFlash2: unary candidates the selector walks [16; --init-drafter: its own].",
        section=DRAFTER,
        at_least=1,
    )  # fmt: skip
    output_multiplier: float | None = opt(
        None,
        "DFlash2: scale of the unary logits [1; --init-drafter: its own].",
        section=DRAFTER,
        above=0,
    )
    final_logit_softcapping: float | None = opt(
        None,
        "DFlash2: soft cap c of the unary logits, c*tanh(x/c) [none; --init-drafter: its own].",
        section=DRAFTER,
        above=0,
    )
    input_embedding_scale: float | None = opt(
        None, "DFlash2: scale of the block's embeddings [1; --init-drafter: its own].",
        section=DRAFTER,
        above=0,
    )  # fmt: skip
    init_drafter: Path | None = opt(
        None,
        "Start from a DFlash drafter folder (z-lab's or speculators' layout): its weights, "
        "and its layer ids, depth, block size and MASK token where not given. A checkpoint "
        "found by --resume wins.",
        path={"exists": True, "file_okay": False},
        section=DRAFTER,
    )
    init_std: float | None = opt(
        None,
        "Standard deviation of the normal start of the drafter's projections (fc, attention, "
        "MLP) [0.02, Transformers' initializer_range, as the reference drafters]; 0: "
        "PyTorch's default start (uniform, 1/sqrt(3 fan_in)). It goes with --lr: AdamW's "
        "step is about the rate whatever the weights' size, so a smaller start wants a "
        "smaller --lr (docs/TRAINER.md, 'Initialisation'). --init-drafter's weights "
        "replace it.",
        section=DRAFTER,
        at_least=0,
        before=0.0,
    )
    mask_token_id: int | None = opt(
        None,
        "Token id whose frozen target embedding is the MASK slot (default: the target's "
        "mask token from its config or tokenizer, e.g. Qwen3's <|MASK|> 151669).",
        section=DRAFTER,
        at_least=0,
    )
    learned_mask: bool = opt(
        False, "Train a MASK vector instead (NOT loadable by SGLang/vLLM/Transformers DFlash).",
        section=DRAFTER,
    )  # fmt: skip
    attention: str = opt(
        "auto", "Attention kernel of the drafter and of the target's packed rows; auto: "
        "flex_attention on CUDA, SDPA elsewhere.",
        choices=("auto", "sdpa", "flex"), section=DRAFTER,
    )  # fmt: skip

    @property
    def layer_ids(self) -> list[int] | None:
        """``--layers`` as integers (None: spread over the target)."""
        return parse_int_list(self.layers)


@dataclass(frozen=True, kw_only=True)
class LossSection(Options):
    """The objective: anchors, the loss weights, how a step's loss is normalized, the
    head's chunk (``trainer.model.blocks.LossConfig.from_options`` makes the loss config)."""

    anchors_per_doc: int = opt(
        512, "At most this many anchors (blocks) per document (the loader spec's name).",
        aliases=("--num-anchors",), section=DRAFTER,
        was=("num_anchors",), at_least=1,
    )  # fmt: skip
    tokens_per_anchor: int = opt(
        32,
        "A document draws one anchor per this many supervised positions (rounded up), at "
        "most --anchors-per-doc: a micro-batch of T tokens then trains about T/32 blocks "
        "(2048 in a 65,536-token one); compute and activation memory follow it. 1: every "
        "position up to --anchors-per-doc (the reference recipe, 512 per sequence).",
        section=DRAFTER,
        at_least=1,
        before=1,
    )
    max_anchors: int = opt(
        0,
        "With --anchor-draw micro-batch only: at most this many anchors per micro-batch, "
        "kept fairly across its documents (the old rule; 0: no cap).",
        section=DRAFTER,
        at_least=0,
    )
    anchor_draw: str = opt(
        "document",
        "document: a document's anchors are a function of the seed, the epoch and the "
        "sample alone (any rank, micro-batch or neighbours). micro-batch: drawn per rank "
        "and loader position, as before (comparisons only).",
        choices=("document", "micro-batch"), section=DRAFTER,
        before="micro-batch",
    )  # fmt: skip
    loss_normalization: str = opt(
        "step",
        "step: the step's weighted CE over the step's total weight, every micro-batch of "
        "every rank (one objective however the loader cuts a step). micro-batch: the mean of "
        "each micro-batch's mean, as speculators, DeepSpec and ModelOpt train (comparisons).",
        choices=("step", "micro-batch"), section=DRAFTER,
        before="micro-batch",
    )  # fmt: skip
    loss_divisor: str = opt(
        "weight",
        "What the weighted CE sum is divided by: weight, the weights' sum (a weighted mean); "
        "slots, the supervised slots (speculators'); sequence, each document's weights, then "
        "the mean over documents (the reference's and SpecForge's). docs/TRAINER.md, 'What "
        "D-PACE's loss divides by'.",
        choices=("weight", "slots", "sequence"), section=DRAFTER,  # trainer.model.blocks.DIVISORS
        before="weight",
    )  # fmt: skip
    loss_weighting: str = opt(
        "dpace",
        "Weight of block offset k: dpace, D-PACE's confidence weights (speculators' DFlash "
        "default; ours since docs/EXPERIMENT.md Part 4): each slot weighs the expected "
        "accepted length it would still buy; decay, exp(-(k-1)/gamma) (before Part 4).",
        choices=("decay", "dpace"), section=DRAFTER,
        before="decay",
    )  # fmt: skip
    dpace_alpha: float = opt(
        0.5,
        "D-PACE's confidence smoothing: q~ = (1 - a) exp(-CE) + a.",
        section=DRAFTER,
        at_least=0,
        at_most=1,
        before=0.5,
    )
    gamma: float = opt(
        7.0, "Loss decay over block offsets, exp(-(k-1)/gamma) (--loss-weighting decay).",
        section=DRAFTER,
        above=0,
    )  # fmt: skip
    selector_alpha: float | None = opt(
        None, "DFlash2: weight of the selector's K-way cross-entropy next to the unary one [1].",
        section=DRAFTER,
        at_least=0,
    )  # fmt: skip
    loss_chunk: int = opt(
        1024,
        "Supervised slots per LM-head chunk (and chunk/block-size blocks per drafter "
        "chunk): logits exist for this many slots at once. 0: unchunked (reference; memory "
        "grows with anchors).",
        section=DRAFTER,
        at_least=0,
    )


#: Each optimizer's ``--lr`` when none is given (docs/EXPERIMENT.md, Part 8): Muon's the best of
#: its sweep, AdamW's its default before 2026-12-07 (``--optimizer adamw`` gives those back).
RATES = {"muon": 1e-2, "adamw": 6e-4}


@dataclass(frozen=True, kw_only=True)
class OptimizerSection(Options):
    """The optimizer and the run's length."""

    optimizer: str = opt(
        "muon",
        "muon: Muon on the drafter's 2-D weights (its update scaled to AdamW's RMS) and AdamW "
        "on the rest, as speculators' DFlash recipe; adamw: AdamW on every weight, the default "
        "before 2026-12-07 (docs/TRAINER.md, 'Optimizer').",
        choices=("muon", "adamw"), section=OPTIM,  # trainer.train.optimizers.OPTIMIZERS
        before="adamw",
    )  # fmt: skip
    lr_schedule: str = opt(
        "cosine", "After the warm-up, the rate falls to 0 along a cosine or a straight line "
        "(speculators').", choices=("cosine", "linear"), section=OPTIM, before="cosine",
    )  # fmt: skip
    lr: float | None = opt(None, "Peak learning rate [default: the optimizer's: " + ", ".join(
        f"{k} {v:g}" for k, v in RATES.items()) + "].", section=OPTIM, above=0,
        show_default=False)  # fmt: skip
    warmup: float = opt(
        0.04, "Warm-up steps; < 1: a fraction of the run.", section=OPTIM, at_least=0
    )
    weight_decay: float = opt(0.01, "Weight decay.", section=OPTIM, at_least=0)
    grad_clip: float = opt(1.0, "Gradient norm clip.", section=OPTIM, above=0)
    steps: int | None = opt(None, "Optimizer steps (or --epochs).", section=OPTIM, at_least=1)
    epochs: int | None = opt(
        None, "Epochs of the loader's plan (or --steps).", section=OPTIM, at_least=1
    )
    max_nonfinite_steps: int = opt(
        3,
        "Stop after this many optimizer steps in a row whose loss or gradients are NaN/inf "
        "(each is skipped: no update); 0: never stop.",
        section=OPTIM,
        at_least=0,
        before=0,
    )
    max_empty_steps: int = opt(
        10,
        "Stop after this many steps in a row in which no rank trained a block (the spec "
        "leaves no document a block); 0: never stop.",
        section=OPTIM,
        at_least=0,
        before=0,
    )
    seed: int = opt(
        0, "Trainer seed (init, anchors); the loader's plan seed is the daemon's or --spec seed=N.",
        section=OPTIM,
    )  # fmt: skip

    def check_length(self) -> None:
        """Exactly one of ``--steps`` and ``--epochs`` (checked when a run starts: a config
        file or ``--print-config`` may leave both unset)."""
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of --steps and --epochs")

    def total_steps(self, steps_per_epoch: int | None) -> int:
        """The run's length in optimizer steps (``--epochs``: times the loader's steps per
        epoch, which it reports with its first batch)."""
        if self.steps is not None:
            return self.steps
        if not steps_per_epoch:
            raise ValueError("--epochs needs the loader's steps per epoch, which it did not report")
        if self.epochs is None:
            raise ValueError("give exactly one of --steps and --epochs")
        return self.epochs * steps_per_epoch

    def peak_lr(self) -> float:
        """``--lr``, or the optimizer's own (``RATES``)."""
        return RATES[self.optimizer] if self.lr is None else self.lr

    def warmup_steps(self, total: int) -> int:
        """``--warmup`` in steps: below 1 a fraction of ``total``, else a count."""
        return round(self.warmup * total) if self.warmup < 1 else int(self.warmup)


@dataclass(frozen=True, kw_only=True)
class LoaderSection(Options):
    """The loader spec a run asks for (the daemon's configured spec supplies the rest)."""

    # The loader spec's fields a trainer sets often: their help and choices are the spec's
    # own (loader_server.wire.spec); unset, the daemon's configured spec decides.
    grad_accum: int | None = opt(None, spec_help("grad_accum"), section=SPEC, at_least=1)
    token_budget: int | None = opt(None, spec_help("token_budget"), section=SPEC, at_least=1)
    max_batch_size: int | None = opt(None, spec_help("max_batch_size"), section=SPEC, at_least=1)
    max_seq_len: int | None = opt(None, spec_help("max_seq_len"), section=SPEC, at_least=1)
    layout: str | None = opt(
        None, spec_help("layout"), choices=spec_choices("layout"), section=SPEC
    )
    spec_pairs: tuple[str, ...] = opt(
        (),
        "Other loader spec fields KEY=VALUE (JSON values), e.g. seed=3 or "
        "buckets=[770,1216]. Fields not given come from the daemon's configured spec.",
        flag="--spec",
        show_default=False,
        section=SPEC,
    )
    cost_profile: Path | None = opt(
        None,
        "Ask the loader to cut and balance micro-batches by this cost profile (from "
        "`dflash-train calibrate`); --spec fields given too win.",
        path={"exists": True, "dir_okay": False},
        section=SPEC,
    )


@dataclass(frozen=True, kw_only=True)
class EvaluationSection(Options):
    """tau during training: the held-out prompts and the public sets, and how often."""

    eval_every: int = opt(
        0, "Measure tau every N steps; 0: at the start and end.", section=EVAL, at_least=0
    )
    eval_prompts: Path | None = opt(
        None, "Held-out prompts (JSONL of {\"prompt\": [ids]}: tokenize/regen --holdout).",
        path={"exists": True}, section=EVAL,
    )  # fmt: skip
    num_eval_prompts: int = opt(16, "Prompts tau is measured on.", section=EVAL, at_least=0)
    eval_new_tokens: int = opt(
        64, "Tokens generated per prompt when measuring tau.", section=EVAL, at_least=1
    )
    eval_sets: tuple[str, ...] = opt(
        (),
        "Prompt sets tau is also measured on at every evaluation, NAME=PATH (gsm8k, "
        "math500, mbpp, mt-bench, alpaca... or a label of yours: the format is detected) or "
        "humaneval (built in), comma-separated or repeated; records get tau/NAME and "
        "tau_pooled/NAME. Each set's first --eval-set-limit prompts, rendered with the target "
        "folder's tokenizer and chat template; multi-turn sets (MT-Bench): the first turn only.",
        show_default=False,
        section=EVAL,
        before=(),
    )
    eval_set_limit: int = opt(
        32, "Prompts of each --eval-sets set (its first N).", section=EVAL, at_least=1, before=32
    )
    eval_thinking: str = opt(
        "off", "The chat template's enable_thinking for --eval-sets prompts.",
        choices=("off", "on"), section=EVAL,
        before="off",
    )  # fmt: skip
    eval_batch: int = opt(
        16,
        "Prompts per verification forward when measuring tau (a rank's share of the held-out "
        "prompts and of each set runs in batches of N): memory grows with N x the longest.",
        section=EVAL,
        at_least=1,
        before=16,
    )


@dataclass(frozen=True, kw_only=True)
class OutputSection(Options):
    """What a run writes: checkpoints, progress, dashboards, timings, the profile."""

    ckpt_every: int = opt(0, "Checkpoint every N steps; 0: at the end.", section=EVAL, at_least=0)
    keep_checkpoints: int = opt(3, "Newest checkpoints kept.", section=EVAL, at_least=1)
    no_progress: bool = opt(False, "No progress bar.", section=EVAL)
    log_every_s: float = opt(
        60.0,
        "Without a terminal (systemd's journal, a log file), or with --no-progress: one "
        "progress line every N seconds (step, loss, tau, tokens/s, ETA); 0: none.",
        section=EVAL,
        at_least=0,
        before=60.0,
    )
    report_to: tuple[str, ...] = opt(
        (),
        "Dashboards, comma-separated or repeated: tensorboard (RUN_DIR/tensorboard), wandb "
        "(offline, RUN_DIR/wandb), mlflow (RUN_DIR/mlruns unless MLFLOW_TRACKING_URI); "
        "rank 0 logs each step's metrics and the options. One that fails is dropped, warned.",
        show_default=False,
        section=EVAL,
        before=(),
    )
    cost_samples: int = opt(
        2000,
        "Micro-batches per rank whose compute time is recorded in RUN_DIR/costs for "
        "`dflash-train calibrate` (after 2 warm-up steps; synchronizes CUDA while recording). "
        "0: off.",
        section=EVAL,
        at_least=0,
    )
    profile_step: int = opt(
        0,
        "Profile optimizer step N with torch.profiler: RUN_DIR/profile.json gets each "
        "phase's time and share of the step, the step's FLOPs and MFU (trainer/train/"
        "profile.py); 0: off.",
        section=EVAL,
        at_least=0,
    )
    peak_tflops: float | None = opt(
        None,
        "The chip's dense bf16 peak for MFU [default: known GPUs by name; none on CPU].",
        section=EVAL,
        above=0,
    )

    @property
    def progress(self) -> bool:
        """A progress bar (or lines, off a terminal) on rank 0."""
        return not self.no_progress


@dataclass(frozen=True, kw_only=True)
class RunOptions(
    OutputSection, EvaluationSection, LoaderSection, OptimizerSection, LossSection,
    DrafterSection, EngineSection, TargetSection, JobSection,
):  # fmt: skip
    """Every ``dflash-train train`` option: all the sections. The command line's flags are
    made from these fields, so their defaults are the same by construction."""

    def __post_init__(self) -> None:
        """Types (``Options``), then every count and rate in range; errors name the flag."""
        super().__post_init__()
        if self.max_anchors and self.anchor_draw == "document":
            raise ValueError(
                f"--max-anchors {self.max_anchors} caps a micro-batch, so a document's blocks "
                "would depend on what shares its micro-batch: it goes with --anchor-draw "
                "micro-batch only; with the default per-document draw, --tokens-per-anchor "
                "bounds a micro-batch's blocks"
            )
        self._check_engine()

    def _check_engine(self) -> None:
        """The engine's options go together (``trainer.engine``): each refusal names them."""
        if not self.engine:
            given = [f for f in ("engine_url", "vllm_python", "engine_dir", "mooncake_master")
                     if getattr(self, f) is not None]  # fmt: skip
            if given:
                flag = "--" + given[0].replace("_", "-")
                raise ValueError(f"{flag} is an engine option: add --target-engine vllm")
            return
        why = f"--target-engine {self.target_engine}"
        if self.tiny:
            raise ValueError(
                f"{why} serves a model folder: save the tiny target with `dflash-train "
                "save-target DIR` and pass --target DIR"
            )
        if (self.engine_url is None) == (self.vllm_python is None):
            raise ValueError(
                f"{why} needs one of --engine-url (a server you run) and --vllm-python (a "
                "server this run starts)"
            )
        if self.engine_url is not None and not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--engine-url {self.engine_url!r}: give the server's URL, e.g. http://HOST:8000"
            )
        if self.target_shard != "none":
            raise ValueError(f"{why}: the trainer holds no decoder to shard (--target-shard)")
        if self.eval_prompts is not None or self.eval_sets:
            flag = "--eval-prompts" if self.eval_prompts is not None else "--eval-sets"
            raise ValueError(
                f"{flag}: tau is measured with the target's decoder, which runs in the engine "
                f"under {why}: measure an export with `dflash-train eval --engine vllm`"
            )

    @classmethod
    def read(cls, run_dir: Path) -> RunOptions:
        """The options a run was started with, from its ``config.json``."""
        path = Path(run_dir) / CONFIG_FILE
        record = read_json(path, "a run's config.json (JSON)")
        if not isinstance(record, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(record).__name__}")
        known = {f.name for f in fields(cls)} | set(RUN_FACTS) | set(renamed(cls))
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}")
        return cls.from_record(record, str(path))

    def dflash2_fields(self) -> dict[str, Any]:
        """The drafter config's variant and DFlash2 fields (``--drafter`` resolved); a
        DFlash2 flag given for a dflash drafter is refused, naming it."""
        given = {k: getattr(self, k) for k in DFLASH2_DEFAULTS if getattr(self, k) is not None}
        if self.drafter != "dflash2":
            named = sorted(
                [*given, *(["selector_alpha"] if self.selector_alpha is not None else [])]
            )
            if named:
                flag = "--" + named[0].replace("_", "-")
                raise ValueError(f"{flag} is a DFlash2 option: add --drafter dflash2")
            return {}
        return {"variant": "dflash2", **DFLASH2_DEFAULTS, **given}

    def write(self, requested_loader_spec: dict[str, Any], world_size: int) -> Path:
        """``run_dir/config.json``: these options and the run's facts."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = self.to_record()
        record.update(requested_loader_spec=requested_loader_spec, world_size=world_size)
        path = self.run_dir / CONFIG_FILE
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        return path
