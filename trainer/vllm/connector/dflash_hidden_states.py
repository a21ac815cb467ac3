"""vLLM's ``ExampleHiddenStatesConnector`` made to run on any device, and to write each
file under its request's name: loaded by vLLM's own interpreter
(``kv_connector_module_path``, this folder on its ``PYTHONPATH``), never by the trainer.
Imports vLLM and torch only (and ``dflash_states_file`` beside it).

The stock connector (vLLM 0.32) copies each finished request's hidden states off the GPU
on a CUDA stream into pinned memory, and a thread writes the file once a CUDA event says
the copy is done. On a CPU build there is no stream, event or pinned memory, so that one
private method (``_submit_async_write``) is replaced: the rows are gathered from the
hidden-state cache at once (a copy: the blocks are freed after this returns), and the same
thread pool writes the file under the same ``.lock`` protocol (the client waits on a
shared ``flock`` for the writer's exclusive one). On a GPU the stock method runs.

Where the states go is each request's to say (its ``kv_transfer_params``: the trainer's
``--states-transport``), so one server serves trainer ranks on its machine and on others:

* ``files``: every file, on either path, is written by ``dflash_states_file.write_states``
  (the thread's ``_write_tensors`` replaced): into ``NAME.part``, then renamed, so what a
  killed server leaves is named after its request (safetensors' ``save_file`` would leave
  a ``.tmpXXXXXX`` that no request names);
* ``shm``: a request that names a region of a trainer rank's arena (``kv_transfer_params``
  ``dflash_shm``: ``arena``, ``offset``, ``nbytes``, ``key``) gets its states copied there
  (``dflash_states_shm``): the region's record lock is taken when the request is first
  scheduled (before the server replies, as the stock connector makes its lock files), and
  let go once the header is written; no file is made. The reply says where
  (``kv_transfer_params.dflash_shm``). The arena must lie in ``shared_storage_path``;
* ``mooncake``: a request that names a key and a Mooncake segment (``dflash_mooncake``:
  ``key``, ``segment``) gets its states put into the store there
  (``dflash_states_mooncake``; the store's master and metadata server are in the extra
  config: ``mooncake_master``, ``mooncake_metadata``, ``mooncake_protocol``,
  ``mooncake_local_host``, ``mooncake_device``); no lock, no file. The reply says the key.

A request may ask for its states in another dtype than the engine's (``dflash_dtype``:
bf16, or fp8 e4m3 with a scale per token and layer; ``dflash_states_wire``): the cast is
made as the rows are gathered, before they travel. The scheduler learns it with the
request and hands it to the worker with the request's save (the metadata's
``dflash_wire``). A dtype this server's torch does not carry is refused in the reply
(``dflash_error``), as a region it cannot write is (``dflash_shm_error``).

Pinned to the vLLM release it was written against (``VLLM_VERSION``): the method it
replaces is private, so another release is refused at start-up with a line naming both
(``serve-check`` exercises it with the pinned build).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from dflash_states_file import write_failure, write_states
from dflash_states_shm import REFUSED, Arenas, parse_target, target_of
from dflash_states_wire import WIRE, encode
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

VLLM_VERSION = "0.32.0"
#: How a request put into the Mooncake store is carried as its file name.
MOONCAKE = "mooncake:"


@dataclass
class _Done:
    """Stands in for the CUDA event of a copy that has already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector``, whose write path also runs without CUDA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import vllm

        found = vllm.__version__.split("+")[0]
        if found != VLLM_VERSION:
            raise RuntimeError(
                f"DFlashHiddenStatesConnector replaces a private method of vLLM "
                f"{VLLM_VERSION}'s ExampleHiddenStatesConnector; this is vLLM {found}"
            )
        super().__init__(*args, **kwargs)
        get = self._kv_transfer_config.get_from_extra_config
        self._arenas = Arenas(self._storage_path)
        self._mooncake = get("mooncake_master", "")  # puts only where a master is configured
        self._shm_locked: dict[str, str] = {}  # req_id -> its region, locked until written
        self._wire: dict[str, str] = {}  # req_id -> the dtype it asked for (the scheduler's)
        self._refusals: dict[str, dict[str, str]] = {}  # req_id -> what its reply says
        self._writer: Any = None  # the Mooncake writer, made on the worker's first put

    # ---- the scheduler's side ------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """As the stock one; a request naming an arena region gets that region as its
        target (``shm:ARENA:OFFSET:NBYTES:KEY``) instead of a file, one naming a Mooncake
        key that key; one asking for another dtype has it noted, and handed to the worker
        with its save (``dflash_wire``)."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            asked = (extra or {}).get("kv_transfer_params") or {}
            target = self._target(new_req.req_id, asked)
            if target is not None:
                self._request_filenames[new_req.req_id] = target
                meta.new_req_filenames[new_req.req_id] = target
        meta.dflash_wire = {p.req_id: self._wire.pop(p.req_id)
                            for p in meta.pending_saves if p.req_id in self._wire}  # fmt: skip
        return meta

    def _target(self, req_id: str, asked: dict[str, Any]) -> str | None:
        """Where the request's states go, when not the stock file (None); a refusal is
        ``REFUSED``, its reply in ``_refusals``."""
        wire = asked.get("dflash_dtype") or ""
        if wire and wire not in WIRE:
            self._refusals[req_id] = {
                "dflash_error": (
                    f"dflash_dtype {wire!r}: this server's torch carries {', '.join(WIRE)}"
                )
            }
            return REFUSED
        if wire:
            self._wire[req_id] = str(wire)
        keyed = asked.get("dflash_mooncake")
        if self._mooncake and isinstance(keyed, dict):
            return MOONCAKE + json.dumps({"key": str(keyed["key"]),
                                          "segment": str(keyed["segment"])})  # fmt: skip
        params = asked.get("dflash_shm")
        if not isinstance(params, dict):
            return None
        try:
            arena, offset, nbytes = str(params["arena"]), int(params["offset"]), int(
                params["nbytes"])  # fmt: skip
            self._arenas.check(arena, offset, nbytes)
            return target_of(arena, offset, nbytes, str(params["key"]))
        except (KeyError, TypeError, ValueError, OSError) as e:  # the trainer is told
            self._wire.pop(req_id, None)
            self._refusals[req_id] = {
                "dflash_shm_error": (
                    f"{type(e).__name__}: {e} (the connector's folder: {self._arenas.folder})"
                )
            }
            return REFUSED

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        target = self._request_filenames.get(request.request_id, "")
        if target == REFUSED:  # nothing to write: the blocks go at once
            self._request_filenames.pop(request.request_id, None)
            self._wire.pop(request.request_id, None)
            return False, self._refusals.pop(request.request_id, {"dflash_error": "refused"})
        delay, params = super().request_finished(request, block_ids)
        named = (params or {}).get("hidden_states_path") or ""
        if named.startswith(MOONCAKE):
            return delay, {"dflash_mooncake": {"key": json.loads(named[len(MOONCAKE) :])["key"]}}
        found = parse_target(named)
        if found is not None:
            arena, offset, nbytes, _ = found
            params = {"dflash_shm": {"arena": arena, "offset": offset, "nbytes": nbytes}}
        return delay, params

    # ---- the worker's side ---------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Lock each new request's region (an arena's) or make its lock file (the stock
        way), before the server replies."""
        if self._is_tp_rank_zero and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for req_id, target in list(meta.new_req_filenames.items()):
                    if target == REFUSED or target.startswith(MOONCAKE):
                        del meta.new_req_filenames[req_id]
                    elif parse_target(target) is not None:
                        del meta.new_req_filenames[req_id]
                        if req_id not in self._shm_locked:
                            self._arenas.lock(target)
                            self._shm_locked[req_id] = target
        super().wait_for_save()

    @staticmethod
    def _write_tensors(
        tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None
    ) -> None:
        """The writer thread: once the copy is done, the file under its request's name
        (``write_states``; one it cannot write leaves why beside it), then the lock
        released."""
        try:
            event.synchronize()
            try:
                write_states(filename, tensors)
            except Exception as e:
                write_failure(filename, f"{type(e).__name__}: {e}")
                raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client reads the file

    def _submit_async_write(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        if not self._is_tp_rank_zero:
            return
        if parse_target(pending.filename) is not None:
            self._submit_region_write(pending)
            return
        if pending.filename.startswith(MOONCAKE):
            self._submit_put(pending)
            return
        if self._kv_cache.is_cuda and not self._wire_of(pending):
            super()._submit_async_write(pending)
            return
        tensors = self._tensors(pending)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o600)  # fmt: skip
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _wire_of(self, pending: PendingSave) -> str:
        """The dtype ``pending``'s request asked for (``""``: the engine's)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return str(getattr(meta, "dflash_wire", {}).get(pending.req_id, ""))

    def _tensors(self, pending: PendingSave) -> dict[str, torch.Tensor]:
        """What is sent of ``pending``'s request: its states gathered, in the dtype it
        asked for, and its token ids."""
        out = encode(self._gather(pending), self._wire_of(pending))
        out["token_ids"] = pending.token_ids.clone()
        return out

    def _gather(self, pending: PendingSave) -> torch.Tensor:
        """The request's rows of the hidden-state cache (a copy: its blocks are freed once
        this returns), on the host."""
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        slots = slots.to(self._kv_cache.device)
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        return hidden.to("cpu")  # a GPU's copy waits for the forward (untested here: no GPU)

    def _submit_region_write(self, pending: PendingSave) -> None:
        """The states into the trainer's arena region by the writer threads; the region's
        lock (taken before the reply) is let go once the header is written."""
        target = self._shm_locked.pop(pending.req_id, pending.filename)
        tensors = self._tensors(pending)
        _, _, _, key = parse_target(target)
        done = _Done()
        future = self._executor.submit(self._arenas.write, target, key, tensors)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _submit_put(self, pending: PendingSave) -> None:
        """The states put into the Mooncake store by the writer threads, in the segment of
        the rank that asked (its blocks are free once gathered)."""
        if self._writer is None:
            from dflash_states_mooncake import Writer

            get = self._kv_transfer_config.get_from_extra_config
            self._writer = Writer(
                master=get("mooncake_master", ""), metadata=get("mooncake_metadata", ""),
                protocol=get("mooncake_protocol", "tcp"),
                local_host=get("mooncake_local_host", "127.0.0.1"),
                device=get("mooncake_device", ""),
            )  # fmt: skip
        where = json.loads(pending.filename[len(MOONCAKE) :])
        tensors = self._tensors(pending)
        done = _Done()
        future = self._executor.submit(self._writer.put, where["key"], where["segment"], tensors)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
