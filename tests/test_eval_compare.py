"""psr-hf compare: paired statistics of lm-eval runs against hand-computed numbers, on synthetic run directories in
lm-eval 0.4.13's --log_samples layout (and, when lm-eval and accelerate are installed, on a real lm-eval run)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from psr_hf.cli import main
from psr_hf.eval.compare import compare_runs
from psr_hf.eval.lm_eval_runs import load_run, parse_run_argument
from psr_hf.eval.stats import (
    cluster_robust_se,
    holm,
    mean_over_tasks,
    paired_binary,
    paired_clustered,
    paired_continuous,
    paired_perplexity_ratio,
    sign_flip_test,
)

REPO = Path(__file__).resolve().parents[1]
TS = "2026-11-30T13-41-23.117940"
Z975 = 1.959963984540054


# ---------------------------------------------------------------------------------------------------- run directories
def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _line(doc_id: int, filter_: str, values: dict, *, doc: dict | None = None, prompt: str | None = None) -> dict:
    """One samples line as lm-eval 0.4.13 writes it (evaluator.py, EvaluationTracker.save_results_samples)."""
    doc = doc if doc is not None else {"question": f"question {doc_id}"}
    prompt = prompt if prompt is not None else f"Question: {doc['question']}\nAnswer:"
    return {"doc_id": doc_id, "doc": doc, "target": "4",
            "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {"until": ["Question:"], "do_sample": False}}},
            "resps": [["The answer is 4."]], "filtered_resps": ["4"], "filter": filter_, "metrics": list(values),
            "doc_hash": _sha(json.dumps(doc, indent=2, ensure_ascii=False)), "prompt_hash": _sha(prompt),
            "target_hash": _sha("4"), **values}


def binary_lines(outcomes, metric: str = "acc", filter_: str = "none", extra: dict | None = None) -> list[dict]:
    return [_line(i, filter_, {metric: float(v), **(extra or {})}) for i, v in enumerate(outcomes)]


def write_run(root: Path, tasks: dict[str, list[dict]], *, groups: dict | None = None, ts: str = TS,
              model: str = "psr_hf", model_args: str = "pretrained=/models/olmoe,policy=exact") -> Path:
    """``root`` as lm-eval's --output_path: root/<model_name_sanitized>/results_<ts>.json and samples files."""
    inner = root / "psr_hf__pretrained=__models__olmoe"
    inner.mkdir(parents=True, exist_ok=True)
    results = {
        "results": {t: {"alias": t, "name": t, "sample_len": len({ln["doc_id"] for ln in lines})}
                    for t, lines in tasks.items()},
        "group_subtasks": dict(groups or {}),
        "configs": {t: {"task": t} for t in tasks},
        "n-samples": {t: {"original": len(lines), "effective": len(lines)} for t, lines in tasks.items()},
        "config": {"model": model, "model_args": model_args, "limit": None, "batch_size": "1"},
        "lm_eval_version": "0.4.13", "model_name": "/models/olmoe", "model_name_sanitized": inner.name,
    }
    (inner / f"results_{ts}.json").write_text(json.dumps(results, indent=2))
    for task, lines in tasks.items():
        with (inner / f"samples_{task}_{ts}.jsonl").open("w") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return root


def outcomes(n: int, *, a_only: int = 0, b_only: int = 0, both: int = 0) -> tuple[list[int], list[int]]:
    """0/1 vectors of A and B over n questions with the given discordant and concordant-correct counts."""
    a = [1] * a_only + [0] * b_only + [1] * both
    b = [0] * a_only + [1] * b_only + [1] * both
    rest = n - len(a)
    assert rest >= 0
    return a + [0] * rest, b + [0] * rest


def ifeval_lines(followed: list[list[bool]]) -> list[dict]:
    """IFEval samples: prompt level = all instructions followed; strict and loose as lm-eval's ifeval utils."""
    return [_line(i, "none", {"prompt_level_strict_acc": all(f), "inst_level_strict_acc": list(f),
                              "prompt_level_loose_acc": all(f), "inst_level_loose_acc": list(f)},
                  doc={"key": i, "prompt": f"prompt {i}"}, prompt=f"prompt {i}")
            for i, f in enumerate(followed)]


