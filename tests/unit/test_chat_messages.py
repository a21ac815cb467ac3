"""Conversations as messages and the span finder's pure parts: row shapes, and character spans
to token masks (no tokenizer, no template)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from trainer.data.messages import MalformedRow, to_messages
from trainer.data.spans import _common_prefix, _common_suffix
from trainer.data.token_spans import mask_from_offsets


def test_to_messages_shapes():
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    openai = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a", "name": None},
        ]
    }
    assert (
        to_messages(sharegpt)
        == to_messages(openai)
        == [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    )
    cases = {
        "missing_messages": {"text": "x"},
        "bad_shape": {"messages": "hello"},
        "empty": {"messages": []},
        "unknown_role": {"messages": [{"role": "robot", "content": "x"}]},
        "non_string_content": {"messages": [{"role": "user", "content": 3}]},
        "empty_assistant": {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]
        },
        "no_assistant_turn": {"messages": [{"role": "user", "content": "q"}]},
    }
    for reason, row in cases.items():
        with pytest.raises(MalformedRow) as e:
            to_messages(row)
        assert e.value.reason == reason


def test_mask_from_offsets_marks_tokens_that_overlap_a_span():
    # tokens: [0,2) [2,5) [5,6) [6,9) [9,12); spans [3,6) and [10,11)
    offsets = np.array([[0, 2], [2, 5], [5, 6], [6, 9], [9, 12]])
    assert mask_from_offsets(offsets, [(3, 6), (10, 11)], 5).tolist() == [0, 1, 1, 0, 1]
    # a span that ends exactly where a token starts does not reach it
    assert mask_from_offsets(offsets, [(0, 2)], 5).tolist() == [1, 0, 0, 0, 0]
    assert mask_from_offsets(offsets, [], 5).tolist() == [0] * 5
    assert mask_from_offsets(offsets[:0], [(0, 1)], 0).tolist() == []


def test_mask_from_offsets_equals_a_per_token_rule_on_random_spans():
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = np.unique(rng.integers(0, 200, 40))
        offsets = np.stack([cuts[:-1], cuts[1:]], 1)
        bounds = np.sort(rng.choice(np.arange(200), 6, replace=False))
        spans = [(int(a), int(b)) for a, b in bounds.reshape(-1, 2)]
        want = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
        assert mask_from_offsets(offsets, spans, len(offsets)).tolist() == want


@pytest.mark.parametrize(
    ("x", "y", "prefix", "suffix"),
    [("abcdef", "abcxef", 3, 2), ("", "abc", 0, 0), ("same", "same", 4, 4), ("ab", "ba", 0, 0)],
)
def test_common_prefix_and_suffix(x, y, prefix, suffix):
    assert _common_prefix(x, y) == prefix
    assert _common_suffix(x, y, min(len(x), len(y))) == suffix


def test_tokenizer_arguments_that_look_like_paths_never_go_to_the_hub(tmp_path, monkeypatch):
    """A folder is a folder; a file, or a path that does not exist, is one error naming it
    (was: ~50 s of Hub retries, or "Repo id must be in the form ..."); only a bare
    ``name`` / ``namespace/name`` matching nothing here is a Hub id."""
    from trainer.data.tokenizer import tokenizer_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "qwen3").mkdir()
    (tmp_path / "tok" / "qwen3" / "tokenizer.json").write_text("{}")
    assert tokenizer_source("tok/qwen3") == Path("tok/qwen3")
    assert tokenizer_source(tmp_path / "tok" / "qwen3") == tmp_path / "tok" / "qwen3"
    for bad, says in [
        ("tok/qwen", "tok/qwen: no such tokenizer folder (tok exists, but has no 'qwen')"),
        ("tok/qwen3/tokenizer.json", "a file, not a tokenizer folder; pass the folder"),
        ("./qwen3", "./qwen3: no such tokenizer folder"),
        ("~/no-such-dflash-tokenizer", "no such tokenizer folder"),
        (str(tmp_path / "missing"), "no such tokenizer folder"),
        ("a/b/c", "a/b/c: no such tokenizer folder"),
        ("qwen3/tokenizer.json", "no such tokenizer folder"),
        ("name with spaces", "no such tokenizer folder"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            tokenizer_source(bad)
    assert tokenizer_source("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a Hub id: nothing here
    assert tokenizer_source("gpt2") == "gpt2"
