"""The training math as pure code (no model, no process): the block attention rule, anchor
sampling and the cap, labels and weights, the fused LM head, chunk planning, the LR
schedule, the loader spec a run asks for, held-out prompts."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_server.wire.spec import AnchorRule
from trainer.data.regen import load_prompts, split_prompt
from trainer.model.attention import BlockChunk, block_attention
from trainer.model.blocks import (
    DocumentDraw,
    LossConfig,
    cap_anchors,
    plan_blocks,
    position_weights,
    sample_anchors,
)
from trainer.model.drafter import (
    plan_chunks,
)
from trainer.model.loss import head_loss
from trainer.model.target import (
    Target,
    TinyTargetSpec,
    build_tiny_model,
    default_layer_ids,
)
from trainer.run import loader_spec
from trainer.sections import RunOptions
from trainer.train.batches import Batch
from trainer.train.clock import lr_factor
from trainer.train.served_spec import ServedSpecError, check_checkpoint_spec


def _chunk(ctx_len: int, anchors: list[int], b: int, docs=None, blk_docs=None) -> BlockChunk:
    docs = torch.zeros(ctx_len, dtype=torch.long) if docs is None else torch.tensor(docs)
    pos = torch.cat([torch.arange(int((docs == d).sum())) for d in docs.unique()])
    blk = torch.zeros(len(anchors), dtype=torch.long) if blk_docs is None else blk_docs
    return BlockChunk(docs, pos, torch.as_tensor(blk), torch.tensor(anchors), b)


def test_mask_hand_checked():
    # Context of 5 positions, blocks of 2 at anchors 1 and 3.
    m = _chunk(5, [1, 3], 2).dense_mask()
    expected = torch.tensor(
        [
            # ctx t0..t4   | block keys b0 b1 (block 0) b2 b3 (block 1)
            [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0, anchor slot: sees t0 only (< 1)
            [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0, mask slot: same, bidirectional in block
            [1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1: t0..t2 (< 3), not block 0
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)


def test_mask_blocks_see_only_their_own_document():
    # Two documents of 3 and 2 positions packed; one block in each, anchors 2 and 1.
    m = _chunk(5, [2, 1], 1, docs=[0, 0, 0, 1, 1], blk_docs=torch.tensor([0, 1])).dense_mask()
    assert m.tolist() == [
        [True, True, False, False, False, True, False],
        [False, False, False, True, False, False, True],
    ]


def test_mask_anchor_zero_sees_no_context():
    m = _chunk(4, [0], 3).dense_mask()
    assert not m[:, :4].any() and m[:, 4:].all()


def test_per_document_sdpa_and_flex_equal_the_dense_mask():
    """flex_attention's BlockMask (eager on CPU) and SDPA's dense mask give one output."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    docs = [0] * 40 + [1] * 30 + [2] * 20
    chunk = _chunk(90, [5, 17, 39, 0, 12, 29, 3], 4, docs, torch.tensor([0, 0, 0, 1, 1, 1, 2]))
    q = torch.randn(1, 4, chunk.num_queries, 16, generator=g)
    k = torch.randn(1, 2, chunk.num_keys, 16, generator=g)
    v = torch.randn(1, 2, chunk.num_keys, 16, generator=g)
    per_doc = block_attention(q, k, v, chunk, "sdpa")
    flex = block_attention(q, k, v, chunk, "flex")
    assert torch.allclose(per_doc, flex, atol=1e-5)
    # ... and both equal one SDPA call over the whole chunk with its dense mask.
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    dense = F.scaled_dot_product_attention(q, kk, vv, attn_mask=chunk.dense_mask()[None, None])
    assert torch.allclose(per_doc, dense, atol=1e-5)


def test_anchors_hand_checked():
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    rule = AnchorRule(block_size=2, anchors_per_doc=100, tokens_per_anchor=1)
    pos, valid = sample_anchors(lm, torch.tensor([10]), torch.Generator(), rule=rule)
    # Supervised from 3; a block of 2 needs a + 2 <= 10: anchors 3..8, all of them.
    assert pos[0][valid[0]].tolist() == [3, 4, 5, 6, 7, 8]