# ---------------------------------------------------------------------------------------------------- statistics
def test_mcnemar_p_is_the_two_sided_binomial_of_the_discordant_counts():
    a, b = outcomes(10, a_only=1, b_only=5, both=2)
    stat = paired_binary(a, b)
    # 6 discordant, min(1, 5) = 1: p = 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * (1 + 6) / 64
    assert stat.p == pytest.approx(14 / 64)
    assert stat.test == "mcnemar-exact"
    assert (stat.counts["reference_only"], stat.counts["run_only"]) == (1, 5)
    # d: five +1, one -1, four 0; mean 0.4; sum (d - 0.4)^2 = 5*0.36 + 1.96 + 4*0.16 = 4.4
    assert stat.difference == pytest.approx(0.4)
    assert stat.se == pytest.approx(math.sqrt(4.4 / 9) / math.sqrt(10))


def test_mcnemar_with_one_sided_discordance_and_without_discordance():
    a, b = outcomes(20, b_only=7, both=5)
    assert paired_binary(a, b).p == pytest.approx(2 / 2**7)
    same = paired_binary([1, 0, 1], [1, 0, 1])
    assert same.p == 1.0 and same.difference == 0.0 and same.se == 0.0


def test_mcnemar_agrees_with_scipy_binomtest():
    from scipy.stats import binomtest

    rng = np.random.default_rng(3)
    for _ in range(20):
        a = rng.integers(0, 2, 60)
        b = np.where(rng.random(60) < 0.3, 1 - a, a)
        stat = paired_binary(a, b)
        k, n = stat.counts["run_only"], stat.counts["run_only"] + stat.counts["reference_only"]
        expected = binomtest(k, n, 0.5).pvalue if n else 1.0
        assert stat.p == pytest.approx(expected)


def test_holm_adjusts_a_small_set_by_hand():
    family = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    # sorted 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> running max 0.06
    np.testing.assert_allclose(family.adjusted, [0.03, 0.06, 0.06, 0.02])
    assert family.reject.tolist() == [True, False, False, True]


def test_holm_leaves_missing_p_values_out_of_the_family():
    family = holm([0.01, float("nan"), 0.02])
    np.testing.assert_allclose(family.adjusted[[0, 2]], [0.02, 0.02])
    assert math.isnan(family.adjusted[1]) and not family.reject[1]


def test_cluster_robust_se_by_hand():
    # 4 prompts with 2, 1, 3, 2 instructions; A followed 2, 0, 1, 1 and B 2, 1, 3, 0
    d, m = [0, 1, 2, -1], [2, 1, 3, 2]
    # difference 2 / 8; residual sums d_i - 0.25 m_i = -0.5, 0.75, 1.25, -1.5; squares sum to 4.625
    assert cluster_robust_se(d, m) == pytest.approx(math.sqrt(4 / 3 * 4.625) / 8)


def test_cluster_robust_se_equals_statsmodels_ols_with_clusters():
    import statsmodels.api as sm

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 6, 50)
    a = [rng.integers(0, 2, s) for s in sizes]
    b = [np.where(rng.random(s) < 0.25, 1 - x, x) for x, s in zip(a, sizes)]
    per_item = np.concatenate([y - x for x, y in zip(a, b)]).astype(float)
    groups = np.repeat(np.arange(len(sizes)), sizes)
    fit = sm.OLS(per_item, np.ones((per_item.size, 1))).fit(cov_type="cluster", cov_kwds={"groups": groups})
    stat = paired_clustered([x.sum() for x in a], [y.sum() for y in b], sizes)
    assert stat.difference == pytest.approx(fit.params[0])
    assert stat.se == pytest.approx(fit.bse[0], rel=1e-10)


def test_cluster_robust_se_with_one_item_per_cluster_is_the_paired_se():
    a, b = outcomes(30, a_only=3, b_only=8, both=10)
    d = np.array(b, float) - np.array(a, float)
    assert cluster_robust_se(d, np.ones(30)) == pytest.approx(paired_binary(a, b).se)


def test_sign_flip_test_enumerates_every_pattern_when_few():
    # non-zero d = 1, 2, -1: 8 sign patterns with sums 4, 2, 0, -2, 2, 0, -2, -4; observed 2; |S| >= 2 in 6 of 8
    flip = sign_flip_test([0, 1, 2, -1], permutations=100_000)
    assert (flip.p, flip.method, flip.resamples) == (pytest.approx(0.75), "exact", 8)
    none = sign_flip_test([0, 0, 0])
    assert (none.p, none.method, none.resamples) == (1.0, "exact", 1)


def _exact_sign_flip_p(d: np.ndarray) -> float:
    """P(|sum s_i d_i| >= |sum d_i|) over independent fair signs, by convolution over integer sums."""
    dist = {0: 1.0}
    for x in d.astype(int):
        new: dict[int, float] = {}
        for s, pr in dist.items():
            for v in (s + x, s - x):
                new[v] = new.get(v, 0.0) + pr / 2
        dist = new
    observed = abs(int(d.sum()))
    return sum(pr for s, pr in dist.items() if abs(s) >= observed)


