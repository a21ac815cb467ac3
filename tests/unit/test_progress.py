"""Training's progress without a terminal: one line every N seconds with step, loss, tau,
tokens/s, data wait and an ETA from the mean step time; a bar only on a terminal."""

from __future__ import annotations

import logging

from trainer.progress import StepProgress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


REC = {"loss": 3.21449, "tokens_per_s": 41200.4, "data_wait_frac": 0.003}


def test_lines_every_n_seconds_with_an_eta(caplog):
    caplog.set_level(logging.INFO, logger="dflash-train")
    clock = Clock()
    p = StepProgress(5000, 100, bar=True, every_s=60, clock=clock, terminal=False)
    assert p.bar is None  # no terminal: lines, not a bar
    for step in range(101, 131):  # 2 s a step: a line each 30 steps
        clock.t += 2
        p.update(step, {**REC, "tau": 2.851} if step == 130 else REC)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "step 130/5000 (2.6%) loss 3.214 tau 2.85 tokens/s 41,200 wait 0.3% ETA 2h42m"
    ]  # 4,870 steps left at 2 s
    clock.t += 59
    p.update(131, REC)
    assert len(caplog.records) == 1  # not yet 60 s since the last line
    clock.t += 1
    p.update(132, {**REC, "loss": None})
    assert caplog.records[-1].getMessage().startswith("step 132/5000 (2.6%) loss - tokens/s")


def test_the_last_step_always_gets_its_line_and_zero_turns_lines_off(caplog):
    caplog.set_level(logging.INFO, logger="dflash-train")
    clock = Clock()
    StepProgress(3, 0, bar=False, every_s=3600, clock=clock, terminal=False).update(3, REC)
    assert (
        caplog.records[-1].getMessage() == "step 3/3 (100.0%) loss 3.214 tokens/s 41,200 wait 0.3%"
    )
    off = StepProgress(3, 0, bar=False, every_s=0, clock=clock, terminal=False)
    off.update(3, REC)
    assert len(caplog.records) == 1


def test_a_terminal_gets_a_bar_with_the_time_left(capsys):
    p = StepProgress(10, 0, bar=True, every_s=60, terminal=True)
    assert p.bar is not None and p.bar.total == 10
    p.update(1, REC)
    assert "<" in str(p.bar)  # tqdm's elapsed<remaining
    p.close()