def test_anchors_skip_docs_with_few_supervised_tokens():
    lm = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    # B=4 needs 8 supervised tokens: doc 0 has 7, doc 1 has 6 -> nothing.
    rule = AnchorRule(block_size=4, anchors_per_doc=4, tokens_per_anchor=1)
    _, valid = sample_anchors(lm, torch.tensor([8, 8]), torch.Generator(), rule=rule)
    assert not valid.any()


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n_docs=st.integers(1, 4),
    block=st.integers(2, 5),
    anchors_per_doc=st.integers(1, 6),
    tokens_per_anchor=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_anchor_properties(data, n_docs, block, anchors_per_doc, tokens_per_anchor, seed):
    lengths = [data.draw(st.integers(1, 30)) for _ in range(n_docs)]
    width = max(lengths)
    lm = torch.zeros(n_docs, width, dtype=torch.uint8)
    for d, n in enumerate(lengths):
        bits = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        lm[d, :n] = torch.tensor(bits, dtype=torch.uint8)
    rule = AnchorRule(block, anchors_per_doc, tokens_per_anchor)
    keys = (
        torch.Generator().manual_seed(seed)
        if seed % 2
        else DocumentDraw(seed, 1).keys(torch.arange(n_docs), width)
    )
    pos, valid = sample_anchors(lm, torch.tensor(lengths), keys, rule=rule)
    for d, n in enumerate(lengths):
        chosen = pos[d][valid[d]].tolist()
        cands = [a for a in range(n) if lm[d, a] == 1 and a + block <= n]
        assert len(chosen) == len(set(chosen)) <= anchors_per_doc
        if int(lm[d].sum()) < 2 * block:
            assert chosen == []
            continue
        assert set(chosen) <= set(cands)
        assert len(chosen) == min(anchors_per_doc, -(-len(cands) // tokens_per_anchor))


def test_anchors_resampled_per_generator():
    lm = torch.ones(1, 200, dtype=torch.uint8)
    rule = AnchorRule(block_size=4, anchors_per_doc=8)
    draw = [
        sample_anchors(lm, torch.tensor([200]), torch.Generator().manual_seed(s), rule=rule)[0]
        for s in (1, 1, 2)
    ]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)]))


def _draw() -> DocumentDraw:
    return DocumentDraw(seed=0, epoch=0)