def test_sign_flip_test_draws_seeded_monte_carlo_when_patterns_exceed_the_budget():
    rng = np.random.default_rng(5)
    d = rng.integers(-2, 4, 40).astype(float)
    d[d == 0] = 1
    first = sign_flip_test(d, permutations=20_000, seed=7)
    again = sign_flip_test(d, permutations=20_000, seed=7)
    assert (first.method, first.resamples) == ("monte-carlo", 20_000) and first.p == again.p
    exact = _exact_sign_flip_p(d)
    assert abs(first.p - exact) < 4 * math.sqrt(exact * (1 - exact) / 20_000) + 1e-4


def test_clustered_comparison_by_hand():
    stat = paired_clustered([2, 0, 1, 1], [2, 1, 3, 0], [2, 1, 3, 2])
    assert stat.difference == pytest.approx(0.25)
    assert stat.se == pytest.approx(math.sqrt(4 / 3 * 4.625) / 8)
    assert stat.p == pytest.approx(0.75) and stat.test == "sign-flip-exact"
    assert stat.counts == {"run_better": 2, "reference_better": 1}


def test_paired_t_for_continuous_scores_by_hand():
    from scipy.stats import t as student

    stat = paired_continuous([0.2, 0.5, 0.9], [0.4, 0.4, 1.0])
    # d = 0.2, -0.1, 0.1: mean 1/15; sd^2 = ((2/15)^2 + (1/6)^2 ... ) computed from the definition
    d = np.array([0.2, -0.1, 0.1])
    mean = d.sum() / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    t = mean / (sd / math.sqrt(3))
    assert stat.difference == pytest.approx(mean) and stat.se == pytest.approx(sd / math.sqrt(3))
    assert stat.p == pytest.approx(2 * student.sf(abs(t), 2)) and stat.test == "paired-t"


def test_perplexity_difference_is_nll_per_word_by_hand():
    # two documents of 10 and 30 words: NLL 20 and 60 under A, 25 and 63 under B: (5 + 3) / 40 nats per word
    stat = paired_perplexity_ratio([20.0, 60.0], [25.0, 63.0], [10, 30])
    assert stat.difference == pytest.approx(8 / 40)
    # residual sums 5 - 0.2*10 = 3, 3 - 0.2*30 = -3: sqrt(2 * 18) / 40
    assert stat.se == pytest.approx(math.sqrt(2 * 18) / 40)
    assert stat.test == "paired-t"


def test_mean_over_tasks_treats_tasks_as_independent():
    interval = mean_over_tasks([1.0, -2.0, 3.0], [0.5, 1.0, 2.0])
    se = math.sqrt(0.25 + 1 + 4) / 3
    assert interval.mean == pytest.approx(2 / 3) and interval.se == pytest.approx(se)
    assert (interval.low, interval.high) == (pytest.approx(2 / 3 - Z975 * se), pytest.approx(2 / 3 + Z975 * se))


# ---------------------------------------------------------------------------------------------------- loading
def test_run_is_found_from_the_output_path_or_the_inner_directory(tmp_path):
    write_run(tmp_path / "exact", {"arc_challenge": binary_lines([1, 0, 1])})
    outer = load_run(tmp_path / "exact")
    inner = load_run(next((tmp_path / "exact").iterdir()))
    assert outer.directory == inner.directory and outer.label == "exact"
    assert outer.tasks == {"arc_challenge": ("arc_challenge",)}
    assert [s.values["acc"] for s in outer.samples["arc_challenge"]] == [1.0, 0.0, 1.0]
    assert outer.model == "psr_hf" and outer.lm_eval_version == "0.4.13"


def test_latest_timestamp_of_each_task_is_read(tmp_path):
    root = tmp_path / "run"
    write_run(root, {"arc_challenge": binary_lines([0, 0, 0]), "hellaswag": binary_lines([1, 1])},
              ts="2026-11-29T09-00-00.000001")
    write_run(root, {"arc_challenge": binary_lines([1, 1, 1])}, ts="2026-11-30T08-00-00.5")
    run = load_run(root)
    assert [s.values["acc"] for s in run.samples["arc_challenge"]] == [1.0, 1.0, 1.0]
    assert set(run.tasks) == {"arc_challenge", "hellaswag"}  # hellaswag only ran in the earlier evaluation
    results_file = next(root.glob("*/results_2026-11-29*.json"))
    only_then = load_run(results_file)
    assert [s.values["acc"] for s in only_then.samples["arc_challenge"]] == [0.0, 0.0, 0.0]


