"""Our corpus in speculators' offline DFlash format and back, and the settings that make
its trainer and ours train the same thing (``benchmarks/bench_vs_speculators.py``).

**Format** (speculators 0.9, ``speculators/train/data.py``): a ``datasets.save_to_disk``
folder of rows ``input_ids`` (int64), ``loss_mask`` (int64) and ``seq_len``, torch format;
beside it ``hidden_states/hs_{i}.safetensors`` per row ``i`` with ``hidden_states``
``[T, n + 1, H]`` (the target's residual stream after layers ``id`` of the drafter's
``n`` ids, then after the last layer *before* the final norm: speculators applies the norm
and LM head itself to make its labels) and ``token_ids`` (int64, equal to the row's ids or
the row is dropped). The first ``int(rows x train_data_ratio)`` rows train, the rest
validate: ``write_speculators_data`` puts our training corpus first and our held-out
samples after it, and ``train_ratio`` returns the ratio that splits there.

**Layer ids**: ours count decoder layers from 0 (feature ``i`` is the output of layer ``i``,
``hidden_states[i + 1]``); speculators' and vLLM's count the embeddings as 0, so ours ``i``
is theirs ``i + 1`` (``trainer.engine.states``).

**Settings** (``RaceSettings``): one packed row per optimizer step on one rank (their
``--total-seq-len``; ours ``--layout packed --token-budget`` with ``--grad-accum 1``),
``anchors`` blocks per row on average, drawn from supervised positions in proportion to
each document's supervised tokens (their ``--max-anchors``, drawn uniformly over the row;
ours our default per-document draw, one anchor per ``tokens_per_anchor`` supervised
positions, ``tokens_per_anchor`` chosen from the corpus by ``tokens_per_anchor``), D-PACE
weights, AdamW with the same peak rate, weight decay and clip, linear
warm-up over the same share of the run then cosine to 0, every drafter layer sliding (causal
inside the block, as vLLM serves both), the same mask token, seed and epochs. What cannot
be matched is ``UNMATCHED``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: What the two trainers do differently under ``RaceSettings`` (printed by the benchmark).
UNMATCHED = (
    "labels: speculators trains each block slot toward the target's argmax at that position "
    "(from the stored last layer); ours toward the corpus token. On replies regenerated "
    "greedily by the same target these are the same tokens wherever the two forwards agree",
    "loss normalisation: speculators divides the D-PACE-weighted CE by the number of "
    "supervised slots; ours by the slots' total weight (a per-step scale, which AdamW "
    "mostly removes)",
    "anchors: speculators draws --max-anchors positions uniformly over the packed row's "
    "supervised positions and always computes that many blocks (padding missing ones); "
    "ours draws one per --tokens-per-anchor supervised positions of each document (rounded "
    "up), chosen so that a row averages the same number, and computes only those: both "
    "in proportion to a document's supervised tokens, ours varying from row to row",
    "packing: each trainer packs the epoch into rows its own way (speculators: LPT and a "
    "binary search per epoch; ours: the loader's planner), so the steps per epoch differ; "
    "both see every training token once per epoch",
    "weights: speculators saves its checkpoint in bf16 always; ours is exported in bf16 "
    "too, so both are served from bf16 weights (fp32 compute)",
    "features: speculators reads the target's hidden states from files made before "
    "training (timed apart as generation); ours runs the target in the training step",
)


def speculators_layer_ids(ours: Sequence[int]) -> list[int]:
    """Our feature layers as speculators' ``--target-layer-ids`` (sorted, as vLLM keeps
    them; ours must be distinct)."""
    ids = [int(i) + 1 for i in ours]
    if len(set(ids)) != len(ids) or min(ids, default=1) < 1:
        raise ValueError(f"layer ids must be distinct and >= 0, got {list(ours)}")
    return sorted(ids)


def train_ratio(n_train: int, n_val: int) -> float:
    """speculators' ``--train-data-ratio`` whose split (``int(rows x ratio)``) falls exactly
    after ``n_train`` rows of ``n_train + n_val`` (both must be at least 1)."""
    if n_train < 1 or n_val < 1:
        raise ValueError(f"need at least one training and one validation row: {n_train}, {n_val}")
    n = n_train + n_val
    ratio = (n_train + 0.5) / n
    assert int(n * ratio) == n_train
    return ratio


def target_states(target: Path, layer_ids: Sequence[int]) -> Callable[[np.ndarray], np.ndarray]:
    """token ids -> the ``[T, n + 1, H]`` hidden states speculators reads, from the target
    folder's Transformers model (fp32): ``hidden_states[i + 1]`` for our layer ``i``, then
    the last decoder layer's output before the final norm (a hook: Transformers' last
    ``hidden_states`` entry is after the norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    last: list[torch.Tensor] = []

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        last.append(output[0] if isinstance(output, tuple) else output)

    model.model.layers[-1].register_forward_hook(hook)

    @torch.inference_mode()
    def states(ids: np.ndarray) -> np.ndarray:
        last.clear()
        out = model(torch.from_numpy(ids)[None], output_hidden_states=True)
        slots = [out.hidden_states[i + 1][0] for i in layer_ids] + [last[0][0]]
        return torch.stack(slots, dim=1).numpy()

    return states


