"""Batch layouts: how a micro-batch's documents sit in its tensors. One entry per layout,
and the one place that knows a layout's name: the spec's choices and refusals, the planner
(``loader_server.planning.planner``: its ``PLANNING`` keeps each layout's batch maker), the
daemon's slots (``service.session``), the client's field shapes (``client.loader``) and the
trainer's document view (``trainer.model.doc_view``) all consult the entry, never the name.

Adding a layout is an entry here plus its planning (a batch maker in ``PLANNING``); the
tests check that every entry has one, and that no code elsewhere compares layout names.
"""

from __future__ import annotations

from dataclasses import dataclass

FieldShapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Layout:
    """One batch layout's facts."""

    name: str
    #: The spec's help for this layout (``--spec layout=``).
    help: str
    #: Documents end to end in one row of ``width`` tokens, positions restarting at each
    #: (``position_ids``, ``cu_seqlens`` travel with the batch); else a row per document,
    #: right-padded to the micro-batch's ``width``.
    packs: bool
    #: The spec's compositions and orders a plan of this layout may be drawn in (None:
    #: every one), and why another is refused (after its name).
    compositions: tuple[str, ...] | None = None
    orders: tuple[str, ...] | None = None
    refusal: str = ""

    def field_shapes(self, rows: int, width: int) -> FieldShapes:
        """The tensor fields of a micro-batch of ``rows`` documents (its ``width`` tokens
        wide) and their shapes, in the order the slot and the client's copy lay them out."""
        if self.packs:
            return (
                ("input_ids", (1, width)),
                ("loss_mask", (1, width)),
                ("position_ids", (1, width)),
                ("lengths", (rows,)),
                ("sample_ids", (rows,)),
                ("cu_seqlens", (rows + 1,)),
            )
        return (
            ("input_ids", (rows, width)),
            ("loss_mask", (rows, width)),
            ("lengths", (rows,)),
            ("sample_ids", (rows,)),
        )

    def max_docs(self, *, token_budget: int, max_batch_size: int, shortest: int) -> int:
        """The most documents one micro-batch can hold: its rows (a row each), or how many of
        the ``shortest`` non-empty documents fit a packed row; never more than its tokens."""
        docs = max(1, token_budget // max(shortest, 1)) if self.packs else max_batch_size
        return min(docs, token_budget)

    def check(self, composition: str, order: str) -> None:
        """ValueError when a plan of this layout cannot be drawn that way."""
        for what, value, allowed in (("composition", composition, self.compositions),
                                     ("order", order, self.orders)):  # fmt: skip
            if allowed is not None and value not in allowed:
                raise ValueError(f"{what} {value!r} {self.refusal}")


PADDED = Layout(
    name="padded",
    help="padded ([B, L] rows, one document each)",
    packs=False,
)
PACKED = Layout(
    name="packed",
    help="packed (one row of whole documents end to end)",
    packs=True,
    compositions=("bucketed", "random"),
    orders=("stratified", "shuffled"),
    refusal=(
        "is a padded-layout baseline: give layout 'padded' with it (packed rows, the default "
        "layout, are always drawn at random)"
    ),
)
LAYOUTS: dict[str, Layout] = {x.name: x for x in (PADDED, PACKED)}
DEFAULT = PACKED.name


def layout(name: str) -> Layout:
    """The layout named ``name``; ValueError naming the known ones."""
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown batch layout {name!r}: one of {', '.join(LAYOUTS)}") from None
