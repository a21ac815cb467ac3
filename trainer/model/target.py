"""The frozen target model: a Hugging Face causal LM that supplies features and scores drafts.

``load_target("tiny")`` builds a small random-weight Qwen3 (4 layers, hidden 128, vocab 512)
from a fixed seed, so every rank and every process builds bit-identical weights without a
download; any other value is a local directory loaded offline (``local_files_only``).

The target runs in eval mode with gradients off. ``features`` returns the hidden states of
the chosen layers concatenated on the last axis (``hidden_states[id + 1]`` is the output of
layer ``id``), the conditioning a DFlash drafter is trained on. Forward hooks on those layers
capture them (no ``output_hidden_states`` copy of every layer); for training,
``train_features`` stops the decoder after the deepest chosen layer and never runs the LM
head. Training and verification share the capture, so the two can never disagree about
which activations a feature is.

The MASK token of a DFlash block is a real token id whose (frozen) embedding row the drafter
reads, as serving engines do: ``mask_token_id`` finds it in the target's config or
tokenizer by one rule (``tokenizer_mask_id``: the tokenizer's mask token or ``<|MASK|>``,
else the id ``add_special_tokens`` would give it when the embedding has that spare row:
151669 for a Qwen3 download). A tiny target saved with a tokenizer follows the same rule;
one without a tokenizer has no ids to avoid and reserves its last row.

Packed rows are split per document by the ``position_ids`` (they restart at 0 for every
document); the mask code of ``transformers`` only does this without a 2D attention mask and
without a cache, which is how ``features`` calls it (a test checks packed == per document),
and only from Transformers 4.54 with torch 2.6 (older ones let a packed row's documents
attend to each other, without a word): ``require_packed_rows`` probes the installed pair
once, before the first packed row, and refuses to go on where it does not split.
Under SDPA that split is a dense ``[T, T]`` mask: memory and attention work grow with the
square of the whole row, not of its documents. ``train_features(..., attention="flex")``
runs a packed row under Transformers' ``flex_attention`` instead, whose block mask skips
every tile between documents (the drafter's ``--attention`` rule: flex on CUDA, SDPA
elsewhere). Verification (padded rows, a cache) always runs under the model's own SDPA.

A target bigger than one GPU is loaded with its decoder layers sharded over the ranks
(``load_target(..., shard=sharder(device))``, ``trainer.model.sharding``): the same
``Target``, whose forwards every rank then runs together (``keep_pace``, ``lockstep``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.model.rope import scaling_from_config
from trainer.model.sharding import Lockstep, is_sharded, reset_after_stop, stopping_after
from trainer.model.weights import Shard, load_model, meta_model
from trainer.options import TINY, TargetOptions

if TYPE_CHECKING:  # transformers is imported where a model is built or loaded
    from transformers import (
        DynamicCache,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        Qwen3ForCausalLM,
    )

    from client.batch import Batch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TinyTargetSpec:
    """Shape of the random-weight Qwen3 built for ``--target tiny``."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_positions: int = 8192
    seed: int = 0
    # RoPE scaling in the config (e.g. YaRN: {"rope_type": "yarn", "factor": 8.0,
    # "original_max_position_embeddings": 8192}); None: plain RoPE
    rope_scaling: dict[str, Any] | None = None

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must divide by num_heads {self.num_heads}, "
                f"which must divide by num_kv_heads {self.num_kv_heads}"
            )