def test_plan_blocks_hand_checked():
    ids = torch.arange(100, 110)[None].int()
    lm = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.uint8)
    batch = Batch(
        input_ids=ids, loss_mask=lm, lengths=torch.tensor([10]), sample_ids=torch.tensor([7]),
        max_seqlen=10, num_tokens=10,
    )  # fmt: skip
    # B=2: supervised anchors with a + 2 <= 10.
    cfg = LossConfig(block_size=2, gamma=2.0, tokens_per_anchor=1, weighting="decay")
    plan = plan_blocks(batch, cfg, _draw())
    assert plan.blk_anchor.tolist() == [1, 2, 3, 4, 5, 6, 8]
    assert plan.labels[:, 0].tolist() == [102, 103, 104, 105, 106, 107, 109]
    # loss_mask[7] == 0 drops offset 1 of anchor 6.
    assert plan.weights[:, 0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    # B=4 needs 8 supervised tokens (there are 8) and a + 4 <= 10.
    cfg = LossConfig(block_size=4, gamma=2.0, tokens_per_anchor=1, weighting="decay")
    plan = plan_blocks(batch, cfg, _draw())
    e = math.exp(-0.5)
    assert plan.blk_anchor.tolist() == [1, 2, 3, 4, 5, 6]
    assert plan.labels[4].tolist() == [106, 107, 108]
    assert torch.allclose(plan.weights[0], torch.tensor([1.0, e, e * e]))
    assert torch.allclose(plan.weights[4], torch.tensor([1.0, 0.0, e * e]))
    assert torch.allclose(plan.weights[5], torch.tensor([0.0, e, e * e]))
    lm[0, 1] = 0  # 7 supervised < 2B: the document is skipped
    assert plan_blocks(batch, LossConfig(block_size=4), _draw()) is None


def test_anchors_whose_blocks_predict_no_supervised_token_are_no_blocks():
    """A supervised token every 4th position: 16 of them (>= 2B, so the document is kept)
    and anchors drawn at each, but each block's targets are unsupervised: nothing to
    train, as a micro-batch without anchors (no 0/0 mean, the drafter run for a zero loss)."""
    ids = torch.arange(64)[None].int()
    lm = (torch.arange(64) % 4 == 0)[None].to(torch.uint8)
    batch = Batch(
        input_ids=ids, loss_mask=lm, lengths=torch.tensor([64]), sample_ids=torch.tensor([3]),
        max_seqlen=64, num_tokens=64,
    )  # fmt: skip
    for weighting in ("decay", "dpace"):
        cfg = LossConfig(block_size=4, tokens_per_anchor=1, weighting=weighting)
        assert plan_blocks(batch, cfg, _draw()) is None
        lm[0, 5] = 1  # a supervised target (anchor 4's offset 1) and anchor (its offset 3: 8)
        plan = plan_blocks(batch, cfg, _draw())
        assert plan is not None and int((plan.weights > 0).sum()) == 2
        lm[0, 5] = 0


def test_which_slots_count_under_dpace_does_not_depend_on_gamma():
    """Under D-PACE the weights come from the slots' own CE after the head; the plan's
    weights only mark the supervised slots. A gamma whose decay underflows in float32
    (exp(-14/0.01) is 0) must not drop slots there (--gamma has no effect under D-PACE)."""
    ids = torch.arange(40)[None].int()
    lm = torch.ones(1, 40, dtype=torch.uint8)
    lm[0, 30] = 0
    batch = Batch(
        input_ids=ids, loss_mask=lm, lengths=torch.tensor([40]), sample_ids=torch.tensor([1]),
        max_seqlen=40, num_tokens=40,
    )  # fmt: skip
    plans = [plan_blocks(batch, LossConfig(block_size=16, gamma=g, tokens_per_anchor=1), _draw())
             for g in (7.0, 0.01)]  # fmt: skip
    assert torch.equal(plans[0].weights, plans[1].weights)
    assert torch.equal(plans[0].weights > 0, lm[0, plans[0].blk_anchor[:, None] +
                                                 torch.arange(1, 16)].bool())  # fmt: skip


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_options_that_would_round_a_supervised_weight_to_zero_are_refused(block_size):
    """The smallest weight of a block is its last offset's: exp(-(B-2)/gamma) under the
    decay, alpha^(B-1) under D-PACE (every confidence 0). Each bound is the float32 limit,
    named with its flag, and it applies to its own weighting only."""
    tiny = torch.finfo(torch.float32).tiny
    gamma_low = (block_size - 2) / -math.log(tiny)
    alpha_low = tiny ** (1 / (block_size - 1))
    if block_size > 2:
        with pytest.raises(ValueError, match=r"--gamma .* round to 0 in float32"):
            LossConfig(block_size=block_size, weighting="decay", gamma=gamma_low * 0.9)
    decay = LossConfig(block_size=block_size, weighting="decay", gamma=gamma_low * 1.01)
    assert (position_weights(block_size, decay.gamma) > 0).all()
    for alpha in (0.0, alpha_low * 0.9):
        with pytest.raises(ValueError, match=r"--dpace-alpha .* round to 0 in float32"):
            LossConfig(block_size=block_size, weighting="dpace", dpace_alpha=alpha)
    from trainer.model.loss import dpace_weights

    ok = LossConfig(block_size=block_size, weighting="dpace", dpace_alpha=alpha_low * 1.01)
    certain_miss = torch.full((1, block_size - 1), 1e4)  # exp(-CE) == 0 at every slot
    sup = torch.ones(1, block_size - 1, dtype=torch.bool)
    assert (dpace_weights(certain_miss, sup, ok.dpace_alpha) > 0).all()
    # the other weighting's option is not checked (it has no effect there)
    LossConfig(block_size=block_size, weighting="dpace", gamma=1e-3)
    LossConfig(block_size=block_size, weighting="decay", dpace_alpha=0.0)


def test_chunked_head_loss_matches_autograd():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    h = torch.randn(13, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (13,), generator=g)
    w = torch.rand(13, generator=g)
    ref_out = head_loss(h, head, labels, 0)
    ref, ref_hits = (ref_out.ce * w).sum(), ref_out.hits
    (ref_grad,) = torch.autograd.grad(ref * 3.0, h)
    for chunk in (1, 4, 13, 100):
        out = head_loss(h, head, labels, chunk)
        assert torch.allclose(out.ce, ref_out.ce, rtol=1e-6)  # each row's own CE
        got, hits = (out.ce * w).sum(), out.hits
        (grad,) = torch.autograd.grad(got * 3.0, h)
        assert torch.allclose(got, ref, rtol=1e-6) and torch.equal(hits, ref_hits)
        assert torch.allclose(grad, ref_grad, atol=1e-6)
    trainable = torch.nn.Linear(8, 50, bias=False)
    with pytest.raises(ValueError, match="frozen head"):
        head_loss(h, trainable, labels, 4)


def test_anchor_cap_is_fair_and_deterministic():
    valid = torch.zeros(4, 50, dtype=torch.bool)
    valid[0, :50] = True
    valid[1, :3] = True  # few anchors: keeps all, its share goes to the others
    valid[2, :20] = True
    valid[3, :10] = True
    kept = [cap_anchors(valid, 25, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], kept[2])
    per_doc = kept[0].sum(1).tolist()
    assert sum(per_doc) == 25 and per_doc[1] == 3
    assert max(per_doc[0], per_doc[2], per_doc[3]) - min(per_doc[0], per_doc[2], per_doc[3]) <= 1
    assert not (kept[0] & ~valid).any()
    assert torch.equal(cap_anchors(valid, 0, torch.Generator()), valid)  # 0: no cap
    assert torch.equal(cap_anchors(valid, 83, torch.Generator()), valid)  # not binding


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(4) == [0, 1, 2]
    assert default_layer_ids(2) == [0]
    with pytest.raises(ValueError, match="out of range"):
        Target(build_tiny_model(TinyTargetSpec()), [4])


def test_anchor_cap_last_round_ignores_how_many_anchors_a_document_has():
    """Two documents, 2 and 100 anchors, cap 3: the third anchor goes to either document
    about half the time (a shared key would always favour the larger one)."""
    valid = torch.zeros(2, 100, dtype=torch.bool)
    valid[0, :2] = True
    valid[1, :] = True
    small_wins = sum(
        int(cap_anchors(valid, 3, torch.Generator().manual_seed(s))[0].sum()) == 2
        for s in range(400)
    )
    assert 140 <= small_wins <= 260


def test_plan_chunks_context_covers_every_block():
    # Documents start at 0, 10, 30; blocks in any order within a chunk.
    doc_start = [0, 10, 30]
    chunks = plan_chunks([0, 1, 1, 2, 2], [5, 8, 3, 2, 7], doc_start, 3)
    assert chunks == ((0, 3, 0, 18), (3, 5, 30, 37))
    assert plan_chunks([0, 0], [4, 9], [0], 0) == ((0, 2, 0, 9),)


def test_host_allocator_threshold_follows_the_chunk_count():
    from trainer.train import hostmem

    many = hostmem.fit_chunks(hostmem.MANY_CHUNKS + 1)
    if many is None:
        pytest.skip("not glibc")
    assert many == hostmem.SMALL_THRESHOLD_BYTES
    assert hostmem.fit_chunks(1) == hostmem.DEFAULT_THRESHOLD_BYTES


def test_warmup_cosine():
    f = lr_factor("cosine", 4, 20, 0.1)
    assert f(0) == pytest.approx(0.2) and f(3) == pytest.approx(0.8)
    assert f(4) == pytest.approx(1.0)
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(20) == pytest.approx(0.1) and f(30) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="exactly one"):
        RunOptions(endpoint="x", run_dir=Path("x")).check_length()


