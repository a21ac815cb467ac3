"""Micro-batches as the trainer sees them, what it consumes them from, and an in-process
batch source for tests.

The trainer consumes ``client.Batch``, the type ``client.LoaderClient`` yields:
``input_ids``/``loss_mask`` ``[B, L]`` right-padded rows (``layout="padded"``) or one packed
row ``[1, T]`` with ``position_ids`` and ``cu_seqlens`` (``layout="packed"``), plus the
position ``(epoch, step, micro)``. ``BatchSource`` is what the training loop asks of its
source; ``pad_batch``/``pack_batch`` build batches by hand and ``ListSource`` serves them from
a list of samples with the client's iterator/state API, so the loop can be tested without a
daemon.

"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

import torch

from client.batch import Batch
from loader_server.wire.layouts import PACKED, PADDED
from loader_server.wire.layouts import layout as layout_of

__all__ = ["PAD_ID", "Batch", "BatchSource", "ListSource", "pack_batch", "pad_batch"]

PAD_ID = 0
_SOURCE_STATE_VERSION = 1


@runtime_checkable
class BatchSource(Protocol):
    """What the training loop consumes (``client.LoaderClient``, ``ListSource``).

    Iterating yields the micro-batches in plan order; ``state_dict`` is where to resume (kept
    in each rank's checkpoint) and ``load_state_dict`` goes back there. ``steps_per_epoch``
    (known once the first batch is served) turns ``--epochs`` into steps; ``effective_spec``
    is the batch spec actually served (None before the first batch, or when unknown).
    """

    @property
    def steps_per_epoch(self) -> int | None: ...

    @property
    def effective_spec(self) -> dict[str, Any] | None: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Position(TypedDict, total=False):
    """``Batch``'s int fields a hand-built batch may set (``pad_batch(..., step=3)``)."""

    epoch: int
    step: int
    micro: int
    bucket: int
    steps_per_epoch: int


def pad_batch(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    sample_ids: Sequence[int] | None = None,
    **position: Unpack[Position],
) -> Batch:
    """A padded batch from ``(input_ids, loss_mask)`` pairs (right padding with ``PAD_ID``);
    ``sample_ids``: the samples' ids in the corpus (default 0, 1, ...: a document's anchors
    follow its id); ``position``: ``Batch``'s int fields (``epoch=``, ``step=``, ...). No
    samples: ``[0, 0]``, as the daemon serves an empty micro-batch of a short last step."""
    lengths = [len(ids) for ids, _ in samples]
    width = max(lengths, default=0)
    ids = torch.full((len(samples), width), PAD_ID, dtype=torch.int32)
    mask = torch.zeros((len(samples), width), dtype=torch.uint8)
    for r, (s_ids, s_mask) in enumerate(samples):
        ids[r, : len(s_ids)] = torch.as_tensor(s_ids, dtype=torch.int32)
        mask[r, : len(s_mask)] = torch.as_tensor(s_mask, dtype=torch.uint8)
    return Batch(
        input_ids=ids,
        loss_mask=mask,
        lengths=torch.tensor(lengths, dtype=torch.int32),
        sample_ids=_ids(sample_ids, len(samples)),
        max_seqlen=width,
        num_tokens=sum(lengths),
        **position,
    )


def pack_batch(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    sample_ids: Sequence[int] | None = None,
    **position: Unpack[Position],
) -> Batch:
    """A packed batch: one row of concatenated documents with per-document positions (no
    samples: ``[1, 0]``); ``sample_ids`` as in ``pad_batch``."""
    lengths = [len(ids) for ids, _ in samples]
    none = torch.zeros(0, dtype=torch.int32)
    ids = torch.cat([none, *(torch.as_tensor(s, dtype=torch.int32) for s, _ in samples)])[None]
    mask = torch.cat([none.byte(), *(torch.as_tensor(m, dtype=torch.uint8) for _, m in samples)])
    mask = mask[None]
    pos = torch.cat([none, *(torch.arange(n, dtype=torch.int32) for n in lengths)])[None]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return Batch(
        input_ids=ids,
        loss_mask=mask,
        lengths=torch.tensor(lengths, dtype=torch.int32),
        sample_ids=_ids(sample_ids, len(samples)),
        max_seqlen=max(lengths, default=0),
        num_tokens=sum(lengths),
        layout=PACKED.name,
        position_ids=pos,
        cu_seqlens=cu,
        **position,
    )


def _ids(sample_ids: Sequence[int] | None, n: int) -> torch.Tensor:
    if sample_ids is None:
        return torch.arange(n, dtype=torch.int64)
    if len(sample_ids) != n:
        raise ValueError(f"{len(sample_ids)} sample ids for {n} samples")
    return torch.as_tensor(list(sample_ids), dtype=torch.int64)


class ListSource:
    """An in-process stand-in for ``LoaderClient``: fixed samples, fixed batches, every epoch.

    Samples are cut in order into micro-batches of ``rows`` samples; a step is
    ``grad_accum`` consecutive micro-batches (incomplete tail steps are dropped). The
    position (next micro-batch to serve) is all the state there is, so resuming is exact.
    """

    def __init__(
        self,
        samples: Sequence[tuple[Sequence[int], Sequence[int]]],
        *,
        rows: int,
        grad_accum: int = 1,
        layout: str = PADDED.name,
        epochs: int | None = None,
    ) -> None:
        if rows < 1 or grad_accum < 1:
            raise ValueError(f"rows and grad_accum must be >= 1, got {rows}, {grad_accum}")
        make = pack_batch if layout_of(layout).packs else pad_batch
        starts = range(0, len(samples) - rows + 1, rows)
        self.steps_per_epoch = len(starts) // grad_accum
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(samples)} samples make no full step of {grad_accum}x{rows}")
        spe = self.steps_per_epoch
        self._micro_batches = [
            (make(samples[i : i + rows], sample_ids=range(i, i + rows), steps_per_epoch=spe),
             s, m)
            for s in range(spe)
            for m in range(grad_accum)
            for i in [starts[s * grad_accum + m]]
        ]  # fmt: skip
        self.epochs = epochs
        # What a LoaderClient reports after its session opens (the spec it is served).
        self.effective_spec: dict[str, Any] = {"grad_accum": grad_accum, "layout": layout}
        self.position = 0  # micro-batches served so far, over all epochs

    def __iter__(self) -> Iterator[Batch]:
        per_epoch = len(self._micro_batches)
        while self.epochs is None or self.position < self.epochs * per_epoch:
            epoch, k = divmod(self.position, per_epoch)
            batch, step, micro = self._micro_batches[k]
            self.position += 1
            yield replace(batch, epoch=epoch, step=step, micro=micro)

    def state_dict(self) -> dict[str, Any]:
        return {"version": _SOURCE_STATE_VERSION, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _SOURCE_STATE_VERSION:
            raise ValueError(f"ListSource state version {state.get('version')} is not supported")
        self.position = int(state["position"])

    def close(self) -> None:
        pass