def build_tiny_model(
    spec: TinyTargetSpec, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Qwen3ForCausalLM:
    """A seeded random-weight ``Qwen3ForCausalLM`` (identical in every process on the same
    kind of device), built directly on ``device`` in ``dtype``: a Qwen3-8B shape is
    initialised on the GPU in seconds, never as a 32 GB fp32 copy in host memory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_positions,
        rope_scaling=None if spec.rope_scaling is None else dict(spec.rope_scaling),
        tie_word_embeddings=False,
        # An extra key the config keeps (its typed fields do not list it: transformers 5
        # declares them as a dataclass's, and mypy reads that as the whole signature).
        mask_token_id=spec.mask_token_id,  # type: ignore[call-arg]
    )
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(spec.seed)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    return model


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """``n`` target layers spread evenly from layer 1 to ``L - 3`` (Qwen3-8B: [1, 9, 17, 25,
    33]); small targets, where that rule repeats layers, get ``n`` distinct layers spread over
    ``[0, L - 2]`` instead (4 layers: [0, 1, 2])."""
    if num_layers < 1 or n < 1:
        raise ValueError(f"need num_layers >= 1 and n >= 1, got {num_layers}, {n}")
    hi = num_layers - 3
    if hi - 1 >= n - 1 and n > 1:
        return [round(1 + i * (hi - 1) / (n - 1)) for i in range(n)]
    top = max(num_layers - 2, 0)
    n = min(n, top + 1)
    if n == 1:
        return [top]
    return sorted({round(i * top / (n - 1)) for i in range(n)})


#: What a decoder layer returns: its hidden states (transformers 5), or a tuple that starts
#: with them (4.x).
LayerOutput = torch.Tensor | tuple[torch.Tensor, ...]


class _StopForward(Exception):
    """Raised by the deepest feature layer's hook: nothing after it is needed."""


class Target:
    """A frozen causal LM with access to its embedding, LM head and chosen-layer features."""

    def __init__(self, model: PreTrainedModel, layer_ids: list[int] | None = None) -> None:
        self.model: PreTrainedModel = model.eval().requires_grad_(False)
        self.base: nn.Module = model.base_model
        # A causal LM's input embedding and LM head (the code reads their ``weight``).
        self.embed_tokens = cast(nn.Embedding, model.get_input_embeddings())
        self.lm_head = cast(nn.Linear, model.get_output_embeddings())
        config: PretrainedConfig = model.config
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.config = config
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept either.
        params = inspect.signature(self.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.layers = cast(nn.ModuleList, self.base.layers)  # the decoder layers
        self.layer_ids = list(layer_ids) if layer_ids else default_layer_ids(self.num_layers)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for a {self.num_layers}-layer target")
        self.sharded = is_sharded(model)  # decoder layers over the ranks (FSDP2)
        self._lockstep: Lockstep | None = None  # inside ``lockstep()``

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def weights_module(self) -> nn.Module:
        """What identifies this target's weights (``trainer.run.weights_fingerprint``)."""
        return self.model

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.layer_ids)

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [R, T, n*H], last_hidden [R, T, H])`` for ``input_ids [R, T]``: the
        whole decoder stack (verification). With a ``cache`` (``new_cache()``) the ids
        continue the cached sequence, and the cache is extended in place.
        ``attention_mask [R, cached + T]`` (1: a real slot): the slots each row may attend
        to, for rows of different lengths in one batch (``trainer.model.speculate``)."""
        feats, out = self._run(
            input_ids, position_ids, cache, stop_early=False, mask=attention_mask
        )
        return feats, out.last_hidden_state

    def batch_features(self, batch: Batch, attention: str = "sdpa") -> torch.Tensor:
        """The features ``[R, T, n*H]`` a micro-batch is trained on: ``train_features`` of
        its ids (with its positions when packed). One entry point for every kind of target
        (``trainer.engine.target.EngineTarget`` hands out what an engine computed)."""
        positions = batch.position_ids if batch.packs else None
        return self.train_features(batch.input_ids, positions, attention)

    @torch.no_grad()
    def train_features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """Features ``[R, T, n*H]`` only: the decoder stops after the deepest chosen layer,
        and neither the other layers' hidden states nor the LM head are computed.
        A packed row (``position_ids`` given) runs under ``flex_attention`` (block-sparse
        over its documents) or, under SDPA, a document at a time (``_per_document``; the
        ranks of a sharded target in lockstep). Padded rows keep SDPA's causal kernel."""
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
        if position_ids is not None:
            require_packed_rows()
        kernel = "flex_attention" if attention == "flex" and position_ids is not None else None
        if kernel is None and position_ids is not None:
            with self.lockstep():
                return self._per_document(input_ids, position_ids)
        with self._attention(kernel):
            return self._run(input_ids, position_ids, None, stop_early=True)[0]

    def _per_document(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows' features, a forward per document (one starts where the positions stop
        counting up by one, Transformers' rule): each document exactly alone, at the cost of
        its squared length, not the row's (CPU: 2.7x faster, docs/BENCHMARKS.md "Against
        speculators"; Transformers' dense mask let a GPT-OSS target's documents mix)."""
        rows = []  # [1, T] in training; any number of rows alike
        for ids, pos in zip(input_ids, position_ids, strict=True):
            cut = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
            run = [self._run(ids[None, a:b], pos[None, a:b], None, stop_early=True)[0]
                   for a, b in itertools.pairwise([0, *cut, pos.numel()])]  # fmt: skip
            rows.append(torch.cat(run, dim=1))
        return torch.cat(rows, dim=0)

    @contextlib.contextmanager
    def _attention(self, kernel: str | None) -> Iterator[None]:
        """Inside, the model's attention layers run ``kernel`` (None: unchanged); on
        leaving, the model's own again."""
        own = self.config._attn_implementation
        if kernel is None or kernel == own:
            yield
            return
        self.model.set_attn_implementation(kernel)
        try:
            yield
        finally:
            self.model.set_attn_implementation(own)

    def keep_pace(self) -> None:
        """A sharded target's training forward over one token, for a rank whose micro-batch
        has nothing to train: it still joins the other ranks' all-gathers. A no-op
        unsharded."""
        if self.sharded:
            self._idle(True)

    @contextlib.contextmanager
    def lockstep(self) -> Iterator[None]:
        """Inside, ranks may run different numbers of forwards of a sharded target (the
        verifier: each rank its own prompts): each forward is announced to the others, and
        on leaving, this rank runs one-token forwards until every rank is done. A no-op
        unsharded or in a world of one."""
        if not self.sharded or self._lockstep is not None or not _distributed():
            yield
            return
        self._lockstep = Lockstep(self.device)
        try:
            yield
        except BaseException:
            self._lockstep = None  # no drain: the error is this rank's to report
            raise
        lock, self._lockstep = self._lockstep, None
        lock.drain(self._idle)

    def _idle(self, stop_early: bool) -> None:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._run(ids, None, None, stop_early=stop_early)

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: DynamicCache | None,
        *,
        stop_early: bool,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Rows are right-padded (causal attention keeps padding out of real positions) or
        packed (``position_ids`` restart at 0 per document). Forward hooks on the chosen
        decoder layers capture their outputs (``hidden_states[id + 1]``); the last layer's
        is normed, as ``output_hidden_states`` reports it."""
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)
        stop = stop_early and deepest < self.num_layers - 1
        if self._lockstep is not None:
            self._lockstep.announce(stop)
        handles = [
            self.layers[i].register_forward_hook(_capture(i, captured, deepest if stop else -1))
            for i in set(self.layer_ids)
        ]
        kwargs: dict[str, Any] = {} if cache is None else {self._cache_kwarg: cache}
        if mask is not None:
            kwargs["attention_mask"] = mask.long()
        out = None
        sharded_stop = self.sharded and stop
        try:
            with stopping_after(self.base, deepest) if sharded_stop else contextlib.nullcontext():
                out = self.base(
                    input_ids=input_ids.long(),
                    position_ids=None if position_ids is None else position_ids.long(),
                    use_cache=cache is not None,
                    **kwargs,
                )
        except _StopForward:
            if sharded_stop:
                reset_after_stop(self.base)
        finally:
            for h in handles:
                h.remove()
        last = self.num_layers - 1
        if last in captured:
            captured[last] = cast(nn.Module, self.base.norm)(captured[last])
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), out

    @staticmethod
    def new_cache() -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def crop_cache(cache: DynamicCache, keep: int) -> None:
        """Keep the first ``keep`` positions (a negative ``crop`` means the same in transformers
        4.x and 5.x, where a positive one changed meaning)."""
        remove = cache.get_seq_length() - keep
        if remove > 0:
            cache.crop(-remove)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(last_hidden)


def _capture(
    i: int, captured: dict[int, torch.Tensor], stop_at: int
) -> Callable[[nn.Module, tuple[Any, ...], LayerOutput], None]:
    """Layer ``i``'s forward hook: its output into ``captured``; after layer ``stop_at``
    the forward ends (``_StopForward``)."""

    def grab(module: nn.Module, args: tuple[Any, ...], output: LayerOutput) -> None:
        captured[i] = output[0] if isinstance(output, tuple) else output
        if i == stop_at:
            raise _StopForward

    return grab


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


@functools.cache
def packed_rows_split() -> bool:
    """Whether this install's Transformers splits a packed row into its documents by the
    position ids: two documents of a one-layer Qwen3 packed in one row, against the second
    alone (a few milliseconds, once; the global RNG is left as it was)."""
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3Model(cfg).eval()
    ids = torch.arange(1, 9)[None]
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[:, 4:]
        alone = model(input_ids=ids[:, 4:], use_cache=False).last_hidden_state
    return bool(torch.allclose(packed, alone, atol=1e-5))


def require_packed_rows() -> None:
    """ValueError unless packed rows' documents stay apart in the target's attention."""
    if not packed_rows_split():
        import transformers

        raise ValueError(
            f"this install's transformers {transformers.__version__} with torch "
            f"{torch.__version__} lets the documents of a packed row attend to each other "
            "(it splits rows by their position ids from transformers 4.54 with torch 2.6): "
            "upgrade both, or train padded rows (--layout padded)"
        )


def load_target(
    name: str,
    *,
    layer_ids: list[int] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    tiny: TinyTargetSpec | None = None,
    shard: Shard | None = None,
) -> Target:
    """``"tiny"`` (a seeded random Qwen3) or a local Hugging Face model directory (offline).
    ``shard`` (``trainer.model.sharding.sharder``): the decoder layers sharded over the
    ranks, a directory's read shard by shard (the tiny target is built whole first)."""
    model: PreTrainedModel
    if name == TINY:
        model = build_tiny_model(tiny or TinyTargetSpec(), device, dtype)
        if shard is not None:
            shard(model)
    else:
        model = load_model(_model_dir(name), device, dtype, shard=shard)  # (weights.py)
    # Both are built on their device in their dtype. Never ``.to(dtype)`` the model: that
    # casts buffers too, and a bf16 rotary ``inv_freq`` puts every position but the first
    # few off by whole radians at thousands of tokens (engines keep it in fp32).
    target = Target(model, layer_ids)
    log.info(
        "target %s: %d layers, hidden %d, vocab %d, features from layers %s",
        name,
        target.num_layers,
        target.hidden_size,
        target.vocab_size,
        target.layer_ids,
    )
    return target


def _model_dir(name: str) -> Path:
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--target {name!r} is neither 'tiny' nor a model directory (with config.json); "
            "nothing is downloaded at run time: fetch the model first, e.g. "
            "`huggingface-cli download Qwen/Qwen3-8B --local-dir DIR`, and pass DIR"
        )
    return path


