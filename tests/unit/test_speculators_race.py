"""The harness of ``benchmarks/bench_vs_speculators.py`` in miniature: our corpus in
speculators' offline format and back, the hidden states it reads, and the settings mapping
(our flags through our trainer's own option parser)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from benchmarks.peer.speculators_format import (
    RaceSettings,
    anchor_candidates,
    our_flags,
    read_speculators_data,
    speculators_flags,
    speculators_layer_ids,
    target_states,
    tokens_per_anchor,
    train_ratio,
    write_our_corpus,
    write_speculators_data,
)
from loader_server.data.dataset import open_dataset
from loader_server.wire.spec import AnchorRule
from trainer.model.blocks import sample_anchors
from trainer.model.target import TinyTargetSpec, build_tiny_model

SPEC = TinyTargetSpec(vocab_size=97, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                      intermediate_size=48)  # fmt: skip


def _rows(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(5, 40))
        mask = (np.arange(t) >= rng.integers(1, t)).astype(np.uint8)  # prompt, then reply
        out.append((rng.integers(0, SPEC.vocab_size - 1, t).astype(np.int32), mask))
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target")
    build_tiny_model(SPEC).save_pretrained(str(path))
    return path


def test_our_corpus_goes_to_their_format_and_back(tmp_path: Path, target: Path) -> None:
    train_rows, held_rows = _rows(7, 0), _rows(3, 1)
    train = open_dataset(write_our_corpus(train_rows, tmp_path / "train.arrow"))
    heldout = open_dataset(write_our_corpus(held_rows, tmp_path / "heldout.arrow"))
    layer_ids = (0, 2)
    states = target_states(target, layer_ids)
    seen: list[int] = []
    meta = write_speculators_data(tmp_path / "spec", train, heldout, states,
                                  lambda done, total: seen.append(done))  # fmt: skip
    assert seen == list(range(1, 11))
    assert meta["rows"] == 10 and meta["train_rows"] == 7
    assert meta["tokens"] == sum(len(r[0]) for r in train_rows + held_rows)
    assert int(10 * meta["train_ratio"]) == 7  # their split: training corpus, then held out
    assert not (tmp_path / "spec.tmp").exists()

    back = read_speculators_data(tmp_path / "spec")
    for (ids, mask), (ids2, mask2) in zip(train_rows + held_rows, back, strict=True):
        assert np.array_equal(ids, ids2) and np.array_equal(mask, mask2)
        assert ids2.dtype == np.int64 and mask2.dtype == np.int64  # as speculators reads them
    again = open_dataset(write_our_corpus(back, tmp_path / "again.arrow"))
    assert len(again) == 10
    for i, (ids, mask) in enumerate(train_rows + held_rows):
        assert np.array_equal(again.input_ids(i), ids)
        assert np.array_equal(again.loss_mask(i), mask)

    # The states file of a held-out row: our layers' outputs, then the last layer before the
    # final norm (speculators makes its labels with the target's norm and head from it).
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.from_numpy(held_rows[1][0].astype(np.int64))
    stored = load_file(str(tmp_path / "spec" / "hidden_states" / "hs_8.safetensors"))
    assert torch.equal(stored["token_ids"], ids)
    hs = stored["hidden_states"]
    assert hs.shape == (len(ids), len(layer_ids) + 1, SPEC.hidden_size)
    with torch.inference_mode():
        out = model(ids[None], output_hidden_states=True)
        for slot, i in enumerate(layer_ids):
            torch.testing.assert_close(hs[:, slot], out.hidden_states[i + 1][0])
        logits = model.lm_head(model.model.norm(hs[:, -1]))
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(hs[:, -1], out.hidden_states[-1][0])  # that one is normed


def test_a_row_whose_states_name_other_tokens_is_refused(tmp_path: Path, target: Path) -> None:
    rows = _rows(3, 2)
    ds = open_dataset(write_our_corpus(rows, tmp_path / "c.arrow"))
    write_speculators_data(tmp_path / "spec", ds, ds, target_states(target, (0,)))
    from safetensors.torch import load_file, save_file

    path = tmp_path / "spec" / "hidden_states" / "hs_4.safetensors"
    tensors = load_file(str(path))
    tensors["token_ids"] = tensors["token_ids"].flip(0)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"hs_4\.safetensors: token_ids differ from row 4"):
        read_speculators_data(tmp_path / "spec")


def test_layer_ids_and_the_split() -> None:
    assert speculators_layer_ids((2, 0, 1)) == [1, 2, 3]
    with pytest.raises(ValueError, match="distinct"):
        speculators_layer_ids((1, 1))
    for n_train in (1, 7, 600, 902_000):
        for n_val in (1, 3, 96):
            assert int((n_train + n_val) * train_ratio(n_train, n_val)) == n_train
    with pytest.raises(ValueError, match="at least one"):
        train_ratio(5, 0)


def test_anchor_candidates_are_the_positions_our_trainer_draws_from() -> None:
    """One anchor per candidate (``tokens_per_anchor`` 1): the trainer's own draw takes
    every position ``anchor_candidates`` counts, in documents long and short, with
    prompts and supervised gaps."""
    rng = np.random.default_rng(1)
    block = 4
    lengths = np.array([40, 9, 12, 30, 7, 64])
    masks = [rng.random(n) < 0.7 for n in lengths]
    masks[1][:] = True  # 9 supervised: above 2 * block, but few with room for a block
    masks[4][:] = True  # 7 supervised: below 2 * block, no anchor
    width = int(lengths.max())
    lm = torch.zeros(len(masks), width, dtype=torch.bool)
    for i, m in enumerate(masks):
        lm[i, : m.size] = torch.from_numpy(m)
    rule = AnchorRule(block, width, 1, 0)
    _, valid = sample_anchors(lm, torch.from_numpy(lengths), torch.Generator(), rule=rule)
    got = [anchor_candidates(m, block) for m in masks]
    assert got == valid.sum(1).tolist()
    assert got[4] == 0 and got[1] == 6


def test_tokens_per_anchor_matches_their_anchors_per_row() -> None:
    # 40 documents of 100 supervised positions in 2 rows: 40 anchors a row is 2 a document.
    k = tokens_per_anchor(np.full(40, 100), 8000, 4000, 40)
    assert 50 <= k < 100 and np.ceil(100 / k) == 2
    # Uneven documents: the chosen K's rows average closest to the asked-for count.
    rng = np.random.default_rng(0)
    sup = rng.integers(10, 700, 500)
    k = tokens_per_anchor(sup, int(sup.sum() * 2.2), 4096, 128)
    rows = sup.sum() * 2.2 / 4096
    mean = {j: np.ceil(sup / j).sum() / rows for j in (k - 1, k, k + 1)}
    assert abs(mean[k] - 128) <= min(abs(mean[k - 1] - 128), abs(mean[k + 1] - 128))
    assert abs(mean[k] - 128) < 10


def _resolved(tmp_path: Path, flags: list[str]) -> dict:
    """Our trainer's options for ``flags``, through its own parser: the TOML it resolves."""
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--endpoint",
        "ipc:///nowhere",
        "--run-dir",
        str(tmp_path),
        "--target",
        "tiny",
        "--print-config",
        *flags,
    ]
    return tomllib.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def _named(flags: list[str]) -> dict[str, list[str]]:
    """Each flag's values."""
    out: dict[str, list[str]] = {}
    for i, f in enumerate(flags):
        if f.startswith("--"):
            out[f] = []
            for v in flags[i + 1 :]:
                if v.startswith("--"):
                    break
                out[f].append(v)
    return out


