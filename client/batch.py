"""``Batch``: one micro-batch of a rank, owned by the trainer.

The client copies each batch out of the shared-memory ring into private memory before
``next()`` returns (``client.ring.Ring.take``), so a batch is an ordinary set of CPU tensors:
it never changes while the trainer holds it (``list(loader)``, a batch kept for logging),
in-place writes work (``labels[mask == 0] = -100``, ``mask.mul_(w)``), and ``pickle`` or
``torch.save`` write only its own bytes. The copy is the size of the batch's real content
(rows x width, not the slot's capacity) and lands in pinned memory once CUDA is initialized
in the process, so ``batch.to("cuda", non_blocking=True)`` is a DMA; PyTorch's pinned-memory
cache keeps that block alive until the copy has run, even if the batch is dropped at once.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from loader_server.wire.layouts import PADDED, layout


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One micro-batch for this rank: private CPU tensors (pinned under CUDA).

    Padded: ``input_ids``/``loss_mask`` ``[B, L]``, ``lengths``/``sample_ids`` ``[B]``.
    Packed: ``input_ids``/``loss_mask``/``position_ids`` ``[1, T]``, ``cu_seqlens`` ``[n+1]``,
    ``lengths``/``sample_ids`` ``[n]``, ``max_seqlen``.

    The loader client and the trainer's own sources (``trainer.train.batches``) build this one
    type; the defaults describe a hand-built padded batch outside any plan.
    """

    input_ids: torch.Tensor  # int32
    loss_mask: torch.Tensor  # uint8, same shape
    lengths: torch.Tensor  # int32: per row (padded) or per document (packed)
    sample_ids: torch.Tensor  # int64
    position_ids: torch.Tensor | None = None  # packed only
    cu_seqlens: torch.Tensor | None = None  # packed only, int32 [n + 1]
    max_seqlen: int  # the longest row (padded) or document (packed)
    num_tokens: int  # real (unpadded) tokens: the sum of ``lengths``
    layout: str = PADDED.name  # a name of ``loader_server.wire.layouts``
    epoch: int = 0
    step: int = 0
    micro: int = 0
    bucket: int = 0
    steps_per_epoch: int = 0  # 0: not served from a plan
    leg: int = 0  # shape changes of its epoch before the plan it comes from (elastic resume)

    @property
    def packs(self) -> bool:
        """Its documents sit end to end in one row (its layout's fact): ``position_ids`` and
        ``cu_seqlens`` mark them; else a row each."""
        return layout(self.layout).packs

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.epoch, self.step, self.micro)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Every tensor on ``device`` (a CPU target returns the same tensors)."""
        dev = torch.device(device)
        return self._map(lambda t: t.to(dev, non_blocking=non_blocking))

    def clone(self) -> Batch:
        """A copy with tensors of its own (the batch itself is already private)."""
        return self._map(torch.Tensor.clone)

    def __reduce__(self) -> tuple[Callable[..., Batch], tuple[dict[str, Any]]]:
        """Pickle (and ``torch.save``) only this batch's bytes: its tensors share one buffer,
        which would otherwise be written whole, once per tensor."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in TENSOR_FIELDS:
            t = state[name]
            if t is not None and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                state[name] = t.clone()
        return (_rebuild, (state,))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        present = {k: getattr(self, k) for k in TENSOR_FIELDS}
        moved: dict[str, Any] = {k: fn(t) for k, t in present.items() if t is not None}
        return replace(self, **moved)


def _rebuild(state: dict[str, Any]) -> Batch:
    return Batch(**state)


def _tensor_fields(cls: type) -> tuple[str, ...]:
    """The fields declared as tensors (optional or not), read from the annotations, so a
    tensor field added to ``Batch`` is moved, cloned and pickled with the others."""
    hints = typing.get_type_hints(cls)
    return tuple(
        f.name
        for f in fields(cls)
        if torch.Tensor in (hints[f.name], *typing.get_args(hints[f.name]))
    )


TENSOR_FIELDS = _tensor_fields(Batch)
