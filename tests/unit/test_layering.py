"""The architecture as rules: which package may import which (read from the source with
``ast``, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "pyarrow", "zmq")
#: What the trainer (and tools built on it) may use of the daemon's package.
PUBLIC = (
    "loader_server.wire",  # the protocol, the ring, the batch spec (stated once)
    "loader_server.data.dataset",
    "loader_server.cli.contract",  # the command-line contract both commands keep
    "loader_server.faults",  # the fault points of the fault matrix, in both processes
)


def imports(package: str) -> dict[str, set[str]]:
    """Module file -> every module it imports (absolute names; ``from x import y`` gives
    both ``x`` and ``x.y``, so importing a submodule by name is seen)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[str(path.relative_to(ROOT))] = names
    return out


def offenders(package: str, forbidden) -> list[str]:
    return [
        f"{path} imports {name}"
        for path, names in imports(package).items()
        for name in sorted(names)
        if forbidden(name)
    ]


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# room -> rooms of loader_server it must not import
ROOMS = {
    "loader_server/wire": ("data", "planning", "service", "cli"),
    "loader_server/data": ("planning", "service", "cli"),
    "loader_server/planning": ("data", "service", "cli"),
    "loader_server/service": ("cli",),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_rooms_import_only_the_rooms_below_them(room):
    banned = tuple(f"loader_server.{r}" for r in ROOMS[room])
    assert offenders(room, lambda n: _under(n, *banned)) == []


def test_the_wire_is_pure_python_and_msgpack():
    assert offenders("loader_server/wire", lambda n: _under(n, *HEAVY, "client", "trainer")) == []


def test_the_client_shares_only_the_wire_with_the_daemon():
    bad = offenders(
        "client",
        lambda n: (
            _under(n, "pyarrow", "trainer")
            or (_under(n, "loader_server") and not _under(n, "loader_server.wire"))
        ),
    )
    assert bad == []


#: What ``trainer/ops`` (calibration fits the planner's cost model) may use besides.
OPS_PUBLIC = ("loader_server.planning.cost",)


def _public(name: str, allowed: tuple[str, ...]) -> bool:
    """Not the daemon's, one of ``allowed``, or a package on the way to one (``from
    loader_server.planning import cost``)."""
    return (
        not _under(name, "loader_server")
        or _under(name, *allowed)
        or any(p.startswith(name + ".") for p in allowed)
    )


def test_the_trainer_uses_only_the_daemon_s_public_modules():
    """The batch spec is the wire's (``loader_server.wire.spec``): the trainer reads no
    planner, but calibration (``trainer/ops``) fits the planner's cost model's features."""
    bad = [
        f"{path} imports {name}"
        for path, names in imports("trainer").items()
        for name in sorted(names)
        if not _public(name, PUBLIC + (OPS_PUBLIC if path.startswith("trainer/ops/") else ()))
    ]
    assert bad == []


@pytest.mark.parametrize("package", ["loader_server", "client", "trainer"])
def test_installed_packages_never_import_the_dev_trees(package):
    # scripts/ and benchmarks/ are not installed: a product module importing them would
    # work in a checkout and fail after `pip install`.
    assert offenders(package, lambda n: _under(n, "scripts", "benchmarks", "tests")) == []


def test_the_rules_see_real_imports():
    # The checker itself: it finds a known import of each kind.
    assert "loader_server.wire.protocol" in imports("client")["client/loader.py"]
    assert "torch" in imports("client")["client/loader.py"]
    assert offenders("client", lambda n: n == "torch") != []


# ---- the trainer ---------------------------------------------------------------------------

#: trainer room -> what it must not import. The foundation (``trainer.options`` and
#: ``trainer.option_values``, ``trainer.files``, ``trainer.progress``) is open to every
#: room; ``trainer.run`` (the composition root) assembles the rooms and only
#: ``trainer.cli`` stands above it.
TRAINER_ROOMS = {
    "trainer/model": ("data", "train", "hf", "ops", "engine", "cli", "run"),
    "trainer/data": ("train", "hf", "ops", "engine", "cli", "run"),
    "trainer/train": ("data", "hf", "ops", "engine", "cli", "run"),
    "trainer/hf": ("data", "ops", "engine", "cli", "run"),
    "trainer/ops": ("model", "data", "hf", "engine", "cli", "run"),
    "trainer/eval": ("train", "engine", "cli", "run"),
    # the engine room sits on the training room (batches, the process group) and feeds the
    # run; vLLM's home is a leaf every room that talks to vLLM shares
    "trainer/engine": ("data", "hf", "ops", "eval", "cli", "run"),
    "trainer/vllm": ("model", "data", "train", "hf", "ops", "eval", "engine", "cli", "run"),
    "trainer/run.py": ("cli",),
}
FOUNDATION = (
    "trainer/options.py",
    "trainer/sections.py",
    "trainer/engine_options.py",
    "trainer/option_values.py",
    "trainer/files.py",
    "trainer/progress.py",
)


def _trainer_module(name: str) -> str | None:
    """The trainer module file an imported name refers to (None: not the trainer's)."""
    return _module_file(name, "trainer")


def _module_file(name: str, package: str) -> str | None:
    """The module file of ``package`` an imported name refers to (None: not the package's)."""
    if not _under(name, package):
        return None
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return str(path.relative_to(ROOT))
    return None


def _file_imports(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("room", sorted(TRAINER_ROOMS))
def test_trainer_rooms_import_only_what_lies_below_them(room):
    banned = tuple(f"trainer.{r}" for r in TRAINER_ROOMS[room])
    files = [room] if room.endswith(".py") else sorted(imports(room))
    bad = [
        f"{f} imports {n}" for f in files for n in sorted(_file_imports(f)) if _under(n, *banned)
    ]
    assert bad == []


@pytest.mark.parametrize("module", FOUNDATION)
def test_the_trainer_foundation_imports_no_trainer_module_and_no_torch(module):
    # ... but the foundation itself (the options read their values through option_values)
    names = {n for n in _file_imports(module) if _trainer_module(n) not in FOUNDATION}
    assert [n for n in sorted(names) if _under(n, "trainer", "torch")] == []


def _assert_no_import_cycle(package: str) -> None:
    """No module of ``package`` (dotted) imports, directly or through others of it, a module
    that imports it back; ``_file_imports`` walks the whole file, so an import inside a
    function counts as one at the top."""
    folder = ROOT.joinpath(*package.split("."))
    graph: dict[str, set[str]] = {}
    for path in sorted(str(p.relative_to(ROOT)) for p in folder.rglob("*.py")):
        deps = {_module_file(n, package) for n in _file_imports(path)}
        graph[path] = {d for d in deps if d is not None and d != path}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError(
                "import cycle: " + " -> ".join([*stack[stack.index(node) :], node])
            )
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            # a package's __init__ importing its own modules is how a package is built
            if not (node.endswith("__init__.py") and dep.startswith(node[: -len("__init__.py")])):
                visit(dep, [*stack, node])
        done.add(node)

    for node in graph:
        visit(node, [])
    assert len(done) == len(graph)


def test_trainer_modules_form_no_import_cycle():
    _assert_no_import_cycle("trainer")


def test_the_trainer_layering_rules_see_real_imports():
    assert _trainer_module("trainer.model.loss.draft_loss") == "trainer/model/loss.py"
    assert _trainer_module("trainer.train") == "trainer/train/__init__.py"
    assert "trainer.model.blocks" in _file_imports("trainer/model/loss.py")


@pytest.mark.parametrize(
    "module", ["trainer.cli", "trainer.ops.calibrate", "trainer.ops.plot", "trainer.data.tokenize"]
)
def test_torch_free_parts_of_the_trainer_import_no_torch(module):
    # the command group, calibration, plots and tokenization start in well under a second
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- scripts/ ------------------------------------------------------------------------------

#: scripts room -> the rooms of scripts/ it must not import. The demo (``scripts/demo.py``)
#: stands above them all; checks may use servers and fixtures, servers fixtures alone.
SCRIPT_ROOMS = {
    "scripts/fixtures": ("servers", "checks", "demo"),
    "scripts/servers": ("checks", "demo"),
    "scripts/checks": ("demo",),
}
#: Programs run by file path (``python scripts/servers/chat_server.py``: no repository root
#: on ``sys.path``) or in vLLM's own virtualenv (the project is not installed there): they
#: import nothing of this repository.
STANDALONE = (
    "scripts/servers/chat_server.py",
    "scripts/checks/speculators_check.py",
    "scripts/checks/vllm_dflash2_check.py",
    "scripts/checks/vllm_rope_check.py",
    "scripts/checks/vllm_weight_probe.py",
)
OURS = ("loader_server", "client", "trainer", "scripts", "benchmarks", "tests")


def test_scripts_never_import_the_benchmarks_or_the_tests():
    # benchmarks/ may import scripts/; the other way round would make a cycle of dev trees
    assert offenders("scripts", lambda n: _under(n, "benchmarks", "tests")) == []


def test_every_script_lies_in_a_room_or_is_the_demo_or_setup():
    top = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert top == ["__init__.py", "demo.py", "setup_venv.sh"]
    rooms = {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").iterdir() if p.is_dir()}
    assert rooms - {"scripts/__pycache__"} == set(SCRIPT_ROOMS)
    for room in SCRIPT_ROOMS:  # each one a package: ``python -m scripts.checks.x``
        assert (ROOT / room / "__init__.py").is_file(), room


@pytest.mark.parametrize("room", sorted(SCRIPT_ROOMS))
def test_script_rooms_import_only_the_rooms_below_them(room):
    banned = tuple(f"scripts.{r}" for r in SCRIPT_ROOMS[room])
    assert offenders(room, lambda n: _under(n, *banned)) == []


@pytest.mark.parametrize("program", STANDALONE)
def test_standalone_programs_import_nothing_of_the_repository(program):
    assert [n for n in sorted(_file_imports(program)) if _under(n, *OURS)] == []


def test_the_script_rules_see_real_imports():
    names = imports("scripts/checks")["scripts/checks/serve_drafters.py"]
    assert "scripts.servers.daemon_process" in names
    assert offenders("scripts/checks", lambda n: _under(n, "scripts.servers")) != []
    assert "trainer.model.drafter" in _file_imports("scripts/checks/serve_parity.py")


# ---- benchmarks/ -----------------------------------------------------------------------------


def test_experiment_modules_form_no_import_cycle():
    # the experiment imports most of its modules inside functions (torch, vLLM and the
    # trainer load only when a step needs them): those imports count too
    _assert_no_import_cycle("benchmarks.experiment")


def _trainer_imports(package: str) -> list[tuple[str, str, str]]:
    """(file, module, name) of every import of the trainer in ``package``'s files, those
    inside functions too (``import trainer.x`` gives the name ``*``)."""
    found = []
    for path in sorted((ROOT / package.replace(".", "/")).glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and _under(node.module or "", "trainer"):
                found += [(rel, str(node.module), a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(rel, a.name, "*") for a in node.names if _under(a.name, "trainer")]
    return found


def test_the_experiment_uses_only_its_declared_trainer_api():
    from benchmarks.experiment import TRAINER_API

    used = _trainer_imports("benchmarks.experiment")
    outside = [f"{f}: {m}.{n}" for f, m, n in used if n not in TRAINER_API.get(m, ())]
    assert outside == [], "declare it in benchmarks/experiment/__init__.py, or do without"
    unused = {(m, n) for m, names in TRAINER_API.items() for n in names}
    unused -= {(m, n) for _, m, n in used}
    assert unused == set(), "an entry the experiment no longer uses"


def test_the_api_rule_sees_every_kind_of_trainer_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.py").write_text(
        "import trainer.run\nfrom trainer.files import atomic_output\n"
        "def f():\n    from trainer.train import checkpoint as ckpt\n"
    )
    assert sorted(_trainer_imports("p")) == [
        ("p/a.py", "trainer.files", "atomic_output"),
        ("p/a.py", "trainer.run", "*"),
        ("p/a.py", "trainer.train", "checkpoint"),
    ]


def test_the_cycle_rule_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    assert "benchmarks.experiment.analysis" in _file_imports("benchmarks/experiment/run.py")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.py").write_text("import p.b\n")
    (tmp_path / "p" / "b.py").write_text("def f():\n    from p.a import g\n")
    with pytest.raises(AssertionError, match=r"import cycle: p/\w\.py -> p/\w\.py -> p/"):
        _assert_no_import_cycle("p")


# ---- room sizes ------------------------------------------------------------------------------

#: Trees whose modules and functions stay small enough to read whole (STYLE.md habit 3).
SMALL_TREES = ("trainer", "scripts", "client", "loader_server", "benchmarks")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sizes(tree: str) -> tuple[list[str], list[str]]:
    """The modules of ``tree`` over ``MAX_MODULE_LINES`` and its functions over
    ``MAX_FUNCTION_LINES`` (from the ``def`` line to the last, docstring included)."""
    modules, functions = [], []
    for path in sorted((ROOT / tree).rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(ROOT)
        if src.count("\n") > MAX_MODULE_LINES:
            modules.append(f"{rel}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return modules, functions


@pytest.mark.parametrize("tree", SMALL_TREES)
def test_modules_and_functions_stay_small(tree):
    modules, functions = _sizes(tree)
    assert modules == [] and functions == []


def test_the_size_rule_sees_long_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "t").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "t" / "m.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    modules, functions = _sizes("t")
    assert len(modules) == 1 and functions == ["t/m.py:1 f: 61 lines"]
