"""A batch's features assembled from its documents' engine states (pure): the chosen
columns of each document's ``[T_d, m, H]`` concatenated on the last axis, laid where the
document lies in the batch's rows. Which columns are ours is the engine's numbering
(``trainer.engine.seam.Layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.model.doc_view import DocView
from trainer.train.batches import Batch
from trainer.vllm.connector.dflash_states_wire import decode


@dataclass(frozen=True)
class Scaled:
    """A document's states as fp8 travels them (``--states-dtype fp8``): ``values [T, m, H]``
    and one float32 scale per token and layer, ``scales [T, m]``; widened only as they are
    laid into the batch's features (``trainer.vllm.connector.dflash_states_wire``)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype


#: A document's states as the client hands them out.
States = torch.Tensor | Scaled


def assemble(
    batch: Batch, states: list[States], columns: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The features ``[R, W, n*H]`` of ``batch`` (its ``input_ids``' shape), from each
    document's engine states ``[T_d, m, H]`` (or ``Scaled``) in the batch's document order
    (``DocView``): the chosen ``columns`` concatenated on the last axis, in ``dtype``;
    padding is zero."""
    docs = DocView.of(batch)
    if len(states) != len(docs):
        raise ValueError(f"{len(states)} documents' states for a batch of {len(docs)}")
    rows, width = batch.input_ids.shape
    hidden = states[0].shape[-1] if states else 0
    out = torch.zeros((rows, width, len(columns) * hidden), dtype=dtype)
    index = torch.tensor(columns, dtype=torch.long)
    for k, s in enumerate(states):
        r, a, n = int(docs.row[k]), int(docs.start[k]), int(docs.length[k])
        if isinstance(s, Scaled):
            picked = decode(s.values.index_select(1, index), s.scales.index_select(1, index), dtype)
        else:
            picked = s.index_select(1, index)
        out[r, a : a + n] = picked.reshape(n, -1)
    return out
