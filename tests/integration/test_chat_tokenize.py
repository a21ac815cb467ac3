"""``dflash-train tokenize`` / ``trainer.data.chat``: masks, input formats, accounting, output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT

from loader_server.data.dataset import open_dataset
from scripts.fixtures.tiny_chat import build_tokenizer, generate_conversations, write_jsonl
from trainer.data.corpus import HELDOUT_NAME, REPORT_NAME
from trainer.data.encoder import ChatEncoder
from trainer.data.messages import MalformedRow, to_messages
from trainer.data.sources import read_rows
from trainer.data.token_spans import token_mask
from trainer.data.tokenize import tokenize_corpus
from trainer.data.tokenizer import offsets_encode
from trainer.options import TokenizeOptions


def chatml(sep: str = "\\n", generation: bool = False) -> str:
    """ChatML with ``sep`` after the role; ``generation``: Transformers' {% generation %}
    markers around what the assistant writes, for the reference mask
    (``apply_chat_template(return_assistant_tokens_mask=True)``)."""
    reply = "{{- message['content'] + '<|im_end|>' }}"
    if generation:
        reply = "{%- generation %}" + reply + "{%- endgeneration %}"
    return (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        f"{{{{- '<|im_start|>assistant{sep}' }}}}{reply}{{{{- '\\n' }}}}"
        "{%- else %}"
        f"{{{{- '<|im_start|>' + message['role'] + '{sep}' + message['content'] }}}}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        f"{{%- if add_generation_prompt %}}{{{{- '<|im_start|>assistant{sep}' }}}}{{%- endif %}}"
    )


# The public Qwen3 chat template (tool branches included), as shipped with Qwen3-8B.
QWEN3_OFFICIAL = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

TRICKY = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo 世界?"},
        {"role": "assistant", "content": "Sure 🎉 — ok"},
    ],
    [{"role": "user", "content": "pick"}, {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "assistant"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\nleading newline"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  spaces  \n"}],
    [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2 🎉"},
    ],
]


@pytest.fixture(scope="session")
def toks(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer folders, built once: chatml, qwen3 (tiny stand-in), qwen3 official
    (with <think>/</think> as added tokens like the real one), chatml with generation
    markers (the reference)."""
    root = tmp_path_factory.mktemp("tok")
    out = {
        "chatml": build_tokenizer(root / "chatml", template="chatml"),
        "qwen3": build_tokenizer(root / "qwen3", template="qwen3"),
    }
    from transformers import PreTrainedTokenizerFast

    for name, template, extra in (
        ("official", QWEN3_OFFICIAL, ["<think>", "</think>"]),
        ("generation", chatml(generation=True), []),
        ("colon", chatml(sep=": "), []),
        ("colon_generation", chatml(sep=": ", generation=True), []),
    ):
        tok = PreTrainedTokenizerFast.from_pretrained(str(out["chatml"]))
        tok.add_tokens(extra)
        tok.chat_template = template
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def rows() -> list[dict]:
    return list(generate_conversations(60, seed=7, words=40))


def _tokenize(src, out, tok, *, force=False, enable_thinking=None, **options):
    return tokenize_corpus(src if isinstance(src, list) else [src], out, tokenizer=tok,
                           enable_thinking=enable_thinking, options=TokenizeOptions(**options),
                           progress=False, force=force)  # fmt: skip


def _shard_bytes(folder: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(folder.glob("*.arrow"))]


# ----------------------------------------------------------------------------- masks


def test_chatml_mask_equals_hand_computed(toks):
    enc = ChatEncoder(toks["chatml"])
    tok = enc.tokenizer
    conv = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the time?"},
        {"role": "assistant", "content": "It is late. Go to bed."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because the day is over."},
    ]

    def piece(text: str, label: int) -> tuple[list[int], list[int]]:
        ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        return ids, [label] * len(ids)

    want_ids: list[int] = []
    want_mask: list[int] = []
    for m in conv:
        is_assistant = int(m["role"] == "assistant")
        for text, label in (
            ("<|im_start|>", 0),
            (m["role"] + "\n", 0),
            (m["content"], is_assistant),
            ("<|im_end|>", is_assistant),
            ("\n", 0),
        ):
            ids, mask = piece(text, label)
            want_ids += ids
            want_mask += mask
    ids, mask = enc.encode(conv)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8
    assert ids.tolist() == tok.apply_chat_template(conv, tokenize=True)["input_ids"]
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    assert enc.end_of_turn == "<|im_end|>"
    assert enc.fallbacks == 0


