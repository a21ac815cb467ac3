"""Precision on the wire (``--states-dtype``): a document's states as the engine computed
them, cast to bf16, or to fp8 e4m3 with one float32 scale per token and layer. Imports
torch only: the connector casts (``encode``, in vLLM's interpreter), the trainer checks and
widens (``decode``, as it lays the states into the batch's features).

fp8: each ``(token, layer)`` row of ``H`` values is divided by ``amax / 448`` (448 is
e4m3's largest finite value) and rounded to e4m3 (3 mantissa bits: a relative error of at
most 2^-4 per value); the row's scale travels beside it (``SCALES``, ``[T, n]``). A row of
zeros gets the scale 1. A NaN or inf in the row makes its scale NaN or inf, which the
trainer refuses, naming the document (``trainer.engine.client.check_states``).
"""

from __future__ import annotations

import torch

#: The wire dtypes a request may ask for (its ``kv_transfer_params`` ``dflash_dtype``), by
#: torch's name; fp8 only where this torch has it.
WIRE: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}
FP8 = getattr(torch, "float8_e4m3fn", None)
if FP8 is not None:
    WIRE["float8_e4m3fn"] = FP8
#: e4m3's largest finite value.
FP8_MAX = 448.0
#: The tensor of per-(token, layer) scales that travels beside fp8 states.
SCALES = "state_scales"


def scaled(dtype: torch.dtype) -> bool:
    """Whether states of ``dtype`` travel with scales."""
    return FP8 is not None and dtype == FP8


def encode(states: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """``states [T, n, H]`` as the wire ``name`` says (``""``: as they are): the tensors
    to send (``hidden_states``, and ``SCALES`` for fp8). ``KeyError`` for a name not in
    ``WIRE``."""
    if not name:
        return {"hidden_states": states}
    dtype = WIRE[name]
    if not scaled(dtype):
        return {"hidden_states": states.to(dtype)}
    amax = states.abs().amax(-1).float()  # [T, n]; NaN and inf stay in the scale
    scales = (amax / FP8_MAX).masked_fill(amax == 0, 1.0)
    values = (states.float() / scales.unsqueeze(-1)).to(dtype)
    return {"hidden_states": values, SCALES: scales}


def decode(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """States of ``dtype`` from the wire's ``values [T, m, H]`` (and their ``scales
    [T, m]``, fp8)."""
    if scales is None:
        return values.to(dtype)
    return values.to(dtype) * scales.to(dtype).unsqueeze(-1)


def nonfinite_fp8(values: torch.Tensor) -> torch.Tensor:
    """A mask of ``values``' NaNs (e4m3fn has no inf: its NaN is every exponent and
    mantissa bit set), without widening them."""
    return (values.view(torch.uint8) & 0x7F) == 0x7F