def test_settings_reach_both_trainers(tmp_path: Path) -> None:
    s = RaceSettings(layer_ids=(0, 1, 2), mask_token_id=511, tokens_per_step=2048,
                     anchors=64, tokens_per_anchor=14, lr=3e-4, epochs=3, seed=4)  # fmt: skip
    # Ours: through our trainer's own parser, read back as the TOML it resolved.
    conf = _resolved(tmp_path, our_flags(s))
    d, o, lo = conf["drafter"], conf["optimizer"], conf["loader"]
    assert d["layers"] == "0,1,2" and d["drafter_layers"] == 1 and d["block_size"] == 16
    assert d["sliding_window"] == s.sliding_window and d["sliding_bidirectional"] is False
    assert d["mask_token_id"] == 511 and d["loss_weighting"] == "dpace"
    assert d["anchor_draw"] == "document" and d["max_anchors"] == 0
    assert d["tokens_per_anchor"] == 14 and d["anchors_per_doc"] >= s.tokens_per_step
    assert (o["lr"], o["warmup"], o["epochs"], o["seed"]) == (3e-4, 0.04, 3, 4)
    assert (o["weight_decay"], o["grad_clip"]) == (0.01, 1.0)
    assert (lo["layout"], lo["token_budget"], lo["grad_accum"]) == ("packed", 2048, 1)
    assert lo["max_seq_len"] == 2048

    # Theirs: the same values under speculators' names.
    named = _named(speculators_flags(s, Path("/t"), Path("/d"), Path("/s"), 0.9))
    assert named["--target-layer-ids"] == ["1", "2", "3"]
    assert named["--total-seq-len"] == ["2048"] and named["--max-anchors"] == ["64"]
    assert named["--optimizer"] == ["adamw"] and named["--lr"] == ["0.0003"]
    assert named["--scheduler-type"] == ["cosine"]
    assert named["--scheduler-warmup-ratio"] == ["0.04"]
    assert named["--per-position-loss-weight"] == ["dpace"]
    assert named["--epochs"] == ["3"] and named["--seed"] == ["4"]
    assert named["--mask-token-id"] == ["511"] and named["--num-layers"] == ["1"]
    assert named["--sliding-window"] == [str(s.sliding_window)]
    assert named["--train-data-ratio"] == ["0.9"] and named["--on-missing"] == ["raise"]
    with pytest.raises(ValueError, match="warmup"):
        RaceSettings(layer_ids=(0,), mask_token_id=1, warmup=4)


