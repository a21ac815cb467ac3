"""A local target loaded the trainer's way (``trainer.model.weights.load_model``) against a
plain ``from_pretrained``, side by side: seconds and a rank's peak resident memory beyond
the weights it ends with, for each (checkpoint dtype -> load dtype) a rank can ask for.

    .venv/bin/python benchmarks/bench_target_load.py [--hidden 2048 --layers 8 --vocab 32000]

A random-weight Qwen3 of that shape is saved once in fp32 and in bf16 (in a temporary
folder); every load runs in a fresh process, whose peak (VmHWM) is reset just before it.
On CPU the weights' destination is host memory, so "beyond the weights" is what the
loading itself costs: on a GPU rank, that is all the host memory it takes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]

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


def save_random(path: Path, dtype: str, hidden: int, layers: int, vocab: int) -> Path:
    """A random-weight Qwen3 of this shape saved in ``dtype`` (built on the meta device)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=hidden // 16, tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.02, generator=gen)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


@click.command()
@click.option("--hidden", type=int, default=2048, show_default=True)
@click.option("--layers", type=int, default=8, show_default=True)
@click.option("--vocab", type=int, default=32000, show_default=True)
def main(hidden: int, layers: int, vocab: int) -> None:
    mib = 2**20
    with tempfile.TemporaryDirectory() as work:
        saved = {d: save_random(Path(work) / d, d, hidden, layers, vocab)
                 for d in ("float32", "bfloat16")}  # fmt: skip
        sizes = {
            d: sum(f.stat().st_size for f in p.glob("*.safetensors")) for d, p in saved.items()
        }
        print(
            f"random Qwen3, hidden {hidden}, {layers} layers, vocab {vocab}: checkpoint "
            f"{sizes['float32'] / mib:.0f} MiB in fp32, {sizes['bfloat16'] / mib:.0f} MiB in bf16"
        )
        print(f"{'checkpoint -> load':>22} {'weights MiB':>12} {'from_pretrained':>22} "
              f"{'ours':>22} {'peak ratio':>11}")  # fmt: skip
        for src, dst in (("float32", "bfloat16"), ("bfloat16", "float32"),
                         ("bfloat16", "bfloat16"), ("float32", "float32")):  # fmt: skip
            plain, ours = measure(saved[src], "plain", dst), measure(saved[src], "ours", dst)
            cells = [f"{r['seconds']:.1f} s, +{max(r['extra'], 0) / mib:.0f} MiB"
                     for r in (plain, ours)]  # fmt: skip
            ratio = max(ours["extra"], 1) / max(plain["extra"], 1)
            print(f"{src + ' -> ' + dst:>22} {ours['weights'] / mib:>12.0f} {cells[0]:>22} "
                  f"{cells[1]:>22} {ratio:>10.2f}x")  # fmt: skip
        print(
            "+MiB: the peak resident memory of the loading process beyond the weights it "
            "ends with (same-dtype CPU loads keep the weights as views of the file: ~0)"
        )


if __name__ == "__main__":
    main()
