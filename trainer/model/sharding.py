"""A target bigger than one GPU: its decoder layers sharded over the ranks with FSDP2.

The decoder is sharded over the ranks of a node; with several nodes each node holds one
replica of it (HSDP: a layer's all-gather never leaves its node, ``decoder_mesh``). Each
decoder layer is one FSDP2 unit (``fully_shard``, ``reshard_after_forward=True``): a
rank keeps a dim-0 shard of each of its tensors (1/world of the layer), the layer's
tensors are all-gathered just before it runs and freed right after, and on a GPU a layer
starting issues the next one's all-gather (forward prefetch), which then runs on FSDP's
own stream while the layer computes. A rank's peak is its shards plus about two layers
whole. The target is frozen: no gradient, so nothing is ever reduce-scattered.

Prefetch is for CUDA only (``prefetches``). FSDP2 runs it on CPU with gloo, but there it
costs instead of overlapping: a 16-layer target (hidden 512, 512 tokens per rank, 2 ranks
on 2 cores) took 2.4-2.7 s per features forward with prefetch, 1.1 s without, 1.0 s whole
(one layer's all-gather: 17 ms).

The embedding, the final norm and the LM head stay whole on every rank (replicated): the
drafter reads ``embed_tokens.weight`` and ``lm_head.weight`` itself, outside the target's
forward (its blocks' embeddings, the chunked LM-head loss), so every rank needs them
whole at every micro-batch; sharded they would be all-gathered at every use. For
Qwen3-8B they are 2 x 151,936 x 4,096 x 2 B = 2.5 GB of its 16 GB; for a 235B MoE of the
same width, the same 2.5 GB of 470. The base model is the FSDP root (it holds no shard:
those tensors are its ignored parameters), so one root runs each forward's bookkeeping.

Collectives: a forward all-gathers every layer it runs, so every rank must run the same
forwards, stopping at the same layer. Training runs one forward per micro-batch on every
rank (a micro-batch with nothing to train still runs a one-token forward:
``Target.keep_pace``). Verification does not: each rank decodes its own prompts, for as
many steps as its drafts take, so ``Lockstep`` announces every forward with a 2-value
all-reduce (full stack or stopped early) and a rank done with its prompts runs one-token
forwards of the announced kind until no rank announces one.

Early stop: ``train_features`` stops after the deepest chosen layer by raising out of that
layer's hook. FSDP2 leaves its per-iteration state undefined when a forward raises, so a
sharded target turns the prefetch from that layer off for the forward (nothing is in
flight past it) and calls ``reset_iter_state`` on the root afterwards.

``--target-shard auto`` shards when the estimate of what a rank must hold does not fit
the free memory of its device (``shard_needed``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from trainer.model.weights import local_part, shard_dim

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

log = logging.getLogger(__name__)

SHARD_MODES = ("none", "fsdp", "auto")
#: The dimensions of a several-node mesh: nodes (replicas), then a node's ranks (shards).
MESH_DIMS = ("node", "local")
#: Bytes per drafter parameter a rank holds while training (fp32 weight, gradient and
#: AdamW's two moments; Muon keeps one on the 2-D weights, so this bounds it from above).
DRAFTER_BYTES_PER_PARAM = 16
#: Share of a device kept free for activations (features, the drafter's chunks, the LM
#: head's logits chunk) and allocator slack when ``auto`` decides.
ACTIVATION_SHARE = 0.25


def decoder_mesh(device: torch.device, local_world: int | None = None) -> DeviceMesh:
    """The mesh the decoder is sharded over: the ranks of one node (``local_world``,
    default torchrun's ``LOCAL_WORLD_SIZE``), each node holding a replica when there are
    several (HSDP: a layer's all-gather never leaves the node); over every rank when the
    nodes do not have the same number of ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("a sharded target needs the process group (torchrun) started first")
    world = dist.get_world_size()
    local = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local >= world or world % local:
        return init_device_mesh(device.type, (world,))
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=MESH_DIMS)


def prefetches(device: torch.device) -> bool:
    """Whether a sharded decoder on ``device`` prefetches the next layer (CUDA only)."""
    return device.type == "cuda"


#: The attribute of a sharded base model that says whether its layers prefetch.
PREFETCH = "dflash_prefetch"


def shard_decoder(model: nn.Module, mesh: DeviceMesh, prefetch: bool | None = None) -> None:
    """Shard ``model``'s decoder layers over ``mesh`` (in place; on the meta device or
    materialised): each layer one unit, resharded after its forward, prefetching the next
    (None: on CUDA); the base model the root, its other tensors (embedding, norm)
    replicated."""
    from torch.distributed.fsdp import fully_shard

    base = cast(nn.Module, getattr(model, "base_model", model))
    layers = list(cast(nn.ModuleList, base.layers))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    rest = {p for name, p in base.named_parameters() if not name.startswith("layers.")}
    fully_shard(base, mesh=mesh, reshard_after_forward=True, ignored_params=rest)
    if prefetch is None:
        prefetch = prefetches(torch.device(mesh.device_type))
    setattr(base, PREFETCH, prefetch)
    if prefetch:
        for layer, after in itertools.pairwise(layers):
            cast("FSDPModule", layer).set_modules_to_forward_prefetch([cast("FSDPModule", after)])


def sharder(
    device: torch.device, prefetch: bool | None = None, local_world: int | None = None
) -> Callable[[nn.Module], None]:
    """What shards a model over ``decoder_mesh`` (``trainer.model.weights.load_model``'s
    ``shard``); ``prefetch``: as ``shard_decoder``'s."""
    mesh = decoder_mesh(device, local_world)
    return lambda model: shard_decoder(model, mesh, prefetch)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "base_model", model), FSDPModule)


