"""Speculative decoding with the target as verifier: the acceptance length tau.

State after the prompt's prefill: the committed tokens end with the target's own next token
(the *anchor*); the target's features are known for every committed position before it
(they live in its KV cache and in ``ctx``). One step:

1. the proposer drafts ``B-1`` tokens ``d_1..d_{B-1}`` after the anchor (a DFlash drafter
   does it in one forward pass over ``[anchor, MASK x (B-1)]`` and the context features);
2. the target scores ``[anchor, d_1..d_{B-1}]`` in one forward pass on top of its cache and
   gives its greedy token ``g_k`` for every position ``anchor + k`` (k = 1..B);
3. ``j`` = length of the prefix where ``d_k == g_k``; the step commits ``d_1..d_j`` and the
   target's ``g_{j+1}``, i.e. ``j + 1`` tokens (1 when every draft token is wrong, ``B`` when
   all are right); ``g_{j+1}`` is the next anchor and the cache is cut back to the
   positions before it.

Which steps run, and what each counts, follow z-lab's ``dflash_generate`` (``dflash/model.py``
of z-lab's dflash repository, whose per-step ``acceptance_lengths`` its benchmark averages):

* every step's **acceptance length** is ``j + 1``, the whole step, even when the output ends
  inside it: at an end-of-sequence token (``eos_token_ids``, see ``eos_ids``) among the
  accepted drafts, or past ``max_new_tokens``;
* the first step always runs, even when the prefill's own first token is an EOS;
* another step runs while at most ``max_new_tokens`` tokens are out, so a step that lands
  exactly on ``max_new_tokens`` is followed by one more (z-lab's ``while start <
  max_length``), and none runs after a step that put an EOS in the output.

The output is cut after the first EOS and at ``max_new_tokens``, and equals the target's plain
greedy decoding (``greedy_generate`` with the same EOS ids) token for token (greedy
speculative decoding is lossless; a test checks it), so tau measures speed only. Temperature
0 only.

A serving engine stops a request as soon as it is finished: vLLM runs no step after an EOS
or once ``max_new_tokens`` tokens are out, so not z-lab's extra step (when the prefill's
token is an EOS, none at all), and counts each step it runs as z-lab does (its
``spec_decode_num_accepted_tokens`` adds ``j`` a step, before the output is cut). Those
leading steps are ``SpecResult.served_steps``.

The statistics (``TauReport``; ``SpecResult`` has the per-prompt ones):

* ``tau`` -- the reference statistic, the one z-lab's DFlash benchmark reports ("Average
  Acceptance length") and so the one to compare with published numbers: the mean over
  prompts of each prompt's own tau (the mean of its acceptance lengths). Every prompt weighs
  the same, however many steps it took.
* ``tau_pooled`` -- acceptance lengths / steps, both summed over all prompts: the mean over
  steps (the mean of z-lab's histogram), so long generations weigh more. The two differ
  unless every prompt has the same tau.
* ``tau_served`` -- the pooled mean over the served steps only: vLLM's mean acceptance length
  ``1 + num_accepted_tokens / num_drafts`` on the same prompts (``make serve-check``
  compares the two).
* ``tau_committed`` -- output tokens (up to and including the first EOS; a last step's
  tokens past ``max_new_tokens`` count) per served step: what ``tau_pooled`` was before
  the statistics followed z-lab.

``TauReport`` keeps sums only (``TauReport.FIELDS``), so ranks can all-reduce them
(``sums``, ``from_sums``) and compute any statistic from the totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from trainer.model.dflash2 import softcap_logits, walk
from trainer.model.drafter import DFlashDrafter, DraftBlocks
from trainer.model.target import Target

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig


class Proposer(Protocol):
    def propose(self, committed: torch.Tensor, ctx: torch.Tensor, num: int) -> torch.Tensor:
        """``num`` draft tokens after ``committed [n]`` (whose last token is the anchor);
        ``ctx [n-1, n_layers*H]`` are the target's features of the positions before it."""
        ...


class DrafterProposer:
    """Drafts a block with a DFlash drafter in one forward pass."""

    def __init__(self, target: Target, drafter: DFlashDrafter) -> None:
        self.target, self.drafter = target, drafter

    @torch.no_grad()
    def logits(self, committed: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B-1, V]`` for the tokens after the anchor ``committed[-1]`` (DFlash2:
        the unary ones, before the selector)."""
        return self._draft(committed, ctx)[1]

    def _draft(
        self, committed: torch.Tensor, ctx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted slots' hidden states ``[B-1, H]`` and their (unary) logits."""
        anchor_pos = committed.numel() - 1
        if ctx.shape[0] != anchor_pos:
            raise ValueError(f"context has {ctx.shape[0]} positions, anchor is at {anchor_pos}")
        blocks = DraftBlocks.one_document(ctx[None], [anchor_pos], committed[-1:])
        hidden = self.drafter(self.target.embed_tokens, blocks, "sdpa")[1:]
        logits = self.target.lm_head(hidden.to(self.target.lm_head.weight.dtype))
        cfg = self.drafter.config
        if self.drafter.candidate_selector is not None:
            logits = softcap_logits(
                logits.float(), cfg.output_multiplier, cfg.final_logit_softcapping
            )
        return hidden, logits

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, ctx: torch.Tensor, num: int) -> torch.Tensor:
        b = self.drafter.config.block_size
        if num != b - 1:
            raise ValueError(f"a block of {b} drafts {b - 1} tokens, asked for {num}")
        hidden, logits = self._draft(committed, ctx)
        selector = self.drafter.candidate_selector
        if selector is None:
            return logits.argmax(-1)
        # DFlash2: the greedy walk over the selector's edges between the unary top-K.
        unary, cands = logits.topk(selector.top_k, dim=-1)
        return walk(selector.edges(hidden, unary, cands, int(committed[-1])), cands)


