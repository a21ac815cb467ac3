"""``SpecLimits``: what one client may ask of a shared daemon, checked as a session opens."""

from __future__ import annotations

from dataclasses import dataclass, fields

from loader_server.wire.spec import BatchSpec


@dataclass(frozen=True, kw_only=True)
class SpecLimits:
    """What one client may ask of a shared daemon (checked when a session opens).

    A spec within ``BatchSpec``'s own bounds can still cost every other job dearly: a huge
    ``grad_accum`` or ``max_batch_size`` makes planning slow or large, a huge budget makes
    rings large (those are capped separately, in bytes). Defaults are far above any real
    training setup; the daemon's config can lower or raise them.
    """

    max_token_budget: int = 1 << 24
    max_batch_size: int = 1 << 16
    max_seq_len: int = 1 << 20
    max_grad_accum: int = 1 << 12

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def check(self, spec: BatchSpec, num_samples: int) -> None:
        """ValueError naming the field, its value and the limit, when ``spec`` exceeds one."""
        for name, value, limit, key in (
            ("token_budget", spec.token_budget, self.max_token_budget, "limit_token_budget"),
            ("max_batch_size", spec.max_batch_size, self.max_batch_size, "limit_batch_size"),
            ("max_seq_len", spec.max_seq_len, self.max_seq_len, "limit_seq_len"),
            ("grad_accum", spec.grad_accum, self.max_grad_accum, "limit_grad_accum"),
        ):
            if value > limit:
                raise ValueError(f"{name} {value} exceeds this daemon's limit of {limit} ({key})")
        if spec.micro_per_step > num_samples:
            raise ValueError(
                f"world_size x grad_accum = {spec.micro_per_step} micro-batches per step, but "
                f"the corpus has {num_samples} samples: no step could ever be filled"
            )