def _opts(**kw):
    kw = {"block_size": 8, "anchors_per_doc": 16, **kw}
    return RunOptions(endpoint="unused", run_dir=Path("unused"), **kw)


RULE = {"block_size": 8, "anchors_per_doc": 16, "tokens_per_anchor": 32, "max_anchors": 0}


def test_loader_spec_holds_the_anchor_rule_and_what_the_user_set():
    """The anchor rule is always the trainer's (the spec it records and the loader's cost
    model follow what it trains); other fields only when the user set them."""
    assert loader_spec(_opts()) == RULE
    assert loader_spec(_opts(token_budget=2048, spec_pairs=("seed=3", "buckets=[100]"))) == {
        **RULE,
        "token_budget": 2048,
        "seed": 3,
        "buckets": [100],
    }
    assert loader_spec(_opts(spec_pairs=("block_size=8",))) == RULE  # agreeing is fine
    with pytest.raises(ValueError, match="grad_accum=4 contradicts --grad-accum 2"):
        loader_spec(_opts(grad_accum=2, spec_pairs=("grad_accum=4",)))
    with pytest.raises(ValueError, match="anchors_per_doc=512 contradicts --anchors-per-doc 16"):
        loader_spec(_opts(spec_pairs=("anchors_per_doc=512",)))


