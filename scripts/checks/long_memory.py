"""Per-rank memory of a training step on long documents, term by term: the formula that
docs/GUIDE.md ("Long context") evaluates at the Qwen3-8B shape, that
``benchmarks/bench_trainer_memory.py --long`` checks against a CPU measurement at
``LONG_SHAPE`` and the GPU check's ``long_context`` stage against a GPU one.

For ``S`` tokens in the micro-batch (one document of ``S``: the case long context is
about), a target of hidden ``H``, MLP ``I``, ``L`` decoder layers run (up to the deepest
feature layer: the forward stops there), ``n`` feature layers, KV width ``kv`` (KV heads x
head_dim), vocabulary ``V``; a drafter of ``P_d`` parameters and ``L_d`` layers; ``A``
anchors (``min(anchors_per_doc, ceil((S - B + 1) / tokens_per_anchor))``), block ``B``, head
chunk ``c`` slots; ``w`` bytes per target weight, ``a`` per activation (2 in bf16 on a
GPU, 4 on CPU):

* resident: the target's weights ``P_t w`` and the drafter's state ``16 P_d`` (fp32
  weights, gradients, AdamW's two moments);
* target forward (no grad, one layer's temporaries at a time): ``S (3 I + 2 H) a`` (the
  MLP's gate, up and product, the residual and its norm), while the captured feature
  layers accumulate: ``S n H a``;
* features kept for the drafter: ``S n H a``; the concatenation copies them once, so the
  target phase peaks at ``2 S n H a`` when it ends;
* drafter context, kept for backward (the projection ``fc`` and its norm, then per layer the
  context keys, normed and rotated, and values), and the fp32 gradients through its norm
  in backward: ``S (3 H a + 12 H + L_d kv (6 a + 4))`` (the norms compute in fp32);
* the drafter's blocks, one chunk of ``c`` slots at a time (recomputed in backward): small
  next to the above, except that SDPA (CPU) regroups a chunk's context keys and values per
  document and repeats them to every query head, ``2 S H a`` (flex attention on a GPU
  reads them in place; neither materialises the scores);
* the head: one ``[c, V]`` fp32 buffer and the drafter's outputs kept for it and their
  gradient, ``2 A (B - 1) H a``;
* under bf16 autocast (a GPU), autocast's bf16 copy of the drafter's weights: ``2 P_d``.

peak = resident + max(target phase, drafter phase).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A target, its drafter and the trainer's anchor and chunk settings."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    feature_layers: tuple[int, ...]
    drafter_layers: int = 1
    block: int = 16
    anchors_per_doc: int = 512
    tokens_per_anchor: int = 32
    loss_chunk: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One Qwen3 decoder layer: attention, MLP, norms."""
        h, q = self.hidden, self.heads * self.head_dim
        return 2 * h * q + 2 * h * self.kv + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    @property
    def target_params(self) -> int:
        return 2 * self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden

    @property
    def drafter_params(self) -> int:
        n, h = len(self.feature_layers), self.hidden
        return n * h * h + self.drafter_layers * self.layer_params() + 2 * h


QWEN3_8B = Shape(
    vocab=151_936, hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12_288,
    feature_layers=(1, 9, 17, 25, 33),
)  # fmt: skip
#: Qwen3-8B's proportions scaled down for a CPU measurement: 4:1 heads, MLP 3x, 5 feature
#: layers, the forward stopping two layers before the last.
LONG_SHAPE = Shape(
    vocab=32_000, hidden=256, layers=8, heads=4, kv_heads=1, intermediate=768,
    feature_layers=(1, 2, 3, 4, 5), tokens_per_anchor=1,  # 512 anchors from 4K tokens up
)  # fmt: skip


def memory_terms(
    shape: Shape, seq: int, *, weight_bytes: int, act_bytes: int, attention: str, docs: int = 1
) -> dict[str, float]:
    """Bytes of each term (module docstring) for a micro-batch of ``seq`` tokens in
    ``docs`` documents of equal length (one row each), with ``resident`` and ``peak``.
    ``act_bytes`` 2: the drafter runs under bf16 autocast, which also keeps a bf16 copy of
    its weights for the step (``2 P_d``)."""
    s, a, h = float(seq), act_bytes, shape.hidden
    n, kv = len(shape.feature_layers), shape.kv
    per_doc = seq // docs
    cands = max(per_doc - shape.block + 1, 0)
    anchors = docs * min(shape.anchors_per_doc, -(-cands // shape.tokens_per_anchor))
    slots = anchors * (shape.block - 1)
    c = min(shape.loss_chunk, slots) if shape.loss_chunk else slots
    terms = {
        "target weights": float(shape.target_params * weight_bytes),
        "drafter state": float(16 * shape.drafter_params),
        "target forward": s * (3 * shape.intermediate + 2 * h) * a,
        "features": s * n * h * a,
        "drafter context": s * (3 * h * a + 12 * h + shape.drafter_layers * kv * (6 * a + 4)),
        "chunk attention": 2 * s * h * a if attention == "sdpa" else 0.0,
        "head": float(c * shape.vocab * 4 + 2 * slots * h * a),
        "autocast copy": float(2 * shape.drafter_params) if act_bytes == 2 else 0.0,
    }
    resident = terms["target weights"] + terms["drafter state"]
    target_phase = max(terms["target forward"] + terms["features"], 2 * terms["features"])
    drafter_phase = terms["features"] + terms["drafter context"]
    drafter_phase += terms["chunk attention"] + terms["head"] + terms["autocast copy"]
    return {**terms, "resident": resident, "peak": resident + max(target_phase, drafter_phase)}