def test_directories_without_samples_or_with_several_models_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--log_samples"):
        load_run(tmp_path / "empty")
    write_run(tmp_path / "two", {"arc_challenge": binary_lines([1])})
    other = tmp_path / "two" / "other_model"
    other.mkdir()
    (other / f"samples_arc_challenge_{TS}.jsonl").write_text(json.dumps(_line(0, "none", {"acc": 1.0})) + "\n")
    with pytest.raises(ValueError, match="several models"):
        load_run(tmp_path / "two")


def test_subtasks_of_a_group_are_pooled_at_the_question_level(tmp_path):
    groups = {"mmlu": ["mmlu_stem", "mmlu_humanities"], "mmlu_stem": ["mmlu_anatomy"],
              "mmlu_humanities": ["mmlu_philosophy"]}
    a1, b1 = outcomes(6, b_only=3)
    a2, b2 = outcomes(4, b_only=2, a_only=1)
    write_run(tmp_path / "a", {"mmlu_anatomy": binary_lines(a1), "mmlu_philosophy": binary_lines(a2)}, groups=groups)
    write_run(tmp_path / "b", {"mmlu_anatomy": binary_lines(b1), "mmlu_philosophy": binary_lines(b2)}, groups=groups)
    assert load_run(tmp_path / "a").tasks == {"mmlu": ("mmlu_anatomy", "mmlu_philosophy")}
    cell = compare_runs(tmp_path / "a", [tmp_path / "b"]).cell("b", "MMLU")
    # 10 questions (doc ids overlap across subtasks and are kept apart), 5 only B, 1 only A
    assert cell.n == 10 and cell.difference == pytest.approx(40.0)
    assert (cell.counts["reference_only"], cell.counts["run_only"]) == (1, 5)
    assert cell.p == pytest.approx(14 / 64)
    apart = compare_runs(load_run(tmp_path / "a", pool_groups=False), [load_run(tmp_path / "b", pool_groups=False)])
    assert [c.name for c in apart.columns] == ["mmlu_anatomy", "mmlu_philosophy"]


# ---------------------------------------------------------------------------------------------------- pairing errors
def test_runs_over_different_documents_are_refused_naming_the_task_and_counts(tmp_path):
    write_run(tmp_path / "a", {"gsm8k": binary_lines([1, 0, 1, 1], "exact_match", "strict-match")})
    write_run(tmp_path / "b", {"gsm8k": binary_lines([1, 0], "exact_match", "strict-match")})
    with pytest.raises(ValueError, match=r"task gsm8k.*a has 4 documents and b has 2, 2 in common"):
        compare_runs(tmp_path / "a", [tmp_path / "b"])


def test_missing_metric_is_refused_naming_task_metric_and_what_is_there(tmp_path):
    write_run(tmp_path / "a", {"arc_challenge": binary_lines([1, 0], "acc", extra={"acc_norm": 1.0})})
    lines = binary_lines([1, 0], "acc", extra={"acc_norm": 1.0})
    del lines[1]["acc"]
    lines[1]["metrics"] = ["acc_norm"]
    write_run(tmp_path / "b", {"arc_challenge": lines})
    with pytest.raises(ValueError, match=r"task arc_challenge \(b\): metric acc is missing on document 1"):
        compare_runs(tmp_path / "a", [tmp_path / "b"])
    with pytest.raises(ValueError, match=r"no metric 'f1'.*available \(metric,filter\): acc,none, acc_norm,none"):
        compare_runs(load_run(tmp_path / "a"), [load_run(tmp_path / "a", "a2")], metrics={"arc_challenge": "f1"})


def test_a_task_missing_from_a_run_and_different_data_are_refused(tmp_path):
    write_run(tmp_path / "a", {"arc_challenge": binary_lines([1, 0]), "hellaswag": binary_lines([1])})
    write_run(tmp_path / "b", {"arc_challenge": binary_lines([1, 1])})
    with pytest.raises(ValueError, match="task hellaswag is missing in b"):
        compare_runs(tmp_path / "a", [tmp_path / "b"])
    assert compare_runs(tmp_path / "a", [tmp_path / "b"], tasks=["arc_challenge"]).cell("b", "ARC-C").n == 2
    other = binary_lines([1, 0])
    other[0]["doc_hash"] = _sha("another document")
    write_run(tmp_path / "c", {"arc_challenge": other, "hellaswag": binary_lines([1])})
    with pytest.raises(ValueError, match="1 of 2 documents differ between a and c"):
        compare_runs(tmp_path / "a", [tmp_path / "c"])