def _tiny_spec(opts: TargetOptions) -> TinyTargetSpec:
    return TinyTargetSpec(
        vocab_size=opts.tiny_vocab,
        num_layers=opts.tiny_layers,
        hidden_size=opts.tiny_hidden,
        intermediate_size=opts.tiny_intermediate or 3 * opts.tiny_hidden,
        num_heads=opts.tiny_heads,
        num_kv_heads=opts.tiny_kv_heads,
        seed=opts.tiny_seed,
    )


def run_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a run's target is loaded in: bf16 on a GPU, fp32 on CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def target_from_options(
    opts: TargetOptions,
    device: torch.device | str,
    layer_ids: list[int] | None = None,
    shard: Shard | None = None,
) -> Target:
    """The target ``opts`` names (``--target``; ``tiny`` shaped by the ``--tiny-*`` options),
    its decoder layers sharded by ``shard`` if given."""
    return load_target(
        opts.target, layer_ids=layer_ids, device=device, dtype=run_dtype(device),
        tiny=_tiny_spec(opts), shard=shard,
    )  # fmt: skip


def meta_target(opts: TargetOptions, dtype: torch.dtype) -> PreTrainedModel:
    """The model ``opts`` names on the meta device (its shape and bytes, nothing loaded)."""
    if opts.tiny:
        return build_tiny_model(_tiny_spec(opts), "meta", dtype)
    return meta_model(_model_dir(opts.target), dtype)


