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

Generation stops after ``max_new_tokens`` tokens or at the first end-of-sequence token
(``eos_token_ids``, see ``eos_ids``): a step whose committed tokens contain an EOS commits
up to and including the first one and is the last step; it counts, with only the tokens it
committed up to the EOS. If the prefill's own first token is EOS there are no steps at all.
The last step may commit tokens past ``max_new_tokens``: they count (as in z-lab's
benchmark) but are cut from the output.

Output equals the target's plain greedy decoding (``greedy_generate`` with the same EOS ids)
token for token (greedy speculative decoding is lossless; a test checks it), so tau measures
speed only. Temperature 0 only.

Two statistics of the acceptance length (``TauReport``):

* ``tau`` -- the reference statistic, the one z-lab's DFlash benchmark reports ("Average
  Acceptance length") and so the one to compare with published numbers: the mean over
  prompts of each prompt's own tau (its committed tokens / its steps). Every prompt weighs
  the same, however many steps it took. A prompt with no steps (EOS as the very first
  token) has no tau and contributes nothing to it (neither to the sum nor to the count).
* ``tau_pooled`` -- committed tokens / steps, both summed over all prompts: the mean over
  steps, so long generations weigh more. The two differ unless every prompt has the same
  tau.

``TauReport`` keeps sums only (``committed``, ``steps``, ``prompt_tau_sum``, ``prompts``), so
ranks can all-reduce them and compute either statistic from the totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

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
        """Logits ``[B-1, V]`` for the tokens after the anchor ``committed[-1]``."""
        anchor_pos = committed.numel() - 1
        if ctx.shape[0] != anchor_pos:
            raise ValueError(f"context has {ctx.shape[0]} positions, anchor is at {anchor_pos}")
        blocks = DraftBlocks.one_document(ctx[None], [anchor_pos], committed[-1:])
        hidden = self.drafter(self.target.embed_tokens, blocks, "sdpa")
        return self.target.lm_head(hidden[1:].to(self.target.lm_head.weight.dtype))

    def propose(self, committed: torch.Tensor, ctx: torch.Tensor, num: int) -> torch.Tensor:
        b = self.drafter.config.block_size
        if num != b - 1:
            raise ValueError(f"a block of {b} drafts {b - 1} tokens, asked for {num}")
        return self.logits(committed, ctx).argmax(-1)


def eos_ids(config: PretrainedConfig | GenerationConfig | None) -> tuple[int, ...]:
    """The end-of-sequence ids of a Hugging Face config's ``eos_token_id`` (an int, a list of
    ints or None/absent; a ``GenerationConfig`` works too), in order, without duplicates."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(dict.fromkeys(int(e) for e in eos))


def _first_eos(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> int | None:
    """Index of the first token of ``tokens [n]`` in ``eos_token_ids``, or None."""
    if not eos_token_ids:
        return None
    eos = torch.as_tensor(list(eos_token_ids), dtype=tokens.dtype, device=tokens.device)
    hits = torch.isin(tokens, eos).nonzero()
    return int(hits[0, 0]) if hits.numel() else None


@dataclass
class SpecResult:
    tokens: torch.Tensor  # the generated tokens: max_new_tokens, or fewer when ending at EOS
    steps: int  # draft-verify steps (the prefill's first token is not a step)
    committed: int  # tokens committed by those steps (== sum(acceptance_lengths))
    # Tokens committed by each step (j + 1, or fewer for a step cut at EOS); len == steps.
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


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
    (P >= 1), ending after the first token in ``eos_token_ids`` (which is kept)."""
    if prompt.numel() < 1 or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    device = target.device
    prompt = prompt.to(device, torch.long)
    cache = target.new_cache()
    feats, last = target.features(prompt[None], cache=cache)
    ctx = feats[0]
    committed = torch.cat([prompt, target.logits(last[0, -1:]).argmax(-1)])
    lengths: list[int] = []
    done = _first_eos(committed[-1:], eos_token_ids) is not None
    while not done and committed.numel() - prompt.numel() < max_new_tokens:
        drafts = proposer.propose(committed, ctx, block_size - 1).to(device, torch.long)
        start = committed.numel() - 1
        block = torch.cat([committed[-1:], drafts])
        pos = torch.arange(start, start + block_size, device=device)[None]
        feats, last = target.features(block[None], pos, cache=cache)
        greedy = target.logits(last[0]).argmax(-1)
        j = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        new = torch.cat([drafts[:j], greedy[j : j + 1]])
        stop = _first_eos(new, eos_token_ids)
        if stop is not None:
            new, done = new[: stop + 1], True
        committed = torch.cat([committed, new])
        lengths.append(new.numel())
        if not done:
            ctx = torch.cat([ctx, feats[0, : j + 1]])
            target.crop_cache(cache, committed.numel() - 1)
    out = committed[prompt.numel() : prompt.numel() + max_new_tokens]
    return SpecResult(
        tokens=out, steps=len(lengths), committed=sum(lengths), acceptance_lengths=lengths
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
    """Sums over prompts (all-reducible across ranks); see the module docstring."""

    committed: int  # committed tokens, summed over prompts
    steps: int  # draft-verify steps, summed over prompts
    prompt_tau_sum: float = 0.0  # sum of each prompt's committed / steps (prompts with steps)
    prompts: int = 0  # prompts with at least one step (those in prompt_tau_sum)

    @property
    def tau(self) -> float:
        """The reference statistic (z-lab's benchmark): mean over prompts of per-prompt tau."""
        return self.prompt_tau_sum / self.prompts if self.prompts else 0.0

    @property
    def tau_pooled(self) -> float:
        """Committed tokens / steps over all prompts together (the mean over steps)."""
        return self.committed / self.steps if self.steps else 0.0


def evaluate_tau(
    target: Target,
    proposer: Proposer,
    prompts: Sequence[torch.Tensor],
    *,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> TauReport:
    """Speculative decoding of every prompt; both tau statistics' sums over ``prompts``."""
    rep = TauReport(committed=0, steps=0)
    for p in prompts:
        r = speculative_generate(
            target,
            proposer,
            p,
            block_size=block_size,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
        )
        rep.committed += r.committed
        rep.steps += r.steps
        if r.steps:
            rep.prompt_tau_sum += r.tau
            rep.prompts += 1
    return rep
