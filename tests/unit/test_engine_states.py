"""``trainer.engine.states``: vLLM's layer ids for ours, and a batch's features put
together from its documents' states, in both layouts."""

from __future__ import annotations

import pytest
import torch

from trainer.engine.states import assemble
from trainer.engine.vllm import engine_layer_ids, feature_columns
from trainer.train.batches import pack_batch, pad_batch


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
