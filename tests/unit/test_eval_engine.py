"""``trainer.eval.engine`` without vLLM: the spec-decode counters parsed from the ``/metrics``
text vLLM 0.32.0 (CPU build) really printed, their arithmetic, the server's command line,
the request bodies and seeds, and the engine's refusals. The engine against a live
(stand-in) server: ``tests/integration/test_vllm_client.py``."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.eval.engine import VllmEngine
from trainer.vllm import api as A
from trainer.vllm import metrics as M
from trainer.vllm import process as P
from trainer.vllm.metrics import SpecCounters

DATA = Path(__file__).resolve().parents[1] / "data"
#: /metrics of vLLM 0.32.0 serving serve-check's tiny target with a full-attention DFlash
#: drafter (num_speculative_tokens 7): once up, and after 16 greedy requests of 48 tokens.
START = (DATA / "vllm-0.32.0-metrics-start.txt").read_text()
AFTER = (DATA / "vllm-0.32.0-metrics-after.txt").read_text()
#: What the second one says (its lines, read by eye).
SIXTEEN = SpecCounters(
    drafts=568, draft_tokens=3976, accepted=205, per_position=(124, 16, 14, 13, 13, 13, 12)
)


def counters(drafts=10, draft_tokens=70, accepted=6, per_position=(4, 2, 0, 0, 0, 0, 0)):
    return SpecCounters(drafts, draft_tokens, accepted, tuple(per_position))


# ---- /metrics ------------------------------------------------------------------------------


def test_the_counters_of_a_real_metrics_page():
    assert M.parse_spec_counters(START) == SpecCounters(0, 0, 0, (0,) * 7)
    assert M.parse_spec_counters(AFTER) == SIXTEEN
    # the page has much else: 54 kB, counters' _created gauges, histograms with le= labels
    assert "vllm:spec_decode_num_drafts_created{" in AFTER and 'le="' in AFTER


def test_the_real_counters_are_coherent_and_give_vllm_s_tau():
    seen = M.parse_spec_counters(AFTER).minus(M.parse_spec_counters(START))
    assert seen == SIXTEEN and seen.inconsistencies() == []
    assert seen.draft_tokens == 7 * seen.drafts  # every draft of a full block here
    assert seen.tau == 1 + 205 / 568
    assert seen.position_rates() == [n / 568 for n in (124, 16, 14, 13, 13, 13, 12)]


def test_engines_are_summed_and_other_families_ignored():
    lines = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 3.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 1.234567e+06',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="1"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 2.0',
        'vllm:generation_tokens_total{engine="0",model_name="target"} 999.0',
        "",
    ]
    assert M.parse_spec_counters("\n".join(lines)) == SpecCounters(1_234_570, 0, 5, (2, 3))


def test_a_server_without_a_drafter_counts_nothing():
    plain = "\n".join(line for line in AFTER.splitlines() if "spec_decode" not in line)
    none = M.parse_spec_counters(plain)
    assert none == SpecCounters(0, 0, 0, ())
    with pytest.raises(ValueError, match=r"no drafts .*was a drafter served"):
        _ = none.tau
    with pytest.raises(ValueError, match="no drafts"):
        none.position_rates()


def test_spec_counters_keeps_the_dict_the_experiment_reads(monkeypatch):
    monkeypatch.setattr(M, "read_metrics", lambda url: AFTER)
    got = M.spec_counters("http://x")
    assert got == {"drafts": 568.0, "draft_tokens": 3976.0, "accepted": 205.0,
                   "per_pos": {0: 124.0, 1: 16.0, 2: 14.0, 3: 13.0, 4: 13.0, 5: 13.0,
                               6: 12.0}}  # fmt: skip


# ---- SpecCounters --------------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 10**12), min_size=3, max_size=3),
    st.lists(st.integers(0, 10**12), min_size=3, max_size=3),
    st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**9)), max_size=8),
)
def test_later_minus_earlier_is_what_was_added(base, added, positions):
    earlier = SpecCounters(*base, tuple(a for a, _ in positions))
    later = SpecCounters(
        *(b + d for b, d in zip(base, added, strict=True)), tuple(a + d for a, d in positions)
    )
    assert later.minus(earlier) == SpecCounters(*added, tuple(d for _, d in positions))
    assert later.minus(later) == SpecCounters(0, 0, 0, (0,) * len(positions))


def test_minus_pads_the_shorter_positions():
    a = counters(per_position=(4, 2))
    assert a.minus(SpecCounters(0, 0, 0, ())) == a
    assert counters(per_position=(4, 2, 1)).minus(a).per_position == (0, 0, 1)


def test_counters_that_went_down_are_refused():
    with pytest.raises(ValueError, match=r"went down .*restarted"):
        counters(drafts=3).minus(counters(drafts=4))
    with pytest.raises(ValueError, match="went down"):
        counters(per_position=(1, 2)).minus(counters(per_position=(2, 2)))


def test_tau_and_the_position_rates():
    c = counters()
    assert c.tau == 1.6
    assert c.position_rates() == [0.4, 0.2, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("c", "says"),
    [
        (counters(accepted=7), "accepted 7 != 6"),
        (counters(accepted=6, per_position=(2, 4)), "rises"),
        (counters(drafts=3, accepted=4, per_position=(4,)), "position 0 accepted 4 of 3"),
    ],
)
def test_incoherent_counters_are_named(c, says):
    assert any(says in p for p in c.inconsistencies())


# ---- the server's command and the requests -----------------------------------------------


def test_the_command_serves_the_drafter_as_dflash_speculator():
    cmd = P.vllm_command("py", Path("/t"), 8000, Path("/d"), num_speculative_tokens=3,
                         max_model_len=4096, extra=("--generation-config", "vllm"))  # fmt: skip
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/t"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--port"] == "8000" and flags["--max-model-len"] == "4096"
    assert flags["--served-model-name"] == P.SERVED and flags["--dtype"] == "float32"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 3}
    assert cmd[-2:] == ["--generation-config", "vllm"]


def test_a_speculators_folder_is_the_model_and_no_drafter_serves_the_target_alone():
    cmd = P.vllm_command("py", Path("/t"), 1, Path("/spec"), speculators=True)
    assert cmd[cmd.index("--model") + 1] == "/spec" and "--speculative-config" not in cmd
    assert "--speculative-config" not in P.vllm_command("py", Path("/t"), 1, None)
    assert "--max-model-len" in P.vllm_command("py", Path("/t"), 1, None)


def test_a_completion_body_asks_for_token_ids_and_says_every_sampling_parameter():
    body = A.completion_body([1, 2], 5, temperature=1.0, top_p=0.9, top_k=20, seed=7,
                             stop_token_ids=[3])  # fmt: skip
    assert body == {"model": "target", "prompt": [1, 2], "max_tokens": 5, "temperature": 1.0,
                    "top_p": 0.9, "top_k": 20, "return_token_ids": True,
                    "stop_token_ids": [3], "seed": 7}  # fmt: skip
    assert "seed" not in A.completion_body([1], 1)


def test_every_prompt_of_a_call_has_its_own_reproducible_seed():
    assert A.request_seeds(0, 3) == [0, 1, 2]
    assert A.request_seeds(2, 3) == [2 * A.SEED_STRIDE + i for i in range(3)]
    assert set(A.request_seeds(1, 100)).isdisjoint(A.request_seeds(2, 100))
    for seed, n in ((-1, 1), (0, A.SEED_STRIDE + 1), (2**62, 1)):
        with pytest.raises(ValueError, match="seed"):
            A.request_seeds(seed, n)


# ---- the engine's refusals ---------------------------------------------------------------


@pytest.fixture
def folders(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    python = tmp_path / "python"
    python.write_text("")
    return {"target": tmp_path / "target", "drafter": tmp_path / "drafter",
            "vllm_python": python, "log": tmp_path / "vllm.log"}  # fmt: skip


def engine(folders, **over) -> VllmEngine:
    kw = {**folders, "num_speculative_tokens": 7, "max_model_len": 64, **over}
    return VllmEngine(**kw)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be at least 1"),
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"vllm_python": Path("/nowhere/python")}, "no such interpreter; .*serve_check.sh"),
        ({"drafter": Path("/nowhere")}, "drafter /nowhere: no config.json"),
    ],
)
def test_the_engine_refuses_a_bad_setting(folders, over, says):
    with pytest.raises(ValueError, match=says):
        engine(folders, **over)


@pytest.mark.parametrize(
    ("prompts", "kw", "says"),
    [
        ([[1] * 60], {"max_new_tokens": 5}, "prompt 0: 60 tokens .* max_model_len 64"),
        ([[1], []], {"max_new_tokens": 5}, "prompt 1: 0 tokens"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ([[1]], {"max_new_tokens": 1, "temperature": -1}, "temperature -1"),
        ([[1]], {"max_new_tokens": 1, "top_p": 0}, "top_p 0"),
        ([[1]], {"max_new_tokens": 1, "top_k": 0}, "top_k 0"),
    ],
)
def test_generate_refuses_what_vllm_would(folders, prompts, kw, says):
    eng = engine(folders)
    eng._url = "http://127.0.0.1:1"  # refused before any request is sent
    with pytest.raises(ValueError, match=says):
        eng.generate(prompts, **kw)


def test_an_engine_not_started_says_so(folders):
    eng = engine(folders)
    with pytest.raises(RuntimeError, match="not running: use it in a `with` block"):
        eng.counters()
    with pytest.raises(RuntimeError, match="not running"):
        eng.generate([[1]], max_new_tokens=1)


@pytest.mark.parametrize("module", [P, A, M])
def test_the_vllm_home_imports_only_the_standard_library(module):
    # vLLM runs in its own virtualenv; the project's process imports none of it
    tree = ast.parse(Path(module.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    tops = {n.split(".")[0] for n in names} - {"__future__", "trainer"}
    assert tops <= sys.stdlib_module_names, tops - sys.stdlib_module_names
    assert all(n.startswith("trainer.vllm") for n in names if n.startswith("trainer"))
