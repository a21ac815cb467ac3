"""``BatchSpec``: everything that decides how an epoch is cut into batches, stated once.

One frozen value object, shared by the planner, the daemon (sessions carry it over the
wire as a dict), its clients and every command. Each field carries its default, its bounds
or choices and its help text (``field`` metadata), and everything else is made from them:
the checks of a whole spec (``BatchSpec.__post_init__``) and of the fields a client asks
for (``check_fields``: a typo refused before a trainer loads its target, naming the field
and the nearest known one), the daemon's and the trainer's spec flags
(``loader_server.cli.spec_flags``, ``trainer.options``). Pure Python (the wire's rule: no
numpy, torch or pyarrow), so the client and the trainer read it without the planner.
``key()`` is a short stable hash used to cache plans: two specs with the same key plan
identically on the same data.

Two limits cut an epoch into micro-batches. ``token_budget`` is the memory bound: a padded
micro-batch of ``rows`` samples whose longest (effective) length is ``L`` holds ``rows*L``
tokens, a packed row ``sum(l_i)``, and neither may exceed it. The cost model
(``loader_server.planning.cost``: ``c0 + c_tok*tokens + c_attn*sum L^2 + c_slot*block
slots``) is the time bound: a micro-batch's modelled cost may not exceed ``cost_budget``
(0: "auto", ``planner.auto_budget``: the cheapest full micro-batch of the corpus), and
steps are balanced across ranks by it. The defaults (``cost_tok`` 1, the other
coefficients 0) make the cost the token count and the cost budget the token budget: the
planner without a cost model, plan for plan. A single row of ``max_seq_len`` tokens must
fit both bounds, otherwise some samples could never be served: that is the first thing
validation checks.

Effective length = ``min(len, max_seq_len)`` under ``overlong="truncate"``; under ``"drop"``
longer samples are left out of the epoch (and reported). Empty samples are always left out.

The trainer's anchor rule (``AnchorRule``) is part of the spec: the cost model's block-slot
term counts the anchors the trainer draws. So is the attention kernel it runs packed rows
under (``packed_attention``): a block-sparse kernel (flex on CUDA) computes each document's
``l**2`` pairs, a dense mask (SDPA) the whole row's ``T**2``. A *cost profile* (JSON,
written by ``dflash-train calibrate``) carries fitted coefficients and the anchor rule and
kernel they were fitted under; ``profile_fields`` turns one into spec fields.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from loader_server.wire.files import read_json
from loader_server.wire.layouts import DEFAULT as DEFAULT_LAYOUT
from loader_server.wire.layouts import LAYOUTS

OVERLONG = ("truncate", "drop")
COMPOSITIONS = ("bucketed", "sorted", "random")
ORDERS = ("stratified", "shuffled", "sequential")
#: What a packed row's attention computes: each document's pairs, or the whole row's.
PACKED_ATTENTION = ("documents", "row")
MAX_AUTO_BUCKETS = 64
#: Hard bounds of any spec: token counts and offsets are int32 in a batch.
INT32_MAX = 2**31 - 1
#: The hand-set boundaries of the pipeline this project replaces (6 buckets up to 8192).
REFERENCE_BUCKETS = (770, 1216, 1728, 2432, 3296)
#: Spec fields of the cost model's coefficients, in the order of its feature columns.
COEFFICIENTS = ("cost_c0", "cost_tok", "cost_attn", "cost_slot", "cost_doc")
#: The cost model's coefficients, in ``COEFFICIENTS`` order.
Coefficients = tuple[float, float, float, float, float]
#: Coefficients a profile may lack (written before they existed: 0, the model then).
OPTIONAL_COEFFICIENTS = ("cost_doc",)
PROFILE_VERSION = 1


class AnchorRule(NamedTuple):
    """How many anchors (blocks) the trainer draws: per document
    ``min(anchors_per_doc, ceil(candidates / tokens_per_anchor))``, where a document's
    candidates are its supervised positions with room for a block (``l - block_size + 1``
    for a document supervised everywhere) and a document needs ``2 * block_size``
    supervised tokens to draw any; per micro-batch at most ``max_anchors`` (0: no cap; only
    the trainer's old per-micro-batch draw caps, ``trainer.model.blocks``). The vectorized
    counts are ``loader_server.planning.cost``'s."""

    block_size: int = 16
    anchors_per_doc: int = 512
    tokens_per_anchor: int = 32
    max_anchors: int = 0

    @classmethod
    def of(cls, values: Any) -> AnchorRule:
        """A rule from its values in field order; the three of records written before
        ``tokens_per_anchor`` existed (block, per document, cap) mean one per token."""
        v = [int(x) for x in values]
        if len(v) == 3:
            return cls(v[0], v[1], 1, v[2])
        if len(v) != len(cls._fields):
            raise ValueError(f"an anchor rule has {len(cls._fields)} values, got {list(values)}")
        return cls(*v)

    def anchors(self, length: int) -> int:
        """Anchors drawn from one document of ``length`` tokens, supervised everywhere."""
        if length < 2 * self.block_size:
            return 0
        candidates = length - self.block_size + 1
        return min(self.anchors_per_doc, -(-candidates // self.tokens_per_anchor))


#: Spec fields of the trainer's anchor rule, which the cost model's ``slots`` follows.
ANCHOR_RULE = AnchorRule._fields


def _spec_field(default: Any, help: str, **check: Any) -> Any:
    """A ``BatchSpec`` field: its default, help text and check (``low``/``high`` integer
    bounds, ``choices``, ``number`` for a finite float >= 0)."""
    return field(default=default, metadata={"help": help, **check})


def _int(default: int, help: str, low: int, high: int = INT32_MAX) -> Any:
    return _spec_field(default, help, low=low, high=high)


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """How to batch an epoch (each field's help says what it is; the module docstring
    says how the budgets bound a micro-batch)."""

    token_budget: int = _int(65536, "Max cost (tokens) of one micro-batch.", 1)
    max_batch_size: int = _int(
        64, "Max rows of a padded micro-batch (documents per packed row are not limited).", 1
    )
    max_seq_len: int = _int(8192, "Longer samples: see overlong.", 1)
    overlong: str = _spec_field(
        "truncate", "Samples over max_seq_len: truncated or dropped (and reported).",
        choices=OVERLONG,
    )  # fmt: skip
    buckets: str | tuple[int, ...] = _spec_field(
        "auto",
        "auto (smallest K whose optimal buckets reach target_efficiency) | auto:K | "
        "increasing upper bounds such as 770,1216,1728,2432,3296 (a last bucket up to "
        "max_seq_len is implied).",
    )
    target_efficiency: float = _spec_field(
        0.97, "Padding efficiency buckets=auto aims for, in (0, 1]."
    )
    layout: str = _spec_field(
        DEFAULT_LAYOUT, " or ".join(x.help for x in LAYOUTS.values()) + ".",
        choices=tuple(LAYOUTS),
    )  # fmt: skip
    composition: str = _spec_field(
        "bucketed",
        "bucketed (shuffled inside length buckets every epoch); sorted and random: baselines "
        "(frozen batches / a full shuffle; padded only).",
        choices=COMPOSITIONS,
    )
    order: str = _spec_field(
        "stratified",
        "How steps mix buckets: stratified (every step its share of each), shuffled, or "
        "sequential (made order, padded only).",
        choices=ORDERS,
    )
    world_size: int = _int(1, "Ranks of the job.", 1, 65536)
    grad_accum: int = _int(1, "Micro-batches per rank per optimizer step.", 1)
    seed: int = _int(0, "With the epoch, determines the plan.", 0, 2**63 - 1)
    cost_c0: float = _spec_field(0.0, "Cost model: fixed cost of a micro-batch.", number=True)
    cost_tok: float = _spec_field(1.0, "Cost model: per token as laid out.", number=True)
    cost_attn: float = _spec_field(0.0, "Cost model: per squared document length.", number=True)
    cost_slot: float = _spec_field(0.0, "Cost model: per drafter block slot.", number=True)
    cost_doc: float = _spec_field(
        0.0,
        "Cost model: per document (a packed row's documents, each its own target forward "
        "under SDPA; a padded micro-batch's rows).",
        number=True,
    )
    packed_attention: str = _spec_field(
        "documents",
        "Cost model: a packed row's attention work, the sum of its documents' squared "
        "lengths (documents: a block-sparse kernel, the trainer's flex on CUDA) or its own "
        "length squared (row: a dense mask, the trainer's SDPA).",
        choices=PACKED_ATTENTION,
    )  # fmt: skip
    cost_budget: float = _spec_field(
        0.0, "Max modelled cost of a micro-batch (0: auto).", number=True
    )
    block_size: int = _int(16, "Trainer's block size (block slots).", 2, 65536)
    anchors_per_doc: int = _int(512, "Trainer's anchors per document, at most.", 1)
    tokens_per_anchor: int = _int(32, "Trainer's tokens of a document per anchor.", 1)
    max_anchors: int = _int(0, "Trainer's anchors per micro-batch (0: no cap).", 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", _normalize_buckets(self.buckets))
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name))
        check_coefficients({n: getattr(self, n) for n in COEFFICIENTS}, "spec")
        if self.max_seq_len > self.token_budget:
            raise ValueError(
                f"token_budget {self.token_budget} is below one row of max_seq_len "
                f"{self.max_seq_len}; raise token_budget or lower max_seq_len"
            )
        c = self.cost_budget
        if c and self.row_cost(self.max_seq_len) > c:
            raise ValueError(
                f"cost_budget {c:g} is below the cost of one row of max_seq_len "
                f"{self.max_seq_len} ({self.row_cost(self.max_seq_len):g}); raise cost_budget "
                f"or lower max_seq_len"
            )
        LAYOUTS[self.layout].check(self.composition, self.order)
        b = self.buckets
        if not isinstance(b, str) and b and b[-1] >= self.max_seq_len:
            raise ValueError(
                f"bucket bound {b[-1]} must be below max_seq_len {self.max_seq_len} "
                f"(the last bucket, up to max_seq_len, is implied)"
            )

    @property
    def coefficients(self) -> Coefficients:
        """The cost model's coefficients in ``COEFFICIENTS`` order."""
        c0, tok, attn, slot, doc = (float(getattr(self, n)) for n in COEFFICIENTS)
        return (c0, tok, attn, slot, doc)

    @property
    def anchor_rule(self) -> AnchorRule:
        """The trainer's anchor rule these fields state."""
        return AnchorRule(
            self.block_size, self.anchors_per_doc, self.tokens_per_anchor, self.max_anchors
        )

    @property
    def cost_model_on(self) -> bool:
        """False for the default model (cost = tokens, budget = token budget): the planner
        then runs its token-only path, bit for bit as without a cost model."""
        default = self.coefficients == (0, 1, 0, 0, 0)
        return not (default and self.cost_budget in (0, self.token_budget))

    def row_cost(self, length: int) -> float:
        """Modelled cost of a micro-batch of one row (document) of ``length`` tokens."""
        c0, tok, attn, slot, doc = self.coefficients
        rule = self.anchor_rule
        anchors = rule.anchors(length)
        if rule.max_anchors:
            anchors = min(anchors, rule.max_anchors)
        slots = rule.block_size * anchors
        return c0 + tok * length + attn * float(length) ** 2 + slot * slots + doc

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
        """Inverse of ``to_dict``; missing keys take defaults, unknown keys are an error
        naming the nearest known one.

        ``attention_weight`` (the one-term cost of earlier versions, still accepted from
        config files and clients) means ``cost_attn`` with ``cost_budget`` = the token
        budget: the same plans."""
        if "attention_weight" in d:
            d = dict(d)
            w = d.pop("attention_weight")
            if w:
                d.setdefault("cost_attn", w)
                d.setdefault("cost_budget", d.get("token_budget", _default("token_budget")))
        d = expand_profile(d)
        _check_names(d)
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


#: Every field of a spec, with its declaration (default, help, check).
SPEC_FIELDS = {f.name: f for f in fields(BatchSpec)}
#: Keys a spec dict may hold besides its fields (a client's or a config file's).
EXTRA_KEYS = ("cost_profile", "attention_weight")


def field_help(name: str) -> str:
    """The help text of spec field ``name`` (flags are made from it)."""
    return str(SPEC_FIELDS[name].metadata["help"])


def check_fields(d: dict[str, Any]) -> None:
    """ValueError for what a client asks for that no daemon could take: an unknown field
    (naming the nearest known one) or a value outside its field's type, bounds or choices.
    The checks that need the whole spec (a row of ``max_seq_len`` within the budgets) are
    the daemon's, once the client's fields meet its own."""
    _check_names(d)
    for name, value in d.items():
        if name == "buckets":
            _normalize_buckets(value)
        elif name in SPEC_FIELDS:
            _check_field(name, value)
    check_coefficients({n: d[n] for n in COEFFICIENTS if n in d}, "spec", partial=True)


def _default(name: str) -> Any:
    return SPEC_FIELDS[name].default


def _check_names(d: dict[str, Any]) -> None:
    unknown = sorted(set(d) - set(SPEC_FIELDS) - set(EXTRA_KEYS))
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*SPEC_FIELDS, *EXTRA_KEYS], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(
            f"unknown batch spec field {unknown[0]!r}{hint} (known: {', '.join(SPEC_FIELDS)})"
        )


def _check_field(name: str, value: Any) -> None:
    """ValueError naming the field and the value unless it has the field's type and is in
    its bounds or choices."""
    meta = SPEC_FIELDS[name].metadata
    if "choices" in meta:
        if value not in meta["choices"]:
            raise ValueError(f"{name} must be one of {', '.join(meta['choices'])}; got {value!r}")
    elif "low" in meta:
        low, high = meta["low"], meta["high"]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    elif meta.get("number"):
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            if name in COEFFICIENTS:
                raise ValueError(f"spec: {name} must be a finite number >= 0, got {value!r}")
            raise ValueError(f"{name} must be a finite number >= 0 (0: auto), got {value!r}")
    elif name == "target_efficiency" and (not _is_number(value) or not 0.0 < value <= 1.0):
        raise ValueError(f"target_efficiency must be in (0, 1], got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_coefficients(values: dict[str, Any], where: str, partial: bool = False) -> None:
    """ValueError naming ``where`` and the field unless every coefficient is a finite
    number >= 0 and (a whole set, not ``partial``) at least one is positive."""
    for name, v in values.items():
        if not _is_number(v) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {v!r}")
    if not partial and not any(values[name] > 0 for name in COEFFICIENTS):
        raise ValueError(f"{where}: every cost coefficient is 0 (at least one must be positive)")


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


# ---- cost profiles --------------------------------------------------------------------------


def expand_profile(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with a ``cost_profile`` key (a path) replaced by the profile's fields
    (``profile_fields``); fields given in ``d`` itself win."""
    if "cost_profile" not in d:
        return d
    rest = {k: v for k, v in d.items() if k != "cost_profile"}
    return {**profile_fields(d["cost_profile"]), **rest}


def profile_text(
    coefficients: dict[str, float], rule: dict[str, int], *, where: str, **info: Any
) -> str:
    """A cost profile's JSON (``info``: fit report, source run, units...); ``where`` names
    it in errors. Writing it is the caller's (the trainer writes through ``trainer.files``)."""
    check_coefficients(coefficients, where)
    doc = {"version": PROFILE_VERSION, "coefficients": coefficients, "anchor_rule": rule, **info}
    return json.dumps(doc, indent=2) + "\n"


def write_profile(
    path: Path, coefficients: dict[str, float], rule: dict[str, int], **info: Any
) -> None:
    """Write a cost profile to ``path`` (tests and tools; the trainer uses ``profile_text``)."""
    Path(path).write_text(profile_text(coefficients, rule, where=str(path), **info))


def profile_fields(path: str | Path) -> dict[str, Any]:
    """The spec fields a cost profile sets: its coefficients (a profile written before
    ``cost_doc`` existed: 0), its anchor rule (before ``tokens_per_anchor`` existed: one
    anchor per token) and its ``packed_attention`` (before it existed: ``documents``, the
    model then).

    Every problem is a ValueError that names the file and the key: unreadable or not
    JSON, another version, a missing or negative coefficient, a missing anchor-rule field.
    """
    p = Path(path)
    try:
        doc = read_json(p, "a cost profile (JSON from dflash-train calibrate)")
    except OSError as e:
        raise ValueError(f"cost profile {p}: cannot read it ({e.strerror or e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"cost profile {p}: version must be {PROFILE_VERSION}, got {got!r}")
    coef, rule = doc.get("coefficients"), doc.get("anchor_rule")
    if not isinstance(coef, dict) or not isinstance(rule, dict):
        raise ValueError(f"cost profile {p}: needs 'coefficients' and 'anchor_rule' objects")
    out: dict[str, Any] = {}
    for name in COEFFICIENTS:
        if name not in coef and name not in OPTIONAL_COEFFICIENTS:
            raise ValueError(f"cost profile {p}: coefficient {name!r} is missing")
        out[name] = coef.get(name, 0.0)
    check_coefficients(out, f"cost profile {p}")
    rule = {"tokens_per_anchor": 1, **rule}
    for name in ANCHOR_RULE:
        v = rule.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                f"cost profile {p}: anchor_rule.{name} must be an integer >= 0, got {v!r}"
            )
        out[name] = v
    kernel = doc.get("packed_attention", "documents")
    if kernel not in PACKED_ATTENTION:
        raise ValueError(
            f"cost profile {p}: packed_attention must be one of {PACKED_ATTENTION}, got {kernel!r}"
        )
    out["packed_attention"] = kernel
    return out
