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

Every file, on either path, is written by ``dflash_states_file.write_states`` (the thread's
``_write_tensors`` replaced): into ``NAME.part``, then renamed, so what a killed server
leaves is named after its request (safetensors' ``save_file`` would leave a ``.tmpXXXXXX``
that no request names).

Pinned to the vLLM release it was written against (``VLLM_VERSION``): the method it
replaces is private, so another release is refused at start-up with a line naming both
(``serve-check`` exercises it with the pinned build).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from dflash_states_file import write_states
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

VLLM_VERSION = "0.32.0"


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

    @staticmethod
    def _write_tensors(
        tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None
    ) -> None:
        """The writer thread: once the copy is done, the file under its request's name
        (``write_states``), then the lock released."""
        try:
            event.synchronize()
            write_states(filename, tensors)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client reads the file

    def _submit_async_write(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.clone(), "token_ids": pending.token_ids.clone()}
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
