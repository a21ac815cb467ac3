"""``dflash-train eval`` end to end: a tiny target folder with a real BPE tokenizer and the
Qwen3 chat template, a drafter trained by the real loop, exported in both dialects and read
from its run folder; set files in their public formats (and the built-in HumanEval); every
protocol in eval.json, the table in eval.md, the plot; MT-Bench's second turn; sampled runs
reproducible by seed; the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from drafters import train_run

from scripts.fixtures.tiny_chat import build_tokenizer
from trainer.cli import main
from trainer.hf.export import export_drafter
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import load_target

pytestmark = pytest.mark.integration

B = 4


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """The target folder, a run folder, its exports (dflash, speculators) and set files."""
    tmp = tmp_path_factory.mktemp("eval")
    tok = build_tokenizer(tmp / "tok", vocab_size=512, template="qwen3")
    target_dir = tmp / "target"
    r = CliRunner().invoke(main, ["save-target", str(target_dir), "--tiny-vocab", "512",
                                  "--tiny-layers", "2", "--tokenizer", str(tok)])  # fmt: skip
    assert r.exit_code == 0, r.output
    target = load_target(str(target_dir))
    n_layers, mask = len(target.layer_ids), target.config.mask_token_id
    cfg = DrafterConfig.from_target(target.config, num_target_layers=n_layers, block_size=B,
                                    mask_token_id=mask)  # fmt: skip
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(1, 500, (48,), generator=g).tolist(), [1] * 48) for _ in range(8)]
    run = train_run(target, samples, tmp / "run", DFlashDrafter(cfg),
                    LossConfig(block_size=B, anchors_per_doc=4), 2)  # fmt: skip
    out = {"target": target_dir, "run": run}
    out["dflash"] = export_drafter(run, tmp / "dflash", dtype="fp32")
    out["speculators"] = export_drafter(run, tmp / "spec", dtype="fp32", fmt="speculators")
    sets = tmp / "sets"
    sets.mkdir()
    write(sets / "gsm8k.jsonl", [
        {"question": "Tom has 3 apples and eats one. How many?", "answer": "2"},
        {"question": "What is 4 + 5?", "answer": "9"},
    ])  # fmt: skip
    write(sets / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And times 3?"]},
    ])  # fmt: skip
    out["gsm8k"], out["mt-bench"] = sets / "gsm8k.jsonl", sets / "question.jsonl"
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_eval(made, out: Path, *drafters: str, extra: tuple[str, ...] = ()) -> dict:
    args = ["eval", *(str(made[d]) for d in drafters), "--target", str(made["target"]),
            "--sets", f"gsm8k={made['gsm8k']},mt-bench={made['mt-bench']}", "--sets",
            "humaneval", "--limit", "2", "--max-new-tokens", "12", "--out", str(out),
            *extra]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "| Drafter | gsm8k | mt-bench | humaneval | Mean |" in r.output
    return json.loads((out / "eval.json").read_text())


def test_eval_reports_every_protocol_for_both_dialects_and_the_run_folder(made, tmp_path):
    doc = run_eval(made, tmp_path / "out", "dflash", "speculators", "run",
                   extra=("--thinking", "both"))  # fmt: skip
    ms = doc["measurements"]
    assert len(ms) == 3 * 3 * 2  # drafters x sets x thinking modes
    assert doc["settings"]["max_new_tokens"] == 12 and doc["settings"]["temperature"] == 0
    for m in ms:
        st = m["stats"]
        assert m["engine"] == "ours" and m["prompts"] == 2 and m["block_size"] == B
        assert 1.0 <= st["tau_ci"][0] <= st["tau"] <= st["tau_ci"][1] <= B
        assert 1.0 <= st["tau_pooled"] <= B and 1.0 <= st["tau_served"] <= B
        assert len(st["position_rates"]) == B - 1
        assert all(0 <= a <= 1 for a in st["position_rates"])
        # the responses: one per turn (MT-Bench: two per prompt)
        assert st["responses"] == (4 if m["set"] == "mt-bench" else 2)
    # the same weights give the same figures, whichever way they are read
    key = lambda m: (m["set"], m["thinking"])  # noqa: E731
    by = {}
    for m in ms:
        by.setdefault(key(m), []).append(m["stats"])
    assert all(v[0] == v[1] == v[2] for v in by.values())
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "temperature 0, block size 4, max new tokens 12" in md
    assert "## Thinking off" in md and "## Thinking on" in md and "## Every protocol" in md
    assert (tmp_path / "out" / "positions.png").stat().st_size > 1000


def test_a_sampled_eval_is_reproducible_by_seed(made, tmp_path):
    # The same seed gives the same figures whatever the batch a prompt shares. That another
    # seed draws otherwise is shown where acceptance is certain to vary (test_speculate.py:
    # test_a_prompt_s_draws_do_not_depend_on_its_batch); this 2-step drafter is rarely
    # accepted at temperature 1, so its figures cannot show it.
    hot = ("--temperature", "1", "--top-p", "0.95", "--seed", "3")
    a = run_eval(made, tmp_path / "a", "dflash", extra=hot)
    b = run_eval(made, tmp_path / "b", "dflash", extra=(*hot, "--batch-size", "1"))
    assert [m["stats"] for m in a["measurements"]] == [m["stats"] for m in b["measurements"]]
    assert a["settings"]["temperature"] == 1.0 and a["settings"]["seed"] == 3
    assert a["settings"]["top_p"] == 0.95 and b["settings"]["batch_size"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--engine", "vllm"), "--engine vllm needs --vllm-python"),
        (("--sets", "gsm8k=MISSING"), "MISSING"),
        (("--sets", "nosuchkind"), "nosuchkind"),
    ],
)
def test_eval_errors_are_one_line(made, tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    write(bad, [{"question": "ok"}, {"text": "no question here"}])
    args = tuple(a.replace("MISSING", str(bad)) for a in args)
    base = ["eval", str(made["dflash"]), "--target", str(made["target"]),
            "--out", str(tmp_path / "o")]  # fmt: skip
    if "--sets" not in args:
        base += ["--sets", "humaneval"]
    r = CliRunner().invoke(main, [*base, *args])
    assert r.exit_code in (1, 2), r.output
    line = r.output.strip().splitlines()[-1]
    assert message.replace("MISSING", str(bad)) in line or message in line, r.output
    assert not (tmp_path / "o").exists()


def test_drafters_whose_folders_share_a_name_keep_a_row_each(made, tmp_path):
    """``runs/A/drafter`` and ``runs/B/drafter`` (the usual layout): each keeps its row,
    labelled by its path under the common parent; the same folder twice is refused."""
    import shutil

    for name in ("A", "B"):
        shutil.copytree(made["dflash"], tmp_path / "runs" / name / "drafter")
    a, b = tmp_path / "runs" / "A" / "drafter", tmp_path / "runs" / "B" / "drafter"
    args = ["eval", str(a), str(b), "--target", str(made["target"]), "--sets", "humaneval",
            "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "o")]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert sorted({m["drafter"] for m in doc["measurements"]}) == ["A/drafter", "B/drafter"]
    md = (tmp_path / "o" / "eval.md").read_text()
    assert "| A/drafter (ours) |" in md and "| B/drafter (ours) |" in md
    again = ["eval", str(a), str(tmp_path / "runs" / "B" / ".." / "A" / "drafter"), *args[3:-1],
             str(tmp_path / "o2")]  # fmt: skip
    r = CliRunner().invoke(main, again)
    assert r.exit_code == 2 and "is given twice" in r.output, r.output
    assert not (tmp_path / "o2").exists()


def test_an_evaluation_that_measures_nothing_fails_saying_why(made, tmp_path):
    """Every prompt too long for the target's positions once --max-new-tokens is reserved:
    no table of dashes (and no row named for an engine that never ran), exit 1 naming the
    flag, and no output folder."""
    positions = json.loads((made["target"] / "config.json").read_text())["max_position_embeddings"]
    r = CliRunner().invoke(main, [
        "eval", str(made["dflash"]), "--target", str(made["target"]), "--sets", "humaneval",
        "--limit", "2", "--max-new-tokens", str(positions), "--out", str(tmp_path / "o"),
    ])  # fmt: skip
    assert r.exit_code == 1, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("Error: "))
    assert "no prompt was measured: all 2 were longer" in line
    assert f"--max-new-tokens {positions}" in line
    assert not (tmp_path / "o").exists()
