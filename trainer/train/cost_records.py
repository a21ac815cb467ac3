"""The micro-batch timing records a training run writes (``RUN_DIR/costs/rank{R}.jsonl``,
``trainer.train.costlog``) and ``dflash-train calibrate`` reads (``trainer.ops.calibrate``):
the one statement of their place and fields. No torch, so reading them stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loader_server.wire.layouts import LAYOUTS
from loader_server.wire.spec import PACKED_ATTENTION, AnchorRule


def cost_dir(run_dir: Path) -> Path:
    """Where each rank writes its timings (``rank{R}.jsonl``)."""
    return Path(run_dir) / "costs"


def rank_file(run_dir: Path, rank: int) -> Path:
    return cost_dir(run_dir) / f"rank{rank}.jsonl"


def make_record(
    *,
    rank: int,
    position: tuple[int, int, int],
    layout: str,
    doc_lengths: list[int],
    rule: list[int],
    anchors: int,
    synced: bool,
    time_s: float,
    attention: str = "documents",
) -> str:
    """One JSON line: where the micro-batch was (``(epoch, step, micro)``), what the cost
    model needs of it (layout, document lengths, the anchor rule, the kernel a packed row's
    attention ran under: ``attention``, a ``packed_attention`` value), and its measured
    time."""
    epoch, step, micro = position
    record = {
        "rank": rank, "epoch": epoch, "step": step, "micro": micro, "layout": layout,
        "doc_lengths": doc_lengths, "rule": rule, "anchors": anchors, "synced": synced,
        "time_s": time_s, "attention": attention,
    }  # fmt: skip
    return json.dumps(record, separators=(",", ":")) + "\n"


def parse_record(line: str, where: str) -> dict[str, Any]:
    """A record line, checked and typed (``key``: its ``(rank, epoch, step, micro)``,
    ``rule`` an ``AnchorRule``, ``attention`` ``documents`` where a record from before it
    existed has none); ValueError naming ``where`` for anything malformed."""
    try:
        rec = json.loads(line)
        key = (int(rec["rank"]), int(rec["epoch"]), int(rec["step"]), int(rec["micro"]))
        rule = AnchorRule.of(rec["rule"])  # three values: a record from before tokens_per_anchor
        lengths = [int(v) for v in rec["doc_lengths"]]
        seconds = float(rec["time_s"])
        layout = rec["layout"]
        attention = rec.get("attention", "documents")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: not a micro-batch timing record ({e})") from None
    if layout not in LAYOUTS or attention not in PACKED_ATTENTION:
        raise ValueError(f"{where}: bad layout or attention in {line[:120]}")
    if not lengths or not seconds > 0:
        raise ValueError(f"{where}: bad lengths or time in {line[:120]}")
    return {
        **rec, "key": key, "rule": rule, "doc_lengths": lengths, "time_s": seconds,
        "attention": attention,
    }  # fmt: skip
