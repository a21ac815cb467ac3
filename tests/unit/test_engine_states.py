"""``trainer.engine.states``: vLLM's layer ids for ours, and a batch's features put
together from its documents' states, in both layouts."""

from __future__ import annotations

import pytest
import torch

from trainer.engine.states import Scaled, assemble
from trainer.engine.vllm import engine_layer_ids, feature_columns
from trainer.train.batches import pack_batch, pad_batch
from trainer.vllm.connector.dflash_states_shm import key_of, read_region, region_bytes, write_region
from trainer.vllm.connector.dflash_states_wire import SCALES, decode, encode


def test_vllm_ids_are_ours_plus_one_sorted_and_unique():
    assert engine_layer_ids([0, 1, 3], 4) == [1, 2, 4]
    assert engine_layer_ids([3, 0, 3, 1], 4) == [1, 2, 4]
    # each of ours picked back out of vLLM's ascending order, repeats and all
    assert feature_columns([3, 0, 3, 1], 4) == [2, 0, 2, 1]
    for bad in ([4], [-1], []):
        with pytest.raises(ValueError, match=r"must be in 0\.\.3"):
            engine_layer_ids(bad, 4)


@pytest.mark.parametrize("make", [pad_batch, pack_batch])
def test_each_document_lands_on_its_own_tokens(make):
    docs = [([1, 2, 3], [1, 1, 1]), ([4, 5], [1, 1]), ([6, 7, 8, 9], [1, 1, 1, 1])]
    batch = make(docs)
    hidden = 2
    # document d's state at token t, engine column c: 100 d + 10 t + c, hidden-wide
    states = [
        (100 * d + 10 * torch.arange(len(ids))[:, None, None] + torch.arange(3)[None, :, None])
        .float()
        .expand(len(ids), 3, hidden)
        for d, (ids, _) in enumerate(docs)
    ]
    out = assemble(batch, states, [2, 0], torch.float32)
    assert out.shape == (*batch.input_ids.shape, 2 * hidden)
    for d, (ids, _) in enumerate(docs):
        row, start = (d, 0) if batch.layout == "padded" else (0, sum(len(i) for i, _ in docs[:d]))
        for t in range(len(ids)):
            got = out[row, start + t]
            assert got[:hidden].tolist() == [100 * d + 10 * t + 2] * hidden
            assert got[hidden:].tolist() == [100 * d + 10 * t + 0] * hidden
    if batch.layout == "padded":  # padding stays zero
        assert out[1, 2:].abs().sum() == 0 and out[0, 3:].abs().sum() == 0


def test_a_batch_and_its_states_must_agree():
    batch = pad_batch([([1, 2], [1, 1])])
    with pytest.raises(ValueError, match="states for a batch of 1"):
        assemble(batch, [], [0], torch.float32)


def test_a_server_the_run_starts_serves_one_machine(monkeypatch):
    """--vllm-python starts the server on rank 0's machine (127.0.0.1, its /dev/shm): a job
    whose ranks span machines is refused, naming what to do instead."""
    from trainer.engine.client import EngineError
    from trainer.engine.supply import _one_machine
    from trainer.train.distributed import DistEnv

    env = DistEnv(rank=0, world_size=16, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(EngineError, match="--engine-url and --engine-dir"):
        _one_machine(env)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    _one_machine(env)  # one machine: fine


# ---- precision on the wire (--states-dtype) ----------------------------------------------


def test_fp8_keeps_each_value_within_e4m3s_rounding_of_its_rows_scale():
    """Each (token, layer) row is scaled to e4m3's range by its own amax: a value is off by
    at most half a step of 3 mantissa bits (2^-4 of itself) or, where it is tiny next to
    its row's largest, half of e4m3's smallest subnormal step (2^-10 of the scale)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 1] = 0.0  # a row of zeros: scale 1, values 0
    sent = encode(x, "float8_e4m3fn")
    values, scales = sent["hidden_states"], sent[SCALES]
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (64, 3)
    assert scales[5, 1] == 1.0 and torch.equal(decode(values, scales, torch.float32)[5, 1],
                                               torch.zeros(32))  # fmt: skip
    err = (decode(values, scales, torch.float32) - x).abs()
    bound = 2**-4 * x.abs() + 2**-10 * scales.unsqueeze(-1)
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert float(err.max()) > 0  # it is lossy: the bound is what is tested
    # the row's largest value is e4m3's largest: the whole range is used
    assert torch.equal(values.float().abs().amax(-1)[scales != 1], torch.full((64 * 3 - 1,), 448.0))


def test_bf16_on_the_wire_is_the_cast_and_nan_or_inf_reach_the_scale():
    x = torch.randn(4, 2, 8)
    assert torch.equal(encode(x, "bfloat16")["hidden_states"], x.to(torch.bfloat16))
    assert encode(x, "")["hidden_states"] is x
    x[1, 0, 3], x[2, 1, 0] = float("nan"), float("inf")
    sent = encode(x, "float8_e4m3fn")
    assert torch.isnan(sent[SCALES][1, 0]) and torch.isinf(sent[SCALES][2, 1])
    assert bool(torch.isfinite(sent[SCALES][0]).all())
    with pytest.raises(KeyError):
        encode(x, "float16")


@pytest.mark.parametrize("wire", ["", "bfloat16", "float8_e4m3fn"])
def test_a_region_carries_each_wire_dtype_whole(wire):
    """The arena's layout (shm and Mooncake) lays out the states and fp8's scales in the
    bytes ``region_bytes`` reserves, exactly: one byte less is refused."""
    x = torch.randn(7, 3, 5)
    sent = {**encode(x, wire), "token_ids": torch.arange(7)}
    hs = sent["hidden_states"]
    nbytes = region_bytes(7, 3, 5, hs.element_size(), SCALES in sent)
    mem = bytearray(nbytes + 128)
    write_region(mem, 64, nbytes, "req-1", sent)
    key, got = read_region(mem, 64)
    assert key == key_of("req-1") and torch.equal(got["token_ids"], torch.arange(7))
    assert got["hidden_states"].dtype == hs.dtype
    assert torch.equal(got["hidden_states"].view(torch.uint8), hs.view(torch.uint8))
    assert (SCALES in got) == (wire == "float8_e4m3fn")
    if SCALES in got:
        assert torch.equal(got[SCALES], sent[SCALES])
    with pytest.raises(ValueError, match="bytes of states for a region of"):
        write_region(bytearray(nbytes), 0, nbytes - 1, "req-1", sent)


def test_scaled_states_are_laid_out_as_their_widened_values():
    docs = [([1, 2, 3], [1, 1, 1]), ([4, 5], [1, 1])]
    batch = pack_batch(docs)
    full = [torch.randn(len(ids), 3, 4) for ids, _ in docs]
    sent = [encode(s, "float8_e4m3fn") for s in full]
    scaled = [Scaled(s["hidden_states"], s[SCALES]) for s in sent]
    widened = [decode(s["hidden_states"], s[SCALES], torch.float32) for s in sent]
    out = assemble(batch, scaled, [2, 0], torch.float32)
    assert torch.equal(out, assemble(batch, widened, [2, 0], torch.float32))
    assert float((out - assemble(batch, full, [2, 0], torch.float32)).abs().max()) > 0
