"""``--init-drafter`` reads both dialects of an export: the DFlash one (z-lab's,
Transformers') and speculators' (``--format speculators``), for DFlash and DFlash2 drafters.
Each is read back into the drafter it was exported from, the two dialects give the same
options and weights, runs started from either export the same files, the speculators
config maps back onto the DFlash one (the writer's mapping inverted), and what a
speculators folder gets wrong is refused in one line naming the file and the field."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafters import greedy_samples, run_opts, train_run, trained_drafter
from safetensors.torch import load_file, save_file

from trainer.hf.export import export_drafter
from trainer.hf.folder import read_drafter_folder
from trainer.hf.speculators import dflash_from_speculators, speculators_config
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.options import DFLASH2_DEFAULTS
from trainer.run import build_drafter, init_from_folder, resolve_init_drafter

pytestmark = pytest.mark.integration

B, MASK, WINDOW = 4, 511, 6
KINDS = ("sliding_attention", "full_attention")
DFLASH2 = dict(variant="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=32)
DIALECTS = ("dflash", "speculators")


def drafter_config(target, variant: str) -> DrafterConfig:
    """Two layers, a bidirectional sliding one next to a full one (what both dialects say)."""
    return DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=2, block_size=B, mask_token_id=MASK,
        layer_types=KINDS, sliding_window=WINDOW, sliding_causal=False,
        **(DFLASH2 if variant == "dflash2" else {}),
    )  # fmt: skip


def run(target, samples, run_dir: Path, drafter: DFlashDrafter) -> Path:
    """One step of the real loop from ``drafter``, seeded alike every time."""
    torch.manual_seed(0)
    return train_run(target, samples, run_dir, drafter, LossConfig(block_size=B), 1)


def exports(run_dir: Path, root: Path) -> dict[str, Path]:
    return {f: export_drafter(run_dir, root / f, dtype="fp32", fmt=f) for f in DIALECTS}


def init(folder: Path, target, tmp_path: Path, **opts):
    """``(options, drafter)`` of a run started with ``--init-drafter folder``."""
    o, spec = resolve_init_drafter(run_opts(init_drafter=folder, **opts))
    drafter = build_drafter(target, o, torch.device("cpu"))
    init_from_folder(drafter, spec, target, replace(o, run_dir=tmp_path))
    return o, drafter, spec


@pytest.fixture(scope="module")
def samples(target):
    return greedy_samples(target, MASK, n=4)


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def released(request, target, samples, tmp_path_factory):
    """``(variant, trained drafter, {dialect: export})`` of a one-step run."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    src = run(target, samples, root / "run", DFlashDrafter(drafter_config(target, request.param)))
    return request.param, trained_drafter(src), exports(src, root)


def test_both_dialects_init_the_same_drafter_and_export_the_same(
    released, target, samples, tmp_path
):
    variant, trained, folders = released
    opts, again = {}, {}
    for dialect, folder in folders.items():
        opts[dialect], drafter, spec = init(folder, target, tmp_path / dialect)
        assert spec.dialect == dialect and drafter.config == trained.config
        for name, value in trained.state_dict().items():
            assert torch.equal(drafter.state_dict()[name], value), (dialect, name)
        # A run started from it, exported again in both dialects.
        again[dialect] = exports(run(target, samples, tmp_path / f"r-{dialect}", drafter),
                                 tmp_path / f"e-{dialect}")  # fmt: skip
    assert replace(opts["dflash"], init_drafter=None) == replace(
        opts["speculators"], init_drafter=None
    )
    assert opts["dflash"].drafter == variant and opts["dflash"].sliding_bidirectional
    for fmt in DIALECTS:
        a, b = (again[d][fmt] for d in DIALECTS)
        before = (folders[fmt] / "model.safetensors").read_bytes()
        assert (a / "model.safetensors").read_bytes() != before  # the step trained it
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        assert (a / "config.json").read_text() == (b / "config.json").read_text()
    # The dialects hold the same tensors, before and after.
    for folders_ in (folders, again["dflash"]):
        ours, theirs = (load_file(folders_[f] / "model.safetensors") for f in DIALECTS)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(
    "kinds, is_causal",
    [(list(KINDS), False), (["sliding_attention"] * 2, None), (["sliding_attention"] * 2, False)],
)
def test_the_speculators_config_maps_back_onto_the_dflash_one(released, kinds, is_causal):
    """The writer's mapping inverted: every key of the DFlash dialect but the two the
    layout drops (``auto_map``, ``num_target_layers``) and DFlash2's neutral ones it has no
    field for (the reader's defaults) comes back as it was."""
    _, _, folders = released
    dflash = json.loads((folders["dflash"] / "config.json").read_text())
    dflash = {k: v for k, v in dflash.items() if k != "is_causal"}
    dflash.update(layer_types=kinds, **({} if is_causal is None else {"is_causal": is_causal}))
    spec = speculators_config(dflash, verifier="t", verifier_architectures=["Q"], where="w")
    back = dflash_from_speculators(spec, Path("c.json"))
    kept = {k: v for k, v in dflash.items() if k not in ("auto_map", "num_target_layers")}
    inner, got = kept.pop("dflash_config"), back["dflash_config"]
    assert {k: back.get(k) for k in kept} == kept
    assert got == {k: v for k, v in inner.items() if k in got}
    dropped = {k: v for k, v in inner.items() if k not in got}
    assert dropped == {k: DFLASH2_DEFAULTS[k] for k in dropped}