def test_mask_matches_transformers_generation_mask(toks, rows):
    """Without markers, our mask equals Transformers' {% generation %} mask, for the fast
    (anchor) path and for the character-offsets path, on plain and tricky contents."""
    ours, ref = ChatEncoder(toks["chatml"]), ChatEncoder(toks["generation"]).tokenizer
    convs = [to_messages(r) for r in rows] + TRICKY
    results = ours.encode_many(convs)
    for conv, (ids, mask) in zip(convs, results, strict=True):
        want = ref.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == want["input_ids"]
        assert mask.tolist() == want["assistant_masks"], conv
        text = ours._template.render(conv)
        spans = ours._finder.spans(text, conv)
        by_offsets = token_mask(offsets_encode(ours.tokenizer, [text])[0], spans, len(ids))
        assert by_offsets.tolist() == want["assistant_masks"]
    assert ours.fallbacks == ours.offset_fallbacks == 0


def test_straddling_token_uses_offsets(toks):
    """A header ending in ': ' and a reply starting with a word: the token ' there' straddles
    the boundary, so the anchors cannot place the span and the offsets do (any overlap: 1)."""
    ours = ChatEncoder(toks["colon"])
    ref = ChatEncoder(toks["colon_generation"]).tokenizer
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "there you go"}]
    ids, mask = ours.encode(conv)
    want = ref.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == want["input_ids"] and mask.tolist() == want["assistant_masks"]
    assert ours.offset_fallbacks == 1 and ours.fallbacks == 0
    first = ours.tokenizer.decode(ids[mask.argmax() : mask.argmax() + 1].tolist())
    assert first == " there"  # the header's space and the reply's first word


def _supervised_text(enc: ChatEncoder, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded runs of supervised tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    tok = enc.tokenizer
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_qwen3_empty_think_block_is_not_supervised(toks):
    enc = ChatEncoder(toks["qwen3"])
    conv = TRICKY[-1]
    ids, mask = enc.encode(conv)
    text = enc.tokenizer.decode(ids.tolist())
    assert text.count("<think>\n\n</think>\n\n") == 1  # only before the last reply
    assert _supervised_text(enc, ids, mask) == ["a1<|im_end|>", "a2 🎉<|im_end|>"]
    think = enc.tokenizer.backend_tokenizer.encode("<think>\n\n</think>\n\n").ids
    start = next(i for i in range(len(ids)) if ids[i : i + len(think)].tolist() == think)
    assert not mask[start : start + len(think)].any()
    assert enc.fallbacks == 0


def test_qwen3_thinking_switch(toks, caplog):
    on = ChatEncoder(toks["qwen3"], enable_thinking=True)
    off = ChatEncoder(toks["qwen3"], enable_thinking=False)
    conv = TRICKY[-1]
    for a, b in zip(on.encode(conv), off.encode(conv), strict=True):
        assert np.array_equal(a, b)  # the template only changes the generation prompt
    prompt_on, prompt_off = on.prompt_ids(conv[:1]), off.prompt_ids(conv[:1])
    assert off.tokenizer.decode(prompt_off.tolist()).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert on.tokenizer.decode(prompt_on.tolist()).endswith("<|im_start|>assistant\n")
    assert on.takes_thinking and not caplog.records
    with caplog.at_level("WARNING", logger="trainer.data.encoder"):
        ChatEncoder(toks["chatml"], enable_thinking=False)
        ChatEncoder(toks["chatml"], enable_thinking=False)
    assert [r.getMessage() for r in caplog.records] == [
        f"{toks['chatml']}: the chat template ignores enable_thinking=False"
    ]


def test_official_qwen3_template(toks):
    """The real template strips think blocks from earlier replies and leading newlines: those
    conversations take the exact fallback; the plain ones the fast path."""
    enc = ChatEncoder(toks["official"])
    ids, mask = enc.encode(TRICKY[-1])
    assert _supervised_text(enc, ids, mask) == ["a1<|im_end|>", "a2 🎉<|im_end|>"]
    assert enc.fallbacks == 0
    conv = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nfirst"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nreason\n</think>\n\nsecond"},
    ]
    ids, mask = enc.encode(conv)
    assert ids.tolist() == enc.tokenizer.apply_chat_template(conv, tokenize=True)["input_ids"]
    # Earlier reply: rendered without its reasoning. Last: the reasoning is the model's output.
    assert _supervised_text(enc, ids, mask) == [
        "first<|im_end|>",
        "<think>\nreason\n</think>\n\nsecond<|im_end|>",
    ]
    ids, mask = enc.encode([conv[0], {"role": "assistant", "content": "\n\nstripped"}])
    assert _supervised_text(enc, ids, mask) == ["stripped<|im_end|>"]
    assert enc.fallbacks == 2


