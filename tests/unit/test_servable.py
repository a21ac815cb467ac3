"""Which corpora a daemon refuses at start (``loader_server.planning.servable``): none that
a session could train on, every one that none could, with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from loader_server.planning.planner import plan_epoch
from loader_server.planning.servable import why_unservable
from loader_server.wire.spec import BatchSpec


@pytest.mark.parametrize(
    ("lengths", "spec", "why"),
    [
        ([], {}, "no samples"),
        ([0, 0, 0], {}, "all 3 samples are empty"),
        ([500, 600, 0], {"max_seq_len": 256, "overlong": "drop"}, "all 2 non-empty samples"),
        ([10] * 3, {"grad_accum": 4}, "3 servable samples make 1 micro-batch"),
        (
            [10] * 3,
            {"grad_accum": 4, "max_batch_size": 1, "layout": "padded"},
            "make 3 micro-batch",
        ),
        (
            [100] * 50,
            {"grad_accum": 4, "layout": "packed", "token_budget": 4096, "max_seq_len": 512},
            "packed",
        ),
    ],
)
def test_the_reason_is_named(lengths, spec, why):
    got = why_unservable(np.array(lengths, np.int64), BatchSpec(**spec))
    if why == "packed":  # 5,000 tokens pack into 2 rows of 4,096: no step of 4
        assert got is not None and "fewer than one step of grad_accum 4" in got
    else:
        assert got is not None and why in got, got


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"grad_accum": 4},
        {"max_seq_len": 256, "overlong": "drop"},
        {"layout": "packed", "token_budget": 2048, "max_seq_len": 512, "grad_accum": 2},
    ],
)
@pytest.mark.parametrize("n", [1, 4, 5, 40, 3000])
def test_a_corpus_is_refused_exactly_when_no_step_of_one_rank_fills(spec, n):
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 400, n)
    lengths[::7] = 0  # some empty samples
    s = BatchSpec(**spec)
    one_rank = plan_epoch(lengths, s, epoch=0)  # world_size 1 is the default
    assert (why_unservable(lengths, s) is None) == (one_rank.num_steps > 0)
