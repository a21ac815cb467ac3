"""serve-check's weights check: vLLM loaded every tensor of the export, and every parameter
of its DFlash drafter holds checkpoint values (or is the target's own embedding / LM head,
or one vLLM does not use).

vLLM's DFlash loader does not report a missing tensor (it serves the drafter with ~0
acceptance), so a probe in vLLM's processes (``vllm_weight_probe.py``, installed as
``sitecustomize`` on ``PYTHONPATH``) records what it loaded and compares the values; this
module installs it and reads its report.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from scripts.checks.serve_harness import Check

PROBE = Path(__file__).with_name("vllm_weight_probe.py")


def probe_env(work: Path, report: Path) -> dict[str, str]:
    """The environment that makes vLLM's processes run the probe and write ``report``."""
    probe = work / "probe"
    probe.mkdir(exist_ok=True)
    shutil.copyfile(PROBE, probe / "sitecustomize.py")
    pythonpath = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, "DFLASH_SERVE_CHECK_REPORT": str(report)}


def check_weights(report_path: Path, export: Path, drafter: str) -> Check:
    from safetensors import safe_open

    name = f"{drafter}: vLLM loaded every drafter weight"
    if not report_path.exists():
        why = (f"the probe wrote no report ({report_path}): vLLM's loading path changed "
               "(scripts/checks/vllm_weight_probe.py needs updating)")  # fmt: skip
        return Check(name, False, why)
    rep = json.loads(report_path.read_text())
    if "error" in rep:
        return Check(name, False, f"the probe failed: {rep['error']}")
    exported: set[str] = set()
    for file in sorted(export.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            exported.update(f.keys())
    problems = []
    unread = exported - set(rep["checkpoint_names"])
    if unread:
        problems.append(f"not read by vLLM: {sorted(unread)}")
    lost = sorted(t for t, hits in rep["tensors_found"].items() if not hits)
    if lost:
        problems.append(f"values in no vLLM parameter: {lost}")
    params = rep["params"]
    shared = sorted(n for n, p in params.items() if p["shared_with_target"])
    unused = sorted(n for n, p in params.items() if p["unused"])
    missing = sorted(
        n for n, p in params.items()
        if not p["shared_with_target"] and not p["unused"]
        and not (p["loaded"] and p["rows_covered"] == p["rows"])
    )  # fmt: skip
    if missing:
        problems.append(f"vLLM parameters not from the checkpoint: {missing}")
    if problems:
        return Check(name, False, "; ".join(problems))
    filled = len(params) - len(shared) - len(unused)
    return Check(
        name, True,
        f"{len(exported)} exported tensors -> {filled} {rep['drafter_class']} parameters "
        f"(values equal); shared with the target: {', '.join(shared) or 'none'}; "
        f"unused by vLLM: {', '.join(unused) or 'none'}",
    )  # fmt: skip