def test_cost_profile_goes_into_the_requested_spec(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "version": 1,
        "coefficients": {"cost_c0": 0.1, "cost_tok": 1e-5, "cost_attn": 0.0, "cost_slot": 1e-6},
        "anchor_rule": {"block_size": 8, "anchors_per_doc": 6, "max_anchors": 64},
    }))  # fmt: skip
    opts = _opts(spec_pairs=("cost_c0=0.2",), cost_profile=profile, token_budget=4096)
    old = replace(opts, block_size=8, anchors_per_doc=6, tokens_per_anchor=1, max_anchors=64,
                  anchor_draw="micro-batch")  # fmt: skip
    spec = loader_spec(old)
    assert spec["cost_c0"] == 0.2 and spec["cost_slot"] == 1e-6 and spec["token_budget"] == 4096
    # A profile from before tokens_per_anchor counted one anchor per token.
    assert (spec["max_anchors"], spec["tokens_per_anchor"]) == (64, 1)
    # A trainer with another rule: the spec follows the trainer, not the profile.
    assert {k: loader_spec(opts)[k] for k in RULE} == RULE


def test_with_a_cost_model_the_spec_names_the_kernel_packed_rows_run_under(tmp_path):
    """Both kernels attend within documents (SDPA one document at a time, flex over a block
    mask), so a packed row's attention costs its documents' squared lengths. The trainer
    says so when it asks for a cost model, and a --spec (or a profile calibrated when SDPA
    attended over the whole row) saying otherwise is refused or overruled."""
    assert "packed_attention" not in loader_spec(_opts())  # no cost model: no cost to model
    costly = ("cost_attn=1e-9", "cost_tok=1e-6")
    assert loader_spec(_opts(spec_pairs=costly))["packed_attention"] == "documents"  # SDPA
    flex = loader_spec(_opts(spec_pairs=costly, attention="flex"))
    assert flex["packed_attention"] == "documents"
    with pytest.raises(ValueError, match=r"packed_attention=row contradicts --attention"):
        loader_spec(_opts(spec_pairs=(*costly, "packed_attention=row")))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "version": 1, "packed_attention": "row",
        "coefficients": {"cost_c0": 0.1, "cost_tok": 1e-5, "cost_attn": 1e-9, "cost_slot": 0.0},
        "anchor_rule": RULE,
    }))  # fmt: skip
    assert loader_spec(_opts(cost_profile=profile))["packed_attention"] == "documents"


def test_a_checkpoint_from_before_a_spec_field_resumes_under_its_default():
    served = {"token_budget": 4096, "tokens_per_anchor": 1, "packed_attention": "documents"}
    check_checkpoint_spec(served, {"token_budget": 4096})
    with pytest.raises(ServedSpecError, match="packed_attention"):
        check_checkpoint_spec({**served, "packed_attention": "row"}, {"token_budget": 4096})


def test_split_prompt():
    assert split_prompt(np.array([0, 0, 1, 1])) == 2
    assert split_prompt(np.array([1, 1, 1])) == 1  # never an empty prompt
    assert split_prompt(np.array([0, 0])) == 2  # nothing to regenerate


def test_load_prompts_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1, 2]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_prompts(bad)