def target_record(config: PretrainedConfig) -> dict[str, Any]:
    """What an export needs from the target's Hugging Face config (kept in checkpoint meta)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope = dict(rope or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return {
        "model_type": str(getattr(config, "model_type", "")),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "max_position_embeddings": int(config.max_position_embeddings),
        "rope_type": str(rope.get("rope_type", rope.get("type", "default"))),
        "rope_theta": None if theta is None else float(theta),
        # what the export writes into the drafter's rope_parameters (None: plain RoPE)
        "rope_scaling": scaling_from_config(config),
    }


MASK_TOKEN = "<|MASK|>"


def tokenizer_mask_id(tok: PreTrainedTokenizerBase, rows: int, where: str) -> int:
    """The MASK id a tokenizer gives a target with ``rows`` embedding rows, by one rule:
    the tokenizer's mask token, else ``<|MASK|>`` where its vocabulary has it, else the id
    ``tok.add_special_tokens({"mask_token": "<|MASK|>"})`` would give (``len(tok)``: what
    z-lab's README does for Qwen3, 151669) when the embedding has that spare row, said in
    the log; else a ValueError naming both sizes. ``where`` names the tokenizer."""
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    found = cast(int | None, tok.convert_tokens_to_ids(MASK_TOKEN))  # one token: one id
    if found is not None and found != tok.unk_token_id:
        return int(found)
    spare = len(tok)
    if spare < rows:
        log.info(
            "%s has no mask token or %s: MASK is id %d, the one add_special_tokens would "
            "give it (a spare row of the %d-row embedding; the exported drafter records it)",
            where, MASK_TOKEN, spare, rows,
        )  # fmt: skip
        return spare
    raise ValueError(
        f"{where} has no mask token or {MASK_TOKEN}, and its {len(tok)} tokens fill the "
        f"target's {rows}-row embedding (no spare row for one): pass --mask-token-id ID, a "
        "token id the data never uses"
    )


def mask_token_id(target: Target, source: str | None = None) -> int | None:
    """The target's MASK token id: ``mask_token_id`` or ``dflash_config.mask_token_id`` in
    its config, else the rule of ``tokenizer_mask_id`` applied to the tokenizer in
    ``source`` (a model directory). None when the config names none and there is no
    tokenizer."""
    cfg = target.config
    dflash = getattr(cfg, "dflash_config", None) or {}
    for value in (getattr(cfg, "mask_token_id", None), dflash.get("mask_token_id")):
        if value is not None:
            return int(value)
    if source is None or not any(
        (Path(source) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    rows = int(target.embed_tokens.weight.shape[0])
    return tokenizer_mask_id(tok, rows, f"the tokenizer in {source}")


def adopt_tokenizer(model: PreTrainedModel, tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """Make a (tiny) target and a tokenizer one checkpoint: the tokenizer's EOS, PAD and
    MASK ids (``tokenizer_mask_id``: the same rule as for any target) go into the model's
    config and generation config. Returns the tokenizer (to save next to the weights).
    Refuses a vocabulary larger than the embedding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    rows = int(cast(nn.Embedding, model.get_input_embeddings()).weight.shape[0])
    if len(tok) > rows:
        raise ValueError(
            f"tokenizer {tokenizer_dir} has {len(tok)} tokens, the target's embedding {rows} rows"
        )
    ids = {
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "mask_token_id": tokenizer_mask_id(tok, rows, f"tokenizer {tokenizer_dir}"),
    }
    for key, value in ids.items():
        setattr(model.config, key, value)
        if key != "mask_token_id":
            setattr(model.generation_config, key, value)
    return tok