def _rows(dataset: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in range(len(dataset)):
        yield np.asarray(dataset.input_ids(i)), np.asarray(dataset.loss_mask(i))


def write_speculators_data(
    out: Path,
    train: Any,
    heldout: Any,
    states: Callable[[np.ndarray], np.ndarray] | None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """``train`` then ``heldout`` (our corpora: ``loader_server.data.dataset.ArrowDataset``)
    as speculators' dataset folder ``out``; with ``states`` (token ids -> ``[T, n + 1, H]``
    float32), the hidden-state file of every row. Returns ``{"rows", "train_rows",
    "tokens", "train_ratio"}``. Written under a temporary name and renamed when whole."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    (tmp / "hidden_states").mkdir(parents=True)
    cols: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    total = len(train) + len(heldout)
    for i, (ids, mask) in enumerate([*_rows(train), *_rows(heldout)]):
        ids64 = ids.astype(np.int64)
        cols["input_ids"].append(ids64)
        cols["loss_mask"].append(mask.astype(np.int64))
        cols["seq_len"].append(len(ids64))
        if states is not None:
            hs = states(ids64)
            if hs.ndim != 3 or hs.shape[0] != len(ids64):
                raise ValueError(f"row {i}: states of shape {hs.shape} for {len(ids64)} tokens")
            save_file(
                {"hidden_states": torch.from_numpy(np.ascontiguousarray(hs, np.float32)),
                 "token_ids": torch.from_numpy(ids64)},
                str(tmp / "hidden_states" / f"hs_{i}.safetensors"),
            )  # fmt: skip
        if progress is not None:
            progress(i + 1, total)
    ds = Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(tmp))
    meta = {
        "rows": total,
        "train_rows": len(train),
        "tokens": int(sum(cols["seq_len"])),
        "train_tokens": int(sum(cols["seq_len"][: len(train)])),
        "train_ratio": train_ratio(len(train), len(heldout)),
    }
    (tmp / "dflash_bench.json").write_text(json.dumps(meta) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def read_speculators_data(folder: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every row of a speculators dataset folder as (token ids, loss mask); refuses a row
    whose ``seq_len`` or hidden-state file's ``token_ids`` disagree with its ids."""
    from datasets import load_from_disk
    from safetensors.numpy import load_file

    ds = load_from_disk(str(folder)).with_format("numpy")
    out = []
    for i in range(len(ds)):
        row = ds[i]
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        if int(row["seq_len"]) != len(ids) or len(mask) != len(ids):
            raise ValueError(f"{folder}: row {i}: seq_len {row['seq_len']}, {len(ids)} ids, "
                             f"{len(mask)} mask values")  # fmt: skip
        hs = folder / "hidden_states" / f"hs_{i}.safetensors"
        if hs.is_file() and not np.array_equal(load_file(str(hs))["token_ids"], ids):
            raise ValueError(f"{hs}: token_ids differ from row {i}'s input_ids")
        out.append((ids, mask))
    return out


def write_our_corpus(rows: Sequence[tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    """Rows (ids, mask) as one of our corpus files (``CORPUS_SCHEMA``), the way back."""
    import pyarrow as pa

    from loader_server.data.dataset import CORPUS_SCHEMA, record_batch

    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int32)
    ids = np.concatenate([r[0] for r in rows]).astype(np.int32)
    mask = np.concatenate([r[1] for r in rows]).astype(np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, CORPUS_SCHEMA) as writer:
        writer.write_batch(record_batch(ids, mask, lengths))
    tmp.rename(path)
    return path


def anchor_candidates(loss_mask: np.ndarray, block_size: int) -> int:
    """The positions our trainer may anchor a block at in a document of this loss mask:
    supervised ones with a whole block after them (``t + block_size <= length``), none in
    a document of fewer than ``2 * block_size`` supervised tokens (``trainer.model.blocks.
    sample_anchors``, ``anchor_counts``)."""
    m = np.asarray(loss_mask).astype(bool)
    if int(m.sum()) < 2 * block_size:
        return 0
    return int(m[: max(m.size - block_size + 1, 0)].sum())


def tokens_per_anchor(
    candidates: np.ndarray, tokens: int, tokens_per_step: int, anchors: int
) -> int:
    """Our ``--tokens-per-anchor`` K whose per-document draw (``ceil(c / K)`` anchors for a
    document of ``c`` anchor candidates, ``anchor_candidates``) averages closest to
    ``anchors`` per row of ``tokens_per_step`` over a corpus of ``tokens`` tokens."""
    sup = np.asarray(candidates, dtype=np.int64)
    rows = max(tokens / tokens_per_step, 1.0)
    k = np.arange(1, max(int(sup.max(initial=1)), 1) + 1)
    per_row = np.ceil(sup[None, :] / k[:, None]).sum(axis=1) / rows
    return int(k[np.argmin(np.abs(per_row - anchors))])


@dataclass(frozen=True, kw_only=True)
class RaceSettings:
    """What both trainers train with (see the module docstring)."""

    layer_ids: tuple[int, ...]  # ours: decoder layer outputs, from 0
    mask_token_id: int
    tokens_per_anchor: int = 32  # ours (``tokens_per_anchor``): ``anchors`` per row on average
    drafter_layers: int = 1
    block_size: int = 16
    tokens_per_step: int = 4096
    anchors: int = 128
    sliding_window: int = 4096
    lr: float = 6e-4
    warmup: float = 0.04  # share of the run
    weight_decay: float = 0.01
    dpace_alpha: float = 0.5
    epochs: int = 1
    seed: int = 0
    #: Each trainer at its own defaults (``--defaults``): only the shared inputs above are
    #: given (the target's layers the data holds, the MASK token, the tokens a step, the
    #: epochs and the seed); the drafter, objective, anchors, optimizer and schedule are
    #: each tool's (``OUR_DEFAULTS``, ``THEIR_DEFAULTS``).
    defaults: bool = False

    def __post_init__(self) -> None:
        speculators_layer_ids(self.layer_ids)
        if not 0 < self.warmup < 1:
            raise ValueError(f"warmup is a share of the run in (0, 1), got {self.warmup}")
        for name in ("drafter_layers", "block_size", "tokens_per_step", "anchors", "epochs",
                     "tokens_per_anchor"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def describe(self) -> dict[str, Any]:
        return asdict(self)


#: What each trainer trains with when nothing else is given (``--defaults``), for the
#: report. Ours are read off ``RunOptions`` (a test holds them to it); speculators 0.9's
#: from its ``train/config/schema.py`` (the DFlash recipe of its issue #979).
OUR_DEFAULTS = {
    "drafter_layers": 1, "block_size": 16, "loss": "D-PACE CE over the weights' sum",
    "anchors": "one per 32 supervised tokens, at most 512 a document",
    "optimizer": "Muon on 2-D weights (RMS-matched), AdamW on the rest", "lr": 1e-2,
    "weight_decay": 0.01, "schedule": "cosine",
    "warmup": 0.04,
}  # fmt: skip
#: speculators' ``--max-anchors`` default: the blocks it computes in each row.
THEIR_MAX_ANCHORS = 512
THEIR_DEFAULTS = {
    "drafter_layers": 5, "block_size": 16, "loss": "D-PACE CE over the supervised slots",
    "anchors": f"{THEIR_MAX_ANCHORS} a row",
    "optimizer": "Muon on 2-D weights (RMS-matched), AdamW on the rest",
    "lr": 1e-3, "weight_decay": "0.1 Muon, 0.01 AdamW", "schedule": "linear",
    "warmup": "scheduler-dependent",
}  # fmt: skip


def _shared_ours(s: RaceSettings) -> list[str]:
    """What our trainer is given in every race: the data's layers and shape, the run's
    length and seed."""
    return [
        "--layers", ",".join(map(str, s.layer_ids)), "--mask-token-id", str(s.mask_token_id),
        "--layout", "packed", "--token-budget", str(s.tokens_per_step),
        "--max-seq-len", str(s.tokens_per_step), "--grad-accum", "1",
        "--epochs", str(s.epochs), "--seed", str(s.seed),
    ]  # fmt: skip


def our_flags(s: RaceSettings) -> list[str]:
    """``dflash-train train`` flags for ``s`` (with the daemon's spec: packed rows of
    ``tokens_per_step``, no sample longer than a row); ``s.defaults``: the shared inputs
    only."""
    if s.defaults:
        return _shared_ours(s)
    return [
        *_shared_ours(s), "--drafter-layers", str(s.drafter_layers),
        "--block-size", str(s.block_size), "--sliding-window", str(s.sliding_window),
        "--anchor-draw", "document", "--tokens-per-anchor", str(s.tokens_per_anchor),
        "--anchors-per-doc", str(s.tokens_per_step), "--max-anchors", "0",
        "--loss-weighting", "dpace", "--dpace-alpha", str(s.dpace_alpha),
        "--optimizer", "adamw", "--lr", str(s.lr), "--warmup", str(s.warmup),
        "--weight-decay", str(s.weight_decay), "--grad-clip", "1.0",
    ]  # fmt: skip


def speculators_flags(
    s: RaceSettings, target: Path, data: Path, save: Path, ratio: float
) -> list[str]:
    """``speculators train`` flags for ``s``: the CPU-only choices (eager loss, sdpa
    attention, fp32 states, no loader workers) and the dataset's split ``ratio``;
    ``s.defaults``: with the shared inputs only."""
    if s.defaults:
        return [
            "--speculator-type", "dflash", "--verifier-name-or-path", str(target),
            "--data-path", str(data), "--on-missing", "raise",
            "--target-layer-ids", *map(str, speculators_layer_ids(s.layer_ids)),
            "--mask-token-id", str(s.mask_token_id), "--total-seq-len", str(s.tokens_per_step),
            "--epochs", str(s.epochs), "--seed", str(s.seed), "--train-data-ratio", repr(ratio),
            *_cpu_only(save),
        ]  # fmt: skip
    return [
        "--speculator-type", "dflash", "--verifier-name-or-path", str(target),
        "--data-path", str(data), "--on-missing", "raise",
        "--target-layer-ids", *map(str, speculators_layer_ids(s.layer_ids)),
        "--num-layers", str(s.drafter_layers), "--block-size", str(s.block_size),
        "--sliding-window", str(s.sliding_window), "--mask-token-id", str(s.mask_token_id),
        "--total-seq-len", str(s.tokens_per_step), "--max-anchors", str(s.anchors),
        "--loss-fn", "ce", "--per-position-loss-weight", "dpace",
        "--dpace-alpha", str(s.dpace_alpha),
        "--optimizer", "adamw", "--lr", str(s.lr), "--weight-decay", str(s.weight_decay),
        "--scheduler-type", "cosine", "--scheduler-warmup-ratio", str(s.warmup),
        "--epochs", str(s.epochs), "--seed", str(s.seed), "--train-data-ratio", repr(ratio),
        *_cpu_only(save),
    ]  # fmt: skip


def _cpu_only(save: Path) -> list[str]:
    """speculators' flags this machine needs whatever the race: eager loss, sdpa attention,
    fp32 states, no loader workers; where it saves and logs."""
    return [
        "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
        "--hidden-states-dtype", "float32", "--num-workers", "0", "--log-freq", "1",
        "--save-path", str(save), "--log-dir", str(save / "logs"),
    ]  # fmt: skip
