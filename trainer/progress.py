"""The one progress bar of long commands (tqdm; off with ``--no-progress``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm


def progress_bar(
    total: int | None, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0
) -> tqdm[Any]:
    """A tqdm bar on stderr, disabled (no output) when not ``enabled``."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
        initial=initial,
    )  # fmt: skip