@contextlib.contextmanager
def stopping_after(base: nn.Module, last: int) -> Iterator[None]:
    """A forward of a sharded decoder that ends after layer ``last`` (raised out of its
    hook): no all-gather is issued past it (its prefetch is off meanwhile)."""
    layers = cast(nn.ModuleList, base.layers)
    if not getattr(base, PREFETCH, False) or last + 1 >= len(layers):
        yield
        return
    stop = cast("FSDPModule", layers[last])
    stop.set_modules_to_forward_prefetch([])
    try:
        yield
    finally:
        stop.set_modules_to_forward_prefetch([cast("FSDPModule", layers[last + 1])])


def reset_after_stop(base: nn.Module) -> None:
    """The root's per-forward state after a forward that raised out of a layer."""
    cast("FSDPModule", base).reset_iter_state()


class Lockstep:
    """Ranks that run different numbers of forwards of a sharded target, kept in step:
    each forward is announced (``announce``); a rank with none left runs the announced
    kind with one token (``drain``) until no rank announces one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _agree(self, stop: bool | None) -> bool | None:
        """All-reduce of ``[full, stopped]`` forwards this round; the kind, None for none."""
        t = torch.zeros(2, dtype=torch.int64, device=self.device)
        if stop is not None:
            t[int(stop)] = 1
        dist.all_reduce(t)
        full, early = (int(x) for x in t.tolist())
        if full and early:
            raise RuntimeError(
                "ranks ran different forwards of the sharded target together (full stack "
                "and stopped early): every rank must run the same kind at once"
            )
        return None if not (full or early) else bool(early)

    def announce(self, stop: bool) -> None:
        if self._agree(stop) != stop:  # pragma: no cover - guarded in _agree
            raise RuntimeError("the ranks disagree on the sharded target's forward")

    def drain(self, idle: Callable[[bool], Any]) -> None:
        while (stop := self._agree(None)) is not None:
            idle(stop)


def flat_values(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t.reshape(-1)[idx]`` (``idx`` on the host), also of a tensor sharded on dim 0: each
    rank puts in the values of its rows and one all-reduce adds them up (every rank must
    call it), so no rank gathers the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.reshape(-1)[idx.to(t.device)]
    local, first = local_part(t)
    lo = first * math.prod(t.shape[1:])
    mine = (idx >= lo) & (idx < lo + local.numel())
    out = torch.zeros(idx.numel(), dtype=local.dtype, device=local.device)
    out[mine.to(local.device)] = local.reshape(-1)[(idx[mine] - lo).to(local.device)]
    dist.all_reduce(out, group=t.device_mesh.get_group(shard_dim(t)))  # not the replicas
    return out


@dataclass(frozen=True)
class ParamBytes:
    """Bytes of a model's parameters: its decoder layers' on this rank and in all, and
    the rest's (replicated: the same on every rank)."""

    layers_local: int
    layers_total: int
    other: int


def param_bytes(model: nn.Module) -> ParamBytes:
    base = cast(nn.Module, getattr(model, "base_model", model))
    in_layers = {id(p) for p in cast(nn.Module, base.layers).parameters()}
    local = total = other = 0
    for p in model.parameters():  # a tied weight once
        size = p.element_size()
        if id(p) in in_layers:
            local += local_part(p)[0].numel() * size
            total += p.numel() * size
        else:
            other += p.numel() * size
    return ParamBytes(local, total, other)


def drafter_params_estimate(config: Any, num_layers: int, num_features: int) -> int:
    """About how many parameters a drafter of ``num_layers`` dense layers of the target's
    width has (``config``: the target's): attention, MLP (its ``intermediate_size``),
    norms, and the ``num_features x H -> H`` projection."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    hd = int(getattr(config, "head_dim", None) or h // heads)
    mlp = int(getattr(config, "intermediate_size", None) or 3 * h)
    layer = h * hd * (2 * heads + 2 * kv) + 3 * h * mlp + 4 * h
    return num_layers * layer + num_features * h * h + 2 * h


def shard_needed(
    *, world_size: int, target_bytes: int, drafter_params: int, free_bytes: int, total_bytes: int
) -> bool:
    """``--target-shard auto``'s rule: shard when there is more than one rank and a rank
    holding the whole target would need more than its device has free: the target, the
    drafter's weights, gradients and AdamW moments (``DRAFTER_BYTES_PER_PARAM``), and
    ``ACTIVATION_SHARE`` of the device's memory for activations."""
    need = target_bytes + DRAFTER_BYTES_PER_PARAM * drafter_params
    need += int(ACTIVATION_SHARE * total_bytes)
    return world_size > 1 and need > free_bytes