def test_a_checkpoint_from_before_the_anchor_rule_was_sent_resumes_in_its_plan():
    """Its spec holds the daemon's 16/512/2048; with no slot cost those fields are not in
    the plan, so the trainer asks for them again (the saved position's plan); with a slot
    cost they are, and the request stays (the daemon then refuses the mismatch)."""
    from types import SimpleNamespace

    from trainer.train.resume import keep_saved_anchor_rule

    legacy = {"token_budget": 512, "block_size": 16, "anchors_per_doc": 512, "max_anchors": 2048}
    asked = {"block_size": 8, "anchors_per_doc": 4, "max_anchors": 2048}
    source = SimpleNamespace(spec=dict(asked))
    keep_saved_anchor_rule(legacy, source)  # type: ignore[arg-type]
    assert source.spec == {"block_size": 16, "anchors_per_doc": 512, "max_anchors": 2048}
    source = SimpleNamespace(spec=dict(asked))
    keep_saved_anchor_rule({**legacy, "cost_slot": 1e-6}, source)  # type: ignore[arg-type]
    assert source.spec == asked


def test_a_checkpoint_from_before_the_schedule_was_recorded_gives_its_peak_rate():
    """Without ``schedule`` in its meta, a checkpoint's peak rate is its scheduler's
    ``base_lrs`` (what a resume would put back): another --lr is refused, the same passes,
    and the schedule's kind and warm-up it never recorded are not compared."""
    from pathlib import Path

    from trainer.train.resume import check_schedule

    old = {"base_lrs": [0.003, 0.003], "last_epoch": 4}
    mine = {"lr": 0.003, "lr_schedule": "linear", "warmup": 0.5}
    check_schedule(Path("step-4"), {}, old, mine)
    with pytest.raises(ValueError, match=r"^step-4: trained with --lr 0.003, this run asks "
                       r"for --lr 0.01: pass --lr 0.003 to continue it"):  # fmt: skip
        check_schedule(Path("step-4"), {}, old, {**mine, "lr": 0.01})
    recorded = {"schedule": {"lr": 0.003, "lr_schedule": "cosine", "warmup": 0.5}}
    with pytest.raises(ValueError, match=r"--lr-schedule cosine, this run asks for --lr-sch"):
        check_schedule(Path("step-4"), recorded, old, mine)


def test_step_flops_counts_the_reference_recipe():
    """Qwen3-8B's target to layer 33 costs ~13.1 GFLOP per token in its linear layers; the
    head's two products over 2,048 x 15 slots are 4 x 30,720 x 4096 x 151,936; a step of
    the reference shape is 9.7e14 in all (docs/TRAINER.md, "Where a step's time goes")."""
    from trainer.train.profile import ModelShape, StepWork, step_flops

    target = ModelShape(hidden=4096, intermediate=12288, q=4096, kv=1024, layers=34)
    assert target.per_token() * 34 == pytest.approx(13.1e9, rel=0.01)
    drafter = ModelShape(hidden=4096, intermediate=12288, q=4096, kv=1024, layers=1)
    work = StepWork(doc_lengths=[8192] * 6 + [1500] * 3, anchors=2048, slots=2048 * 15)
    f = step_flops(work, target, drafter, features=5, block=16, vocab=151936)
    assert f["head"] == 4 * 30720 * 4096 * 151936
    tokens = 6 * 8192 + 3 * 1500
    attention = 4 * (6 * 8192**2 + 3 * 1500**2) / 2 * 4096 * 34
    assert f["target"] == pytest.approx(tokens * target.per_token() * 34 + attention)
    assert f["total"] == pytest.approx(9.7e14, rel=0.01)
    assert f["total"] == f["target"] + f["drafter"] + f["head"]


