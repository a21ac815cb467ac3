"""The rest of an epoch under another shape (loader_server.planning.elastic): a pure,
deterministic function, every sample served once over any chain of shapes, fresh-epoch
guarantees for the rest, and clear refusals; and the client's side of it (a state turned
into legs), without a daemon."""

from __future__ import annotations

import numpy as np
import pytest

from client import LoaderClient
from client.state import STATE_VERSION, resume, saved_state
from loader_server.data.synth import SynthSpec, synth_lengths
from loader_server.planning.elastic import ChainMismatch, consumed, plan_rest, shaped
from loader_server.planning.planner import plan_epoch
from loader_server.wire.protocol import MAX_LEGS, Leg, ProtocolError, legs
from loader_server.wire.spec import BatchSpec

LENGTHS = synth_lengths(SynthSpec(num_samples=6000, seed=4, median_len=300, max_len=2048))
SMALL = {"token_budget": 8192, "max_batch_size": 32, "max_seq_len": 2048, "layout": "padded"}
SPECS = {
    "bucketed": BatchSpec(**SMALL),
    "shuffled": BatchSpec(**SMALL, order="shuffled"),
    "sorted": BatchSpec(**SMALL, composition="sorted"),
    "random": BatchSpec(**SMALL, composition="random"),
    "packed": BatchSpec(**{**SMALL, "layout": "packed"}),
    "cost": BatchSpec(**SMALL, cost_c0=0.01, cost_tok=1e-4, cost_attn=1e-8, cost_slot=1e-5),
}


def _same(a, b) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("sample_ids", "offsets", "micro_lens", "micro_costs", "micro_buckets")
    )


def _serve(spec: BatchSpec, chain: list[tuple[int, int, float]], epoch: int = 0):
    """Serve ``epoch`` through shapes ``(world, grad_accum, fraction of the steps)``; the
    last shape serves to the end. Returns (sample ids received, plans)."""
    got, done, plans = [], [], []
    for k, (world, ga, frac) in enumerate(chain):
        plan = plan_rest(LENGTHS, shaped(spec, world, ga), epoch=epoch, legs=done,
                         prior=plans[-1] if plans else None)  # fmt: skip
        plans.append(plan)
        steps = plan.num_steps if k == len(chain) - 1 else max(1, int(plan.num_steps * frac))
        got.append(consumed(plan, steps))
        done = [*done, Leg(world, ga, steps)]
    return np.concatenate(got), plans


