"""DFlash2: DFlash with a dynamic grouped convolution around each sublayer and a candidate
selector over the LM head's top-K tokens, as vLLM (``qwen3_dflash2.py``, its DFlash2
speculator) serves it and vllm-project/speculators (``models/dflash2``) trains it.

**Convolution.** Each drafter layer wraps its attention and its MLP in a
``GroupedConv``: one projection of the sublayer's input gives, per token, ``2 x T x G``
coefficients (``T = conv_kernel_size`` taps, ``G = H / conv_group_size`` channel groups).
``prepare`` convolves the input with ``base_kernel[0] + delta[0]``, ``finish`` the
sublayer's output with ``base_kernel[1] + delta[1]``; tap ``t`` reads the token ``t``
places earlier in the same block (none before the block's first slot). Initialised to the
identity (tap 0 = 1, projection 0), so a fresh DFlash2 drafter computes what DFlash does.

**Unary logits.** ``softcap(output_multiplier x lm_head(h))``, ``softcap(x) =
c tanh(x / c)`` when ``final_logit_softcapping`` is set (vLLM's candidate logits
processor: scale, then cap). Block inputs are embedded times ``input_embedding_scale``.

**Selector.** For each drafted slot ``l`` the unary top-K tokens are candidates; an edge
from the candidate ``p`` chosen at ``l - 1`` (the anchor at the first slot) to candidate
``c`` at ``l`` scores ``unary[l, c] + <P[pred] * W h_l, S[c]>`` with two ``[V, R]``
codebooks ``P``, ``S`` and ``W: H -> R``. Drafting is the greedy walk: at each slot the
best edge from the token chosen before (vLLM's ``_selector_walk_kernel`` at temperature
0); verification stays plain greedy (accept while the target agrees).

**Training** (speculators' ``compute_metrics``): the unary cross-entropy of DFlash, plus
``selector_alpha`` times a K-way cross-entropy over the unary top-K teacher-forced on the
true previous token, with the true token put in place of the K-th candidate where the
top-K misses it; both weighted ``exp(-(k-1)/gamma)`` by block offset (and by the loss
mask). Gradients reach the drafter through both terms (the candidates' unary scores are
part of the selector's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("dflash", "dflash2")


def grouped_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``x [R, H]`` (blocks of ``block_size`` rows, back to back) convolved within each
    block: ``out[r] = sum_t (base[t] + delta[r, t, group]) * x[r - t]`` over the taps ``t``
    with ``r - t`` in ``r``'s block. ``delta [R, T, G]``, ``base [T, H]``."""
    rows, hidden = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    # fp32 sums, as vLLM's kernel accumulates them (the result in x's dtype)
    blocks = x.float().view(rows, groups, hidden // groups)
    coefficients = base.float().view(1, taps, groups, hidden // groups) + delta.float()[..., None]
    out = coefficients[:, 0] * blocks
    slot = torch.arange(rows, device=x.device) % block_size
    for tap in range(1, taps):
        shifted = F.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
        out = out + coefficients[:, tap] * shifted * (slot >= tap).view(-1, 1, 1)
    return out.view(rows, hidden).to(x.dtype)


class GroupedConv(nn.Module):
    """The input- and output-side convolutions of one sublayer (vLLM's DFlashGroupedConv,
    speculators' GroupedDynamicCausalConv: same parameter names and shapes)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.block_size = taps, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        with torch.no_grad():  # the identity: DFlash's layer, exactly
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's convolved input and the output side's coefficients."""
        c = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        return grouped_conv(x, c[:, 0], self.base_kernel[0], self.block_size), c[:, 1]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y, coefficients, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """Low-rank predecessor x hidden x successor scores of the unary top-K candidates."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for w in (self.predecessor_codebook, self.successor_codebook):
            nn.init.normal_(w, std=0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def transitions(
        self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """``[N, K]`` scores of ``candidates [N, K]`` after ``predecessors [N]``, in fp32
        (a product and a sum, not a matmul: autocast would run that in bf16)."""
        context = self.predecessor_codebook[predecessors].float() * self._project(hidden)
        return (context[:, None, :] * self.successor_codebook[candidates].float()).sum(-1)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``W h`` in fp32 (the projection is a matmul: autocast off for it)."""
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), self.hidden_projection.weight.float())

    def edges(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchor: int
    ) -> torch.Tensor:
        """``[L, K, K]`` edge scores of one block's ``L`` slots: ``[l, p, c]`` from the
        ``p``-th candidate of slot ``l - 1`` (the anchor at ``l = 0``) to the ``c``-th of
        ``l``; ``unary [L, K]`` are the candidates' unary logits (vLLM's ``_score_edges``)."""
        k = candidates.shape[1]
        pred = torch.cat([candidates.new_full((1, k), anchor), candidates[:-1]])
        context = self.predecessor_codebook[pred].float() * self._project(hidden)[:, None]
        succ = self.successor_codebook[candidates].float()  # [L, K, R]
        return unary[:, None, :].float() + (context[:, :, None] * succ[:, None]).sum(-1)


def softcap_logits(z: torch.Tensor, multiplier: float, cap: float | None) -> torch.Tensor:
    """``cap * tanh(multiplier * z / cap)`` (or ``multiplier * z`` without a cap)."""
    if multiplier != 1.0:
        z = z * multiplier
    if cap:
        z = torch.tanh(z / cap) * cap
    return z


def walk(edges: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The greedy path through ``edges [L, K, K]``: at each slot the best edge from the
    candidate taken before (the anchor's row at the first slot); ``[L]`` token ids."""
    prev, out = 0, []
    for slot in range(edges.shape[0]):
        prev = int(edges[slot, prev].argmax())
        out.append(candidates[slot, prev])
    return torch.stack(out)


def training_candidates(
    candidates: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unary top-K ``candidates [N, K]`` with the label put in the last place where it
    is missing; the label's place ``[N]``; whether the top-K held it ``[N]``."""
    match = candidates == labels[:, None]
    found = match.any(-1)
    last = candidates.shape[1] - 1
    place = torch.where(found, match.long().argmax(-1), torch.full_like(labels, last))
    out = candidates.clone()
    out[:, last] = torch.where(found, out[:, last], labels)
    return out, place, found
