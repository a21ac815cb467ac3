"""vLLM's spec-decode counters, read off ``/metrics``.

vLLM counts per request and per step (``docs/SERVING.md``; ``trainer.model.verifier``):
``num_drafts`` +1 for each step that ran a draft, ``num_draft_tokens`` +K, ``num_accepted_
tokens`` +j (the accepted drafts) and ``num_accepted_tokens_per_pos[k]`` +1 when draft
``k`` was accepted. Its mean acceptance length ``1 + accepted / drafts`` (``SpecCounters.
tau``) is the verifier's ``tau_served``; at temperature 0 the two are equal (serve-check).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from trainer.vllm.api import fetch_bytes

#: vLLM's counter families (Prometheus text: a counter ``X`` is the sample ``X_total``).
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative spec-decode counters, read off ``/metrics`` (summed over its
    engines): drafts (draft steps, one per request and step), draft tokens, accepted draft
    tokens, and accepted drafts by position (``per_position[k]``: steps that accepted draft
    ``k``, 0-based). ``later.minus(earlier)`` counts the requests in between."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...]

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(earlier.per_position))
        mine, theirs = _padded(self.per_position, n), _padded(earlier.per_position, n)
        out = SpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted=self.accepted - earlier.accepted,
            per_position=tuple(a - b for a, b in zip(mine, theirs, strict=True)),
        )
        if min(out.drafts, out.draft_tokens, out.accepted, *out.per_position, 0) < 0:
            raise ValueError(
                f"vLLM's counters went down ({earlier} -> {self}): "
                "was the server restarted between the two reads?"
            )
        return out

    @property
    def tau(self) -> float:
        """vLLM's mean acceptance length ``1 + accepted / drafts``."""
        return 1.0 + self.accepted / self._drafts()

    def position_rates(self) -> list[float]:
        """The acceptance rate of each draft position: ``per_position[k] / drafts``."""
        drafts = self._drafts()
        return [n / drafts for n in self.per_position]

    def inconsistencies(self) -> list[str]:
        """What vLLM's counting rules rule out, in words (none: the counters are coherent).
        A step that accepted ``j`` drafts adds 1 to positions ``0..j-1``, so the positions
        sum to ``accepted``, never rise, and position 0 counts at most ``drafts``."""
        pos = self.per_position
        out = []
        if sum(pos) != self.accepted:
            out.append(f"accepted {self.accepted} != {sum(pos)}, the positions' sum")
        if any(b > a for a, b in pairwise(pos)):
            out.append(f"accepted by position rises: {list(pos)}")
        if pos and pos[0] > self.drafts:
            out.append(f"position 0 accepted {pos[0]} of {self.drafts} drafts")
        return out

    def _drafts(self) -> int:
        if self.drafts <= 0:
            raise ValueError(f"vLLM counted no drafts ({self}): was a drafter served?")
        return self.drafts


def _padded(values: tuple[int, ...], n: int) -> tuple[int, ...]:
    return values + (0,) * (n - len(values))


def parse_spec_counters(text: str) -> SpecCounters:
    """The spec-decode counters in vLLM's ``/metrics`` text (all zero when it serves no
    drafter: then it has none of them)."""
    sums = dict.fromkeys(COUNTERS.values(), 0)
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in COUNTERS:
            sums[COUNTERS[base]] += round(float(value))
        elif base == PER_POSITION:
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + round(float(value))
    positions = tuple(per_pos.get(k, 0) for k in range(max(per_pos, default=-1) + 1))
    return SpecCounters(per_position=positions, **sums)


def read_metrics(url: str) -> str:
    """``/metrics`` of the server at ``url`` (Prometheus text)."""
    return fetch_bytes(url + "/metrics", None, timeout=30).decode()


def read_counters(url: str) -> SpecCounters:
    return parse_spec_counters(read_metrics(url))


def spec_counters(url: str) -> dict[str, Any]:
    """``read_counters`` as a dict: ``drafts``, ``draft_tokens``, ``accepted`` (floats) and
    ``per_pos`` (position -> accepted drafts)."""
    c = read_counters(url)
    return {"drafts": float(c.drafts), "draft_tokens": float(c.draft_tokens),
            "accepted": float(c.accepted),
            "per_pos": {k: float(n) for k, n in enumerate(c.per_position)}}  # fmt: skip