def speculators_copy(folder: Path, dest: Path, *, top=None, layer=None, tensors=None) -> Path:
    """A copy of a speculators export with top-level / transformer_layer_config keys
    replaced (None removes one) and its tensors edited."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    for into, changes in ((cfg, top or {}), (cfg["transformer_layer_config"], layer or {})):
        for key, value in changes.items():
            into.pop(key) if value is None else into.__setitem__(key, value)
    (dest / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(dest / "model.safetensors")), dest / "model.safetensors")
    return dest


def test_a_speculators_folder_is_checked_as_a_dflash_one(released, target, tmp_path):
    variant, _, folders = released
    src = folders["speculators"]
    cases = [
        ({"top": {"aux_hidden_state_layer_ids": None}}, "no aux_hidden_state_layer_ids"),
        ({"top": {"aux_hidden_state_layer_ids": [0, 1, 2]}}, "0 is no target layer's output"),
        ({"top": {"speculators_model_type": "eagle3"}}, "speculators_model_type 'eagle3'"),
        ({"top": {"mask_token_id": None}}, "no mask_token_id"),
        ({"top": {"draft_vocab_size": 256}}, "draft_vocab_size 256 != transformer_layer_config"),
        ({"top": {"sample_from_anchor": True}}, "sample_from_anchor True is not supported"),
        ({"top": {"sliding_window_non_causal": False}}, "sliding_window_non_causal False disag"),
        ({"top": {"sliding_window_non_causal": False}, "layer": {"is_causal": None}},
         "sliding_window_non_causal false next to full_attention"),
        ({"layer": {"num_hidden_layers": 3}}, "layer_types has 2 entries for num_hidden_layers"),
        ({"layer": {"sliding_window": None, "use_sliding_window": None}},
         "sliding_attention layers but sliding_window"),
        ({"layer": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}},
         "rope_type 'dynamic' changes its frequencies"),
        ({"layer": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                        "original_max_position_embeddings": 64}}},
         "rope_scaling {'rope_type': 'yarn'"),  # not this run's target's RoPE
        ({"layer": {"hidden_size": 64}}, "hidden_size 64 != 128"),
        ({"top": {"block_size": 8}}, "block_size 8 != 4"),
        ({"tensors": lambda s: {**s, "d2t": torch.zeros(4)}}, "tensor d2t is not a drafter"),
        ({"tensors": lambda s: {**s, "fc.weight": s["fc.weight"][:, :-1].contiguous()}},
         "tensor fc.weight has shape"),
    ]  # fmt: skip
    if variant == "dflash2":
        cases.append(({"top": {"selector_rank": None}}, "no selector_rank"))
    for i, (edit, needle) in enumerate(cases):
        folder = speculators_copy(src, tmp_path / str(i), **edit)
        with pytest.raises(ValueError) as err:
            if needle.startswith(("block_size", "hidden_size")):  # against the run's drafter
                o, spec = resolve_init_drafter(run_opts(init_drafter=folder))
                o = replace(o, block_size=B)
                drafter = build_drafter(target, o, torch.device("cpu"))
                init_from_folder(drafter, spec, target, replace(o, run_dir=tmp_path))
            else:
                init(folder, target, tmp_path)
        message = str(err.value)
        assert needle in message and str(folder) in message, (edit, message)
        assert "\n" not in message
    # A flag given must agree with the speculators folder as with a DFlash one.
    with pytest.raises(ValueError, match=r"--block-size 16 differs .*'s block_size 4"):
        resolve_init_drafter(run_opts(init_drafter=src, block_size=16))


def test_speculators_defaults_and_its_converter_s_full_layers(released, tmp_path, caplog):
    """speculators saves only what differs from the config class's defaults, and its
    converter writes ``sliding_window_non_causal`` false for full-attention drafters
    (trained bidirectional inside the block): such a folder reads, with a warning."""
    _, _, folders = released
    full = speculators_copy(
        folders["speculators"], tmp_path / "full",
        top={"sliding_window_non_causal": False},
        layer={"layer_types": None, "use_sliding_window": None, "sliding_window": None,
               "is_causal": None, "hidden_act": None, "attention_bias": None},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trainer.hf.speculators"):
        folder = read_drafter_folder(full)
    assert "vLLM serves every layer of this folder causal" in caplog.text
    assert folder.layer_types is None and folder.config["hidden_act"] == "silu"
    assert folder.target_layer_ids == [0, 1, 2] and folder.mask_token_id == MASK
