"""The architecture as rules: which package may import which (read from the source with
``ast``, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "pyarrow", "zmq")
#: What the trainer (and tools built on it) may use of the daemon's package.
PUBLIC = ("loader_server.wire", "loader_server.planning.cost", "loader_server.data.dataset")


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


def test_the_trainer_uses_only_the_daemon_s_public_modules():
    bad = offenders(
        "trainer",
        # a package on the way to a public module (``from loader_server.planning import
        # cost``) is fine; anything else of loader_server is not
        lambda n: (
            _under(n, "loader_server")
            and not _under(n, *PUBLIC)
            and not any(p.startswith(n + ".") for p in PUBLIC)
        ),
    )
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