def test_corpus_level_metrics_are_refused(tmp_path):
    lines = [_line(i, "none", {"bleu": [f"ref {i}", f"pred {i}"]}) for i in range(3)]
    write_run(tmp_path / "a", {"wmt": lines})
    with pytest.raises(ValueError, match="no single score per question"):
        compare_runs(load_run(tmp_path / "a"), [load_run(tmp_path / "a", "a2")])


# ---------------------------------------------------------------------------------------------------- metric choice
def _suite_lines(seed: int) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    flip = lambda n: rng.integers(0, 2, n).tolist()  # noqa: E731
    gsm = [_line(i, f, {"exact_match": float(v)}) for f in ("strict-match", "flexible-extract")
           for i, v in enumerate(flip(8))]
    return {
        "arc_challenge": [_line(i, "none", {"acc": float(v), "acc_norm": 1.0}) for i, v in enumerate(flip(8))],
        "gsm8k": gsm,
        "bbh_cot_fewshot_navigate": [_line(i, "get-answer", {"exact_match": float(v)}) for i, v in enumerate(flip(5))],
        "bbh_cot_fewshot_snarks": [_line(i, "get-answer", {"exact_match": float(v)}) for i, v in enumerate(flip(5))],
        "ifeval": ifeval_lines([[bool(x) for x in flip(k)] for k in (1, 2, 3, 2)]),
        "humaneval": [_line(i, "create_test", {"pass@1": float(v)}) for i, v in enumerate(flip(6))],
        "mbpp": [_line(i, "none", {"pass_at_1": float(v)}) for i, v in enumerate(flip(6))],
    }


def test_default_metrics_follow_the_paper(tmp_path):
    groups = {"bbh_cot_fewshot": ["bbh_cot_fewshot_navigate", "bbh_cot_fewshot_snarks"]}
    write_run(tmp_path / "a", _suite_lines(0), groups=groups)
    write_run(tmp_path / "b", _suite_lines(1), groups=groups)
    comparison = compare_runs(tmp_path / "a", [tmp_path / "b"])
    chosen = [(c.name, c.metric, c.filter, c.kind, c.in_mean) for c in comparison.columns]
    assert chosen == [
        ("ARC-C", "acc", "none", "binary", True),
        ("GSM8K", "exact_match", "strict-match", "binary", True),
        ("BBH", "exact_match", "get-answer", "binary", True),
        ("IFE-P", "prompt_level_strict_acc", "none", "binary", True),
        ("IFE-I", "inst_level_strict_acc", "none", "clustered", False),
        ("HumanE.", "pass@1", "create_test", "binary", True),
        ("MBPP", "pass_at_1", "none", "binary", True),
    ]
    assert comparison.cell("b", "BBH").n == 10
    assert comparison.cell("b", "IFE-I").n == 4 and comparison.cell("b", "IFE-I").details["items"] == 8
    assert comparison.means[0].columns == ("ARC-C", "GSM8K", "BBH", "IFE-P", "HumanE.", "MBPP")


def test_metric_override_picks_metric_and_filter(tmp_path):
    write_run(tmp_path / "a", _suite_lines(0))
    write_run(tmp_path / "b", _suite_lines(1))
    comparison = compare_runs(tmp_path / "a", [tmp_path / "b"], tasks=["gsm8k", "arc_challenge", "ifeval"],
                              metrics={"gsm8k": "exact_match,flexible-extract",
                                       "arc_challenge": ["acc", "acc_norm"], "ifeval": "inst_level_loose_acc"})
    assert [(c.name, c.metric, c.filter) for c in comparison.columns] == [
        ("ARC-C acc", "acc", "none"), ("ARC-C acc_norm", "acc_norm", "none"),
        ("GSM8K", "exact_match", "flexible-extract"), ("IFE-I loose", "inst_level_loose_acc", "none")]
    with pytest.raises(ValueError, match="no filter 'loose'"):
        compare_runs(tmp_path / "a", [tmp_path / "b"], metrics={"gsm8k": "exact_match,loose"})


