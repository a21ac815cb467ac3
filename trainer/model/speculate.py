"""Batched speculative decoding: many prompts per verification forward, greedy or sampled.

The same steps as the reference verifier (``trainer.model.verifier``: z-lab's
``dflash_generate``, its acceptance lengths, vLLM's served steps), for ``R`` prompts at once:

* **one target forward per step for all rows.** The rows share one KV cache; a row's slots
  are the positions it committed, and an attention mask ``[R, slots]`` keeps out what is not
  its own: the left padding of the prefill, and the slots of drafts a row rejected while
  another row accepted more. After a step the cache is cut back to the longest row's
  commit; the holes left in the others are squeezed out (a gather) when they pass a quarter
  of the cache, and at every step for a target with sliding-window layers, whose window
  counts slots. Each row has its own position ids, so the mask is the only difference from
  decoding it alone.
* **one drafter forward per step for all rows**, over a cached context: the drafter's keys
  and values of every committed position (``DFlashDrafter.context_kv``) are computed once,
  when the position is committed, not again at every step.
* **rows leave when done** (their steps follow z-lab's loop exactly, see the reference), and
  the batch shrinks with them.

Acceptance (``accept``):

* greedy (temperature 0): the longest prefix of drafts equal to the target's argmax, then the
  target's own token;
* sampled (``Sampling(temperature=T, top_p, top_k)``): as vLLM's rejection sampler treats a
  drafter whose drafts are greedy (their probabilities one-hot): draft ``d_k`` is accepted
  with the target's probability ``p_k(d_k)`` (after temperature, top-k, top-p); at the first
  rejection the next token is drawn from ``p_k`` with ``d_k`` removed (renormalised); when
  every draft is accepted, the bonus token is drawn from ``p_B``. The output is then
  distributed exactly as plain sampling from the target (a test checks the frequencies). Each
  prompt draws from its own generator, seeded by ``(seed, prompt key)``: a prompt's output
  does not depend on which prompts share its batch.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trainer.model.dflash2 import softcap_logits, walk
from trainer.model.drafter import ContextKV, DFlashDrafter, DraftBlocks, plan_chunks
from trainer.model.target import Target
from trainer.model.verifier import SpecResult, first_eos

if TYPE_CHECKING:
    from transformers import DynamicCache

#: Squeeze a cache's holes out when they are more than this share of its slots.
HOLES_SHARE = 0.25


@dataclass(frozen=True)
class Sampling:
    """Decoding: greedy at temperature 0, else sampled (vLLM's order: temperature, then
    top-k, then top-p). ``seed`` keys every prompt's generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling): no top-k
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1 (0 or -1: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, key: int) -> torch.Generator | None:
        """The generator of prompt ``key`` (None when greedy: nothing is drawn)."""
        if self.greedy:
            return None
        digest = hashlib.blake2b(struct.pack("<2q", self.seed, key), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The target's sampling distribution ``[..., V]`` (float32) of ``logits [..., V]``."""
    x = logits.float() / s.temperature
    if s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if s.top_p < 1:
        srt, order = x.sort(dim=-1, descending=True)
        p = srt.softmax(-1)
        # drop a token when the tokens before it already hold top_p (the first is kept)
        drop = (p.cumsum(-1) - p) >= s.top_p
        x = x.scatter(-1, order, srt.masked_fill(drop, -math.inf))
    return x.softmax(-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [R, V]`` by inverse CDF at ``u [R]`` in [0, 1)."""
    cdf = probs.cumsum(-1)
    hit = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype), right=True)
    return hit.squeeze(-1).clamp_max(probs.shape[-1] - 1)


def accept(
    drafts: torch.Tensor, logits: torch.Tensor, s: Sampling, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(j [R], next [R])``: accepted drafts and the token after them, for ``drafts
    [R, B-1]`` and the target's ``logits [R, B, V]`` at ``[anchor, d_1..d_{B-1}]``.
    Sampled: ``u [R, B]`` uniforms (``B-1`` for the drafts, one for the next token)."""
    if s.greedy:
        greedy = logits.argmax(-1)
        j = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)
        return j, greedy.gather(1, j[:, None]).squeeze(1)
    if u is None:
        raise ValueError("sampled acceptance needs the uniforms")
    probs = probabilities(logits, s)
    b = logits.shape[1]
    p_draft = probs[:, :-1].gather(2, drafts[:, :, None]).squeeze(2)
    j = (u[:, :-1].to(p_draft.dtype) < p_draft).long().cumprod(1).sum(1)
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    dist = probs[rows, j].clone()
    rejected = j < b - 1
    removed = drafts.gather(1, j.clamp_max(b - 2)[:, None]).squeeze(1)
    dist[rows[rejected], removed[rejected]] = 0.0  # the residual (p - one-hot)+
    return j, draw(dist, u[:, -1])


@dataclass
class _Row:
    """One prompt in flight: its tokens, its results, and its place in the batch's cache."""

    key: int
    prompt_len: int
    committed: torch.Tensor  # prompt + output so far (the last token is the anchor)
    gen: torch.Generator | None
    kv: list[list[torch.Tensor]]  # per drafter layer: [keys, values] of its context
    lengths: list[int] = field(default_factory=list)
    useful: list[int] = field(default_factory=list)
    served: int | None = None
    eos_at: int | None = None


class _Batch:
    """The rows in flight and the target cache they share (its mask and their positions)."""

    def __init__(self, target: Target, rows: list[_Row], cache: DynamicCache, valid: torch.Tensor):
        self.target, self.rows, self.cache, self.valid = target, rows, cache, valid
        self.sliding = any(getattr(layer, "is_sliding", False) for layer in cache.layers)

    def step_target(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over ``block [R, B]`` after every row's committed positions."""
        r, b = block.shape
        start = torch.tensor([row.committed.numel() - 1 for row in self.rows])
        pos = (start[:, None] + torch.arange(b)).to(block.device)
        mask = torch.cat([self.valid, self.valid.new_ones(r, b)], 1)
        feats, last = self.target.features(block, pos, cache=self.cache, attention_mask=mask)
        self.valid = mask
        return feats, last

    def settle(self, kept: torch.Tensor, b: int) -> None:
        """After a step: each row keeps its first ``kept[r]`` block slots; the cache is cut
        to the longest, and squeezed when its holes pass ``HOLES_SHARE``."""
        n = self.valid.shape[1]
        slot = torch.arange(b, device=kept.device)
        self.valid[:, n - b :] = slot[None] < kept[:, None].to(self.valid.device)
        keep = n - b + int(kept.max())
        self.valid = self.valid[:, :keep]
        Target.crop_cache(self.cache, keep)
        holes = int((~self.valid).sum()) / max(self.valid.numel(), 1)
        if self.sliding or holes > HOLES_SHARE:
            self.select(torch.arange(len(self.rows)))

    def select(self, which: torch.Tensor) -> None:
        """Keep rows ``which`` and squeeze their cache: each row's slots right-aligned, in
        order, with left padding only."""
        valid = self.valid[which.to(self.valid.device)]
        width = int(valid.sum(1).max()) if valid.numel() else 0
        order = torch.sort(valid.int(), dim=1, stable=True).indices[:, valid.shape[1] - width :]
        self.valid = valid.gather(1, order)
        rows_dev = which.to(self.valid.device)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                idx = order.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                setattr(layer, name, t[rows_dev.to(t.device)].gather(2, idx))
        self.rows = [self.rows[i] for i in which.tolist()]


class BatchedVerifier:
    """Speculative decoding of many prompts with ``drafter`` drafting for ``target``."""

    def __init__(
        self, target: Target, drafter: DFlashDrafter, *, max_new_tokens: int,
        eos_token_ids: Sequence[int] = (), sampling: Sampling | None = None,
    ) -> None:  # fmt: skip
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.target, self.drafter = target, drafter
        self.block_size = drafter.config.block_size
        self.max_new_tokens, self.eos = max_new_tokens, tuple(eos_token_ids)
        self.sampling = sampling or Sampling()

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[torch.Tensor], keys: Sequence[int] | None = None
    ) -> list[SpecResult]:
        """One ``SpecResult`` per prompt (in order), all decoded in one batch; ``keys`` seed
        each prompt's generator when sampling (default: its index)."""
        if not prompts:
            return []
        if any(p.numel() < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        keys = list(range(len(prompts))) if keys is None else list(keys)
        batch = self._prefill(prompts, keys)
        done: dict[int, SpecResult] = {}
        while batch.rows:
            self._retire(batch, done)
            if batch.rows:
                self._step(batch)
        return [done[k] for k in keys]

    def _prefill(self, prompts: Sequence[torch.Tensor], keys: list[int]) -> _Batch:
        device, width = self.target.device, max(p.numel() for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        for r, p in enumerate(prompts):
            ids[r, width - p.numel() :] = p.to(device, torch.long)
            valid[r, width - p.numel() :] = True
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)
        cache = self.target.new_cache()
        feats, last = self.target.features(ids, pos, cache=cache, attention_mask=valid)
        gens = [self.sampling.generator(k) for k in keys]
        first = self._first_tokens(last[:, -1], gens)
        rows = []
        for r, (p, key) in enumerate(zip(prompts, keys, strict=True)):
            n = p.numel()
            ctx = feats[r, width - n :]
            tokens = torch.cat([p.to(device, torch.long), first[r : r + 1]])
            row = _Row(key, n, tokens, gens[r], self._kv(ctx, 0))
            if first_eos(first[r : r + 1], self.eos) is not None:
                row.eos_at = 0
            rows.append(row)
        return _Batch(self.target, rows, cache, valid)

    def _first_tokens(self, last: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
        """The prefill's token of every row: the target's argmax, or its draw."""
        logits = self.target.logits(last)
        if self.sampling.greedy:
            return logits.argmax(-1)
        u = torch.cat([torch.rand(1, generator=g) for g in gens]).to(logits.device)
        return draw(probabilities(logits, self.sampling), u)

    def _kv(self, feats: torch.Tensor, start: int) -> list[list[torch.Tensor]]:
        pos = torch.arange(start, start + feats.shape[0], device=feats.device)
        return [[k, v] for k, v in self.drafter.context_kv(feats, pos)]

    def _retire(self, batch: _Batch, done: dict[int, SpecResult]) -> None:
        """Rows whose loop ends here (z-lab's, see the reference verifier) leave the batch."""
        keep = []
        for i, row in enumerate(batch.rows):
            generated = row.committed.numel() - row.prompt_len
            if row.served is None and (row.eos_at is not None or generated >= self.max_new_tokens):
                row.served = len(row.lengths)
            if generated > self.max_new_tokens or (row.eos_at is not None and row.lengths):
                done[row.key] = self._result(row)
            else:
                keep.append(i)
        if len(keep) < len(batch.rows):
            batch.select(torch.tensor(keep, dtype=torch.long))

    def _result(self, row: _Row) -> SpecResult:
        assert row.served is not None
        end = (
            self.max_new_tokens if row.eos_at is None else min(self.max_new_tokens, row.eos_at + 1)
        )
        out = row.committed[row.prompt_len : row.prompt_len + end]
        committed = sum(row.useful[: row.served])
        return SpecResult(out, row.lengths, served_steps=row.served, committed=committed)

    def _step(self, batch: _Batch) -> None:
        b, rows = self.block_size, batch.rows
        anchors = torch.stack([row.committed[-1] for row in rows])
        drafts = self._propose(rows, anchors)
        block = torch.cat([anchors[:, None], drafts], 1)
        feats, last = batch.step_target(block)
        logits = self.target.logits(last)
        u = None
        if not self.sampling.greedy:
            u = torch.stack([torch.rand(b, generator=row.gen) for row in rows]).to(logits.device)
        j, nxt = accept(drafts, logits, self.sampling, u)
        kept = (j + 1).tolist()
        # the drafter's context keys and values of every row's newly committed positions
        # (the anchor and the accepted drafts), in one call for all rows
        start = torch.tensor([row.committed.numel() - 1 for row in rows])
        slot = torch.cat([torch.arange(n) for n in kept])
        at = torch.arange(len(rows)).repeat_interleave(torch.tensor(kept))
        new_kv = self.drafter.context_kv(feats[at, slot], (start[at] + slot).to(feats.device))
        for r, row in enumerate(rows):
            jr = kept[r] - 1
            self._commit(row, torch.cat([drafts[r, :jr], nxt[r : r + 1]]))
        for i, (k, v) in enumerate(new_kv):
            for row, k_r, v_r in zip(rows, k.split(kept, 2), v.split(kept, 2), strict=True):
                row.kv[i][0] = torch.cat([row.kv[i][0], k_r], 2)
                row.kv[i][1] = torch.cat([row.kv[i][1], v_r], 2)
        batch.settle(j + 1, b)

    def _commit(self, row: _Row, new: torch.Tensor) -> None:
        generated = row.committed.numel() - row.prompt_len
        row.lengths.append(new.numel())  # j + 1: the whole step, even past an EOS in it
        stop = first_eos(new, self.eos) if row.eos_at is None else None
        row.useful.append(
            0 if row.eos_at is not None else new.numel() if stop is None else stop + 1
        )
        if stop is not None:
            row.eos_at = generated + stop
        row.committed = torch.cat([row.committed, new])

    def _propose(self, rows: list[_Row], anchors: torch.Tensor) -> torch.Tensor:
        """Every row's ``B-1`` drafts ``[R, B-1]`` in one drafter forward."""
        b, device = self.block_size, anchors.device
        lens = [row.committed.numel() - 1 for row in rows]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        n_layers = len(rows[0].kv)
        ctx_kv: ContextKV = [
            (
                torch.cat([row.kv[i][0] for row in rows], 2),
                torch.cat([row.kv[i][1] for row in rows], 2),
            )
            for i in range(n_layers)
        ]
        lens_t = torch.tensor(lens, device=device)
        doc = torch.arange(len(rows), device=device).repeat_interleave(lens_t)
        pos = torch.arange(int(lens_t.sum()), device=device) - torch.tensor(
            starts, device=device
        ).repeat_interleave(lens_t)
        empty = torch.empty(0, device=device, dtype=torch.long)
        blocks = DraftBlocks(
            feats=torch.empty(0, device=device), ctx_row=empty, ctx_col=empty, ctx_doc=doc,
            ctx_pos=pos, blk_doc=torch.arange(len(rows), device=device), blk_anchor=lens_t,
            anchor_ids=anchors, chunks=plan_chunks(list(range(len(rows))), lens, starts, 0),
        )  # fmt: skip
        hidden = self.drafter(self.target.embed_tokens, blocks, "sdpa", ctx_kv=ctx_kv)
        hidden = hidden.view(len(rows), b, -1)[:, 1:]
        logits = self.target.lm_head(hidden.to(self.target.lm_head.weight.dtype))
        selector = self.drafter.candidate_selector
        if selector is None:
            return logits.argmax(-1)
        cfg = self.drafter.config
        logits = softcap_logits(logits.float(), cfg.output_multiplier, cfg.final_logit_softcapping)
        out = []
        for r in range(len(rows)):  # DFlash2: the greedy walk over the selector's edges
            unary, cands = logits[r].topk(selector.top_k, dim=-1)
            out.append(walk(selector.edges(hidden[r], unary, cands, int(anchors[r])), cands))
        return torch.stack(out)