def test_at_defaults_each_trainer_gets_the_shared_inputs_only(tmp_path: Path) -> None:
    """``--defaults`` (issue 71): the data's layers and shape, the run's length and seed,
    and nothing that would override a tool's default; ours then train as ``OUR_DEFAULTS``
    says (read back through our parser), theirs with none of the matched race's choices."""
    from benchmarks.peer.speculators_format import OUR_DEFAULTS
    from trainer.sections import RATES

    s = RaceSettings(layer_ids=(0, 1, 2), mask_token_id=511, tokens_per_step=2048, epochs=3,
                     seed=4, defaults=True)  # fmt: skip
    ours = _named(our_flags(s))
    assert set(ours) == {"--layers", "--mask-token-id", "--layout", "--token-budget",
                         "--max-seq-len", "--grad-accum", "--epochs", "--seed"}  # fmt: skip
    conf = _resolved(tmp_path, our_flags(s))
    d, o = conf["drafter"], conf["optimizer"]
    assert "lr" not in o  # unset: the optimizer's own rate
    got = {"block_size": d.get("block_size", 16), "lr": RATES[o["optimizer"]],
           "warmup": o["warmup"], "weight_decay": o["weight_decay"]}  # fmt: skip
    assert got == {k: OUR_DEFAULTS[k] for k in got}
    assert (o["optimizer"], o["lr_schedule"]) == ("muon", "cosine")
    assert (d["tokens_per_anchor"], d["anchors_per_doc"]) == (32, 512)
    theirs = _named(speculators_flags(s, Path("/t"), Path("/d"), Path("/s"), 0.9))
    chosen = {
        "--num-layers",
        "--block-size",
        "--max-anchors",
        "--optimizer",
        "--lr",
        "--scheduler-type",
        "--per-position-loss-weight",
        "--loss-fn",
        "--sliding-window",
    }
    assert not chosen & set(theirs)
    assert theirs["--total-seq-len"] == ["2048"] and theirs["--target-layer-ids"] == ["1", "2", "3"]
    assert theirs["--epochs"] == ["3"] and theirs["--hidden-states-dtype"] == ["float32"]


def test_the_summary_sets_ours_offline_online_and_longer_against_theirs() -> None:
    """Two pairs with an online and a longer run each: every ratio is ours / theirs per
    pair, the wall time with their hidden-state generation added, tau with its paired
    difference; the longer run's wall time, tokens and tau against theirs."""
    from benchmarks.peer.race_summary import summarize

    def run(tokens: int, step_s: float, wall: float, rss: float, accepted: int) -> dict:
        served = [[10, accepted], [10, accepted]]  # two prompts, (drafts, accepted)
        tau = 1 + 2 * accepted / 20
        return {"tokens": tokens, "step_s": step_s, "wall_s": wall, "rss_peak_gb": rss,
                "steps": 10, "epochs": 1, "served": served, "tau": tau}  # fmt: skip

    runs = [
        {"ours": run(1000, 1.0, 10.0, 0.5, 15), "theirs": run(1000, 2.0, 20.0, 1.0, 16),
         "ours-online": run(1000, 4.0, 30.0, 0.25, 15),
         "ours-longer": run(4000, 4.0, 40.0, 0.5, 18)},
        {"ours": run(1000, 1.0, 10.0, 0.5, 14), "theirs": run(1000, 2.0, 20.0, 1.0, 16),
         "ours-online": run(1000, 4.0, 30.0, 0.25, 16),
         "ours-longer": run(4000, 4.0, 40.0, 0.5, 17)},
    ]  # fmt: skip
    out = summarize(runs, {"generation_s": 10.0, "target_epoch_s": 0.5})
    assert out["tokens_per_s"]["ratio"]["mean"] == pytest.approx(2.0)
    assert out["online tokens_per_s"]["ratio"]["mean"] == pytest.approx(0.5)
    assert out["online rss_peak_gb"]["ratio"]["mean"] == pytest.approx(0.25)
    assert out["wall_with_generation_s"]["ratio"]["mean"] == pytest.approx(10 / 30)
    assert out["online wall_with_generation_s"]["ratio"]["mean"] == pytest.approx(1.0)
    assert out["tau"]["difference"]["mean"] == pytest.approx(-0.15)
    assert out["online tau"]["difference"]["mean"] == pytest.approx(-0.05)
    assert out["longer wall_s"]["ratio"]["mean"] == pytest.approx(2.0)
    assert out["longer tokens"]["ratio"]["mean"] == pytest.approx(4.0)
    assert out["longer tau"]["difference"]["mean"] == pytest.approx(+0.15)
    # Without online runs, or without served tau, those rows are absent.
    offline = [{k: v for k, v in p.items() if k == "ours" or k == "theirs"} for p in runs]
    assert not any(
        k.startswith(("online", "longer"))
        for k in summarize(offline, {"generation_s": 1.0, "target_epoch_s": 0.5})
    )