def eos_ids(config: PretrainedConfig | GenerationConfig | None) -> tuple[int, ...]:
    """The end-of-sequence ids of a Hugging Face config's ``eos_token_id`` (an int, a list of
    ints or None/absent; a ``GenerationConfig`` works too), in order, without duplicates."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(dict.fromkeys(int(e) for e in eos))


def first_eos(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> int | None:
    """Index of the first token of ``tokens [n]`` in ``eos_token_ids``, or None."""
    if not eos_token_ids:
        return None
    eos = torch.as_tensor(list(eos_token_ids), dtype=tokens.dtype, device=tokens.device)
    hits = torch.isin(tokens, eos).nonzero()
    return int(hits[0, 0]) if hits.numel() else None


@dataclass
class SpecResult:
    tokens: torch.Tensor  # the generated tokens: max_new_tokens, or fewer when ending at EOS
    # z-lab's acceptance length of every draft-verify step (j + 1, see the module docstring);
    # the prefill's first token is not a step.
    acceptance_lengths: list[int] = field(default_factory=list)
    served_steps: int = 0  # the leading steps a serving engine (vLLM) also runs
    committed: int = 0  # tokens the served steps put in the output, up to the first EOS

    @property
    def steps(self) -> int:
        """Draft-verify steps, z-lab's count (== len(acceptance_lengths))."""
        return len(self.acceptance_lengths)

    @property
    def accepted(self) -> int:
        """Sum of the acceptance lengths (z-lab's)."""
        return sum(self.acceptance_lengths)

    @property
    def served_accepted(self) -> int:
        """Sum of the served steps' acceptance lengths (vLLM's counters, plus one a step)."""
        return sum(self.acceptance_lengths[: self.served_steps])

    @property
    def tau(self) -> float:
        """This prompt's tau as z-lab counts it: the mean of its acceptance lengths."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tau_served(self) -> float:
        """Acceptance length over the served steps (what vLLM's counters give)."""
        return self.served_accepted / self.served_steps if self.served_steps else 0.0

    @property
    def tau_committed(self) -> float:
        """Output tokens per served step (tokens past the first EOS not counted)."""
        return self.committed / self.served_steps if self.served_steps else 0.0


@torch.no_grad()
def speculative_generate(
    target: Target,
    proposer: Proposer,
    prompt: torch.Tensor,
    *,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> SpecResult:
    """Greedy speculative decoding of up to ``max_new_tokens`` tokens after ``prompt [P]``
    (P >= 1), ending after the first token in ``eos_token_ids`` (which is kept). The steps
    are z-lab's ``dflash_generate``'s (see the module docstring)."""
    if prompt.numel() < 1 or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    device = target.device
    prompt = prompt.to(device, torch.long)
    cache = target.new_cache()
    feats, last = target.features(prompt[None], cache=cache)
    ctx = feats[0]
    committed = torch.cat([prompt, target.logits(last[0, -1:]).argmax(-1)])
    lengths: list[int] = []
    served: int | None = None  # steps run when a serving engine stopped
    useful: list[int] = []  # each step's output tokens, up to the first EOS
    eos_at = 0 if first_eos(committed[-1:], eos_token_ids) is not None else None
    while True:
        generated = committed.numel() - prompt.numel()
        if served is None and (eos_at is not None or generated >= max_new_tokens):
            served = len(lengths)  # vLLM: a finished request gets no more steps
        # z-lab: `while start < max_length`, i.e. another step while at most max_new_tokens
        # tokens are out (one lands on it exactly: one more step), and a break after any
        # step that leaves a stop token in the output: so the first step always runs.
        if generated > max_new_tokens or (eos_at is not None and lengths):
            break
        drafts = proposer.propose(committed, ctx, block_size - 1).to(device, torch.long)
        start = committed.numel() - 1
        block = torch.cat([committed[-1:], drafts])
        pos = torch.arange(start, start + block_size, device=device)[None]
        feats, last = target.features(block[None], pos, cache=cache)
        greedy = target.logits(last[0]).argmax(-1)
        j = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        new = torch.cat([drafts[:j], greedy[j : j + 1]])
        lengths.append(j + 1)  # the whole step, even past an EOS in it (z-lab, vLLM)
        stop = first_eos(new, eos_token_ids) if eos_at is None else None
        useful.append(0 if eos_at is not None else new.numel() if stop is None else stop + 1)
        if stop is not None:
            eos_at = generated + stop
        committed = torch.cat([committed, new])
        ctx = torch.cat([ctx, feats[0, : j + 1]])
        target.crop_cache(cache, committed.numel() - 1)
    assert served is not None  # set on the iteration that breaks, if not before
    end = max_new_tokens if eos_at is None else min(max_new_tokens, eos_at + 1)
    out = committed[prompt.numel() : prompt.numel() + end]
    return SpecResult(
        tokens=out, acceptance_lengths=lengths, served_steps=served, committed=sum(useful[:served])
    )


@torch.no_grad()
def greedy_generate(
    target: Target,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Plain greedy decoding with a KV cache (the reference speculative decoding must match):
    ``max_new_tokens`` tokens, or fewer ending with the first token in ``eos_token_ids``."""
    device = target.device
    ids = prompt.to(device, torch.long)
    eos = set(int(e) for e in eos_token_ids)
    cache = target.new_cache()
    _, last = target.features(ids[None], cache=cache)
    out = []
    for k in range(max_new_tokens):
        nxt = target.logits(last[0, -1:]).argmax(-1)
        out.append(nxt)
        if int(nxt) in eos or k == max_new_tokens - 1:
            break
        pos = torch.tensor([[ids.numel() + len(out) - 1]], device=device)
        _, last = target.features(nxt[None], pos, cache=cache)
    return torch.cat(out)


@dataclass
class TauReport:
    """Sums over prompts (all-reducible across ranks: ``sums``/``from_sums``); see the
    module docstring for the statistics."""

    accepted: int = 0  # acceptance lengths (z-lab's), summed over steps and prompts
    steps: int = 0  # draft-verify steps (z-lab's), summed over prompts
    prompt_tau_sum: float = 0.0  # sum of each prompt's tau (prompts with steps)
    prompts: int = 0  # prompts with at least one step (those in prompt_tau_sum)
    served_accepted: int = 0  # acceptance lengths of the steps vLLM also runs
    served_steps: int = 0  # those steps
    committed: int = 0  # output tokens of those steps, up to the first EOS

    FIELDS = (
        "accepted",
        "steps",
        "prompt_tau_sum",
        "prompts",
        "served_accepted",
        "served_steps",
        "committed",
    )

    def add(self, r: SpecResult) -> None:
        """Count one prompt's result."""
        self.accepted += r.accepted
        self.steps += r.steps
        if r.steps:
            self.prompt_tau_sum += r.tau
            self.prompts += 1
        self.served_accepted += r.served_accepted
        self.served_steps += r.served_steps
        self.committed += r.committed

    def sums(self) -> list[float]:
        """The fields in ``FIELDS`` order (one tensor to all-reduce)."""
        return [float(getattr(self, f)) for f in self.FIELDS]

    @classmethod
    def from_sums(cls, sums: Sequence[float]) -> TauReport:
        """The report of ``sums`` (e.g. all-reduced ``sums()``)."""
        values = dict(zip(cls.FIELDS, sums, strict=True))
        rep = cls(**{f: round(v) for f, v in values.items() if f != "prompt_tau_sum"})
        rep.prompt_tau_sum = float(values["prompt_tau_sum"])
        return rep

    @property
    def tau(self) -> float:
        """The reference statistic (z-lab's benchmark): mean over prompts of per-prompt tau."""
        return self.prompt_tau_sum / self.prompts if self.prompts else 0.0

    @property
    def tau_pooled(self) -> float:
        """Acceptance lengths over all prompts' steps together (the mean over steps)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tau_served(self) -> float:
        """vLLM's mean acceptance length, ``1 + num_accepted_tokens / num_drafts``, over the
        same prompts: the pooled mean over the steps a serving engine runs."""
        return self.served_accepted / self.served_steps if self.served_steps else 0.0

    @property
    def tau_committed(self) -> float:
        """Output tokens per served step (the statistic ``tau`` was before z-lab's)."""
        return self.committed / self.served_steps if self.served_steps else 0.0

    def metrics(self) -> dict[str, float]:
        """The four statistics by name (``tau``, ``tau_pooled``, ``tau_served``,
        ``tau_committed``)."""
        names = ("tau", "tau_pooled", "tau_served", "tau_committed")
        return {n: getattr(self, n) for n in names}


def evaluate_tau(
    target: Target,
    proposer: Proposer,
    prompts: Sequence[torch.Tensor],
    *,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> TauReport:
    """Speculative decoding of every prompt; the statistics' sums over ``prompts``."""
    rep = TauReport()
    for p in prompts:
        rep.add(
            speculative_generate(
                target,
                proposer,
                p,
                block_size=block_size,
                max_new_tokens=max_new_tokens,
                eos_token_ids=eos_token_ids,
            )
        )
    return rep
