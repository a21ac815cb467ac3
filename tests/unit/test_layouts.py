"""Batch layouts in one place (``loader_server.wire.layouts``): every entry has its planning,
the spec's choices and refusals come from the entries, and no code elsewhere compares a
layout's name (read from the source, as the layering rules are)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loader_server.planning.planner import PLANNING
from loader_server.wire.layouts import LAYOUTS, PACKED, PADDED, layout
from loader_server.wire.spec import SPEC_FIELDS, BatchSpec

ROOT = Path(__file__).resolve().parents[2]
#: Every tree with code that may meet a batch layout (the tests themselves may name them).
TREES = ("loader_server", "client", "trainer", "benchmarks", "scripts")
HOME = "loader_server/wire/layouts.py"


def _names(node: ast.AST) -> set[str]:
    """The layout names ``node`` is, or holds as a literal set, tuple or list."""
    if isinstance(node, ast.Constant) and node.value in LAYOUTS:
        return {node.value}
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in LAYOUTS}
    return set()


def name_comparisons(source: str, path: str) -> list[str]:
    """``path:line`` of every comparison of a layout name: ``x == "packed"``, ``"padded" !=
    x``, ``x in {"packed", "padded"}``."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Compare) and any(
            _names(side) for side in (node.left, *node.comparators)
        ):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_code_outside_the_registry_compares_layout_names():
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != HOME:
                found += name_comparisons(path.read_text(), rel)
    assert found == [], "consult loader_server.wire.layouts (a layout's facts) instead"


@pytest.mark.parametrize(
    "code",
    [
        'if spec.layout == "packed": pass',
        'x = "padded" != b.layout',
        'ok = name in {"padded", "packed"}',
        'ok = name not in ("packed",)',
    ],
)
def test_the_check_finds_each_kind_of_comparison(code):
    assert name_comparisons(code, "x.py") == ["x.py:1"]


def test_the_check_leaves_facts_and_other_strings_alone():
    code = 'a = layout(spec.layout).packs\nb = mode == "packed_attention"\nc = {"layout": x}'
    assert name_comparisons(code, "x.py") == []


def test_every_layout_has_its_planning_and_is_a_spec_choice():
    assert set(PLANNING) == set(LAYOUTS)
    meta = SPEC_FIELDS["layout"].metadata
    assert meta["choices"] == tuple(LAYOUTS)
    assert BatchSpec().layout in LAYOUTS
    for entry in LAYOUTS.values():
        assert entry.help in meta["help"]


def test_a_layout_s_refusals_name_the_value_and_the_way_out():
    with pytest.raises(ValueError, match="order 'sequential' is a padded-layout baseline"):
        BatchSpec(layout=PACKED.name, order="sequential")
    with pytest.raises(ValueError, match="composition 'sorted' is a padded-layout baseline"):
        BatchSpec(layout=PACKED.name, composition="sorted")
    BatchSpec(layout=PADDED.name, composition="sorted", order="sequential")  # its own
    with pytest.raises(ValueError, match=r"unknown batch layout 'rows': one of padded, packed"):
        layout("rows")


def test_field_shapes_and_document_bounds_follow_the_fact():
    assert PADDED.field_shapes(3, 7) == (
        ("input_ids", (3, 7)), ("loss_mask", (3, 7)), ("lengths", (3,)), ("sample_ids", (3,)),
    )  # fmt: skip
    shapes = dict(PACKED.field_shapes(3, 7))
    assert shapes["input_ids"] == shapes["position_ids"] == (1, 7)
    assert shapes["cu_seqlens"] == (4,) and shapes["lengths"] == (3,)
    kw = {"token_budget": 100, "max_batch_size": 8}
    assert PADDED.max_docs(**kw, shortest=3) == 8
    assert PACKED.max_docs(**kw, shortest=3) == 33
    assert PACKED.max_docs(**kw, shortest=1) == 100  # never more than its tokens
    assert PACKED.max_docs(token_budget=100, max_batch_size=8, shortest=500) == 1
