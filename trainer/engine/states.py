"""A batch's features assembled from its documents' engine states (pure): the chosen
columns of each document's ``[T_d, m, H]`` concatenated on the last axis, laid where the
document lies in the batch's rows. Which columns are ours is the engine's numbering
(``trainer.engine.seam.Layers``).
"""

from __future__ import annotations

import torch

from trainer.model.docs import DocView
from trainer.train.batches import Batch


def assemble(
    batch: Batch, states: list[torch.Tensor], columns: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The features ``[R, W, n*H]`` of ``batch`` (its ``input_ids``' shape), from each
    document's engine states ``[T_d, m, H]`` in the batch's document order
    (``DocView``): the chosen ``columns`` concatenated on the last axis; padding is zero."""
    docs = DocView.of(batch)
    if len(states) != len(docs):
        raise ValueError(f"{len(states)} documents' states for a batch of {len(docs)}")
    rows, width = batch.input_ids.shape
    hidden = states[0].shape[-1] if states else 0
    out = torch.zeros((rows, width, len(columns) * hidden), dtype=dtype)
    index = torch.tensor(columns, dtype=torch.long)
    for k, s in enumerate(states):
        r, a, n = int(docs.row[k]), int(docs.start[k]), int(docs.length[k])
        out[r, a : a + n] = s.index_select(1, index).reshape(n, -1)
    return out
