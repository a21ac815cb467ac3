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

Sharded (``shard=``, a function that shards the model: ``trainer.model.sharding``): the
parameters are built on the meta device (buffers such as the rotary table computed as
usual), sharded there, and only then allocated, each rank holding its shards; a tensor
sharded on dim 0 (FSDP2's ``Shard(0)``) is read as the rows this rank owns, one
contiguous byte range of the file, so no rank ever holds, reads or converts the rest.

Mixture-of-experts checkpoints keep one tensor per expert (``mlp.experts.3.gate_proj.
weight``, Qwen2/3-MoE's naming; tested with Qwen3-MoE) where transformers 5 models hold the
experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``, gate then up; ``down_proj [E, H,
I]``): each expert's tensors are read into their rows of the stacked one (on a rank that
owns them, when sharded), as transformers' own conversion does.

What it reads is checked: every parameter and persistent buffer of the model must come
from the checkpoint (tied weights once) with its parameter's shape; a mismatch is one line
naming the tensor and the file. A checkpoint this reader does not cover
(``pytorch_model.bin``, a dtype it does not know, a tensor the model does not have, as
with names a model renames on load) goes through ``from_pretrained`` as before, logged;
sharded, it is refused (``from_pretrained`` would put the whole model on every rank).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
#: One expert's tensor in a checkpoint, and the stacked parameter it goes into: part
#: ``index`` of ``parts`` concatenated along dim 1 of that expert's row.
EXPERT = re.compile(
    r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
STACKED = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
           "down_proj": ("down_proj", 0, 1)}  # fmt: skip
#: What shards a model built with its parameters on the meta device (in place).
Shard = Callable[["PreTrainedModel"], None]


class WeightsError(ValueError):
    """A checkpoint whose tensors do not fit the model its config describes (one line)."""


class _Unsupported(Exception):
    """This reader does not cover the checkpoint: ``from_pretrained`` loads it."""


def load_model(
    path: Path, device: torch.device | str, dtype: torch.dtype | None, *, shard: Shard | None = None
) -> PreTrainedModel:
    """The causal LM in folder ``path`` on ``device`` in ``dtype`` (None: as
    ``from_pretrained`` chooses; sharded: the checkpoint's), in eval mode; ``shard``
    shards it while its parameters are still on the meta device."""
    device = torch.device(device)
    files = safetensors_files(path)
    if shard is not None:
        return _load_sharded(path, files, device, dtype, shard)
    if dtype is None:
        return _from_pretrained(path, device, None)
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


