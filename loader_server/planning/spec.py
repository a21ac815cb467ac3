"""``BatchSpec``: everything that decides how an epoch is cut into batches.

One frozen value object, shared by the planner, the daemon (sessions carry it over the
wire as a dict) and every CLI command (``spec_options`` in ``loader_server.cli.plan``).
Its ``key()`` is a short stable hash used to cache plans: two specs with the same key plan
identically on the same data.

Two limits cut an epoch into micro-batches. ``token_budget`` is the memory bound: a padded
micro-batch of ``rows`` samples whose longest (effective) length is ``L`` holds ``rows*L``
tokens, a packed row ``sum(l_i)``, and neither may exceed it. The cost model
(``loader_server.planning.cost``: ``c0 + c_tok*tokens + c_attn*sum L^2 + c_slot*block slots``) is
the time bound: a micro-batch's modelled cost may not exceed ``cost_budget`` (0: "auto",
``planner.auto_budget``: the cheapest full micro-batch of the corpus), and steps are
balanced across ranks by it. The defaults (``cost_tok`` 1, the other coefficients 0) make
the cost the token count and the cost budget the token budget: the planner without a cost
model, plan for plan. A single row of ``max_seq_len`` tokens must fit both bounds,
otherwise some samples could never be served: that is the first thing validation checks.

Effective length = ``min(len, max_seq_len)`` under ``overlong="truncate"``; under ``"drop"``
longer samples are left out of the epoch (and reported). Empty samples are always left out.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from loader_server.planning import cost

OVERLONG = ("truncate", "drop")
LAYOUTS = ("padded", "packed")
COMPOSITIONS = ("bucketed", "sorted", "random")
ORDERS = ("stratified", "shuffled", "sequential")
MAX_AUTO_BUCKETS = 64
#: Hard bounds of any spec: token counts and offsets are int32 in a batch.
INT32_MAX = 2**31 - 1
#: The hand-set boundaries of the pipeline this project replaces (6 buckets up to 8192).
REFERENCE_BUCKETS = (770, 1216, 1728, 2432, 3296)


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """How to batch an epoch.

    Attributes:
        token_budget: max cost of one micro-batch (tokens, see the module docstring).
        max_batch_size: max rows of a padded micro-batch (documents per packed row are
            not limited).
        max_seq_len: longer samples are truncated or dropped (``overlong``).
        overlong: ``"truncate"`` or ``"drop"``.
        buckets: ``"auto"`` (smallest K whose optimal buckets reach ``target_efficiency``),
            ``"auto:K"`` (optimal K buckets), or increasing upper bounds such as
            ``(770, 1216, 1728, 2432, 3296)``; a last bucket up to ``max_seq_len`` is
            implied. A comma-separated string or a list is normalized to a tuple.
        target_efficiency: padding efficiency ``"auto"`` aims for.
        layout: ``"padded"`` ([B, L] rows) or ``"packed"`` (one row of concatenated
            documents, for varlen attention).
        composition: ``"bucketed"`` (per-epoch shuffle inside length buckets),
            ``"sorted"`` (the original flaw: one global length sort, frozen batches) or
            ``"random"`` (full shuffle). Sorted and random shuffle batch order (unless
            ``order="sequential"``); stratifying applies to bucketed batches. Packed
            rows are always drawn at random.
        order: ``"stratified"`` (every step mixes buckets by token share),
            ``"shuffled"`` (micro-batches in random order) or ``"sequential"`` (in the
            order they were made, not shuffled: with ``composition="sorted"``, the
            original pipeline without even its batch shuffle, the shortest steps first;
            an experiment's worst case, with any composition but packed rows).
        world_size, grad_accum: a step has ``world_size*grad_accum`` micro-batches.
        seed: with the epoch, determines the plan.
        cost_c0, cost_tok, cost_attn, cost_slot: the cost model's coefficients (per
            micro-batch, per token, per squared document length, per block slot), in any
            one unit (seconds when calibrated); ``loader_server.planning.cost``.
        cost_budget: max modelled cost of one micro-batch; 0 = auto (see above).
        block_size, anchors_per_doc, tokens_per_anchor, max_anchors: the trainer's anchor
            rule (``cost.AnchorRule``), which the block-slot feature follows
            (``max_anchors`` 0: no per-micro-batch cap).
    """

    token_budget: int = 65536
    max_batch_size: int = 64
    max_seq_len: int = 8192
    overlong: str = "truncate"
    buckets: str | tuple[int, ...] = "auto"
    target_efficiency: float = 0.97
    layout: str = "packed"
    composition: str = "bucketed"
    order: str = "stratified"
    world_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    cost_c0: float = 0.0
    cost_tok: float = 1.0
    cost_attn: float = 0.0
    cost_slot: float = 0.0
    cost_budget: float = 0.0
    block_size: int = 16
    anchors_per_doc: int = 512
    tokens_per_anchor: int = 32
    max_anchors: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", _normalize_buckets(self.buckets))
        self._check_ints()
        _check_choice("overlong", self.overlong, OVERLONG)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("composition", self.composition, COMPOSITIONS)
        _check_choice("order", self.order, ORDERS)
        if not 0.0 < self.target_efficiency <= 1.0:
            raise ValueError(f"target_efficiency must be in (0, 1], got {self.target_efficiency}")
        cost.check_coefficients({n: getattr(self, n) for n in cost.COEFFICIENTS}, "spec")
        c = self.cost_budget
        if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c < 0:
            raise ValueError(f"cost_budget must be a finite number >= 0 (0: auto), got {c!r}")
        if self.max_seq_len > self.token_budget:
            raise ValueError(
                f"token_budget {self.token_budget} is below one row of max_seq_len "
                f"{self.max_seq_len}; raise token_budget or lower max_seq_len"
            )
        if c and self.row_cost(self.max_seq_len) > c:
            raise ValueError(
                f"cost_budget {c:g} is below the cost of one row of max_seq_len "
                f"{self.max_seq_len} ({self.row_cost(self.max_seq_len):g}); raise cost_budget "
                f"or lower max_seq_len"
            )
        if self.layout == "packed" and self.order == "sequential":
            raise ValueError(
                "order 'sequential' keeps padded batches in the order they were made: give "
                "layout 'padded' with it (packed rows, the default layout, are always drawn "
                "at random)"
            )
        if self.layout == "packed" and self.composition == "sorted":
            raise ValueError(
                "composition 'sorted' is a padded-layout baseline: give layout 'padded' "
                "with it (packed rows, the default layout, are always drawn at random)"
            )
        self._check_buckets()

    def _check_ints(self) -> None:
        for name, low, high in (
            ("token_budget", 1, INT32_MAX),
            ("max_batch_size", 1, INT32_MAX),
            ("max_seq_len", 1, INT32_MAX),
            ("world_size", 1, 65536),
            ("grad_accum", 1, INT32_MAX),
            ("seed", 0, 2**63 - 1),
            ("block_size", 2, 65536),
            ("anchors_per_doc", 1, INT32_MAX),
            ("tokens_per_anchor", 1, INT32_MAX),
            ("max_anchors", 0, INT32_MAX),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")

    def _check_buckets(self) -> None:
        b = self.buckets
        if isinstance(b, str):
            return  # "auto" / "auto:K" were validated by _normalize_buckets
        if b and b[-1] >= self.max_seq_len:
            raise ValueError(
                f"bucket bound {b[-1]} must be below max_seq_len {self.max_seq_len} "
                f"(the last bucket, up to max_seq_len, is implied)"
            )

    @property
    def coefficients(self) -> np.ndarray:
        """The cost model's coefficients in ``cost.FEATURES`` order (float64 [4])."""
        return np.array([getattr(self, n) for n in cost.COEFFICIENTS], np.float64)

    @property
    def anchor_rule(self) -> cost.AnchorRule:
        """The trainer's anchor rule these fields state."""
        return cost.AnchorRule(
            self.block_size, self.anchors_per_doc, self.tokens_per_anchor, self.max_anchors
        )

    @property
    def cost_model_on(self) -> bool:
        """False for the default model (cost = tokens, budget = token budget): the planner
        then runs its token-only path, bit for bit as without a cost model."""
        default = (self.cost_c0, self.cost_tok, self.cost_attn, self.cost_slot) == (0, 1, 0, 0)
        return not (default and self.cost_budget in (0, self.token_budget))

    def row_cost(self, length: int) -> float:
        """Modelled cost of a micro-batch of one row (document) of ``length`` tokens."""
        f = cost.features(np.array([length]), np.zeros(1, np.int64), layout="padded",
                          rule=self.anchor_rule)  # fmt: skip
        return float(f[0] @ self.coefficients)

    @property
    def micro_per_step(self) -> int:
        """Micro-batches in one optimizer step, over all ranks."""
        return self.world_size * self.grad_accum

    @property
    def auto_buckets(self) -> int | None:
        """K for ``"auto:K"``, 0 for ``"auto"`` (smallest K reaching the target), None for
        explicit bounds."""
        if not isinstance(self.buckets, str):
            return None
        return 0 if self.buckets == "auto" else int(self.buckets.split(":")[1])

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack/JSON-able values (bucket bounds as a list)."""
        d = asdict(self)
        if isinstance(self.buckets, tuple):
            d["buckets"] = list(self.buckets)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchSpec:
        """Inverse of ``to_dict``; missing keys take defaults, unknown keys are an error.

        ``attention_weight`` (the one-term cost of earlier versions, still accepted from
        config files and clients) means ``cost_attn`` with ``cost_budget`` = the token
        budget: the same plans."""
        if "attention_weight" in d:
            d = dict(d)
            w = d.pop("attention_weight")
            if w:
                d.setdefault("cost_attn", w)
                d.setdefault("cost_budget", d.get("token_budget", cls.token_budget))
        d = expand_profile(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown BatchSpec field {unknown[0]!r} (known: {sorted(known)})")
        return cls(**d)

    def key(self) -> str:
        """16 hex digits identifying this spec (hash of ``to_dict`` with sorted keys).

        Computed once per instance (the daemon asks for it on every batch it serves)."""
        cached = self.__dict__.get("_key")
        if cached is None:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
            object.__setattr__(self, "_key", cached)  # not a field: eq/asdict ignore it
        return cached


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


def expand_profile(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with a ``cost_profile`` key (a path) replaced by the profile's fields
    (``loader_server.planning.cost.profile_fields``); fields given in ``d`` itself win."""
    if "cost_profile" not in d:
        return d
    rest = {k: v for k, v in d.items() if k != "cost_profile"}
    return {**cost.profile_fields(d["cost_profile"]), **rest}


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _normalize_buckets(b: object) -> str | tuple[int, ...]:
    """``"auto"``, ``"auto:K"``, ``"770,1216"``, lists/tuples -> canonical form."""
    if isinstance(b, str):
        text = b.strip().lower()
        if text == "auto":
            return "auto"
        if text.startswith("auto:"):
            k = text[5:]
            if not k.isdigit() or not 1 <= int(k) <= MAX_AUTO_BUCKETS:
                raise ValueError(f"buckets {b!r}: K in 'auto:K' must be 1..{MAX_AUTO_BUCKETS}")
            return f"auto:{int(k)}"
        try:
            b = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"buckets must be 'auto', 'auto:K' or comma-separated integers, got {b!r}"
            ) from None
    if not isinstance(b, list | tuple):
        raise ValueError(f"buckets must be 'auto', 'auto:K' or a list of integers, got {b!r}")
    bounds = []
    for x in b:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
            raise ValueError(f"bucket bound {x!r} is not a positive integer (buckets {list(b)})")
        bounds.append(int(x))
    if any(hi <= lo for lo, hi in itertools.pairwise(bounds)):
        raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
    return tuple(bounds)