def test_template_errors_and_no_torch(toks):
    enc = ChatEncoder(toks["chatml"])
    with pytest.raises(MalformedRow) as e:
        enc.encode([{"role": "user", "content": "only a question"}])
    assert e.value.reason == "no_assistant_turn"
    code = (
        "import sys, trainer.data.encoder as c;"
        f"e = c.ChatEncoder({str(toks['qwen3'])!r});"
        "e.encode([{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]);"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------- inputs


def _write_formats(rows: list[dict], root: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    (root / "rows.json").write_text(json.dumps(rows))
    (root / "wrapped.json").write_text(json.dumps({"data": rows}))
    # Columnar formats take their columns from the first row: give every row both (one null).
    columns = [{k: r.get(k) for k in ("id", "messages", "conversations")} for r in rows]
    pq.write_table(pa.Table.from_pylist(columns), root / "rows.parquet")
    datasets.Dataset.from_list(columns).save_to_disk(str(root / "hf"))
    split = root / "split"  # a folder of two JSONL files, read in name order
    write_jsonl(split / "a.jsonl", rows[:25])
    write_jsonl(split / "b.jsonl", rows[25:])
    return {
        "jsonl": write_jsonl(root / "rows.jsonl", rows),
        "json": root / "rows.json",
        "wrapped": root / "wrapped.json",
        "parquet": root / "rows.parquet",
        "hf": root / "hf",
        "folder": split,
    }


def test_formats_give_identical_corpora(toks, rows, tmp_path, monkeypatch):
    paths = _write_formats(rows, tmp_path / "in")
    read = {k: [to_messages(r) for _, _, r in read_rows([p])] for k, p in paths.items()}
    assert all(v == read["jsonl"] for v in read.values())
    # One datasets shard given as a file; the folder read without the datasets package.
    shard = next((paths["hf"]).glob("*.arrow"))
    monkeypatch.setitem(sys.modules, "datasets", None)
    for p in (shard, paths["hf"]):
        assert [to_messages(r) for _, _, r in read_rows([p])] == read["jsonl"]
    monkeypatch.undo()
    shards = {}
    for kind, path in paths.items():
        report = _tokenize(path, tmp_path / kind, toks["chatml"])
        assert report["conversations"] == len(rows) and report["malformed_rows"] == 0
        shards[kind] = _shard_bytes(tmp_path / kind)
    assert all(v == shards["jsonl"] for v in shards.values())
    # --limit reads the first rows whatever the format
    a = _tokenize(paths["parquet"], tmp_path / "lim_pq", toks["chatml"], limit=7)
    b = _tokenize(paths["folder"], tmp_path / "lim_dir", toks["chatml"], limit=30)
    assert (a["rows_read"], a["conversations"], b["rows_read"]) == (7, 7, 30)


# ----------------------------------------------------------------------------- accounting


def _malformed_source(rows: list[dict], path: Path) -> Path:
    bad = [
        {"text": "no conversation"},  # missing_messages
        {"messages": [{"role": "user", "content": "q"}]},  # no_assistant_turn
        {"messages": [{"role": "robot", "content": "q"}]},  # unknown_role
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]},
        {"messages": []},  # empty
        ["not", "an", "object"],  # bad_shape
    ]
    write_jsonl(path, rows[:10] + bad + rows[10:20])
    with open(path, "a") as f:
        f.write("{not json\n\n")  # bad_json, then a blank line (not a row)
        f.write(json.dumps(rows[20]) + "\n")
    return path


def test_malformed_rows_are_counted_never_silently_dropped(toks, rows, tmp_path):
    src = _malformed_source(rows, tmp_path / "mixed.jsonl")
    report = _tokenize(src, tmp_path / "out", toks["chatml"], max_length=80, overflow="drop")
    skipped = report["skipped"]
    assert {k: v["count"] for k, v in skipped.items() if k != "too_long"} == {
        "missing_messages": 1,
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "empty_assistant": 1,
        "non_string_content": 1,
        "empty": 1,
        "bad_shape": 1,
        "bad_json": 1,
    }
    assert (skipped["missing_messages"]["first_row"], skipped["bad_json"]["first_row"]) == (10, 27)
    assert skipped["missing_messages"]["first_file"] == str(src)
    assert report["malformed_rows"] == 8 and report["rows_read"] == 21 + 8
    assert report["dropped_too_long"] == skipped["too_long"]["count"] > 0
    total = report["conversations"] + report["heldout"] + report["malformed_rows"]
    assert total + report["dropped_too_long"] == report["rows_read"]
    assert json.loads((tmp_path / "out" / REPORT_NAME).read_text()) == report
    bad = [(i, r.reason) for _, i, r in read_rows([src]) if isinstance(r, MalformedRow)]
    assert bad == [(16, "bad_shape"), (27, "bad_json")]  # the reader's own; the rest are rows


