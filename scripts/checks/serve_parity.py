"""serve-check's parity checks: other projects' DFlash code on our exports computes what the
trainer's drafter computes.

* ``speculators_parity``: speculators' converter takes the export (and validates it), and
  speculators' own DFlash (or DFlash2) forward on a held-out sequence equals the trainer's
  drafter slot for slot (``speculators_check.py``, run in the vLLM virtualenv); our
  ``--format speculators`` export equals the converter's output;
* ``vllm_dflash2_parity``: vLLM's ``DFlash2Qwen3ForCausalLM`` loads a DFlash2 export on CPU
  and its convolutions, candidate logits and selector edges equal the trainer's
  (``vllm_dflash2_check.py``, run in the vLLM virtualenv).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scripts.checks.serve_harness import TRAIN, Check, Verifier, sh

HERE = Path(__file__).resolve().parent

#: How far (relative to the hidden states' or scores' scale) another fp32 implementation's
#: forward may lie from the trainer's drafter's. Two fp32 forwards of the same formulas
#: agree to about 1e-6 of the scale here (each within 1.2e-6 of the float64 forward); once,
#: in CI, speculators' DFlash2 forward came out 5.3e-5 from the float64 one (1.5e-5 of the
#: scale) on inputs and weights that give 1.2e-6 on every rerun, threads and instruction
#: sets varied (cause not found). The smallest formula difference tried, an RMSNorm epsilon
#: of 1e-5 for 1e-6, moves the forward by 5e-2: 500 times this bound.
PARITY_RTOL = 1e-4


def speculators_parity(
    args: argparse.Namespace,
    work: Path,
    tag: str,
    name: str,
    run_dir: Path,
    export: Path,
    target: Path,
    tokens: list[int],
) -> Check:
    """speculators' converter on the export (validated by it), then speculators' own
    DFlash forward on a held-out sequence against the trainer's drafter, slot for slot
    (``scripts/checks/speculators_check.py``, in the vLLM virtualenv)."""
    import torch

    from trainer.model.drafter import DraftBlocks

    check = f"{name}: speculators converts it; its forward == the drafter's"
    ours_dialect = work / f"drafter-{tag}-speculators"
    sh(*TRAIN, "export", str(run_dir), str(ours_dialect), "--dtype", "fp32", "--format",
       "speculators")  # fmt: skip
    verifier = Verifier(target, export)
    ids = torch.tensor(tokens)
    feats, _ = verifier.target.features(ids[None])
    inputs, outputs = work / f"speculators-in-{tag}.pt", work / f"speculators-out-{tag}.pt"
    torch.save({"features": feats, "input_ids": ids[None], "num_anchors": 6,
                "loss_mask": torch.ones(1, ids.numel(), dtype=torch.long)}, inputs)  # fmt: skip
    try:
        sh(args.vllm_python, str(HERE / "speculators_check.py"), str(export),
           str(target), str(work / f"speculators-{tag}"), str(inputs), str(outputs),
           str(ours_dialect), log=work / f"speculators-{tag}.log")  # fmt: skip
    except RuntimeError as e:
        return Check(check, False, str(e)[-300:])
    theirs = torch.load(outputs)
    anchors = theirs["anchors"][theirs["valid"]].tolist()
    drafter = verifier.proposer.drafter
    with torch.no_grad():
        blocks = DraftBlocks.one_document(feats, anchors, ids[anchors])
        ours = drafter(verifier.target.embed_tokens, blocks)
        exact = _float64_forward(verifier, feats, anchors, ids)
    hidden = theirs["hidden"][: ours.shape[0]]
    diff = float((ours - hidden).abs().max())
    scale = float(ours.abs().max())
    detail, dialect_ok = _speculators_detail(theirs, anchors, diff, scale)
    detail += (
        f"; from the float64 forward: ours {float((ours.double() - exact).abs().max()):.1e}, "
        f"speculators' {float((hidden.double() - exact).abs().max()):.1e}"
    )
    if not dialect_ok:
        return Check(check, False, detail)
    if drafter.candidate_selector is not None:  # DFlash2: the selector's candidate scores
        detail, scores_ok = _selector_scores(verifier, ids, anchors, ours, theirs, detail)
        if not scores_ok:
            return Check(check, False, detail)
    if drafter.config.layer_types is not None:  # sliding: speculators trains another rule
        return Check(f"{name}: speculators converts and validates it", True,
                     detail + " (not an equality: speculators masks sliding layers by "
                     "another rule than vLLM serves)")  # fmt: skip
    return Check(check, diff <= PARITY_RTOL * max(scale, 1.0), detail)


def _float64_forward(verifier: Verifier, feats: Any, anchors: list[int], ids: Any) -> Any:
    """The trainer's drafter's forward in float64 (copies of the drafter and embedding):
    the reference each fp32 forward's rounding is measured from."""
    import copy

    from trainer.model.drafter import DraftBlocks

    drafter = copy.deepcopy(verifier.proposer.drafter).double()
    embed = copy.deepcopy(verifier.target.embed_tokens).double()
    blocks = DraftBlocks.one_document(feats.double(), anchors, ids[anchors])
    return drafter(embed, blocks)