# ---------------------------------------------------------------------------------------------------- tables
def _three_runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """exact (A), psr (B), cp (C) on 40 questions of three tasks; the p-values, by hand:
    ARC-C  B: 12 only B          -> 2 / 2^12 = 0.000488, Holm x6 = 0.0029: bold
    GSM8K  B: 9 only B, 1 only A -> 2 * 11 / 2^10 = 0.0215, Holm x5 = 0.107: dagger
    HellaS. B: 2 and 2           -> 1
    C: identical on ARC-C and HellaS.; GSM8K 3 only A -> 2 / 2^3 = 0.25
    """
    arc_a, arc_b = outcomes(40, b_only=12, both=10)
    gsm_a, gsm_b = outcomes(40, a_only=1, b_only=9, both=5)
    hel_a, hel_b = outcomes(40, a_only=2, b_only=2, both=20)
    gsm_c = list(gsm_a)
    for i in [i for i, v in enumerate(gsm_a) if v][:3]:
        gsm_c[i] = 0

    def tasks(arc, gsm, hel):
        return {"arc_challenge": binary_lines(arc), "hellaswag": binary_lines(hel),
                "gsm8k": binary_lines(gsm, "exact_match", "strict-match")}

    return (write_run(tmp_path / "exact", tasks(arc_a, gsm_a, hel_a)),
            write_run(tmp_path / "psr", tasks(arc_b, gsm_b, hel_b)),
            write_run(tmp_path / "cp", tasks(arc_a, gsm_c, hel_a)))


def _paired_se_points(n: int, discordant: int, difference: float) -> float:
    """100 x sd(d) / sqrt(n) for d in {-1, 0, 1}: sum (d - mean)^2 = discordant - n mean^2."""
    return 100 * math.sqrt((discordant - n * difference**2) / (n - 1) / n)


def test_table_numbers_and_bold_and_dagger_placement(tmp_path):
    exact, psr, cp = _three_runs(tmp_path)
    comparison = compare_runs(exact, [psr, cp])
    arc, gsm, hel = (comparison.cell("psr", c) for c in ("ARC-C", "GSM8K", "HellaS."))
    assert arc.p == pytest.approx(2 / 2**12) and arc.p_holm == pytest.approx(6 * 2 / 2**12) and arc.significant
    assert gsm.p == pytest.approx(22 / 1024) and gsm.p_holm == pytest.approx(5 * 22 / 1024)
    assert gsm.nominal and not gsm.significant
    assert hel.p == 1.0 and not (hel.significant or hel.nominal)
    assert comparison.cell("cp", "GSM8K").p == pytest.approx(0.25)
    assert (arc.difference, gsm.difference, hel.difference) == (pytest.approx(30.0), pytest.approx(20.0), 0.0)
    assert arc.se == pytest.approx(_paired_se_points(40, 12, 0.3))
    assert gsm.se == pytest.approx(_paired_se_points(40, 10, 0.2))
    assert arc.reference_score == pytest.approx(25.0) and arc.score == pytest.approx(55.0)

    ses = [_paired_se_points(40, 12, 0.3), _paired_se_points(40, 4, 0.0), _paired_se_points(40, 10, 0.2)]
    mean = comparison.mean("psr")
    assert mean.mean == pytest.approx(50 / 3)
    assert mean.high - mean.mean == pytest.approx(Z975 * math.sqrt(sum(s * s for s in ses)) / 3)

    half = Z975 * math.sqrt(sum(s * s for s in ses)) / 3
    lines = comparison.to_markdown().splitlines()
    assert lines[0] == "| run | ARC-C | HellaS. | GSM8K | mean |"
    assert lines[2] == "| exact (reference, score) | 25.0 | 55.0 | 15.0 | 31.7 |"
    assert lines[3] == f"| psr | **+30.0** | 0.0 | +20.0† | +16.7 ± {half:.1f} |"
    cp_half = Z975 * math.sqrt(_paired_se_points(40, 3, -0.075) ** 2) / 3
    assert lines[4] == f"| cp | 0.0 | 0.0 | -7.5 | -2.5 ± {cp_half:.1f} |"
    assert "Holm's correction over the table's 6 tests" in comparison.to_markdown()


def test_ifeval_columns_by_hand(tmp_path):
    # the hand example of the statistics tests, through the files: 4 prompts with 2, 1, 3, 2 instructions
    a = [[True, True], [False], [True, False, False], [True, False]]
    b = [[True, True], [True], [True, True, True], [False, False]]
    write_run(tmp_path / "a", {"ifeval": ifeval_lines(a)})
    write_run(tmp_path / "b", {"ifeval": ifeval_lines(b)})
    comparison = compare_runs(tmp_path / "a", [tmp_path / "b"])
    prompt, inst = comparison.cell("b", "IFE-P"), comparison.cell("b", "IFE-I")
    # prompt level: A follows all on prompt 0 only, B on 0, 1, 2: 2 only B -> p = 2 / 4
    assert prompt.difference == pytest.approx(50.0) and prompt.p == pytest.approx(0.5)
    assert inst.difference == pytest.approx(25.0) and inst.reference_score == pytest.approx(50.0)
    assert inst.se == pytest.approx(100 * math.sqrt(4 / 3 * 4.625) / 8)
    assert inst.p == pytest.approx(0.75) and inst.test == "sign-flip-exact"
    assert inst.counts["instructions_run_only"] == 3 and inst.counts["instructions_reference_only"] == 1
    assert comparison.means[0].columns == ("IFE-P",)


