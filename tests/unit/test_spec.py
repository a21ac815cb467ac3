"""BatchSpec: defaults, normalization, validation messages, dict round trip, stable key."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from loader_server.wire.spec import REFERENCE_BUCKETS, BatchSpec


def test_defaults_match_the_contract():
    s = BatchSpec()
    assert (s.token_budget, s.max_batch_size, s.max_seq_len) == (65536, 64, 8192)
    assert (s.overlong, s.buckets, s.target_efficiency) == ("truncate", "auto", 0.97)
    assert (s.layout, s.composition, s.order) == ("packed", "bucketed", "stratified")
    assert (s.world_size, s.grad_accum, s.seed) == (1, 1, 0)
    assert (s.cost_c0, s.cost_tok, s.cost_attn, s.cost_slot, s.cost_budget) == (0, 1, 0, 0, 0)
    assert s.anchor_rule == (16, 512, 32, 0) and not s.cost_model_on
    assert s.micro_per_step == 1 and s.auto_buckets == 0


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("auto", "auto"),
        ("AUTO:8", "auto:8"),
        ("770,1216, 1728", (770, 1216, 1728)),
        ([770, 1216], (770, 1216)),
        (np.array([5, 9]).tolist(), (5, 9)),
        ((np.int64(5), np.int32(9)), (5, 9)),
        ((), ()),
    ],
)
def test_buckets_are_normalized(given, want):
    assert BatchSpec(buckets=given).buckets == want


def test_dict_round_trip_through_msgpack():
    s = BatchSpec(buckets=REFERENCE_BUCKETS, world_size=8, grad_accum=4, cost_attn=1e-5)
    d = msgpack.unpackb(msgpack.packb(s.to_dict()))
    assert d["buckets"] == list(REFERENCE_BUCKETS)
    assert BatchSpec.from_dict(d) == s
    assert BatchSpec.from_dict({}) == BatchSpec()


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="'token_budgte'"):
        BatchSpec.from_dict({"token_budgte": 4096})


def test_key_is_short_stable_and_sensitive():
    a = BatchSpec(buckets=[770, 1216])
    assert a.key() == BatchSpec(buckets=(770, 1216)).key() == BatchSpec(buckets="770,1216").key()
    assert len(a.key()) == 16 and int(a.key(), 16) >= 0
    assert a.key() != BatchSpec(buckets=(770, 1217)).key()
    assert BatchSpec(seed=1).key() != BatchSpec(seed=2).key()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_budget": 4096}, r"token_budget 4096 .* max_seq_len 8192"),
        (
            {"max_seq_len": 1024, "cost_attn": 0.01, "cost_budget": 1024},
            r"cost_budget 1024 .* 1024",
        ),
        ({"token_budget": 0}, r"token_budget must be an integer in \[1, 2147483647\], got 0"),
        ({"token_budget": 2**31}, r"token_budget must be an integer in \[1, 2147483647\]"),
        ({"grad_accum": 2**40}, r"grad_accum must be an integer in \[1, 2147483647\]"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"world_size": 0}, r"world_size must be an integer in \[1, 65536\], got 0"),
        ({"grad_accum": 2.0}, "grad_accum"),
        ({"seed": -1}, r"seed must be an integer in \[0, 9223372036854775807\], got -1"),
        ({"world_size": True}, "world_size"),
        ({"overlong": "clip"}, "overlong must be one of truncate, drop; got 'clip'"),
        ({"layout": "ragged"}, "'ragged'"),
        ({"composition": "sortd"}, "'sortd'"),
        ({"order": "interleaved"}, "'interleaved'"),
        ({"target_efficiency": 0.0}, "target_efficiency"),
        ({"target_efficiency": 1.5}, "1.5"),
        ({"cost_attn": -1.0}, "cost_attn must be a finite number >= 0, got -1.0"),
        ({"cost_slot": float("nan")}, "cost_slot"),
        ({"cost_tok": 0.0}, "every cost coefficient is 0"),
        ({"cost_budget": -1.0}, "cost_budget"),
        ({"cost_c0": True}, "cost_c0"),
        ({"block_size": 1}, r"block_size must be an integer in \[2, 65536\], got 1"),
        ({"max_anchors": -1}, "max_anchors"),
        ({"buckets": "auto:0"}, "auto:0"),
        ({"buckets": "auto:65"}, "1..64"),
        ({"buckets": "auto:x"}, "auto:x"),
        ({"buckets": "small,large"}, "small,large"),
        ({"buckets": (1216, 770)}, r"strictly increasing, got \[1216, 770\]"),
        ({"buckets": (0, 10)}, "bucket bound 0"),
        ({"buckets": (10, 8192)}, "bucket bound 8192 must be below max_seq_len 8192"),
        ({"buckets": 7}, "buckets must be"),
        ({"layout": "packed", "composition": "sorted"}, "sorted"),
    ],
)
def test_bad_specs_are_rejected_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchSpec(**kwargs)


def test_spec_is_frozen_and_keyword_only():
    s = BatchSpec()
    with pytest.raises(AttributeError):
        s.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        BatchSpec(65536)  # type: ignore[misc]


def test_row_cost_is_the_cost_model_of_one_row():
    s = BatchSpec(cost_c0=5.0, cost_attn=1e-4, cost_slot=0.5, block_size=4, anchors_per_doc=50,
                  tokens_per_anchor=1)  # fmt: skip
    # 100 tokens, 100**2 attention, min(50, 100 - 4 + 1) anchors of 4 slots.
    assert s.row_cost(100) == pytest.approx(5.0 + 100 + 1e-4 * 100**2 + 0.5 * 4 * 50)
    # One anchor per 32 candidates (the default): ceil(97 / 32) = 4.
    s32 = BatchSpec(cost_slot=0.5, block_size=4, anchors_per_doc=50)
    assert s32.row_cost(100) == pytest.approx(100 + 0.5 * 4 * 4)
    assert s.row_cost(7) == pytest.approx(5.0 + 7 + 1e-4 * 49)  # under 2 blocks: no anchors
    assert s.cost_model_on and BatchSpec(cost_budget=65536).cost_model_on is False


def test_attention_weight_of_earlier_versions_still_reads():
    """Config files and clients of earlier versions say ``attention_weight``: it is
    ``cost_attn`` against the token budget, the same plans."""
    s = BatchSpec.from_dict({"attention_weight": 1e-5, "token_budget": 32768})
    assert (s.cost_attn, s.cost_budget, s.token_budget) == (1e-5, 32768, 32768)
    assert BatchSpec.from_dict({"attention_weight": 0.0}) == BatchSpec()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            {"tokne_budget": 10},
            "unknown batch spec field 'tokne_budget'; did you mean 'token_budget'?",
        ),
        ({"layuot": "packed"}, "did you mean 'layout'?"),
        ({"xyzzy": 1}, "unknown batch spec field 'xyzzy' (known: token_budget"),
        ({"layout": "pakced"}, "layout must be one of padded, packed; got 'pakced'"),
        ({"grad_accum": 0}, "grad_accum must be an integer in [1, "),
        ({"grad_accum": 2.0}, "grad_accum must be an integer"),
        ({"cost_slot": -1.0}, "spec: cost_slot must be a finite number >= 0"),
        ({"target_efficiency": 1.5}, "target_efficiency must be in (0, 1]"),
        ({"buckets": "auto:99"}, "K in 'auto:K' must be 1..64"),
    ],
)
def test_a_clients_fields_are_checked_as_the_daemon_checks_them(spec, says):
    """``check_fields`` (what ``LoaderClient`` and the trainer run before asking a daemon):
    the field checks of a whole spec, without the ones that need the daemon's other fields."""
    from client import LoaderClient
    from loader_server.wire.spec import check_fields

    with pytest.raises(ValueError) as e:
        check_fields(spec)
    assert says in str(e.value)
    with pytest.raises(ValueError) as e:
        LoaderClient("ipc:///nowhere", job="j", rank=0, world_size=1, spec=spec)
    assert says in str(e.value)
    # A field alone may be what a whole spec with the daemon's others refuses: not here.
    check_fields({"max_seq_len": 1_000_000, "cost_profile": "p.json"})


def test_every_field_states_its_help_and_check_once():
    """The flags and the checks are made from the fields' declarations: each has help, and
    a bound, a choice or a number check unless it is buckets or target_efficiency."""
    from loader_server.wire.spec import SPEC_FIELDS

    for name, f in SPEC_FIELDS.items():
        meta = f.metadata
        assert meta["help"], name
        checked = {"low", "choices", "number"} & set(meta) or name in (
            "buckets",
            "target_efficiency",
        )
        assert checked, name