def test_dpace_weights_follow_the_published_formula():
    """D-PACE (speculators' ``dpace_loss_decay``): q = exp(-CE), q~ = (1 - a) q + a (1 at
    unsupervised slots), w_j = sum over supervised m >= j of prod_{i <= m} q~_i; 0 at
    unsupervised j. Written out slot by slot against the vectorized weights."""
    from trainer.model.loss import dpace_weights

    g = torch.Generator().manual_seed(1)
    ce = torch.rand(6, 7, generator=g, dtype=torch.float64) * 4
    sup = torch.rand(6, 7, generator=g) < 0.7
    sup[0] = True  # a fully supervised block
    sup[1] = False  # and one with no supervised slot
    for alpha in (0.0, 0.5, 1.0):
        got = dpace_weights(ce, sup, alpha)
        want = torch.zeros_like(ce)
        for n in range(ce.shape[0]):
            for j in range(ce.shape[1]):
                if not sup[n, j]:
                    continue
                total = 0.0
                for m in range(j, ce.shape[1]):
                    if not sup[n, m]:
                        continue
                    prod = 1.0
                    for i in range(m + 1):
                        q = math.exp(-float(ce[n, i]))
                        prod *= (1 - alpha) * q + alpha if sup[n, i] else 1.0
                    total += prod
                want[n, j] = total
        assert torch.allclose(got, want, rtol=1e-12, atol=0), alpha
    assert not dpace_weights(ce, sup, 0.5)[1].any()
    # alpha 1: every q~ is 1, so w_j counts the supervised slots from j on.
    full = dpace_weights(ce[:1], sup[:1], 1.0)[0]
    assert full.tolist() == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    assert not dpace_weights(ce.requires_grad_(), sup, 0.5).requires_grad


def test_the_objective_flags_offer_what_the_loss_config_takes():
    """The options (the trainer's foundation, which imports no model code) and
    ``LossConfig`` name the same choices for the objective's settings."""
    from dataclasses import fields as dc_fields

    from trainer.model.blocks import ANCHOR_DRAWS, NORMALIZATIONS, WEIGHTINGS

    meta = {f.name: f.metadata for f in dc_fields(RunOptions)}
    assert meta["anchor_draw"]["choices"] == ANCHOR_DRAWS
    assert meta["loss_normalization"]["choices"] == NORMALIZATIONS
    assert meta["loss_weighting"]["choices"] == WEIGHTINGS
    defaults = RunOptions(endpoint="x", run_dir=Path("r"))
    cfg = LossConfig()
    assert (defaults.anchor_draw, defaults.loss_normalization, defaults.loss_weighting) == (
        cfg.anchor_draw, cfg.normalization, cfg.weighting,
    )  # fmt: skip
    assert (defaults.tokens_per_anchor, defaults.max_anchors, defaults.dpace_alpha) == (
        cfg.tokens_per_anchor, cfg.max_anchors, cfg.dpace_alpha,
    )  # fmt: skip


def test_dpace_weighs_early_offsets_and_adapts_per_block():
    """The two halves of D-PACE's gain over the position decay (docs/EXPERIMENT.md, Part 4:
    a steeper fixed decay recovers one half, +0.28 of +0.56 tau): (1) where the drafter is
    unsure it moves weight to the first offsets, far more than the decay (gamma 7, block
    8: offsets 3-7 hold 60% of its weight); (2) per block, a late slot keeps its weight
    only where the slots before it are confident, i.e. where a draft will reach it; the
    decay gives every block the same profile."""
    from trainer.model.loss import dpace_weights

    decay = torch.exp(-torch.arange(7, dtype=torch.float64) / 7.0)
    assert float(decay[2:].sum() / decay.sum()) == pytest.approx(0.607, abs=1e-3)
    sup = torch.ones(2, 7, dtype=torch.bool)
    ce = torch.stack([torch.full((7,), 3.0), torch.full((7,), 0.05)]).double()  # unsure; sure
    w = dpace_weights(ce, sup, 0.5)
    share = w / w.sum(-1, keepdim=True)
    assert float(share[0, :2].sum()) > 0.7 > float(decay[:2].sum() / decay.sum())  # (1)
    # (2): the confident block keeps far more of its weight on the late offsets
    assert float(share[1, 4:].sum()) > 3 * float(share[0, 4:].sum())
    early_miss = ce[1].clone()
    early_miss[0] = 3.0  # the first draft is likely wrong: the rest of the block is rarely reached
    w2 = dpace_weights(torch.stack([ce[1], early_miss]), sup, 0.5)
    assert float(w2[1, 4:].sum()) < 0.6 * float(w2[0, 4:].sum())
