"""Every name the docs put in backticks that names code exists in the code.

The docs are README.md, docs/*.md and systemd/README.md. What counts as code, and how each
kind is checked (source is read as text or with ``ast``; nothing heavy is imported):

* a path into the repository (``loader_server/service/rings.py``, ``tests/x.py::test_y``)
  exists, and so does the test it names; a relative code file (``cli/plan.py``,
  ``loss.py``) is the end of some repository path;
* a dotted name rooted in one of our packages (``loader_server.data.dataset``,
  ``trainer.data.regen.load_prompts``) resolves to a module file and a name it defines;
  ``Class.method`` names a method of that class; ``module.name`` with a module's short name
  (``chat.tokenize_corpus``) or an object (``batch.num_tokens``) names something defined in
  our code;
* ``name(...)`` names a function or class of ours, and each ``keyword=`` in the parentheses
  is one of its parameters; a CamelCase word names a class (or other name) of ours;
  a snake_case word is a name or string constant somewhere in our code (config keys,
  metric names and report fields are strings there);
* ``dflash-loader X`` / ``dflash-train X`` name a subcommand, and the ``--flags`` after it
  are its options (also on the command lines of code blocks); ``X --flag`` with X one of
  the subcommands likewise; ``python benchmarks/...`` / ``python -m benchmarks...`` and
  ``scripts/`` commands take only flags their source defines; a span of flags alone
  (``--slots``) names an option of some command of ours; ``from ... import`` lines of
  code blocks import names our modules define.

Names of other projects (systemd directives, torch, Transformers, SGLang, vLLM...) are in the
allow-lists below, each with its origin. Plain lowercase words (``auto``, ``fill``), values,
shell snippets and ALL-CAPS names (environment variables, constants of C and the kernel)
are not checked: the rule cannot tell them from prose.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "systemd/README.md"]
#: Where the code the docs may name lives.
PACKAGES = ("loader_server", "client", "trainer", "scripts", "benchmarks")
#: Top-level folders a path in the docs may start with.
TOP = (*PACKAGES, "tests", "docs", "systemd")
CODE_SUFFIXES = (".py", ".pyi", ".c", ".h", ".sh")
CLIS = {"dflash-loader": "loader_server.cli.main", "dflash-train": "trainer.cli"}

# Allow-lists: names of other projects the docs rightly mention.
EXTERNAL_FILES = {
    # SpecForge, SGLang, vLLM, Transformers and z-lab files the trainer's docs compare with
    "eagle3_utils.py",
    "regenerate_train_data.py",
    "dflash/model.py",
    "srt/models/dflash.py",
    "srt/speculative/dflash_utils.py",
    "generation/candidate_generator.py",
    "model_executor/models/qwen3_dflash.py",
}
EXTERNAL_NAMES = {
    # systemd unit directives (systemd/README.md discusses which the units set)
    "LimitMEMLOCK",
    "LockPersonality",
    "PrivateMounts",
    "ProtectClock",
    "ProtectControlGroups",
    "ProtectHostname",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "RuntimeDirectoryMode",
    # Transformers: the chat template call, its mask option, and generate()
    "apply_chat_template",
    "return_assistant_tokens_mask",
    "generate",
    # numpy, the kernel
    "default_rng",
    "fork",
    "madvise",
    # notation in formulas, not calls: exp(x), loss(t), rng([seed, ...]) for default_rng
    "exp",
    "loss",
    "rng",
    # torchrun's c10d rendezvous options (--rdzv-conf KEY=VALUE, docs/TRAINER.md)
    "is_host",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "last_call_timeout",
    # an error kind our code builds with an f-string (trainer/data/server/http.py: f"http_{status}")
    "http_503",
}
#: Flags of other programs the docs name.
EXTERNAL_FLAGS = {
    # torchrun
    "--max-restarts",
    "--rdzv-endpoint",
    "--nnodes",
    # SGLang and vLLM servers
    "--max-running-requests",
    "--max-num-seqs",
    "--dp",
    "--reasoning-parser",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "--generation-config",
    "--no-async-scheduling",
    "--no-enable-prefix-caching",
    # docker run, systemd-nspawn
    "--shm-size",
    "--ipc",
    "--keep-unit",
    "--register",
}
#: Words after which a command of ours is the program run (not an argument of another).
LAUNCHERS = {"--no-python", "sudo", "exec"}
HELP = {"-h", "--help"}  # both CLIs' help_option_names
#: Roots of dotted names that are other projects' modules.
EXTERNAL_MODULES = {"np", "math", "torch", "pyarrow", "datasets", "zmq", "http", "pickle"}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./*{},:-]*)")
REL_CODE = re.compile(r"^[\w./-]+(" + "|".join(map(re.escape, CODE_SUFFIXES)) + ")$")
FILE_NAME = re.compile(r"\.(py|pyi|c|h|sh|md|toml|png|json|jsonl|tmp|safetensors|example)$")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?$")
CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
KEYWORD = re.compile(r"(?<![\w=!<>])([A-Za-z_]\w*)=(?!=)")


# --------------------------------------------------------------------------- the docs


def doc_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, in a code block) for every line of a Markdown file. Fences as
    CommonMark reads them: a backtick fence's info string holds no backtick (a line opening
    with the span ```` ``` ```` is prose), and a fence closes only on a bare fence of its own
    character at least as long."""
    fence = ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and not fence and not (m.group(1)[0] == "`" and "`" in m.group(2)):
            fence = m.group(1)
            continue
        closes = m and fence and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)
        if closes and not m.group(2).strip():
            fence = ""
            continue
        yield n, line, bool(fence) or line.startswith("    ")


