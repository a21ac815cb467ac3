"""When the loop checkpoints (``Cadence``).

Every ``--ckpt-every`` steps and after the last step. A run that ends early (SIGTERM on
some rank, the loader out of batches) or fails (a loader outage) saves its last completed
step too, unless a checkpoint holds it already: a resumed run's first step is held by the
checkpoint it resumed from, and the first step of a fresh run has nothing to save before
it. The metrics record of a step is written before its checkpoint: a kill in between
replays the step, and the resume cuts the file back to the checkpoint's step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Cadence:
    """``every``: checkpoint every that many steps (0: only at the end)."""

    every: int
    first_step: int = 0  # the step this run (or this resume) began at
    saved_at: int | None = None  # the step the newest checkpoint holds

    def begin(self, step: int, *, resumed: bool) -> None:
        """The loop starts at ``step`` (a resumed run's checkpoint holds it)."""
        self.first_step, self.saved_at = step, step if resumed else None

    def due(self, step: int, final: bool) -> bool:
        """Whether the step just trained is checkpointed (the last one always is)."""
        return final or bool(self.every and step % self.every == 0)

    def saved(self, step: int) -> None:
        self.saved_at = step

    def unsaved(self, step: int) -> bool:
        """Whether this run trained a step (``step``) that no checkpoint holds."""
        return step != self.first_step and self.saved_at != step
