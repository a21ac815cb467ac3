"""``EngineTarget``: the part of the target a trainer still needs when an engine runs the
decoder. The drafter embeds its block tokens with the target's embedding and scores with
its LM head, and a layer the engine gives before the final norm (vLLM's last) is normed by
it (``seam.Layers.prenorm``): those
three tensors are read from the model folder (``load_head``, nothing else is allocated or
read), and each micro-batch's features are the ones ``EngineFeed`` fetched for it.

It is a ``Target`` to the training loop: ``batch_features`` hands out the held features,
``keep_pace`` and ``lockstep`` have nothing to keep in step. Whatever needs the decoder
(``features``: the verifier's tau during training) is refused with what to use instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.engine.seam import Engine
from trainer.model.target import Target, default_layer_ids
from trainer.model.weights import WeightsError, meta_model, read_header, safetensors_files
from trainer.train.batches import Batch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

NO_DECODER = (
    "the target's decoder runs in the engine (--target-engine vllm): the trainer holds only "
    "its embedding, final norm and LM head; measure tau on an export with `dflash-train eval "
    "--engine vllm`"
)


def load_head(path: Path, device: torch.device | str, dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``path`` on the meta device, with only its input embedding, final norm
    and LM head allocated on ``device`` and read from the checkpoint (tied weights once)."""
    skeleton = meta_model(path, dtype)
    files = safetensors_files(path)
    if files is None:
        raise WeightsError(f"{path}: no model.safetensors (or index): the head is read from it")
    where = {name: f for f in files for name in read_header(f)[0]}
    names = {id(m): n for n, m in skeleton.named_modules()}
    embed = cast(nn.Module, skeleton.get_input_embeddings())
    head = cast(nn.Module, skeleton.get_output_embeddings())
    tied = head.weight is embed.weight
    norm = cast(nn.Module, skeleton.base_model.norm)
    from safetensors import safe_open

    for module in (embed, norm) if tied else (embed, norm, head):
        module.to_empty(device=device)
        for pname, p in module.named_parameters():
            full = f"{names[id(module)]}.{pname}"
            if full not in where:
                raise WeightsError(f"{path}: the checkpoint has no tensor {full}")
            with safe_open(str(where[full]), "pt") as f:
                t = f.get_tensor(full)
            if tuple(t.shape) != tuple(p.shape):
                raise WeightsError(f"{path}: {full} is {tuple(t.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(dtype))
    if tied:
        head.weight = embed.weight
    return skeleton


class EngineTarget(Target):
    """The target's head here, its features from an engine (``trainer.engine.feed``)."""

    def __init__(self, path: Path, layer_ids: list[int] | None, device: torch.device | str,
                 dtype: torch.dtype, engine: Engine | None = None) -> None:  # fmt: skip
        model = load_head(Path(path), device, dtype)
        model.requires_grad_(False)
        self.model = model
        self.base = cast(nn.Module, model.base_model)
        self.embed_tokens = cast(nn.Embedding, model.get_input_embeddings())
        self.lm_head = cast(nn.Linear, model.get_output_embeddings())
        self.norm = cast(nn.Module, self.base.norm)
        config = model.config
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.layer_ids = list(layer_ids) if layer_ids else default_layer_ids(self.num_layers)
        if engine is None:
            from trainer.engine import seam

            engine = seam.engine("vllm")
        self.engine_layers = engine.layers(self.layer_ids, self.num_layers)
        self.engine_ids = self.engine_layers.engine_ids
        self.columns = self.engine_layers.columns
        self.sharded = False
        self.dtype = dtype
        self._device = torch.device(device)
        self._held: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        log.info(
            "target %s: its head here (embedding, final norm, LM head); features of layers "
            "%s from the engine (its layer ids %s)", path, self.layer_ids, self.engine_ids,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def weights_module(self) -> nn.Module:
        """Only the head is here: a run's checkpoints name this target by it (an engine
        run resumes as one)."""
        return nn.ModuleDict({"embed": self.embed_tokens, "norm": self.norm, "head": self.lm_head})

    @staticmethod
    def _key(batch: Batch) -> tuple[int, ...]:
        return (batch.leg, batch.epoch, batch.step, batch.micro)

    def hold(self, batch: Batch, features: torch.Tensor) -> None:
        """Keep ``batch``'s features (host memory) until the loss asks for them."""
        self._held[self._key(batch)] = features

    def batch_features(self, batch: Batch, attention: str = "sdpa") -> torch.Tensor:
        """The features the feed fetched for ``batch`` (micro-batches before it that had
        no block to train are dropped), on the device; the last layer's normed."""
        key = self._key(batch)
        while self._held:
            k, feats = self._held.popitem(last=False)
            if k == key:
                break
        else:
            raise RuntimeError(f"no features were fetched for micro-batch {key}")
        if tuple(feats.shape[:2]) != tuple(batch.input_ids.shape):
            raise RuntimeError(
                f"features {tuple(feats.shape)} for micro-batch {key} of ids "
                f"{tuple(batch.input_ids.shape)}"
            )
        feats = feats.to(self._device, non_blocking=True)
        h = self.hidden_size
        for col, layer in enumerate(self.layer_ids):
            if layer in self.engine_layers.prenorm:  # the engine gives it before the final norm
                part = slice(col * h, (col + 1) * h)
                feats[..., part] = self.norm(feats[..., part])
        return feats

    def train_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       attention: str = "sdpa") -> torch.Tensor:  # fmt: skip
        raise RuntimeError(NO_DECODER)

    def features(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(NO_DECODER)

    def keep_pace(self) -> None:
        pass

    @contextlib.contextmanager
    def lockstep(self) -> Iterator[None]:
        yield
