"""Atomic, versioned, verified checkpoints that carry the loader position with the weights.

Layout: ``RUN_DIR/checkpoints/step-00000100/`` holds

* ``model.pt`` (written by rank 0): drafter weights, optimizer and scheduler state, the
  step, and the configs needed to rebuild the drafter. Under DDP every rank holds the same
  replicated parameters and optimizer state, so one copy is complete (a sharded optimizer
  would need one file per rank: that is the "saved from one rank only" bug of some
  trainers, which DDP cannot have).
* ``rank-00000.pt`` ... one per rank: that rank's loader ``state_dict`` (the next batch it
  must be served) and its RNG states. A job resumed on more ranks than saved it gives the
  new ranks rank 0's loader state (at a step boundary all ranks share one position; the
  client turns it into the rest of the epoch for the new shape) and no RNG state.

``RUN_DIR/manifests/step-00000100.json`` records each file's size and blake2b digest
(``model.pt``'s is hashed as it is written; the manifest lies outside the checkpoint folder
so the folder holds exactly the checkpoint's files). Every file is written as ``name.tmp``,
fsynced and renamed; all ranks write into ``step-N.tmp/``; rank 0 writes the manifest, then
renames the folder to ``step-N`` and fsyncs the parent. A crash at any point leaves either
the previous complete checkpoint or the new one, never a torn one; stale ``*.tmp`` folders
are ignored and cleaned up by the next save. The newest ``keep`` checkpoints are kept.

What is read back is verified first (``verify_checkpoint``: sizes, and digests where asked):
a truncated or corrupt checkpoint raises ``TornCheckpointError``, and so does a file
``torch.load`` cannot read (checkpoints written before manifests existed are trusted when
they load). ``--resume`` and ``export`` then fall back to the newest complete one.

A drafter state with a non-finite tensor is never written (``NonFiniteCheckpointError``);
a write that fails (no space, read-only, a file size limit) removes only its own
``step-N.tmp`` and raises ``CheckpointWriteError``, naming the path and, for a full disk,
the space needed and free: the previous checkpoints stay as they were.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch

from loader_server.faults import fault_point
from trainer.files import fsync_dir
from trainer.model.blocks import LEGACY_LOSS_FIELDS, LossConfig
from trainer.options import renamed
from trainer.sections import RunOptions
from trainer.train.distributed import DistEnv, all_reduce, barrier

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
#: Loss config fields newer than some checkpoints, with what those checkpoints trained:
#: DFlash2's selector weight, and the objective before it was one however a step is cut.
LOSS_DEFAULTS = {"selector_alpha": LossConfig.selector_alpha, **LEGACY_LOSS_FIELDS}
MANIFEST_VERSION = 1
MANIFESTS = "manifests"  # RUN_DIR/manifests/step-N.json
_NAME = re.compile(r"^step-(\d{8})$")
_CHUNK = 1 << 20  # bytes hashed at a time when verifying


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written (one line for the user)."""


class TornCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, truncated, corrupt or unreadable: the readers
    fall back to an older one."""


class NonFiniteCheckpointError(CheckpointError):
    """A drafter state holding NaN or inf: never written, never exported."""


class RunWriteError(ValueError):
    """A write into the run folder failed (no space, read-only, too large): one line."""


class CheckpointWriteError(RunWriteError, CheckpointError):
    """Writing a checkpoint failed (no space, read-only, too large); older ones are intact."""


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """What rank 0's ``model.pt`` holds besides the file header: the one place its keys are
    spelled. ``training`` (optimizer and scheduler state) is absent where only the drafter
    is read (``export``)."""

    step: int
    epoch: int
    world_size: int = 1  # ranks that wrote it (from the file header)
    drafter: dict[str, torch.Tensor]
    drafter_config: dict[str, Any]
    loss_config: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    #: The LR schedule's clock (``trainer.train.clock.Clock.to_dict``); None before it existed.
    clock: dict[str, int] | None = None

    def to_shared(self) -> dict[str, Any]:
        """The ``shared`` dict ``save_checkpoint`` writes (the step goes in the header)."""
        return {
            "drafter": self.drafter,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "drafter_config": self.drafter_config,
            "loss_config": self.loss_config,
            "meta": self.meta,
            "epoch": self.epoch,
            "clock": self.clock,
        }

    @classmethod
    def from_shared(cls, shared: Mapping[str, Any], where: Path) -> CheckpointRecord:
        """The record of a loaded ``model.pt`` (``where`` names it in errors); loss configs
        written under the options' older names are read under the new ones."""
        missing = sorted({"step", "drafter", "drafter_config", "loss_config"} - set(shared))
        if missing:
            raise ValueError(f"{where}: not a drafter checkpoint (no {', '.join(missing)})")
        saved_loss: dict[str, Any] = dict(shared["loss_config"])
        # Fields newer than the checkpoint mean what it trained (LOSS_DEFAULTS).
        old = renamed(RunOptions)
        loss = {**LOSS_DEFAULTS, **{old.get(k, k): v for k, v in saved_loss.items()}}
        return cls(
            step=int(shared["step"]),
            epoch=int(shared.get("epoch", 0)),
            world_size=int(shared.get("world_size", 1)),
            drafter=dict(shared["drafter"]),
            drafter_config=dict(shared["drafter_config"]),
            loss_config=loss,
            meta=dict(shared.get("meta") or {}),
            optimizer=shared.get("optimizer"),
            scheduler=shared.get("scheduler"),
            clock=shared.get("clock"),
        )


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def manifest_path(path: Path) -> Path:
    """The manifest of the checkpoint folder ``RUN_DIR/checkpoints/step-N``:
    ``RUN_DIR/manifests/step-N.json``."""
    return path.parent.parent / MANIFESTS / f"{path.name}.json"


class _HashingWriter:
    """A write-only file object that hashes what passes through it (``torch.save`` needs
    only ``write``) and keeps the ``OSError`` a write raised (torch reports it as a
    ``RuntimeError`` without the errno)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.hash = hashlib.blake2b(digest_size=16)
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = int(self._f.write(data))
        except OSError as e:
            self.error = e
            raise
        self.hash.update(memoryview(data)[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` to ``path`` via a fsynced temporary file and a rename; returns the
    file's manifest entry (size and blake2b digest, hashed while writing)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        w = _HashingWriter(f)
        try:
            torch.save(obj, cast(IO[bytes], w))  # it only calls write()
        except Exception:
            if w.error is not None:
                raise w.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": w.size, "blake2b": w.hash.hexdigest()}


def file_digest(path: Path) -> dict[str, Any]:
    """A file's manifest entry, read back."""
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "blake2b": h.hexdigest()}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rng(seed: int, rank: int, step: int) -> None:
    """Seed this process's RNGs from the run (for a rank a checkpoint holds no state of)."""
    key = hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    value = int.from_bytes(key, "little") >> 1
    torch.manual_seed(value)
    random.seed(value)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an inf."""
    return [
        k
        for k, t in tensors.items()
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())
    ]


def check_finite(tensors: Mapping[str, torch.Tensor], where: str, tail: str = "") -> None:
    """Raise ``NonFiniteCheckpointError`` naming ``where`` and the first bad tensors."""
    bad = non_finite(tensors)
    if bad:
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteCheckpointError(
            f"{where}: drafter weight {names} is not finite (NaN or inf){tail}"
        )


def save_checkpoint(
    run_dir: Path,
    step: int,
    env: DistEnv,
    *,
    record: CheckpointRecord,
    per_rank: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Collective: every rank calls it with its own ``per_rank``; ``record`` is written by
    rank 0 only. Returns the final folder. Refuses a non-finite drafter state (every rank
    holds the same replicated weights, so every rank refuses); a failed write on any rank
    raises ``CheckpointWriteError`` on every rank, leaving the older checkpoints intact."""
    save = _Save(checkpoint_dir(run_dir), step, env)
    tail = ": training diverged; not saved, the previous checkpoints are intact"
    check_finite(record.drafter, f"checkpoint {save.final}", tail)
    need = _state_bytes(record.to_shared()) + env.world_size * _state_bytes(per_rank)
    for phase in (
        save.start if env.is_main else _nothing,
        lambda: save.write(record, per_rank),
        save.publish if env.is_main else _nothing,
    ):
        err: OSError | None = None
        try:
            phase()
        except OSError as e:
            err = e
        _agree_or_raise(err, env, save.final, save.tmp, need)
    if env.is_main:
        try:
            _prune(save.root, keep, save.final)
        except OSError as e:  # the new checkpoint is complete: old ones linger, no harm
            log.warning("could not remove old checkpoints in %s: %s", save.root, e)
    barrier(env)
    return save.final


