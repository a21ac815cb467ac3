"""The remote code shipped in an exported drafter folder (``dflash-train export``).

``configuration_dflash.py`` and ``modeling_dflash.py`` are copied verbatim next to the
weights, so they import only ``torch`` and ``transformers`` (and each other, relatively).
``AutoModel.from_pretrained(DIR, trust_remote_code=True)`` loads them from there; the trainer
imports them from here (tests compare the two against the trainer's drafter).
"""

from __future__ import annotations

from pathlib import Path

REMOTE_CODE_FILES = ("configuration_dflash.py", "modeling_dflash.py")
#: The folder architecture of each drafter generation (``DrafterConfig.variant``), in both
#: dialects of a drafter folder (``trainer.hf.folder``, ``trainer.hf.speculators``).
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


def remote_code_paths() -> list[Path]:
    """The files to copy into an export folder."""
    here = Path(__file__).parent
    return [here / name for name in REMOTE_CODE_FILES]