def spans() -> list[tuple[str, str]]:
    """(where, text) of every inline code span outside code blocks."""
    out = []
    for doc in DOCS:
        name = doc.relative_to(ROOT)
        text = "\n".join(line if not block else "" for _, line, block in doc_lines(doc))
        for m in SPAN.finditer(text):
            where = f"{name}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append((where, m.group(2).strip()))
    return out


def command_lines() -> list[tuple[str, str]]:
    """(where, command) for each line of the code blocks (continuations joined)."""
    out = []
    for doc in DOCS:
        pending = ""
        for n, line, block in doc_lines(doc):
            if not block:
                pending = ""
                continue
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            out.append((f"{doc.relative_to(ROOT)}:{n}", pending.split(" #")[0]))
            pending = ""
    return out


# --------------------------------------------------------------------------- the code


def py_files() -> list[Path]:
    # .py and .pyi (never the bytecode a machine that writes __pycache__ leaves)
    found = (p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py*")))
    return [p for p in found if p.suffix in (".py", ".pyi")]


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


class Index:
    """What our packages' source defines, read once with ``ast``."""

    def __init__(self) -> None:
        #: function or class name -> its parameter (or field) names; "*" takes any
        self.functions: dict[str, set[str]] = {}
        #: class name -> every name in its bodies (methods, attributes, fields)
        self.classes: dict[str, set[str]] = {}
        #: every name defined or used as a name, attribute, parameter or keyword
        self.names: set[str] = set()
        #: every identifier-like word in a string constant (keys, metric names, messages)
        self.strings: set[str] = set()
        for path in py_files():
            self.names.add(path.name.split(".")[0])
            for node in ast.walk(parsed(path)):
                self.add(node)
        for c_file in (ROOT / "loader_server").rglob("*.[ch]"):
            self.names.update(re.findall(r"[A-Za-z_]\w*", c_file.read_text()))
        self.names.update(self.functions)

    def add(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
            if node.args.kwarg:
                params.add("*")
            self.functions.setdefault(node.name, set()).update(params)
        elif isinstance(node, ast.ClassDef):
            members = {_name(n) for n in ast.walk(node)} - {None}
            fields = {
                b.target.id
                for b in node.body
                if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
            }
            self.functions.setdefault(node.name, set()).update(fields or {"*"})
            self.classes.setdefault(node.name, set()).update(members)  # type: ignore[arg-type]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.strings.update(re.findall(r"[A-Za-z_][\w.]*", node.value))
        name = _name(node)
        if name:
            self.names.add(name)


def _name(node: ast.AST) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.keyword):
        return node.arg
    return None


@cache
def code_index() -> Index:
    return Index()


def known(name: str) -> bool:
    index = code_index()
    return name in index.names or name in index.strings or name in EXTERNAL_NAMES


@cache
def module_file(dotted: str) -> Path | None:
    base = ROOT / dotted.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    out: set[str] = set()
    for node in parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


@cache
def cli_group(prog: str) -> click.Group:
    group = importlib.import_module(CLIS[prog]).main
    assert isinstance(group, click.Group)
    return group


def options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | HELP


@cache
def defined_tests() -> set[str]:
    return {
        name
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        for name in re.findall(r"def (test_\w+)", p.read_text())
    }


@cache
def repo_files() -> tuple[str, ...]:
    """Every file's path relative to the root, hidden folders (.git, .venv) left out."""
    return tuple(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    )


def quoted_flags(folder: str) -> set[str]:
    """Every ``"--flag"`` literal in a folder's source (argparse and click both spell so)."""
    return {
        flag
        for p in sorted((ROOT / folder).rglob("*.py"))
        for flag in re.findall(r"[\"'](--[\w-]+)[\"']", p.read_text())
    }


# --------------------------------------------------------------------------- the checks


def check_paths(text: str) -> list[str]:
    errors = []
    for m in PATH.finditer(text):
        path, _, test = m.group(1).rstrip(".,:").partition("::")
        if "*" in path or "{" in path:
            if not list(ROOT.glob(re.sub(r"\{[^}]*\}", "*", path))):
                errors.append(f"no file matches {path}")
            continue
        if not (ROOT / path).exists():
            errors.append(f"no such path {path}")
        elif test and not re.search(rf"def {re.escape(test)}\b", (ROOT / path).read_text()):
            errors.append(f"{path} has no {test}")
    relative = not PATH.search(text) and REL_CODE.match(text) and text not in EXTERNAL_FILES
    if relative and not any(("/" + p).endswith("/" + text) for p in repo_files()):
        errors.append(f"no file ends with {text}")
    return errors


def check_dotted(text: str) -> list[str]:
    m = DOTTED.match(text)
    if not m or FILE_NAME.search(text):
        return []
    parts = m.group(1).split(".")
    if parts[0] in EXTERNAL_MODULES:
        return []
    if parts[0] in PACKAGES:
        for cut in range(len(parts), 0, -1):
            path = module_file(".".join(parts[:cut]))
            if path is None:
                continue
            rest = parts[cut:]
            if rest and rest[0] not in top_level_names(path):
                return [f"{'.'.join(parts[:cut])} defines no {rest[0]}"]
            members = code_index().classes.get(rest[0]) if len(rest) > 1 else None
            if members is not None and rest[1] not in members:
                return [f"class {rest[0]} has no {rest[1]}"]
            return []
        return [f"no module {parts[0]}.{parts[1]}"]
    if parts[0][0].isupper():
        members = code_index().classes.get(parts[0])
        if members is None and parts[0] not in EXTERNAL_NAMES:
            return [f"no class {parts[0]}"]
        if members is not None and parts[1] not in members:
            return [f"class {parts[0]} has no {parts[1]}"]
        return []
    return [] if known(parts[-1]) else [f"{parts[-1]} is not defined in the code"]


def check_call(text: str) -> list[str]:
    m = CALL.match(text)
    if not m or len(m.group(1)) < 3 or hasattr(builtins, m.group(1)):
        return []
    name = m.group(1)
    if name in EXTERNAL_NAMES:
        return []
    functions = code_index().functions
    if name not in functions:
        return [f"no function or class {name}"]
    params = functions[name]
    return [
        f"{name} has no parameter {k}"
        for k in KEYWORD.findall(m.group(2))
        if "*" not in params and k not in params
    ]


def check_word(text: str) -> list[str]:
    if text.startswith("test_"):
        return [] if text in defined_tests() else [f"no test {text}"]
    if CAMEL.match(text) or SNAKE.match(text):
        return [] if known(text) else [f"{text} is not defined in the code"]
    return []


def check_commands(text: str) -> list[str]:
    """``dflash-loader X --flag``, ``X --flag`` (X a subcommand), ``python benchmarks/..``."""
    errors = []
    for segment in re.split(r"\s*(?:\|\||&&|;|\|)\s*", text):
        words = segment.split()
        for i, word in enumerate(words):
            prog = word.rsplit("/", 1)[-1]
            if prog in CLIS and (i == 0 or words[i - 1] in LAUNCHERS):
                errors += check_cli(prog, words[i + 1 :])
            elif i == 0 and len(words) > 1 and words[1].startswith("--"):
                errors += check_bare_subcommand(word, words[1:])
            elif re.fullmatch(r"(benchmarks|scripts)/[\w/]+\.py", word) and i > 0:
                errors += check_script_flags(word.split("/")[0], words[i + 1 :])
            elif word == "-m" and i + 1 < len(words) and words[i + 1].split(".")[0] in PACKAGES:
                if module_file(words[i + 1]) is None:
                    errors.append(f"no module {words[i + 1]}")
                errors += check_module_flags(words[i + 1], words[i + 2 :])
    return errors


def flags_in(words: list[str]) -> list[str]:
    return [f for w in words if w.startswith("--") for f in w.split("=")[0].split("/")]


def check_flags(flags: list[str], valid: set[str], what: str) -> list[str]:
    return [
        f"{what} has no {f}"
        for f in flags
        if f not in valid
        and f not in EXTERNAL_FLAGS
        and not (f.endswith("*") and any(v.startswith(f[:-1]) for v in valid))
    ]


def check_cli(prog: str, words: list[str]) -> list[str]:
    group = cli_group(prog)
    while words and words[0].startswith("-"):
        if words[0] not in options(group):
            return [f"{prog} has no option {words[0]}"]
        if words[0] in HELP:
            return []  # help ends the command line; what follows is prose
        words = words[1:]
    if not words or not re.fullmatch(r"[a-z][\w-]*", words[0]):
        return []  # a placeholder such as COMMAND, or the group alone
    command = group.commands.get(words[0])
    if command is None:
        return [f"{prog} has no command {words[0]}"]
    return check_flags(flags_in(words[1:]), options(command), f"{prog} {words[0]}")


def check_bare_subcommand(name: str, words: list[str]) -> list[str]:
    commands = [g.commands[name] for g in map(cli_group, CLIS) if name in g.commands]
    if not commands:
        return []
    valid = set().union(*(options(c) for c in commands))
    return check_flags(flags_in(words), valid, name)


def check_script_flags(folder: str, words: list[str]) -> list[str]:
    return check_flags(flags_in(words), quoted_flags(folder), f"{folder}/ code")


@cache
def module_command_flags(dotted: str) -> frozenset[str] | None:
    """The options of the click command ``python -m DOTTED`` runs (its ``__main__`` for a
    package), whose flags are made from options' fields rather than written out; None when
    it defines none."""
    path = module_file(dotted)
    if path is not None and path.name == "__init__.py" and (path.parent / "__main__.py").is_file():
        dotted, path = dotted + ".__main__", path.parent / "__main__.py"
    if path is None or 'if __name__ == "__main__":' not in path.read_text():
        return None  # importing it would run it
    try:
        module = importlib.import_module(dotted)
    except ImportError:
        return None
    found = [v for v in vars(module).values() if isinstance(v, click.Command)]
    return frozenset(set().union(*map(options, found))) if found else None


def check_module_flags(dotted: str, words: list[str]) -> list[str]:
    """``python -m DOTTED --flag``: its command's options, else the flags its tree quotes."""
    flags = module_command_flags(dotted)
    if flags is None:
        return check_script_flags(dotted.split(".")[0], words)
    return check_flags(flags_in(words), set(flags), f"python -m {dotted}")


@cache
def every_flag() -> set[str]:
    """Every option of both CLIs' commands, and every flag benchmarks/ and scripts/ define."""
    flags = quoted_flags("benchmarks") | quoted_flags("scripts")
    for main in sorted((ROOT / "benchmarks").rglob("__main__.py")):
        dotted = ".".join(main.parent.relative_to(ROOT).parts)
        flags |= module_command_flags(dotted) or set()
    for group in map(cli_group, CLIS):
        flags |= options(group).union(*(options(c) for c in group.commands.values()))
    return flags


def check_bare_flags(text: str) -> list[str]:
    """A span of flags alone (``--slots``, ``--spec KEY=VALUE``) names options we have."""
    if not text.startswith("--"):
        return []
    return check_flags(flags_in(text.split()), every_flag(), "no command")


def check_imports(text: str) -> list[str]:
    """``from loader_server.x import y`` in a code block: y is defined in that module."""
    m = re.fullmatch(r"\s*from ([\w.]+) import ([\w, ]+)", text)
    if not m or m.group(1).split(".")[0] not in PACKAGES:
        return []
    return [
        e for name in m.group(2).split(",") for e in check_dotted(f"{m.group(1)}.{name.strip()}")
    ]


CHECKS = (check_paths, check_dotted, check_call, check_word, check_commands, check_bare_flags)


def problems() -> list[str]:
    out = []
    for where, text in spans():
        out += [f"{where}: `{text}`: {e}" for check in CHECKS for e in check(text)]
    for where, text in command_lines():
        block_checks = (check_paths, check_commands, check_imports)
        out += [f"{where}: {e}" for check in block_checks for e in check(text)]
    return out


def test_every_code_name_in_the_docs_exists():
    assert problems() == []


def test_every_relative_link_in_the_docs_exists():
    """``[text](path)`` and ``![image](path)`` links to files of the repository."""
    missing = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in DOCS
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", doc.read_text())
        if "://" not in target and not (doc.parent / target).exists()
    ]
    assert missing == []


