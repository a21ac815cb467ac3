"""Named phases of a training step, for the profiler (``trainer.train.profile``).

``phase(name)`` is a ``torch.profiler.record_function`` range (free when no profiler
runs); ``PHASES`` lists them in step order: ``copy`` (the micro-batch to the device),
``plan`` (anchors, labels, weights on the host), ``target`` (the frozen target's forward
to the deepest feature layer), ``blocks`` (the drafter's inputs gathered from the
features), ``drafter`` (its chunked forward), ``head`` (LM head + weighted CE, forward and
the gradient of the hidden states in one pass), ``backward`` (the drafter's backward,
recompute included, with DDP's all-reduce overlapping it), ``optimizer`` (clip, AdamW,
zero grad).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

PHASES = ("copy", "plan", "target", "blocks", "drafter", "head", "backward", "optimizer")
PREFIX = "dflash."


def phase(name: str) -> AbstractContextManager[Any]:
    """A named range of the step (one of ``PHASES``)."""
    return torch.profiler.record_function(PREFIX + name)
