"""What an engine returns and what the drafter is trained on, kept apart and mapped.

vLLM's ``extract_hidden_states`` numbers layers as Transformers' ``hidden_states`` tuple
does: id ``k`` is the output after ``k`` decoder layers, so our layer ``i`` (the output of
decoder layer ``i``, ``trainer.model.target``) is vLLM's id ``i + 1``. It returns one
``[T, n, H]`` array per request with its ids in ascending order, whatever order it was
given, and repeated ids break it: so the server is given our ids sorted, unique and
shifted (``engine_layer_ids``), and each feature is picked back out of that order
(``feature_columns``). Our last layer (``L - 1``, vLLM's id ``L``) is vLLM's output before
the final norm, where Transformers' last entry (and our target's feature) is after it: the
trainer applies the target's final norm to that one (``EngineTarget``).
"""

from __future__ import annotations

import torch

from trainer.model.docs import DocView
from trainer.train.batches import Batch


def engine_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for our ``layer_ids``: sorted, unique, +1."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise ValueError(f"layer ids {layer_ids} must be in 0..{num_layers - 1} (and some)")
    return [i + 1 for i in sorted(set(layer_ids))]


def feature_columns(layer_ids: list[int], num_layers: int) -> list[int]:
    """For each of our ``layer_ids`` in order, its index in the engine's ``[T, n, H]``."""
    order = engine_layer_ids(layer_ids, num_layers)
    return [order.index(i + 1) for i in layer_ids]


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
