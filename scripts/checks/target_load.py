"""A local target loaded in a fresh process, measured: the trainer's way
(``trainer.model.weights.load_model``) or a plain ``from_pretrained`` (then ``.to(device)``).

``measure`` is the measurement behind ``python benchmarks/bench_target_load.py`` (CPU, every
dtype pair) and the GPU check's ``load`` stage (``scripts/checks/gpu_check.py``: a 2 GB fp32
checkpoint onto the GPU in bf16); the checkpoint they load is
``scripts.fixtures.random_qwen3.save_random``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

MEASURE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[4])
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM
    import transformers.models.qwen3.modeling_qwen3  # imported before the baseline
    from trainer.model.weights import load_model
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    dtype, device = getattr(torch, sys.argv[3]), torch.device(sys.argv[5])
    if device.type == "cuda":
        torch.cuda.init()  # its host memory is the baseline's, not the load's
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM starts again from here
    before, t = status("VmRSS"), time.perf_counter()
    if sys.argv[2] == "plain":
        m = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True, dtype=dtype)
        m.to(device)
    else:
        m = load_model(Path(sys.argv[1]), device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, peak = time.perf_counter() - t, status("VmHWM")
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    state = m.state_dict()
    weights = sum(x.numel() * x.element_size() for x in state.values())
    on_host = weights if device.type == "cpu" else 0  # the weights' own pages, if on the host
    checksum = sum(float(x.double().sum()) for x in state.values())  # after the peak
    print(json.dumps({"seconds": seconds, "extra": peak - before - on_host,
                      "weights": weights, "checksum": checksum, "gpu_peak": gpu}))
""")


def measure(path: Path, mode: str, dtype: str, device: str = "cpu") -> dict[str, Any]:
    """Load ``path`` onto ``device`` in a fresh process (``mode`` "plain" or "ours",
    ``dtype`` a torch dtype name): seconds, bytes of the weights, peak host bytes beyond
    the weights' own (all of the peak on a GPU), a checksum of the state, peak GPU bytes."""
    cmd = [sys.executable, "-c", MEASURE, str(path), mode, dtype, str(ROOT), device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