def _speculators_detail(
    theirs: dict[str, Any], anchors: list[int], diff: float, scale: float
) -> tuple[str, bool]:
    """What speculators computed, in words, and whether our ``--format speculators`` export
    equals its converter's checkpoint (weights and config)."""
    detail = (
        f"{theirs['speculators_model_type']} checkpoint, aux_hidden_state_layer_ids "
        f"{theirs['aux_hidden_state_layer_ids']}; {len(anchors)} blocks at anchors {anchors}: "
        f"max |ours - speculators'| {diff:.2e} (hidden states up to {scale:.1f})"
    )
    mine = theirs["ours"]
    differ = dict(mine["config_differs"])
    note = ""
    # speculators' DFlash converter always writes sliding_window_non_causal false (its
    # default), which vLLM turns into dflash_config.causal true for every layer: full and
    # bidirectional layers served causal. Ours says true there (what was trained).
    if differ.get("sliding_window_non_causal") == [True, False]:
        del differ["sliding_window_non_causal"]
        note = (
            " (but sliding_window_non_causal: ours true, the converter's false, which vLLM "
            "serves as causal in every layer)"
        )
    detail += (
        f"; our --format speculators export: {mine['tensors']} tensors "
        f"{'equal' if mine['weights_equal'] else 'DIFFER'}, {mine['config_keys']} config keys"
        + (f", differ: {differ}" if differ else " equal")
        + note
    )
    return detail, bool(mine["weights_equal"]) and not differ


def _selector_scores(
    verifier: Verifier, ids: Any, anchors: list[int], ours: Any, theirs: dict[str, Any],
    detail: str,
) -> tuple[str, bool]:  # fmt: skip
    """DFlash2: the selector's teacher-forced scores of the unary top-K candidates, ours
    against speculators'; ``detail`` with the comparison added, and whether they agree."""
    import torch

    drafter = verifier.proposer.drafter
    selector = drafter.candidate_selector
    assert selector is not None  # a DFlash2 drafter's
    b = drafter.config.block_size
    with torch.no_grad():
        logits = verifier.target.lm_head(ours).float()
        cands = logits.topk(selector.top_k, dim=-1).indices
        block = ids[torch.tensor(anchors)[:, None] + torch.arange(b)]
        prev = torch.cat([block[:, :1], block[:, :-1]], 1).reshape(-1)
        scores = logits.gather(1, cands) + selector.transitions(ours, prev, cands)
    n = scores.shape[0]
    same_ids = torch.equal(cands, theirs["candidates"][:n])
    score_d = float((scores - theirs["scores"][:n]).abs().max())
    detail += (
        f"; selector scores of the top-{selector.top_k}: max |ours - speculators'| "
        f"{score_d:.2e}, candidate ids {'equal' if same_ids else 'DIFFER'}"
    )
    differ = not same_ids or score_d > PARITY_RTOL * max(float(scores.abs().max()), 1.0)
    return detail, not differ


def vllm_dflash2_parity(
    args: argparse.Namespace, work: Path, name: str, export: Path, target: Path,
    tokens: list[int],
) -> Check:  # fmt: skip
    """vLLM's ``DFlash2Qwen3ForCausalLM`` loads the export on CPU and its convolutions,
    candidate logits and selector edges equal the trainer's on the same inputs
    (``scripts/checks/vllm_dflash2_check.py``, in the vLLM virtualenv)."""
    import torch

    check = f"{name}: vLLM's DFlash2 model class loads it; its pieces == the drafter's"
    ours = _dflash2_pieces(Verifier(target, export), tokens)
    inputs, outputs = work / "vllm-dflash2-in.pt", work / "vllm-dflash2-out.pt"
    torch.save({k: v for k, v in ours.items() if k not in ("convs", "edges")}, inputs)
    try:
        sh(args.vllm_python, str(HERE / "vllm_dflash2_check.py"), str(target),
           str(export), str(inputs), str(outputs), log=work / "vllm-dflash2.log")  # fmt: skip
    except RuntimeError as e:
        return Check(check, False, str(e)[-300:])
    problems, detail = _dflash2_compare(ours, torch.load(outputs))
    return Check(check, not problems, "; ".join(problems) if problems else detail)


