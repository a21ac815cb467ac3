"""Loading a local Hugging Face model onto its device without a host copy per rank.

``from_pretrained`` memory-maps safetensors: in the checkpoint's own dtype on CPU the
weights stay views of the page cache (one copy per node, whatever the number of ranks),
which ``load_model`` keeps. In another dtype it first builds a converted copy of the whole
model in host memory, per rank (8 ranks x 64 GB for a 32B target), and onto a GPU every
rank maps and reads the whole file before the copy. ``load_model`` instead builds the
model on its device (``torch.device`` context, weight initialization skipped) and reads
every tensor of the checkpoint with plain file reads, ``STAGING_BYTES`` at a time, into a
host staging buffer (pinned on CUDA) and from there into its parameter on the device,
converting the dtype on the way. Host memory beyond the weights' destination: one
staging buffer. No file is mapped, so a rank's resident memory does not grow with the
checkpoint either.

What it reads is checked: every parameter and persistent buffer of the model must come
from the checkpoint (tied weights once) with its parameter's shape; a mismatch is one line
naming the tensor and the file. A checkpoint this reader does not cover
(``pytorch_model.bin``, a dtype it does not know, a tensor the model does not have, as
with names a model renames on load) goes through ``from_pretrained`` as before, logged.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

#: Bytes read from the file per copy into the device (the host memory the load needs).
STAGING_BYTES = 64 << 20
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class WeightsError(ValueError):
    """A checkpoint whose tensors do not fit the model its config describes (one line)."""


class _Unsupported(Exception):
    """This reader does not cover the checkpoint: ``from_pretrained`` loads it."""


def load_model(
    path: Path, device: torch.device | str, dtype: torch.dtype | None
) -> PreTrainedModel:
    """The causal LM in folder ``path`` on ``device`` in ``dtype`` (None: as
    ``from_pretrained`` chooses), in eval mode."""
    device = torch.device(device)
    if dtype is None:
        return _from_pretrained(path, device, None)
    files = safetensors_files(path)
    if files is not None and device.type == "cpu" and checkpoint_dtype(files) == dtype:
        return _from_pretrained(path, device, dtype)  # views of the page cache: no copy
    try:
        if files is None:
            raise _Unsupported("no safetensors files")
        return _read_into(path, files, device, dtype)
    except _Unsupported as e:
        why = str(e)  # not the exception: its traceback would keep a half-built model alive
    log.info("%s: loaded by from_pretrained (%s)", path, why)
    return _from_pretrained(path, device, dtype)


def _from_pretrained(
    path: Path, device: torch.device, dtype: torch.dtype | None
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device)  # type: ignore[arg-type]  # transformers' stub types .to() narrowly
    return model.eval()


def safetensors_files(path: Path) -> list[Path] | None:
    """The checkpoint's safetensors files (one, or the shards its index names); None if
    it has none."""
    index = path / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: unreadable shard index ({e})") from None
        return [path / s for s in shards]
    single = path / SAFETENSORS
    return [single] if single.is_file() else None


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """``(tensors, data_start)``: a safetensors file's header (name -> dtype, shape,
    data_offsets) and where its data begins."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise WeightsError(f"{file}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def checkpoint_dtype(files: list[Path]) -> torch.dtype | None:
    """The floating-point dtype of the checkpoint's tensors (None: mixed or unknown)."""
    kinds = {v["dtype"] for f in files for v in read_header(f)[0].values()}
    floats = {DTYPES.get(k) for k in kinds if k.startswith(("F", "BF"))}
    return floats.pop() if len(floats) == 1 else None


def _read_into(
    path: Path, files: list[Path], device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """Check every tensor against the model on the meta device (nothing allocated), then
    build it on ``device`` and read the tensors into it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    reads = _plan_reads(path, files, _build(config, torch.device("meta"), dtype))
    model = _build(config, device, dtype)
    wanted = _destinations(model)
    pin = device.type == "cuda"
    staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin)
    with torch.no_grad():  # parameters are written in place
        for file, start, name, src, begin, end in reads:
            with open(file, "rb", buffering=0) as f:
                _copy(f, start + begin, end - begin, src, wanted[name], staging)
    if pin:
        torch.cuda.synchronize(device)  # the staging buffer is reused and freed after this
    return model.eval()


def _build(config: Any, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``config`` on ``device`` in ``dtype``, its random initialization
    skipped (weights tied as ``post_init`` would)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device(device), _no_init():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # an architecture from_config cannot build: from_pretrained says why
        raise _Unsupported(f"from_config: {e}") from None
    model.tie_weights()  # part of the initialization skipped above
    return model


Read = tuple[Path, int, str, torch.dtype, int, int]  # file, data start, name, dtype, span


def _plan_reads(path: Path, files: list[Path], skeleton: torch.nn.Module) -> list[Read]:
    """Every tensor of the checkpoint matched to the model (on the meta device): names,
    dtypes and shapes known, nothing the model needs missing (tied weights once)."""
    wanted = _destinations(skeleton)
    reads: list[Read] = []
    for file in files:
        header, start = read_header(file)
        for name, info in header.items():
            if name not in wanted:
                raise _Unsupported(f"{file.name} holds {name!r}, which the model does not have")
            src = DTYPES.get(info["dtype"])
            if src is None:
                raise _Unsupported(f"{name!r} has dtype {info['dtype']}")
            if tuple(info["shape"]) != tuple(wanted[name].shape):
                raise WeightsError(
                    f"{file}: tensor {name!r} has shape {info['shape']}, the model built from "
                    f"{path / 'config.json'} has {list(wanted[name].shape)}"
                )
            begin, end = info["data_offsets"]
            reads.append((file, start, name, src, int(begin), int(end)))
    loaded = {id(wanted[r[2]]) for r in reads}  # a tied weight is one tensor, two names
    missing = sorted(n for n, t in wanted.items() if id(t) not in loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightsError(
            f"{path}: the checkpoint has no {', '.join(missing[:3])}{more} (the model its "
            "config.json describes needs them)"
        )
    return reads


def _copy(
    f: Any, offset: int, nbytes: int, src: torch.dtype, dest: torch.Tensor, staging: torch.Tensor
) -> None:
    """Read ``nbytes`` at ``offset`` (a tensor of dtype ``src``) into ``dest``, a staging
    buffer's worth at a time."""
    flat = dest.view(-1)
    item = torch.empty((), dtype=src).element_size()
    if nbytes != flat.numel() * item:
        raise WeightsError(f"{f.name}: a tensor of {nbytes} bytes for {flat.numel()} values")
    per = max(1, staging.numel() // item)
    f.seek(offset)
    for first in range(0, flat.numel(), per):
        n = min(per, flat.numel() - first)
        view = memoryview(staging.numpy()).cast("B")[: n * item]  # type: ignore[arg-type]
        if f.readinto(view) != n * item:
            raise WeightsError(f"{f.name}: truncated (a tensor ends past the end of the file)")
        flat[first : first + n].copy_(staging[: n * item].view(src), non_blocking=True)
        if staging.is_pinned():
            torch.cuda.current_stream(dest.device).synchronize()  # before the next read


def _destinations(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint must fill: parameters and persistent buffers, by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict())
    out.update(
        (name, buf)
        for name, buf in model.named_buffers(remove_duplicate=False)
        if name in persistent
    )
    return out


def _no_init() -> Any:
    """Transformers' context that skips random initialization (the weights are read over
    it); a no-op context where it does not exist (initializing only costs time)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()