CHAINS = {
    "other products": [(4, 1, 0.3), (2, 1, 0.4), (3, 2, 0.5), (1, 3, 1.0)],
    "the same product": [(4, 2, 0.3), (2, 4, 0.5), (8, 1, 0.2), (1, 8, 1.0)],
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_any_chain_of_shapes_serves_every_sample_exactly_once(name, chain):
    spec = SPECS[name]
    got, plans = _serve(spec, CHAINS[chain], epoch=2)
    ids, counts = np.unique(got, return_counts=True)
    assert counts.max() == 1
    servable = np.flatnonzero(LENGTHS > 0)
    missing = np.setdiff1d(servable, ids)
    assert missing.size == plans[-1].stats["dropped_leftover"]  # only the last leftover
    for plan in plans[1:]:  # every rest: a full plan of its shape and its samples
        s = plan.spec
        assert plan.num_micro == plan.num_steps * s.world_size * s.grad_accum
        rows = plan.micro_rows()
        if s.layout == "padded":
            assert (rows * plan.micro_lens <= s.token_budget).all()
            assert (rows <= s.max_batch_size).all()
        else:
            assert (plan.micro_lens <= s.token_budget).all()
        assert plan.stats["served_before"] + plan.stats["served"] + plan.stats[
            "dropped_leftover"] == servable.size  # fmt: skip


def _steps(plan, first: int = 0) -> list[set[tuple[int, ...]]]:
    """Each step of ``plan`` from ``first`` as the set of its micro-batches' sample ids."""
    width, out = plan.spec.micro_per_step, []
    for step in range(first, plan.num_steps):
        micro = range(step * width, (step + 1) * width)
        out.append({tuple(plan.sample_ids[plan.offsets[m] : plan.offsets[m + 1]]) for m in micro})
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("after", [(2, 4), (8, 1), (1, 8)])
def test_a_change_that_keeps_world_x_grad_accum_keeps_the_steps(name, after):
    """4 x 2 -> 2 x 4 (a lost node made up by accumulation), 8 x 1, 1 x 8: the rest of the
    epoch is the uninterrupted plan's steps, each with the same micro-batches, dealt afresh
    to the new ranks with the rank balance recomputed."""
    spec = shaped(SPECS[name], 4, 2)
    whole = plan_rest(LENGTHS, spec, epoch=1)
    served = whole.num_steps // 3
    rest = plan_rest(LENGTHS, shaped(spec, *after), epoch=1, legs=[Leg(4, 2, served)])
    assert rest.leg == 1 and rest.num_steps == whole.num_steps - served
    assert _steps(rest) == _steps(whole, served)
    assert rest.stats["dropped_leftover"] == whole.stats["dropped_leftover"]
    # Dealt by cost: no worse balanced than the old shape's order cut into the new ranks.
    world, accum = after
    ranks = rest.micro_costs.reshape(rest.num_steps, world, accum).sum(axis=2)
    naive = whole.micro_costs[served * 8 :].reshape(rest.num_steps, world, accum).sum(axis=2)
    assert (ranks.max(axis=1) <= naive.max(axis=1) * (1 + 1e-12)).all()
    if world > 1 and accum > 1 and name in ("packed", "cost"):  # costs vary: strictly better
        assert ranks.max(axis=1).mean() < naive.max(axis=1).mean()


def test_no_legs_is_the_epoch_plan_and_the_rest_is_deterministic():
    spec = shaped(SPECS["bucketed"], 4, 1)
    assert _same(plan_rest(LENGTHS, spec, epoch=3), plan_epoch(LENGTHS, spec, epoch=3))
    chain = [Leg(4, 1, 10), Leg(2, 2, 7)]
    a = plan_rest(LENGTHS, shaped(spec, 3, 1), epoch=3, legs=chain)
    b = plan_rest(LENGTHS, shaped(spec, 3, 1), epoch=3, legs=chain)
    assert _same(a, b) and a.leg == 2
    # With the last leg's plan given (a daemon's cache) the rest is the same plan.
    prior = plan_rest(LENGTHS, shaped(spec, 2, 2), epoch=3, legs=chain[:1])
    c = plan_rest(LENGTHS, shaped(spec, 3, 1), epoch=3, legs=chain, prior=prior)
    assert _same(a, c)
    # Randomness of its own: the same samples planned as a whole epoch batch differently.
    alone = np.where(a.keep, LENGTHS, 0)
    assert not _same(a, plan_epoch(alone, shaped(spec, 3, 1), epoch=3))


def test_the_rest_is_planned_as_well_as_a_fresh_plan_of_its_samples():
    spec = SPECS["bucketed"]
    _, plans = _serve(spec, [(4, 1, 0.4), (2, 1, 1.0)])
    rest = plans[1]
    fresh = plan_epoch(np.where(rest.keep, LENGTHS, 0), rest.spec, epoch=0)
    assert abs(rest.stats["padding_efficiency"] - fresh.stats["padding_efficiency"]) < 0.01
    assert abs(rest.num_steps - fresh.num_steps) <= 2


def test_bad_chains_are_refused_naming_the_leg():
    spec = SPECS["bucketed"]
    whole = plan_rest(LENGTHS, shaped(spec, 4, 1), epoch=0)
    with pytest.raises(ChainMismatch, match=rf"ran {whole.num_steps + 1} steps under world_size 4"):
        plan_rest(LENGTHS, spec, epoch=0, legs=[Leg(4, 1, whole.num_steps + 1)])
    with pytest.raises(ValueError, match="prior is the plan of epoch 0 leg 0, not of epoch 0 leg "
                       "0 under world_size 2"):  # fmt: skip
        plan_rest(LENGTHS, spec, epoch=0, legs=[Leg(2, 1, 3)], prior=whole)
    with pytest.raises(ValueError, match=f"at most {MAX_LEGS}"):
        plan_rest(LENGTHS, spec, epoch=0, legs=[Leg(1, 1, 1)] * (MAX_LEGS + 1))
    for bad in ([[4, 1]], [[4, 1, 0]], [[4, True, 3]], "4,1,3", [[1, 1, 1]] * (MAX_LEGS + 1)):
        with pytest.raises(ProtocolError, match="legs must be a list"):
            legs(bad)
    assert legs([[4, 1, 3]]) == (Leg(4, 1, 3),) and legs(None) == ()


def _state(world=4, position=(1, 7, 0), grad_accum=1, legs_=()):
    spec = {**BatchSpec(**SMALL, world_size=world, grad_accum=grad_accum).to_dict()}
    return {"version": 3, "job": "j", "rank": 0, "world_size": world, "position": list(position),
            "legs": [list(x) for x in legs_], "fingerprint": "f" * 16, "spec": spec}  # fmt: skip


def test_a_client_turns_a_state_of_another_shape_into_legs():
    c = LoaderClient("ipc:///nonexistent", job="j", rank=1, world_size=2)
    c.load_state_dict(_state())
    assert c.position == (1, 0, 0) and c.legs == (Leg(4, 1, 7),)
    assert c.resized.startswith("world_size 4 x grad_accum 1 -> 2 x 1 at epoch 1 step 7")
    assert c._saved_spec["world_size"] == 2 and c._saved_spec["grad_accum"] == 1
    # A second change appends; at step 0 of an epoch nothing was served: no leg.
    d = LoaderClient("ipc:///nonexistent", job="j", rank=2, world_size=3, spec={"grad_accum": 2})
    d.load_state_dict(_state(2, (1, 5, 0), 1, [Leg(4, 1, 7)]))
    assert d.legs == (Leg(4, 1, 7), Leg(2, 1, 5)) and d._saved_spec["grad_accum"] == 2
    e = LoaderClient("ipc:///nonexistent", job="j", rank=0, world_size=8)
    e.load_state_dict(_state(4, (3, 0, 0)))
    assert e.position == (3, 0, 0) and e.legs == ()
    # Same shape: the legs are kept, the position unchanged.
    f = LoaderClient("ipc:///nonexistent", job="j", rank=0, world_size=4)
    f.load_state_dict(_state(4, (1, 9, 0), 1, [Leg(2, 1, 3)]))
    assert f.position == (1, 9, 0) and f.legs == (Leg(2, 1, 3),) and f.resized is None


def test_a_client_refuses_what_cannot_resume_under_another_shape():
    c = LoaderClient("ipc:///nonexistent", job="j", rank=0, world_size=2, spec={"grad_accum": 2})
    with pytest.raises(ValueError, match=r"inside step 7 \(micro-batch 1 of 2\)"):
        c.load_state_dict(_state(4, (1, 7, 1), 2))
    with pytest.raises(ValueError, match="saved without its spec"):
        c.load_state_dict({**_state(), "version": 1, "spec": None})
    with pytest.raises(ValueError, match="job='j', this client has job='k'"):
        LoaderClient("ipc:///x", job="k", rank=0, world_size=2).load_state_dict(_state())
    with pytest.raises(ProtocolError, match="state legs"):
        c.load_state_dict({**_state(), "legs": [[4, 1, -1]]})
    full = [Leg(1, 1, 1)] * MAX_LEGS
    with pytest.raises(ValueError, match="changed shape"):
        c.load_state_dict(_state(4, (1, 7, 0), 1, full))


def test_a_saved_state_resumes_where_it_was_saved_as_pure_logic():
    """``client.state``: what ``state_dict`` writes, ``resume`` reads back unchanged under
    the same shape, and under another shape turns the served steps into a leg."""
    spec = BatchSpec(**SMALL, world_size=4).to_dict()
    kw = dict(position=(2, 5, 0), legs=(Leg(2, 1, 3),), fingerprint="f" * 16, spec=spec)
    saved = saved_state(job="j", rank=1, world_size=4, **kw)
    assert saved["version"] == STATE_VERSION and saved["position"] == [2, 5, 0]
    same = resume(saved, job="j", rank=1, world_size=4, grad_accum=None)
    assert (same.position, same.legs, same.spec, same.resized) == (
        (2, 5, 0),
        kw["legs"],
        spec,
        None,
    )
    with pytest.raises(ValueError, match="rank=1, this client has rank=0"):
        resume(saved, job="j", rank=0, world_size=4, grad_accum=None)
    grown = resume(saved, job="j", rank=0, world_size=8, grad_accum=2)
    assert grown.position == (2, 0, 0) and grown.legs == (Leg(2, 1, 3), Leg(4, 1, 5))
    assert grown.spec["world_size"] == 8 and grown.spec["grad_accum"] == 2
    assert "world_size 4 x grad_accum 1 -> 8 x 2 at epoch 2 step 5" in grown.resized
    with pytest.raises(ValueError, match="version 9 is not 3"):
        resume({**saved, "version": 9}, job="j", rank=1, world_size=4, grad_accum=None)