def meta_model(path: Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The model ``path/config.json`` describes, on the meta device (nothing allocated):
    its parameters' names, shapes and bytes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        return _build(config, torch.device("meta"), dtype)
    except _Unsupported as e:
        raise WeightsError(f"{path}: {e}") from None


def _read_into(
    path: Path, files: list[Path], device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """Check every tensor against the model on the meta device (nothing allocated), then
    build it on ``device`` and read the tensors into it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    pieces = _plan_reads(path, files, _build(config, torch.device("meta"), dtype))
    model = _build(config, device, dtype)
    _read_pieces(pieces, _destinations(model), device)
    return model.eval()


def _load_sharded(
    path: Path, files: list[Path] | None, device: torch.device, dtype: torch.dtype | None,
    shard: Shard,
) -> PreTrainedModel:  # fmt: skip
    """Build with the parameters on the meta device, check the checkpoint against it,
    shard it, allocate this rank's shards on ``device`` and read them (nothing else)."""
    from transformers import AutoConfig

    if files is None:
        raise WeightsError(f"{path}: a sharded target is read from safetensors files; it has none")
    dtype = dtype or checkpoint_dtype(files) or torch.float32
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        with _params_on_meta():
            model = _build(config, torch.device("cpu"), dtype)  # buffers computed on the host
        pieces = _plan_reads(path, files, model)
    except _Unsupported as e:
        raise WeightsError(
            f"{path}: cannot be loaded sharded ({e}); load it whole (--target-shard none)"
        ) from None
    buffers = {n: b.to(device) for n, b in model.named_buffers() if not b.is_meta}
    shard(model)
    model.to_empty(device=device)  # this rank's shards, the replicated tensors whole
    model.tie_weights()  # to_empty gives each name its own tensor
    for name, value in buffers.items():
        model.get_buffer(name).copy_(value)
    _read_pieces(pieces, _destinations(model), device)
    return model.eval()


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers (the rotary
    table) are computed where they are made. Built under ``_no_init``, a parameter's
    storage is never written before it moves, so a large one costs no resident memory."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _build(config: Any, device: torch.device, dtype: torch.dtype | None) -> PreTrainedModel:
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


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes: all of model tensor ``name``, or (an
    expert's) row ``expert`` of it, columns ``cols`` of that row when several tensors are
    concatenated there."""

    file: Path
    offset: int  # where its bytes start in the file
    nbytes: int
    src: torch.dtype
    name: str
    shape: tuple[int, ...]
    expert: int | None = None
    cols: tuple[int, int] | None = None
    parts: int = 1  # tensors concatenated in an expert's row


def _plan_reads(path: Path, files: list[Path], skeleton: torch.nn.Module) -> list[Piece]:
    """Every tensor of the checkpoint matched to the model (on the meta device): names,
    dtypes and shapes known, nothing the model needs missing (tied weights once)."""
    wanted = _destinations(skeleton)
    pieces: list[Piece] = []
    for file in files:
        header, start = read_header(file)
        for name, info in header.items():
            src = DTYPES.get(info["dtype"])
            if src is None:
                raise _Unsupported(f"{name!r} has dtype {info['dtype']}")
            begin, end = (int(x) for x in info["data_offsets"])
            piece = Piece(file, start + begin, end - begin, src, name, tuple(info["shape"]))
            pieces.append(_placed(piece, wanted, path))
    _check_covered(pieces, wanted, path)
    return pieces


def _placed(piece: Piece, wanted: dict[str, torch.Tensor], path: Path) -> Piece:
    """``piece`` with its destination: the model tensor of its name, else the stacked
    experts' tensor whose row it is; its shape checked against that."""
    dest, shape = wanted.get(piece.name), piece.shape
    if dest is not None:
        if shape != tuple(dest.shape):
            raise WeightsError(
                f"{piece.file}: tensor {piece.name!r} has shape {list(shape)}, the model "
                f"built from {path / 'config.json'} has {list(dest.shape)}"
            )
        return piece
    slot = _expert_slot(piece.name)
    if slot is None or slot[0] not in wanted:
        raise _Unsupported(f"{piece.file.name} holds {piece.name!r}, which the model does not have")
    name, expert, part, parts = slot
    full = tuple(wanted[name].shape)
    fits = len(shape) == 2 and len(full) == 3 and expert < full[0]
    if not fits or full[1:] != (parts * shape[0], shape[1]):
        raise WeightsError(
            f"{piece.file}: expert tensor {piece.name!r} of shape {list(shape)} does not fit "
            f"{name!r} of {list(full)} (the model built from {path / 'config.json'})"
        )
    cols = (part * shape[0], (part + 1) * shape[0]) if parts > 1 else None
    return replace(piece, name=name, expert=expert, cols=cols, parts=parts)


def _expert_slot(name: str) -> tuple[str, int, int, int] | None:
    """``(stacked tensor, expert, part, parts)`` of a per-expert checkpoint tensor's name."""
    m = EXPERT.match(name)
    if m is None:
        return None
    stacked, part, parts = STACKED[m["proj"]]
    return f"{m['base']}.{stacked}", int(m["e"]), part, parts


def _check_covered(pieces: list[Piece], wanted: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor the model needs is filled whole (a tied weight is one tensor, two
    names; a stacked experts' tensor needs every part of every expert)."""
    got: dict[int, set[tuple[int, int]]] = {}
    need: dict[int, int] = {}  # pieces a tensor needs (0: it is filled by one)
    for p in pieces:
        key = id(wanted[p.name])
        if p.expert is None:
            need[key] = 0
        else:
            got.setdefault(key, set()).add((p.expert, p.cols[0] if p.cols else 0))
            need.setdefault(key, wanted[p.name].shape[0] * p.parts)
    done = {k for k, n in need.items() if len(got.get(k, ())) >= n}
    missing = sorted(n for n, t in wanted.items() if id(t) not in done)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightsError(
            f"{path}: the checkpoint has no {', '.join(missing[:3])}{more} (the model its "
            "config.json describes needs them)"
        )


def _read_pieces(
    pieces: list[Piece], wanted: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Read each piece into this rank's part of its destination, a staging buffer at a time."""
    pin = device.type == "cuda"
    staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin)
    with torch.no_grad():  # parameters are written in place
        for piece in pieces:
            span = _local_span(piece, wanted[piece.name])
            if span is None:
                continue  # another rank's rows
            offset, nbytes, dest = span
            with open(piece.file, "rb", buffering=0) as f:
                _copy(f, offset, nbytes, piece.src, dest, staging)
    if pin:
        torch.cuda.synchronize(device)  # the staging buffer is reused and freed after this


def _local_span(piece: Piece, dest: torch.Tensor) -> tuple[int, int, torch.Tensor] | None:
    """``(file offset, bytes, destination)`` of the part of ``piece`` this rank holds:
    the whole piece unsharded, else the rows of dim 0 it owns (an expert's piece whole,
    if the rank owns that expert's row); None when it holds none of it."""
    local, first = local_part(dest)
    if piece.expert is not None:
        row = piece.expert - first
        if not 0 <= row < local.shape[0]:
            return None
        out = local[row] if piece.cols is None else local[row, piece.cols[0] : piece.cols[1]]
        return piece.offset, piece.nbytes, out
    if local.dim() == 0 or local.shape[0] == dest.shape[0]:
        return piece.offset, piece.nbytes, local
    if local.shape[0] == 0:
        return None
    row_bytes = piece.nbytes // dest.shape[0]
    return piece.offset + first * row_bytes, local.shape[0] * row_bytes, local


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(this rank's tensor, the global index of its first row)``: a DTensor sharded on
    dim 0 (over one dimension of its mesh, replicated over any other: FSDP2's and HSDP's
    layouts) holds the rows ``torch.chunk`` gives its place on that dimension; any other
    tensor is all there."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, 0
    dim = shard_dim(t)
    rank, world = t.device_mesh.get_local_rank(dim), t.device_mesh.size(dim)
    per = -(-t.shape[0] // world)  # torch.chunk's chunk size
    first = min(rank * per, t.shape[0])
    local = t.to_local()
    if local.shape[0] != min(per, t.shape[0] - first):
        raise WeightsError(
            f"rank {rank} holds {local.shape[0]} rows of {t.shape[0]}, not chunk {per}"
        )
    return local, first


def shard_dim(t: Any) -> int:
    """The mesh dimension a DTensor is sharded over on its dim 0 (the others replicate)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    found = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(found) != 1 or any(p != Replicate() for i, p in enumerate(placements) if i != found[0]):
        raise WeightsError(f"a parameter sharded as {placements}: only Shard(0) is read")
    return found[0]


def _copy(
    f: Any, offset: int, nbytes: int, src: torch.dtype, dest: torch.Tensor, staging: torch.Tensor
) -> None:
    """Read ``nbytes`` at ``offset`` (values of dtype ``src``) into ``dest`` (contiguous),
    a staging buffer's worth at a time."""
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
        return contextlib.nullcontext()
    return no_init_weights()