def _nothing() -> None:
    """A phase of the save that is rank 0's: the other ranks only agree on its outcome."""


class _Save:
    """One checkpoint being written: into ``tmp`` (rank 0 makes it, every rank writes its
    part, rank 0 the shared record), then published as ``final`` with its manifest."""

    def __init__(self, root: Path, step: int, env: DistEnv) -> None:
        self.root, self.step, self.env = root, step, env
        self.final = root / f"step-{step:08d}"
        self.tmp = root / f"step-{step:08d}.tmp"
        self.entries: dict[str, dict[str, Any]] = {}
        self.head = {"version": CHECKPOINT_VERSION, "step": step, "world_size": env.world_size}

    def start(self) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)

    def write(self, record: CheckpointRecord, per_rank: dict[str, Any]) -> None:
        env, head = self.env, self.head
        name = f"rank-{env.rank:05d}.pt"
        self.entries[name] = atomic_save({**head, "rank": env.rank, **per_rank}, self.tmp / name)
        fault_point("checkpoint.write", self.step)
        if env.is_main:
            shared = {**head, **record.to_shared()}
            self.entries["model.pt"] = atomic_save(shared, self.tmp / "model.pt")

    def publish(self) -> None:
        for r in range(1, self.env.world_size):  # the other ranks' files: small, read back
            name = f"rank-{r:05d}.pt"
            self.entries[name] = file_digest(self.tmp / name)
        manifest = {
            "version": MANIFEST_VERSION,
            "step": self.step,
            "files": dict(sorted(self.entries.items())),
        }
        fsync_dir(self.tmp)
        mpath = manifest_path(self.final)
        mpath.parent.mkdir(exist_ok=True)
        _write_json(mpath, manifest)
        fault_point("checkpoint.publish", self.step)
        if self.final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        fsync_dir(self.root)


def _agree_or_raise(err: OSError | None, env: DistEnv, final: Path, tmp: Path, need: int) -> None:
    """Collective (it is the barrier between the phases of a save): raise on every rank
    if any rank failed, after rank 0 removed this save's ``tmp`` folder."""
    failed = err is not None
    if env.distributed:
        flag = torch.tensor([1.0 if failed else 0.0], device=env.device)
        failed = bool(all_reduce(flag, env, op="max").item() > 0)
    if not failed:
        return
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    what = f"checkpoint {final.name} in {final.parent}"
    intact = "the previous checkpoints are intact: fix that, then rerun with --resume"
    if err is None:
        raise CheckpointWriteError(
            f"cannot write {what}: another rank failed to write its part; {intact}"
        )
    raise CheckpointWriteError(write_error_message(err, what, need, intact, final.parent))


def write_error_message(
    err: OSError, what: str, need: int | None, tail: str = "", path: Path | None = None
) -> str:
    """One line for a failed write of ``what`` (in folder ``path``): the reason, the file
    and, for a full disk, about how much space it needs (``need`` bytes) and how much is
    free there."""
    reason = err.strerror or str(err)
    msg = f"cannot write {what}: {reason}"
    if err.filename:
        msg += f" ({err.filename})"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(Path(path if path is not None else (err.filename or ".")))
        sizes = []
        if need is not None:
            sizes.append(f"needs about {_mb(need)}")
        if free is not None:
            sizes.append(f"{_mb(free)} free")
        if sizes:
            msg += f": {', '.join(sizes)}"
    if tail:
        msg += f"; {tail}"
    return msg