def test_strict_stops_at_the_first_malformed_row(toks, rows, tmp_path):
    src = _malformed_source(rows, tmp_path / "mixed.jsonl")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"^{src}: row 10: missing_messages: .*--strict"):
        _tokenize(src, out, toks["chatml"], strict=True, workers=2)
    assert not out.exists() and not Path(f"{out}.tmp").exists()


def test_truncate_vs_drop(toks, rows, tmp_path):
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    full = _tokenize(src, tmp_path / "full", toks["chatml"])
    limit = int(full["length"]["p50"])
    cut = _tokenize(src, tmp_path / "cut", toks["chatml"], max_length=limit)
    drop = _tokenize(src, tmp_path / "drop", toks["chatml"], max_length=limit, overflow="drop")
    longer = int((open_dataset(tmp_path / "full").lengths > limit).sum())
    assert cut["truncated"] + cut["dropped_too_long"] == longer > 0
    assert drop["dropped_too_long"] == longer and drop["truncated"] == 0
    assert drop["conversations"] == len(rows) - longer
    assert cut["length"]["max"] == limit and drop["length"]["max"] <= limit
    ds = open_dataset(tmp_path / "cut")
    assert all(ds.loss_mask(i).any() for i in range(len(ds)))


# ----------------------------------------------------------------------------- output


def test_deterministic_any_worker_count_and_loader_opens_it(toks, rows, tmp_path):
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    one = _tokenize(src, tmp_path / "w1", toks["qwen3"], workers=1, shard_rows=23)
    two = _tokenize(src, tmp_path / "w2", toks["qwen3"], workers=2, shard_rows=23)
    assert one["shards"] == ["shard-00000.arrow", "shard-00001.arrow", "shard-00002.arrow"]
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    assert two["workers"] == 2 and one["tokens"] == two["tokens"]
    ds = open_dataset(tmp_path / "w2", vocab_size=one["vocab_size"])
    assert len(ds) == one["conversations"] == len(rows)
    assert int(ds.lengths.sum()) == one["tokens"]
    enc = ChatEncoder(toks["qwen3"])
    for i in (0, 30, len(rows) - 1):
        ids, mask = enc.encode(to_messages(rows[i]))
        assert np.array_equal(ds.input_ids(i), ids) and np.array_equal(ds.loss_mask(i), mask)
    assert int(sum(ds.loss_mask(i).sum() for i in range(len(ds)))) == one["supervised_tokens"]


def test_holdout_prompts_load_with_regen(toks, rows, tmp_path):
    from trainer.data.regen import load_prompts

    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    report = _tokenize(src, tmp_path / "out", toks["qwen3"], holdout=4, enable_thinking=False)
    assert report["conversations"] == len(rows) - 4 and report["heldout"] == 4
    path = Path(report["heldout_prompts"])
    assert path == tmp_path / "out" / HELDOUT_NAME
    prompts = load_prompts(path)
    enc = ChatEncoder(toks["qwen3"], enable_thinking=False)
    for k, prompt in enumerate(prompts):
        messages = to_messages(rows[len(rows) - 4 + k])
        first = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        assert prompt.tolist() == enc.prompt_ids(messages[:first]).tolist()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["sample"] for x in lines] == list(range(len(rows) - 4, len(rows)))
    assert len(open_dataset(tmp_path / "out")) == len(rows) - 4  # the loader skips the JSONL


# ----------------------------------------------------------------------------- CLI


def test_cli(toks, rows, tmp_path):
    from trainer.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["tokenize", "--help"])
    assert result.exit_code == 0 and "--max-length" in result.output
    src = write_jsonl(tmp_path / "rows.jsonl", rows[:10])
    out = tmp_path / "out"
    args = ["--tokenizer", str(toks["chatml"]), "--no-progress", "--workers", "1"]
    result = runner.invoke(main, ["tokenize", str(src), str(out), *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["conversations"] == 10
    for argv, message in (
        ([str(tmp_path / "nope.jsonl"), str(tmp_path / "o2")], "nope.jsonl: no such file"),
        ([str(src), str(out)], "already exists and is not empty (--force replaces it)"),
    ):
        result = runner.invoke(main, ["tokenize", *argv, *args])
        assert result.exit_code == 1
        assert result.output.strip().count("\n") == 0 and message in result.output
    result = runner.invoke(main, ["tokenize", str(src), str(out), *args, "--force"])
    assert result.exit_code == 0 and "10 conversations in the corpus" in result.output
