"""The one progress bar of long commands (tqdm; off with ``--no-progress``), and training's
progress where no one watches a bar: systemd's journal, a log file."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("dflash-train")


def progress_bar(
    total: int | None, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0
) -> tqdm[Any]:
    """A tqdm bar on stderr, disabled (no output) when not ``enabled``."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
        initial=initial,
    )  # fmt: skip


class StepProgress:
    """Training's progress, step by step. On a terminal (and without ``--no-progress``) a
    tqdm bar: steps done of ``total``, elapsed and remaining time, the step's loss, tau,
    tokens/s and data wait. Elsewhere one log line every ``every_s`` seconds (0: none)::

        step 120/5000 (2.4%) loss 3.214 tau 2.85 tokens/s 41,200 wait 0.3% ETA 1h02m

    The ETA is the steps left at the mean step time since this process started."""

    def __init__(
        self,
        total: int,
        initial: int,
        *,
        bar: bool,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ) -> None:
        self.total, self.initial, self.every_s, self.clock = total, initial, every_s, clock
        on_tty = sys.stderr.isatty() if terminal is None else terminal
        self.bar = progress_bar(total, "train", initial=initial) if bar and on_tty else None
        self.t0 = self.last = clock()

    def update(self, step: int, rec: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix(rec), refresh=False)
            return
        now = self.clock()
        if self.every_s > 0 and (now - self.last >= self.every_s or step >= self.total):
            self.last = now
            log.info("%s", self.line(step, rec, now))

    def line(self, step: int, rec: dict[str, Any], now: float) -> str:
        share = f" ({100 * step / self.total:.1f}%)" if self.total else ""
        parts = [f"step {step}/{self.total}{share}"]
        parts += [f"{k} {v}" for k, v in postfix(rec).items()]
        done = step - self.initial
        if done > 0 and step < self.total:
            parts.append(f"ETA {_duration((now - self.t0) / done * (self.total - step))}")
        return " ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def postfix(rec: dict[str, Any]) -> dict[str, str]:
    """The step record's figures a person follows: loss, tau (when measured), tokens/s,
    data wait."""
    out = {"loss": f"{rec['loss']:.3f}" if rec.get("loss") is not None else "-"}
    if rec.get("tau") is not None:
        out["tau"] = f"{rec['tau']:.2f}"
    if rec.get("tokens_per_s") is not None:
        out["tokens/s"] = f"{rec['tokens_per_s']:,.0f}"
    if rec.get("data_wait_frac") is not None:
        out["wait"] = f"{100 * rec['data_wait_frac']:.1f}%"
    return out


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