@pytest.mark.parametrize(
    "text",
    [
        "loader_server/service/shm.py",
        "loader_server.service.nothing",
        "loader_server.data.dataset.write_rows",
        "loader_server.data.dataset.ArrowDataset.write_rows",
        "open_dataset(path, no_such_keyword=1)",
        "LoaderClient.no_such_method()",
        "NoSuchClass",
        "no_such_function()",
        "dflash-loader bench corpus",
        "dflash-loader serve --no-such-flag",
        "serve --no-such-flag",
        "python benchmarks/bench_loader.py corpus --no-such-flag",
        "python -m benchmarks.no_such_tool",
        "tests/unit/test_docs.py::test_no_such_test",
        "--no-such-flag",
    ],
)
def test_a_name_that_does_not_exist_is_caught(text):
    assert [e for check in CHECKS for e in check(text)]


def test_an_import_in_a_code_block_is_checked():
    assert check_imports("from loader_server.planning.planner import plan_epoch, EpochPlan") == []
    assert check_imports("from client import LoaderClient") == []
    assert check_imports("from loader_server.service.server import NoSuchName")
    assert check_imports("from torch import nn") == []


@pytest.mark.parametrize(
    "text",
    [
        "loader_server/service/rings.py",
        "loader_server.data.dataset",
        "loader_server.data.dataset.ArrowDataset.fill",
        "trainer.data.regen.load_prompts",
        "open_dataset(path, vocab_size=None)",
        "LoaderClient.close()",
        "dflash-loader serve --slots",
        "--shm-dir",
        "dflash-loader --debug COMMAND ...",
        "python benchmarks/bench_loader.py CORPUS --warmup 20",
        "tests/unit/test_docs.py::test_a_name_that_does_not_exist_is_caught",
    ],
)
def test_a_name_that_exists_passes(text):
    assert [e for check in CHECKS for e in check(text)] == []


def test_code_blocks_are_found_where_markdown_finds_them(tmp_path):
    """A line opening with an inline span of backticks is prose, not a fence (from there on
    every block and every span would be read inside out); a fence closes on its own kind."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```` ``` ```` ends a block.\n"  # 1: prose
        "```bash\n"
        "make test\n"  # 3: code
        "~~~\n"  # 4: code (not this fence's kind)
        "```\n"
        "after `x`\n"  # 6: prose
        "    indented\n"  # 7: code
    )
    got = {n: block for n, _, block in doc_lines(doc)}
    assert got == {1: False, 3: True, 4: True, 6: False, 7: True}