def test_perplexity_columns_are_tested_but_kept_out_of_the_mean(tmp_path):
    def ppl(lls):
        return [_line(i, "none", {"word_perplexity": [ll, w], "byte_perplexity": [ll, 5 * w]})
                for i, (ll, w) in enumerate(lls)]

    write_run(tmp_path / "a", {"wikitext": ppl([(-20.0, 10), (-60.0, 30)]), "arc_challenge": binary_lines([1, 0])})
    write_run(tmp_path / "b", {"wikitext": ppl([(-25.0, 10), (-63.0, 30)]), "arc_challenge": binary_lines([1, 1])})
    comparison = compare_runs(tmp_path / "a", [tmp_path / "b"])
    cell = comparison.cell("b", "wikitext")
    column = next(c for c in comparison.columns if c.name == "wikitext")
    assert (column.metric, column.kind, column.unit, column.in_mean) == ("word_perplexity", "ratio", "nats/word", False)
    assert cell.difference == pytest.approx(0.2) and cell.details["perplexity_ratio"] == pytest.approx(math.exp(0.2))
    assert comparison.reference_scores["wikitext"] == pytest.approx(math.exp(80 / 40))
    assert comparison.means[0].columns == ("ARC-C",)
    assert "wikitext: word_perplexity (none); differences in nats/word" in comparison.to_markdown()


def test_a_column_without_a_t_test_stays_out_of_holm_and_says_why(tmp_path):
    # every score rises by exactly 0.25: zero variance, so the paired t-test is undefined (no p-value)
    def scores(values):
        return [_line(i, "none", {"score": v}) for i, v in enumerate(values)]

    write_run(tmp_path / "a", {"probe": scores([0.25, 0.5, 0.75]), "arc_challenge": binary_lines([0, 0, 0, 0])})
    write_run(tmp_path / "b", {"probe": scores([0.5, 0.75, 1.0]), "arc_challenge": binary_lines([1, 1, 1, 1])})
    comparison = compare_runs(tmp_path / "a", [tmp_path / "b"])
    probe, arc = comparison.cell("b", "probe"), comparison.cell("b", "ARC-C")
    assert probe.test == "paired-t" and probe.difference == pytest.approx(25.0) and probe.statistic is None
    assert math.isnan(probe.p) and math.isnan(probe.p_holm) and not (probe.significant or probe.nominal)
    assert "every difference equals 0.25" in probe.details["no_test"]
    assert comparison.tests() == 1 and arc.p_holm == arc.p == pytest.approx(2 / 2**4)
    markdown = comparison.to_markdown()
    assert "over the table's 1 tests" in markdown and "1 cell without a test" in markdown
    record = comparison.to_dict()
    assert record["tests"] == 1
    assert next(c for c in record["cells"] if c["column"] == "probe")["p"] is None


