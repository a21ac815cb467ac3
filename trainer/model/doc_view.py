"""Every document of a batch as ``(row, start, length)``: the one representation the model
code works on. A padded row is one document starting at 0; a packed row holds
``len(cu_seqlens) - 1`` documents. Working per document is what keeps a drafter block from
ever seeing another document's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from client.batch import Batch


@dataclass(frozen=True)
class DocView:
    """Every document of a batch: row index, start column and length (int64 tensors, CPU)."""

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor

    @staticmethod
    def of(batch: Batch) -> DocView:
        """Documents of a padded or packed batch."""
        if batch.packs:
            if batch.cu_seqlens is None:
                raise ValueError("a packed batch needs cu_seqlens")
            cu = batch.cu_seqlens.to("cpu", torch.int64)
            length = cu[1:] - cu[:-1]
            return DocView(row=torch.zeros_like(length), start=cu[:-1].clone(), length=length)
        length = batch.lengths.to("cpu", torch.int64)
        return DocView(
            row=torch.arange(length.numel()), start=torch.zeros_like(length), length=length
        )

    def __len__(self) -> int:
        return int(self.length.numel())

    def gather(self, x: torch.Tensor, pad: float | int = 0) -> torch.Tensor:
        """``x[row, start:start+length]`` for every document, right-padded: ``[D, Lmax, ...]``."""
        width = int(self.length.max()) if len(self) else 0
        col = torch.arange(width)
        inside = col[None, :] < self.length[:, None]
        src_col = (self.start[:, None] + col[None, :]).clamp(max=x.shape[1] - 1)
        idx_row = self.row[:, None].expand_as(src_col).to(x.device)
        out = x[idx_row, src_col.to(x.device)]
        keep = inside.to(x.device).reshape(inside.shape + (1,) * (out.dim() - 2))
        return torch.where(keep, out, torch.as_tensor(pad, dtype=out.dtype, device=x.device))

    def select(self, keep: torch.Tensor) -> DocView:
        return DocView(row=self.row[keep], start=self.start[keep], length=self.length[keep])