def _dflash2_pieces(verifier: Verifier, tokens: list[int]) -> dict[str, Any]:
    """The trainer's DFlash2 pieces on fixed inputs: every layer's two convolutions
    (``prepare`` and ``finish`` on random rows), one block's hidden states after an anchor,
    their unary top-K candidates and the selector's edges. The inputs go to vLLM as they are
    (``convs`` and ``edges`` are ours alone)."""
    import torch

    from trainer.model.dflash2 import softcap_logits
    from trainer.model.drafter import DraftBlocks

    drafter, tgt = verifier.proposer.drafter, verifier.target
    cfg, selector = drafter.config, drafter.candidate_selector
    assert selector is not None
    g = torch.Generator().manual_seed(0)
    rows, hid = 2 * cfg.block_size, cfg.hidden_size
    conv_in = [torch.randn(rows, hid, generator=g) for _ in drafter.layers]
    conv_out = [torch.randn(rows, hid, generator=g) for _ in drafter.layers]
    ids = torch.tensor(tokens)
    anchor = min(12, ids.numel() - 1)
    feats, _ = tgt.features(ids[None])
    with torch.no_grad():
        blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
        hidden = drafter(tgt.embed_tokens, blocks)[1:]
        logits = softcap_logits(tgt.lm_head(hidden).float(), cfg.output_multiplier,
                                cfg.final_logit_softcapping)  # fmt: skip
        unary, cands = logits.topk(selector.top_k, dim=-1)
        edges = selector.edges(hidden, unary, cands, int(ids[anchor]))
        ours_conv = []
        for i, layer in enumerate(drafter.layers):
            convs: tuple[Any, Any] = (layer.attention_conv, layer.mlp_conv)  # DFlash2's
            for conv in convs:
                y, c = conv.prepare(conv_in[i])
                ours_conv.append((y, conv.finish(conv_out[i], c)))
    return {"block": cfg.block_size, "conv_in": conv_in, "conv_out": conv_out,
            "hidden": hidden, "candidates": cands, "unary": unary,
            "anchor": ids[anchor : anchor + 1], "lm_head": tgt.lm_head.weight,
            "convs": ours_conv, "edges": edges}  # fmt: skip


def _dflash2_compare(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[list[str], str]:
    """What differs between our DFlash2 pieces and vLLM's (nothing, when the check passes),
    and the comparison in words."""
    import torch

    problems = []
    # vLLM's parameters all filled from the export, but the target's embedding and LM head
    # (nested loaders also report their own, unprefixed names: only the model's count)
    theirs["loaded"] = sorted(set(theirs["loaded"]) & set(theirs["params"]))
    unfilled = sorted(
        n for n in set(theirs["params"]) - set(theirs["loaded"]) - set(theirs["unused"])
        if not n.endswith(("embed_tokens.weight", "lm_head.weight"))
    )  # fmt: skip
    if unfilled:
        problems.append(f"vLLM parameters not from the export: {unfilled}")
    dflash2 = [n for n in theirs["loaded"] if "conv" in n or "candidate_selector" in n]
    conv = max(
        float((a - b).abs().max())
        for mine, their in zip(ours["convs"], theirs["convs"], strict=True)
        for a, b in zip(mine, their, strict=True)
    )
    if not torch.equal(theirs["candidates"], ours["candidates"]):
        problems.append("candidates differ")
    unary_d = float((theirs["unary"] - ours["unary"]).abs().max())
    edge_d = float((theirs["edges"] - ours["edges"]).abs().max())
    for label, d in (("convolutions", conv), ("candidate logits", unary_d), ("edges", edge_d)):
        if d > 1e-4:
            problems.append(f"{label} differ by {d:.2e}")
    detail = (
        f"{theirs['architectures']}: {len(theirs['exported'])} exported tensors -> "
        f"{len(theirs['loaded'])} of {len(theirs['params'])} parameters ({len(dflash2)} "
        f"convolution and selector ones; not filled: the target's embedding and LM head, "
        f"unused {theirs['unused'] or 'none'}); "
        f"max |ours - vLLM's|: convolutions {conv:.1e}, "
        f"top-{theirs['top_k']} candidate logits {unary_d:.1e} (same ids), selector edges "
        f"{edge_d:.1e}"
    )
    return problems, detail