def run_write_error(e: OSError, run_dir: Path) -> RunWriteError:
    """A failed write into the run folder (no space, read-only...), as its one line."""
    where = f"into the run folder {run_dir}"
    return RunWriteError(write_error_message(e, where, None, path=run_dir))


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (what ``torch.save`` writes, roughly)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: Path, keep: int, final: Path) -> None:
    """Keep the newest ``keep`` checkpoints up to ``final`` (newer ones are torn leftovers
    of a run that resumed from an older one: the replay re-saves them), drop stale
    ``.tmp`` folders and manifests without their folder."""
    done = sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.name <= final.name)
    for old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(old)
        manifest_path(old).unlink(missing_ok=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    manifests = root.parent / MANIFESTS
    for m in manifests.glob("step-*.json") if manifests.is_dir() else ():
        if _NAME.match(m.stem) and not (root / m.stem).is_dir():
            m.unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def verify_checkpoint(
    path: Path, *, digests: bool = True, only: Iterable[str] | None = None
) -> bool:
    """Check ``path`` against its manifest: every file (or those named in ``only``)
    present with its recorded size, and digest with ``digests``. Raises
    ``TornCheckpointError``; returns False for a checkpoint older than manifests (nothing
    to check it against: its readers trust it if it loads)."""
    mpath = manifest_path(path)
    if not mpath.is_file():
        return False
    try:
        manifest = json.loads(mpath.read_text())
        listed: dict[str, dict[str, Any]] = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TornCheckpointError(f"{path}: unreadable manifest {mpath.name} ({e})") from e
    names = list(listed) if only is None else list(only)
    for name in names:
        entry = listed.get(name)
        if entry is None:
            raise TornCheckpointError(f"{path}: {name} is not in its manifest {mpath.name}")
        file = path / name
        if not file.is_file():
            raise TornCheckpointError(f"{path}: {name} is missing")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise TornCheckpointError(
                f"{path}: {name} has {size} bytes, {entry.get('size')} were written (truncated)"
            )
        if digests and file_digest(file)["blake2b"] != entry.get("blake2b"):
            raise TornCheckpointError(f"{path}: {name} differs from what was written (corrupt)")
    return True


def load_checkpoint(path: Path, env: DistEnv) -> tuple[CheckpointRecord, dict[str, Any]]:
    """``(record, per_rank)`` of this rank, checked for version. Written by another number
    of ranks, a rank it did not have gets rank 0's file with ``rng`` None (see the module
    docstring). A file that is missing or does not load raises ``TornCheckpointError`` (see
    ``verify_checkpoint`` for the manifest check, which callers run first)."""
    shared = load_file(path / "model.pt")
    saved = shared.get("world_size")
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise TornCheckpointError(f"checkpoint {path}: model.pt names no world size ({saved!r})")
    own = env.rank < saved
    per_rank = load_file(path / f"rank-{env.rank if own else 0:05d}.pt")
    if not own:
        per_rank = {**per_rank, "rng": None}
    if per_rank["step"] != shared["step"]:  # a rank file of another save: torn
        raise TornCheckpointError(
            f"checkpoint {path}: rank file step {per_rank['step']} != {shared['step']}"
        )
    return CheckpointRecord.from_shared(shared, path / "model.pt"), per_rank


def load_file(file: Path, *, mmap: bool = False) -> dict[str, Any]:
    """One checkpoint file, its version checked; missing or unreadable files raise
    ``TornCheckpointError``."""
    if not file.is_file():
        raise TornCheckpointError(f"checkpoint file missing: {file}")
    # Our own files: RNG states include Python tuples, which weights_only allows.
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, I/O error: all mean "unreadable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TornCheckpointError(f"{file}: unreadable ({first})") from e
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise ValueError(
            f"{file}: checkpoint version {version} is not {CHECKPOINT_VERSION}; "
            "it was written by another trainer version"
        )
    return state