def test_json_record_and_cli(tmp_path, capsys):
    exact, psr, cp = _three_runs(tmp_path)
    out = tmp_path / "table.json"
    code = main(["compare", str(exact), f"PSR={psr}", str(cp), "--json", str(out), "--seed", "3"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| PSR | **+30.0** | 0.0 | +20.0† |" in printed
    assert "mcnemar-exact" in printed and f"JSON record: {out}" in printed
    record = json.loads(out.read_text())
    assert record["reference"]["label"] == "exact" and [r["label"] for r in record["runs"]] == ["PSR", "cp"]
    assert record["tests"] == 6 and record["alpha"] == 0.05 and record["seed"] == 3
    cell = next(c for c in record["cells"] if c["run"] == "PSR" and c["column"] == "GSM8K")
    assert cell["n"] == 40 and cell["counts"]["reference_only"] == 1 and cell["counts"]["run_only"] == 9
    assert cell["p"] == pytest.approx(22 / 1024) and cell["p_holm"] == pytest.approx(110 / 1024)
    assert cell["test"] == "mcnemar-exact" and cell["nominal"] and not cell["significant"]
    assert cell["se"] == pytest.approx(_paired_se_points(40, 10, 0.2))
    assert record["means"][0]["columns"] == ["ARC-C", "HellaS.", "GSM8K"]
    assert record["columns"][0]["unit"] == "points"
    assert any(path.endswith(f"samples_gsm8k_{TS}.jsonl") for path in record["reference"]["files"])


def test_cli_errors_exit_with_code_2(tmp_path, capsys):
    write_run(tmp_path / "a", {"arc_challenge": binary_lines([1, 0, 1])})
    write_run(tmp_path / "b", {"arc_challenge": binary_lines([1, 0])})
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "3 documents and b has 2" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a")]) == 2
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--metric", "arc"]) == 2
    assert "expected TASK=METRIC" in capsys.readouterr().err


def test_run_labels_must_differ_and_parse_from_label_equals_path(tmp_path):
    assert parse_run_argument("exact=out/a") == ("exact", "out/a")
    assert parse_run_argument("out/a") == (None, "out/a")
    odd = tmp_path / "x=y"
    odd.mkdir()
    assert parse_run_argument(str(odd)) == (None, str(odd))
    write_run(tmp_path / "a", {"arc_challenge": binary_lines([1])})
    with pytest.raises(ValueError, match="labels must differ"):
        compare_runs(tmp_path / "a", [tmp_path / "a"])


def test_psr_hf_eval_compare_imports_neither_torch_nor_lm_eval():
    code = textwrap.dedent(
        """
        import sys
        before = set(sys.modules)  # whatever interpreter start loaded (.pth files) is not ours
        import psr_hf.eval
        import psr_hf.eval.compare
        for name in ("torch", "lm_eval", "statsmodels"):
            print(f"LOADED {name}=" + str(name in sys.modules and name not in before))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED torch=False" in proc.stdout and "LOADED lm_eval=False" in proc.stdout
    assert "LOADED statsmodels=False" in proc.stdout


# ---------------------------------------------------------------------------------------------------- real lm-eval
_TASKS = {
    "probe_mc_a.yaml": """
        task: probe_mc_a
        dataset_path: json
        dataset_kwargs:
          data_files: {data}/mc.jsonl
        test_split: train
        output_type: multiple_choice
        doc_to_text: "{{{{q}}}}?"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - metric: acc
          - metric: acc_norm
        """,
    "probe_group.yaml": """
        group: probe_group
        task:
          - probe_mc_a
          - probe_mc_b
        aggregate_metric_list:
          - metric: acc
            weight_by_size: true
        """,
    "probe_gen.yaml": """
        task: probe_gen
        dataset_path: json
        dataset_kwargs:
          data_files: {data}/gen.jsonl
        test_split: train
        output_type: generate_until
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: exact_match
        generation_kwargs:
          until: ["Question:"]
          do_sample: false
          max_gen_toks: 4
        filter_list:
          - name: strict-match
            filter:
              - function: regex
                regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
              - function: take_first
          - name: flexible-extract
            filter:
              - function: regex
                group_select: -1
                regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
              - function: take_first
        """,
}


@pytest.mark.slow
def test_real_lm_eval_outputs_are_read_and_paired(tmp_path):
    from psr_hf.testing import save_tiny

    data = tmp_path / "data"
    tasks = tmp_path / "tasks"
    data.mkdir()
    tasks.mkdir()
    (data / "mc.jsonl").write_text("".join(json.dumps({"q": f"item {i}", "choices": ["yes", "no"], "label": i % 2})
                                           + "\n" for i in range(4)))
    (data / "gen.jsonl").write_text("".join(json.dumps({"question": f"{i}+{i}", "answer": f"#### {2 * i}"}) + "\n"
                                            for i in range(3)))
    for name, text in _TASKS.items():
        (tasks / name).write_text(textwrap.dedent(text).format(data=data))
    (tasks / "probe_mc_b.yaml").write_text((tasks / "probe_mc_a.yaml").read_text().replace("probe_mc_a", "probe_mc_b"))
    save_tiny("olmoe", tmp_path / "model")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    lm_eval = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={tmp_path / 'model'},dtype=float32", "--include_path", str(tasks), "--tasks",
               "probe_group,probe_gen", "--output_path", str(tmp_path / "exact"), "--log_samples", "--device", "cpu",
               "--batch_size", "1"]
    proc = subprocess.run(lm_eval, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shutil.copytree(tmp_path / "exact", tmp_path / "again")
    comparison = compare_runs(tmp_path / "exact", [tmp_path / "again"])
    assert [(c.name, c.metric, c.filter, c.subtasks) for c in comparison.columns] == [
        ("probe_gen", "exact_match", "strict-match", ("probe_gen",)),
        ("probe_group", "acc", "none", ("probe_mc_a", "probe_mc_b"))]
    assert comparison.cell("again", "probe_group").n == 8
    assert all(c.difference == 0 and c.p == 1.0 for c in comparison.cells)
