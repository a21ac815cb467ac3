"""vLLM's JSON configurations this project passes: a DFlash drafter as the speculator
(serving and evaluation), and the hidden-state extraction the engine room trains from
(``extract_hidden_states`` with our connector)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The connector class vLLM loads from ``CONNECTOR_DIR`` (on its ``PYTHONPATH``).
CONNECTOR = "DFlashHiddenStatesConnector"
CONNECTOR_MODULE = "dflash_hidden_states"
CONNECTOR_DIR = Path(__file__).resolve().parent / "connector"


def dflash_speculative_config(drafter: Path, num_speculative_tokens: int) -> dict[str, Any]:
    """``--speculative-config`` serving a DFlash drafter folder."""
    return {"method": "dflash", "model": str(drafter),
            "num_speculative_tokens": num_speculative_tokens}  # fmt: skip


def states_speculative_config(engine_ids: list[int]) -> dict[str, Any]:
    """``--speculative-config`` extracting the hidden states of vLLM layer ids
    ``engine_ids`` (``num_speculative_tokens`` 1, the ids in
    ``draft_model_config.hf_config``: vLLM reads nothing else there)."""
    hf = {"eagle_aux_hidden_state_layer_ids": list(engine_ids)}
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": hf}}  # fmt: skip


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """``--kv-transfer-config``: our connector, with ``extra`` as its
    ``kv_connector_extra_config`` (the transport's settings)."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_connector_extra_config": dict(extra)}  # fmt: skip
