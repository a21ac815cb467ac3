"""The experiment's arms: each compared spec, one ``Arm`` in ``ARMS``: the loader ``--spec``
pairs and the trainer flags that make its runs (``benchmarks.experiment.run.train_command``
puts them together), the specs it is contrasted with, and how the report names and draws
it. A new arm is one entry here."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The old objective (Part 3's): each micro-batch's mean alike, anchors per rank and
#: micro-batch (docs/TRAINER.md, "One objective, however a step is cut").
OLD_OBJECTIVE = ("--loss-normalization", "micro-batch", "--anchor-draw", "micro-batch")
#: The position decay of Parts 1-3 (``exp(-(k-1)/7)``), named: the trainer's default
#: weighting is D-PACE since Part 4.
DECAY = ("--loss-weighting", "decay")
DPACE = ("--loss-weighting", "dpace")
#: Muon on the 2-D weights, AdamW on the rest (speculators' optimizer; the trainer's default
#: since Part 8): every other arm trains with AdamW (``train_command`` names it).
MUON = ("--optimizer", "muon")
PACKED = ("layout=packed",)
BUCKETED = ("layout=padded", "buckets={buckets}")


@dataclass(frozen=True)
class Arm:
    """One compared spec. ``loader``: its ``--spec`` pairs (``{buckets}`` and ``{six}`` are
    filled in); each names its layout, so a spec means the same batches whatever the
    loader's default is. ``objective``: its trainer flags (weighting, divisor, optimizer,
    depth); each names its weighting, so a spec trains the same runs whatever the trainer's
    defaults. ``start``: ``--init-std`` (PyTorch's default, "0", which every run of Parts
    1-4 started from and ``--lr``'s default was chosen with). ``rate``: its own ``--lr``
    (the experiment's when None), so that specs swept apart meet in one OUT_DIR, paired by
    seed. ``feed``: the ``--states-dtype`` of a run fed by a vLLM server it starts
    (``--target-engine vllm``: precision on the wire, docs/TRAINER.md; it measures no tau
    while it trains, vLLM serves its final drafter as every run's); None runs the target in
    the trainer. ``versus``: the specs it is contrasted with, paired by seed, besides the
    reference (``measures.reference_of``)."""

    label: str
    loader: tuple[str, ...]
    objective: tuple[str, ...] = DECAY
    start: str = "0"
    rate: str | None = None
    feed: str | None = None
    versus: tuple[str, ...] = ()
    color: str | None = None


def _packed(
    label: str, *objective: str, start: str = "0", rate: str | None = None,
    feed: str | None = None, versus: tuple[str, ...] = (), color: str | None = None,
) -> Arm:  # fmt: skip
    """An arm of packed rows (the loader's default since Part 3)."""
    return Arm(f"ours, packed rows, {label}", PACKED, objective, start, rate, feed, versus, color)


#: Every arm, in the order the report lists their contrasts (the depths at the defaults
#: are added below, from the defaults' arm).
ARMS: dict[str, Arm] = {
    "sorted": Arm("sorted (frozen composition)", ("layout=padded", "composition=sorted"),
                  color="tab:red"),
    "six": Arm("6 hand-set buckets + shuffled",
               ("layout=padded", "buckets={six}", "order=shuffled"), color="tab:green"),
    "shuffled": Arm("bucketed + shuffled", (*BUCKETED, "order=shuffled"), color="tab:orange"),
    "stratified": Arm("bucketed + stratified", (*BUCKETED, "order=stratified"),
                      versus=("stratified-old",), color="tab:blue"),  # the step normalization
    "packed": Arm("ours, packed rows", PACKED, versus=("packed-old",), color="tab:purple"),
    "frozen": Arm("sorted, batch order not shuffled",
                  ("layout=padded", "composition=sorted", "order=sequential"), color="tab:brown"),
    # Part 3's comparison, under its objective, rerun
    "stratified-old": Arm("bucketed + stratified, old objective", (*BUCKETED, "order=stratified"),
                          (*DECAY, *OLD_OBJECTIVE), color="tab:cyan"),
    "packed-old": _packed("old objective", *DECAY, *OLD_OBJECTIVE, versus=("stratified-old",),
                          color="tab:gray"),
    # D-PACE's weights against the position decay; a steeper decay: its early weight, or
    # its per-block adaptivity?
    "packed-dpace": _packed("D-PACE", *DPACE, versus=("packed", "packed-gamma3"),
                            color="tab:pink"),
    "packed-gamma3": _packed("decay gamma 3", *DECAY, "--gamma", "3", versus=("packed",),
                             color="tab:olive"),
    # the trainer's N(0, 0.02) start at the experiment's rate
    "packed-dpace-init02": _packed("D-PACE, N(0, 0.02) start", *DPACE, start="0.02",
                                   versus=("packed-dpace",), color="darkgoldenrod"),
    # D-PACE's divisor (issue 71): speculators' (the slots), the reference's (per sequence)
    "packed-dpace-slots": _packed("D-PACE over the slots", *DPACE, "--loss-divisor", "slots",
                                  versus=("packed-dpace",), color="tab:olive"),
    "packed-dpace-sequence": _packed("D-PACE per sequence", *DPACE, "--loss-divisor",
                                     "sequence", versus=("packed-dpace",), color="tab:cyan"),
    # speculators' optimizer, at the experiment's --lr (swept one OUT_DIR per rate) ...
    "packed-dpace-muon": _packed("D-PACE, Muon", *DPACE, *MUON, versus=("packed-dpace",),
                                 color="tab:brown"),
    # ... and from the trainer's start
    "packed-dpace-init02-muon": _packed("D-PACE, N(0, 0.02) start, Muon", *DPACE, *MUON,
                                        start="0.02", versus=("packed-dpace-init02",),
                                        color="tab:orange"),
    # each optimizer at the best rate of its sweep (docs/EXPERIMENT.md, Part 8)
    "packed-dpace-lr1e-3": _packed("D-PACE, AdamW at 1e-3", *DPACE, rate="1e-3",
                                   color="tab:blue"),
    "packed-dpace-muon-lr1e-2": _packed("D-PACE, Muon at 1e-2", *DPACE, *MUON, rate="1e-2",
                                        versus=("packed-dpace-lr1e-3",), color="tab:red"),
    # ... from the trainer's start: the trainer's defaults since Part 8 (against
    # packed-dpace-init02 at --lr 6e-4: its defaults before)
    "packed-dpace-init02-muon-lr1e-2": _packed(
        "D-PACE, N(0, 0.02) start, Muon at 1e-2", *DPACE, *MUON, start="0.02", rate="1e-2",
        versus=("packed-dpace-init02",), color="tab:green",
    ),
    # a deeper drafter, at equal tokens: under AdamW at the experiment's start and rate ...
    "packed-dpace-depth3": _packed("D-PACE, 3 layers", *DPACE, "--drafter-layers", "3",
                                   versus=("packed-dpace",), color="tab:pink"),
    "packed-dpace-depth5": _packed("D-PACE, 5 layers", *DPACE, "--drafter-layers", "5",
                                   versus=("packed-dpace",), color="tab:purple"),
    # precision on the wire, paired with packed's colocated target (Part 6)
    "packed-bf16": _packed("states from vLLM in bf16", *DECAY, feed="bf16", color="tab:green"),
    "packed-fp8": _packed("states from vLLM in fp8", *DECAY, feed="fp8", color="tab:red"),
}  # fmt: skip


def _deeper(base: str, layers: int, color: str) -> Arm:
    """``base`` with ``layers`` drafter layers, contrasted with it."""
    arm = ARMS[base]
    return replace(arm, label=f"ours at the defaults (Muon at 1e-2), {layers} layers",
                   objective=(*arm.objective, "--drafter-layers", str(layers)),
                   versus=(base,), color=color)  # fmt: skip


# ... and at the trainer's defaults
for _layers, _color in ((3, "tab:olive"), (5, "tab:cyan")):
    ARMS[f"packed-dpace-init02-muon-lr1e-2-depth{_layers}"] = _deeper(
        "packed-dpace-init02-muon-lr1e-2", _layers, _color
    )
#: The arms' names (``--specs`` takes these).
SPECS = tuple(ARMS)
#: The arms fed by a vLLM server, and the dtype each asks the states in.
FEEDS = {name: arm.feed for name, arm in ARMS.items() if arm.feed is not None}
#: Pairs compared besides every spec minus the reference: (spec, minus spec), where both ran.
CONTRASTS = tuple((name, other) for name, arm in ARMS.items() for other in arm.versus)
#: The specs an experiment runs when none are named, by corpus.
DEFAULT_SPECS = {
    "synthetic": ("sorted", "shuffled", "stratified"),
    "text": ("sorted", "six", "stratified", "packed", "frozen"),
}


def label(spec: str) -> str:
    """How the report names ``spec``."""
    return ARMS[spec].label if spec in ARMS else spec


def color(spec: str) -> str | None:
    """How the report draws ``spec`` (matplotlib's next colour when None)."""
    return ARMS[spec].color if spec in ARMS else None
