"""psr-hf bench-speculative (psr_hf.bench.speculative) and the drafter-effect study (psr_hf.bench.drafter_effect) on
the CPU with the shipped olmoe-routing and tiny-moe: row names, the break-even arithmetic, a whole small record whose
speculative outputs are the harness's, and the drafter effect's counts."""

from __future__ import annotations

import pytest

from psr_hf.assets.loading import load_model
from psr_hf.bench.drafter_effect import drafter_effect
from psr_hf.bench.prompt_sets import tokenized
from psr_hf.bench.speculative import (SpeculativeRow, _order, break_even, check_followed, humaneval_first,
                                      parse_rows, run_speculative_bench)
from psr_hf.cli import main
from psr_hf.hf.speculative import speculative_generate
from psr_hf.policy.blocks import BlockConfig
from psr_hf.policy.calibration import Calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


@pytest.fixture(scope="module")
def models():
    target, tokenizer, info = load_model("olmoe-routing", "cpu")
    drafter, _, _ = load_model("tiny-moe", "cpu")
    return target, drafter, tokenizer, Calibration.load(info["calibration_file"])


def test_row_names_parse_and_bad_ones_are_refused():
    rows = parse_rows(["sd_confidence_k16", "sd_confidence_k16_skip", "sd_exact_k8"])
    assert rows == [SpeculativeRow("confidence", 16), SpeculativeRow("confidence", 16, copies=False),
                    SpeculativeRow("exact", 8)]
    assert [r.name for r in rows] == ["sd_confidence_k16", "sd_confidence_k16_skip", "sd_exact_k8"]
    for bad in (["sd_bogus_k4"], ["sd_exact_k0"], ["exact_k4"], ["sd_exact_4"], ["sd_exact_k4", "sd_exact_k4"]):
        with pytest.raises(ValueError, match="--rows"):
            parse_rows(bad)


def test_a_skipped_row_needs_its_row_with_copies_and_runs_after_it_in_the_first_round():
    with pytest.raises(ValueError, match="sd_confidence_k8; give that row too"):
        check_followed(parse_rows(["sd_confidence_k16", "sd_confidence_k8_skip"]))
    names = ["engine_resident", "sd_confidence_k16_skip", "sd_exact_k16", "sd_confidence_k16"]
    followed = {"sd_confidence_k16_skip": "sd_confidence_k16"}
    first = _order(names, 0, followed)
    assert sorted(first) == sorted(names)
    assert first.index("sd_confidence_k16_skip") == first.index("sd_confidence_k16") + 1
    assert _order(names, 1, followed) != first


def test_cli_refuses_a_bad_row_before_loading(capsys):
    assert main(["bench-speculative", "--model", "olmoe-routing", "--rows", "sd_bogus_k4"]) == 2
    assert "sd_MODE_kK" in capsys.readouterr().err


def test_break_even_is_the_papers_arithmetic():
    summary = {"engine_resident": {"ms_per_token": 2.0, "copies_per_token": 0.0},
               "engine_psr": {"ms_per_token": 5.0, "copies_per_token": 10.0},
               "sd_confidence_k16": {"tau": 4.0, "ms_per_token": 9.0, "copies_per_verification": 20.0,
                                     "draft_ms_per_verification": 8.0, "verify_ms_per_verification": 28.0},
               "sd_confidence_k16_skip": {"tau": 4.0, "ms_per_token": 6.0, "copies_per_verification": 20.0,
                                          "draft_ms_per_verification": 8.0, "verify_ms_per_verification": 12.0}}
    rows = [SpeculativeRow("confidence", 16), SpeculativeRow("confidence", 16, copies=False)]
    out = break_even(summary, rows, ["engine_resident", "engine_psr"])
    assert out["against"] == "engine_psr" and out["psr_ms_per_copy"] == pytest.approx(0.3)
    entry = out["rows"]["sd_confidence_k16"]
    assert entry["break_even_drafting_ms"] == pytest.approx(4 * 5.0 - 28.0)
    assert entry["verify_copies_ms"] == pytest.approx(16.0)
    assert entry["break_even_drafting_ms_copies_hidden_as_psr"] == pytest.approx(20.0 - (12.0 + 20 * 0.3))


def test_a_small_record_holds_every_row_and_the_harness_outputs(models):
    target, drafter, tokenizer, cal = models
    prompts = humaneval_first(1)
    seen = []
    rows = [SpeculativeRow("confidence", 4), SpeculativeRow("confidence", 4, copies=False)]
    record = run_speculative_bench(target, drafter, tokenizer, calibration=cal, prompts=prompts, rows=rows,
                                   ar_configs=["psr_lam0.25_n1_res37"], rounds=3, max_new_tokens=6, max_len=320,
                                   checkpoint=seen.append)
    assert [r["rounds_done"] for r in seen] == [1, 2, 3]
    assert set(record["rows"]) == {"engine_resident", "engine_psr_lam0.25_n1_res37", "sd_confidence_k4",
                                   "sd_confidence_k4_skip"}
    ids = tokenized(prompts, tokenizer, 320 - 6 - 4 - 2)[0].ids
    harness = speculative_generate(target, drafter, ids, BlockConfig(mode="confidence", pool=24), max_new_tokens=6,
                                   draft_tokens=4, calibration=cal)
    assert record["outputs"]["sd_confidence_k4"] == [harness.tokens]
    assert record["rows"]["sd_confidence_k4"]["tau"] >= 1
    # the copies-skipped row times the verifications of the row it follows
    assert record["outputs"]["sd_confidence_k4_skip"] == [harness.tokens]
    for key in ("tau", "verifications", "tokens"):
        assert record["rows"]["sd_confidence_k4_skip"][key] == record["rows"]["sd_confidence_k4"][key]
    assert record["break_even"]["against"] == "engine_psr_lam0.25_n1_res37"


def test_the_drafter_effect_counts_committed_token_layers(models):
    target, drafter, tokenizer, cal = models
    ids = [tokenized(humaneval_first(1), tokenizer, 200)[0].ids]
    effect = drafter_effect(target, drafter, ids, BlockConfig(mode="position", pool=24), draft_tokens=4,
                            max_new_tokens=16, calibration=cal)
    assert effect.blocks > 0 and effect.committed_token_layers >= 16 * effect.blocks
    assert 0 <= effect.changed <= effect.committed_token_layers
    # exact verification: a committed position's experts depend only on the tokens before it
    exact = drafter_effect(target, drafter, ids, BlockConfig(mode="exact", pool=24), draft_tokens=4,
                           max_new_tokens=16, calibration=cal)
    assert exact.blocks > 0 and exact.changed == 0
