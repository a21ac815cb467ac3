"""The experiment's arms: each compared spec, as the loader ``--spec`` pairs and trainer
flags that make it (``benchmarks.experiment.run.train_command`` puts them together). A new
arm is an entry here: its loader pairs, and its objective, start or feed where they are
not the base's."""

from __future__ import annotations

#: Loader ``--spec`` pairs of each compared spec (``{buckets}`` and ``{six}`` are filled in).
#: Each names its layout: a spec means the same batches whatever the loader's default is.
SPECS: dict[str, tuple[str, ...]] = {
    "sorted": ("layout=padded", "composition=sorted"),
    "six": ("layout=padded", "buckets={six}", "order=shuffled"),
    "shuffled": ("layout=padded", "buckets={buckets}", "order=shuffled"),
    "stratified": ("layout=padded", "buckets={buckets}", "order=stratified"),
    "packed": ("layout=packed",),
    "frozen": ("layout=padded", "composition=sorted", "order=sequential"),
    "packed-dpace": ("layout=packed",),
    "packed-gamma3": ("layout=packed",),
    "packed-dpace-init02": ("layout=packed",),
    "stratified-old": ("layout=padded", "buckets={buckets}", "order=stratified"),
    "packed-old": ("layout=packed",),
    "packed-dpace-slots": ("layout=packed",),
    "packed-dpace-sequence": ("layout=packed",),
    "packed-dpace-muon": ("layout=packed",),
    "packed-dpace-init02-muon": ("layout=packed",),
    "packed-dpace-lr1e-3": ("layout=packed",),
    "packed-dpace-muon-lr1e-2": ("layout=packed",),
    "packed-dpace-init02-muon-lr1e-2": ("layout=packed",),
    "packed-dpace-depth3": ("layout=packed",),
    "packed-dpace-depth5": ("layout=packed",),
    "packed-dpace-init02-muon-lr1e-2-depth3": ("layout=packed",),
    "packed-dpace-init02-muon-lr1e-2-depth5": ("layout=packed",),
    "packed-bf16": ("layout=packed",),
    "packed-fp8": ("layout=packed",),
}
#: The old objective (Part 3's): each micro-batch's mean alike, anchors per rank and
#: micro-batch (docs/TRAINER.md, "One objective, however a step is cut").
OLD_OBJECTIVE = ("--loss-normalization", "micro-batch", "--anchor-draw", "micro-batch")
#: The position decay of Parts 1-3 (``exp(-(k-1)/7)``), named: the trainer's default
#: weighting is D-PACE since Part 4.
DECAY = ("--loss-weighting", "decay")
#: Trainer flags of each spec's objective (``DECAY`` unless listed). Every spec names its
#: weighting as it names its layout: a spec trains the same runs whatever the defaults.
OBJECTIVES: dict[str, tuple[str, ...]] = {
    "packed-dpace": ("--loss-weighting", "dpace"),
    "packed-gamma3": (*DECAY, "--gamma", "3"),
    "packed-dpace-init02": ("--loss-weighting", "dpace"),
    # D-PACE's divisor (issue 71): speculators' (the slots), the reference's (per sequence)
    "packed-dpace-slots": ("--loss-weighting", "dpace", "--loss-divisor", "slots"),
    "packed-dpace-sequence": ("--loss-weighting", "dpace", "--loss-divisor", "sequence"),
    # speculators' optimizer (Muon on the 2-D weights, AdamW on the rest) and depths; the
    # learning rate of each is swept as the experiment's --lr, one OUT_DIR per rate
    "packed-dpace-muon": ("--loss-weighting", "dpace", "--optimizer", "muon"),
    # ... and from the trainer's start (against packed-dpace-init02, at the trainer's --lr)
    "packed-dpace-init02-muon": ("--loss-weighting", "dpace", "--optimizer", "muon"),
    # each optimizer at the best rate of its sweep (docs/EXPERIMENT.md, Part 8: RATES)
    "packed-dpace-lr1e-3": ("--loss-weighting", "dpace"),
    "packed-dpace-muon-lr1e-2": ("--loss-weighting", "dpace", "--optimizer", "muon"),
    # the candidate default (Muon at its rate) from the trainer's start, against
    # packed-dpace-init02 at the trainer's --lr 6e-4: the trainer's defaults
    "packed-dpace-init02-muon-lr1e-2": ("--loss-weighting", "dpace", "--optimizer", "muon"),
    "packed-dpace-depth3": ("--loss-weighting", "dpace", "--drafter-layers", "3"),
    "packed-dpace-depth5": ("--loss-weighting", "dpace", "--drafter-layers", "5"),
    # the depths at the trainer's defaults (since Part 8: Muon at 1e-2 from N(0, 0.02))
    "packed-dpace-init02-muon-lr1e-2-depth3": (
        "--loss-weighting",
        "dpace",
        "--optimizer",
        "muon",
        "--drafter-layers",
        "3",
    ),
    "packed-dpace-init02-muon-lr1e-2-depth5": (
        "--loss-weighting",
        "dpace",
        "--optimizer",
        "muon",
        "--drafter-layers",
        "5",
    ),
    "stratified-old": (*DECAY, *OLD_OBJECTIVE),
    "packed-old": (*DECAY, *OLD_OBJECTIVE),
}
#: The drafter's start of each spec (``--init-std``; "0" unless listed): PyTorch's default,
#: which every run of Parts 1-4 started from and ``--lr``'s default was chosen with. Named,
#: as the weighting is: the trainer's default is N(0, 0.02) since 2026-12-06.
STARTS: dict[str, str] = {
    "packed-dpace-init02": "0.02",
    "packed-dpace-init02-muon": "0.02",
    "packed-dpace-init02-muon-lr1e-2": "0.02",
    "packed-dpace-init02-muon-lr1e-2-depth3": "0.02",
    "packed-dpace-init02-muon-lr1e-2-depth5": "0.02",
}
#: The learning rate of each spec that has its own (``--lr``: the experiment's unless listed),
#: so that specs swept apart meet in one OUT_DIR, paired by seed.
RATES: dict[str, str] = {
    "packed-dpace-lr1e-3": "1e-3",
    "packed-dpace-muon-lr1e-2": "1e-2",
    "packed-dpace-init02-muon-lr1e-2": "1e-2",
    "packed-dpace-init02-muon-lr1e-2-depth3": "1e-2",
    "packed-dpace-init02-muon-lr1e-2-depth5": "1e-2",
}
#: The specs whose target states come from a vLLM server the run starts (``--target-engine
#: vllm``, ``--vllm-python``), sent in this ``--states-dtype``: precision on the wire
#: (docs/TRAINER.md), paired with ``packed``'s colocated target. The others run the target in
#: the trainer. An engine-fed run measures no tau while it trains (the decoder is in the
#: engine); vLLM serves its final drafter as every run's.
FEEDS: dict[str, str] = {"packed-bf16": "bf16", "packed-fp8": "fp8"}
#: The specs an experiment runs when none are named, by corpus.
DEFAULT_SPECS = {
    "synthetic": ("sorted", "shuffled", "stratified"),
    "text": ("sorted", "six", "stratified", "packed", "frozen"),
}
