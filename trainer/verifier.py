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

tau = committed tokens / steps. Output equals the target's plain greedy decoding token for
token (greedy speculative decoding is lossless; a test checks it), so tau measures speed
only. Temperature 0 only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trainer.drafter import DFlashDrafter, block_attention_mask
from trainer.target import Target


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
        b = self.drafter.config.block_size
        device = ctx.device
        anchor_pos = committed.numel() - 1
        if ctx.shape[0] != anchor_pos:
            raise ValueError(f"context has {ctx.shape[0]} positions, anchor is at {anchor_pos}")
        emb = self.target.embed_tokens(committed[-1:].view(1, 1))
        block_pos = torch.arange(anchor_pos, anchor_pos + b, device=device)[None]
        ctx_pos = torch.arange(anchor_pos, device=device)[None]
        anchor = torch.tensor([[anchor_pos]], device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)
        mask = block_attention_mask(anchor, valid, anchor_pos, b)
        hidden = self.drafter(emb, ctx[None], block_pos, ctx_pos, mask)
        return self.target.lm_head(hidden[0, 1:].to(self.target.lm_head.weight.dtype))

    def propose(self, committed: torch.Tensor, ctx: torch.Tensor, num: int) -> torch.Tensor:
        b = self.drafter.config.block_size
        if num != b - 1:
            raise ValueError(f"a block of {b} drafts {b - 1} tokens, asked for {num}")
        return self.logits(committed, ctx).argmax(-1)


@dataclass
class SpecResult:
    tokens: torch.Tensor  # the generated tokens (exactly max_new_tokens)
    steps: int  # draft-verify steps (the prefill's first token is not a step)
    committed: int  # tokens committed by those steps

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
) -> SpecResult:
    """Greedy speculative decoding of ``max_new_tokens`` tokens after ``prompt [P]`` (P >= 1)."""
    if prompt.numel() < 1 or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    device = target.device
    prompt = prompt.to(device, torch.long)
    cache = target.new_cache()
    feats, last = target.features(prompt[None], cache=cache)
    ctx = feats[0]
    committed = torch.cat([prompt, target.logits(last[0, -1:]).argmax(-1)])
    steps = total = 0
    while committed.numel() - prompt.numel() < max_new_tokens:
        drafts = proposer.propose(committed, ctx, block_size - 1).to(device, torch.long)
        start = committed.numel() - 1
        block = torch.cat([committed[-1:], drafts])
        pos = torch.arange(start, start + block_size, device=device)[None]
        feats, last = target.features(block[None], pos, cache=cache)
        greedy = target.logits(last[0]).argmax(-1)
        j = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        committed = torch.cat([committed, drafts[:j], greedy[j : j + 1]])
        ctx = torch.cat([ctx, feats[0, : j + 1]])
        target.crop_cache(cache, committed.numel() - 1)
        steps += 1
        total += j + 1
    new = committed[prompt.numel() : prompt.numel() + max_new_tokens]
    return SpecResult(tokens=new, steps=steps, committed=total)


@torch.no_grad()
def greedy_generate(target: Target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with a KV cache (the reference speculative decoding must match)."""
    device = target.device
    ids = prompt.to(device, torch.long)
    cache = target.new_cache()
    _, last = target.features(ids[None], cache=cache)
    out = []
    for _ in range(max_new_tokens):
        nxt = target.logits(last[0, -1:]).argmax(-1)
        out.append(nxt)
        pos = torch.tensor([[ids.numel() + len(out) - 1]], device=device)
        _, last = target.features(nxt[None], pos, cache=cache)
    return torch.cat(out)


@dataclass
class TauReport:
    committed: int
    steps: int

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


def evaluate_tau(
    target: Target,
    proposer: Proposer,
    prompts: Sequence[torch.Tensor],
    *,
    block_size: int,
    max_new_tokens: int,
) -> TauReport:
    """Committed tokens and steps summed over ``prompts`` (tau = committed / steps)."""
    committed = steps = 0
    for p in prompts:
        r = speculative_generate(
            target, proposer, p, block_size=block_size, max_new_tokens=max_new_tokens
        )
        committed += r.committed
        steps += r.steps
    return TauReport(committed=committed, steps=steps)
