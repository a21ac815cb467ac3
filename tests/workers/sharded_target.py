"""One rank of the sharded-target check (``tests/integration/test_target_shard.py``), under
torchrun with 2 gloo ranks on CPU:

    python -m torch.distributed.run --standalone --nproc-per-node 2 sharded_target.py OUT DIR...

For each model folder, the target whole and with its decoder layers sharded over the ranks
(``trainer.model.sharding``), on the same inputs: the features of a padded and a packed
batch (all layers, and stopped after the deepest chosen one), the DFlash loss and the
drafter's gradients, a micro-batch with nothing to train on rank 1 only (rank 0 trains),
the same with the next layer prefetched and with two one-rank "nodes" (HSDP),
tau over 3 prompts on rank 0 and 1 on rank 1 (the one-prompt verifier and the batched one,
in lockstep), and the parameter bytes each rank holds. Writes ``OUT/rank-R.json``.
"""

import copy
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.loss import draft_loss
from trainer.model.sharding import param_bytes, sharder
from trainer.model.speculate import BatchedVerifier
from trainer.model.target import Target, load_target
from trainer.model.verifier import DrafterProposer, evaluate_tau
from trainer.run import weights_fingerprint
from trainer.train.batches import pack_batch, pad_batch

LAYERS = [0, 1]
BLOCK = 4


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def samples(vocab: int, seed: int, lengths=(40, 33, 25)) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab - 1, (n,), generator=g).tolist(), [1] * n) for n in lengths]


def features(whole: Target, shard: Target, docs: list) -> dict:
    padded, packed = pad_batch(docs), pack_batch(docs)
    fw, hw = whole.features(padded.input_ids)
    fs, hs = shard.features(padded.input_ids)
    pos = packed.position_ids
    return {
        "features": max(gap(fw, fs), gap(hw, hs)),
        "train_padded": gap(whole.train_features(padded.input_ids),
                            shard.train_features(padded.input_ids)),
        "train_packed": gap(whole.train_features(packed.input_ids, pos),
                            shard.train_features(packed.input_ids, pos)),
    }  # fmt: skip


def losses(whole: Target, shard: Target, docs: list, rank: int) -> dict:
    vocab = whole.vocab_size
    cfg = LossConfig(block_size=BLOCK, anchors_per_doc=4)
    dcfg = DrafterConfig.from_target(
        whole.config, num_target_layers=len(LAYERS), num_layers=1, block_size=BLOCK,
        mask_token_id=vocab - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    twin = copy.deepcopy(drafter)
    out: dict = {}
    for name, batch in (("padded", pad_batch(docs)), ("packed", pack_batch(docs))):
        lw = draft_loss(whole, drafter, batch, cfg, torch.Generator().manual_seed(rank))
        ls = draft_loss(shard, twin, batch, cfg, torch.Generator().manual_seed(rank))
        lw.loss.backward()
        ls.loss.backward()
        out[f"loss_{name}"] = [float(lw.loss), float(ls.loss)]
        pairs = zip(drafter.parameters(), twin.parameters(), strict=True)
        out[f"grad_{name}"] = max(gap(p.grad, q.grad) for p, q in pairs)
        drafter.zero_grad()
        twin.zero_grad()
    # Rank 1's micro-batch has no document with 2 x B supervised tokens; rank 0's has.
    batch = pad_batch([(docs[0][0][:5], [1] * 5)]) if rank == 1 else pad_batch(docs)
    alone = draft_loss(shard, twin, batch, cfg, torch.Generator().manual_seed(rank))
    out["empty_micro_loss"] = None if alone.loss is None else float(alone.loss)
    out.update(taus(whole, shard, drafter.eval(), rank))
    return out


def taus(whole: Target, shard: Target, drafter: DFlashDrafter, rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own prompts
    prompts = [torch.randint(0, whole.vocab_size - 1, (5 + k,), generator=g)
               for k in range(3 if rank == 0 else 1)]  # fmt: skip
    kw = {"block_size": BLOCK, "max_new_tokens": 12}
    with torch.no_grad():
        rep_w = evaluate_tau(whole, DrafterProposer(whole, drafter), prompts, **kw)
        with shard.lockstep():
            rep_s = evaluate_tau(shard, DrafterProposer(shard, drafter), prompts, **kw)
        bw = BatchedVerifier(whole, drafter, max_new_tokens=12).generate(prompts)
        with shard.lockstep():
            bs = BatchedVerifier(shard, drafter, max_new_tokens=12).generate(prompts)
    same = all(torch.equal(a.tokens, b.tokens) and a.acceptance_lengths == b.acceptance_lengths
               for a, b in zip(bw, bs, strict=True))  # fmt: skip
    return {"tau_sums": [rep_w.sums(), rep_s.sums()], "batched_same": same,
            "prompts": len(prompts)}  # fmt: skip


def check(path: Path, rank: int) -> dict:
    whole = load_target(str(path), layer_ids=LAYERS, dtype=torch.float32)
    shard = load_target(str(path), layer_ids=LAYERS, dtype=torch.float32,
                        shard=sharder(torch.device("cpu")))  # fmt: skip
    out = {
        "sharded": shard.sharded and not whole.sharded,
        "same_fingerprint": weights_fingerprint(shard.model) == weights_fingerprint(whole.model),
        "bytes_whole": asdict(param_bytes(whole.model)),
        "bytes_sharded": asdict(param_bytes(shard.model)),
    }
    docs = samples(whole.vocab_size, seed=0)  # the same batch on both ranks
    out.update(features(whole, shard, docs))
    # The next layer's all-gather issued as a layer starts (what a GPU does; off on CPU,
    # where it is slower): the same features, stopped early or not, twice over.
    ahead = load_target(str(path), layer_ids=LAYERS, dtype=torch.float32,
                        shard=sharder(torch.device("cpu"), prefetch=True))  # fmt: skip
    twice = [features(whole, ahead, docs) for _ in range(2)]
    out["prefetch"] = max(v for r in twice for v in r.values())
    # Two nodes of one rank each (HSDP): each holds a whole replica of the decoder.
    nodes = load_target(str(path), layer_ids=LAYERS, dtype=torch.float32,
                        shard=sharder(torch.device("cpu"), local_world=1))  # fmt: skip
    out["hsdp"] = max(features(whole, nodes, docs).values())
    out["hsdp_bytes"] = asdict(param_bytes(nodes.model))
    out["hsdp_fingerprint"] = weights_fingerprint(nodes.model) == weights_fingerprint(whole.model)
    out.update(losses(whole, shard, docs, rank))
    return out


def main() -> None:
    out, dirs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {d.name: check(d, rank) for d in dirs}
    (out / f"rank-{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    # Measured: in about 1 run in 10, a rank aborts ("terminate called without an active
    # exception", SIGABRT) in the interpreter's teardown, after both ranks destroyed the
    # process group and wrote their results (this worker builds three sharded models, one
    # on an HSDP mesh). What the test checks is written by then: end without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
