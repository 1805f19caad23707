"""The summaries of a free-generation run (:mod:`psr_hf.bench.free_generation_timing`): per task, the bench's row
records (:func:`~psr_hf.bench.summary.row_records` over the decode steps) with the prompt time and the continuations
beside them, and the ratios of the paper's Table 6: PSR over Cache-Prior at the same residency, per task, over rounds
(paired on log ms/token), over prompts (a seeded bootstrap of the task's prompts) and per prompt (a sign test),
with Holm's correction over the table's ratios and over its sign tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..eval.stats import holm
from ..policy.config import RoutingConfig
from .common import paired_summary, summarize
from .free_generation_timing import Continuation, Results
from .rows import ENGINE_RESIDENT, RESIDENT, Row
from .summary import row_records


def _per_token(values: Sequence[float], counts: Sequence[int]) -> float:
    total = sum(counts)
    return float(sum(values) / total) if total else float("nan")


def _prompt_copies(runs: Sequence[Continuation]) -> dict[str, float]:
    """Copies per prompt token over ``runs`` (token-weighted), from the controller's totals over each prompt."""
    counts = [int(c.prompt_stats.get("tokens", 0)) for c in runs]
    return {key: _per_token([c.prompt_stats.get(key, 0.0) * n for c, n in zip(runs, counts)], counts)
            for key in ("copies_per_token", "demand_per_token", "prefetch_per_token")}


def _task_additions(done: Sequence[Sequence[Continuation]]) -> dict[str, Any]:
    """What a task's row record adds for free generation: the prompt (time per prompt token over rounds, copies
    per prompt token), the generated tokens, whether every round generated the same continuations, and per prompt
    the ms per generated token over every round's steps."""
    first = done[0]
    same = all([c.tokens for c in run] == [c.tokens for c in first] for run in done)
    stopped: dict[str, int] = {}
    for c in first:
        stopped[c.stopped] = stopped.get(c.stopped, 0) + 1
    per_prompt = []
    for i, c in enumerate(first):
        steps = [run[i] for run in done]
        per_prompt.append({
            "key": c.key, "prompt_tokens": c.prompt_tokens, "generated": len(c.tokens),
            "ms_per_token": _per_token([sum(s.ms) for s in steps], [len(s.ms) for s in steps]),
            "decode_ms": [float(sum(s.ms)) for s in steps], "decode_steps": [len(s.ms) for s in steps],
            "prompt_ms": [s.prompt_ms for s in steps]})
    return {
        "prompt": {
            "tokens_per_round": int(sum(c.prompt_tokens for c in first)),
            "ms_per_prompt_token": summarize([_per_token([c.prompt_ms for c in run], [c.prompt_tokens for c in run])
                                              for run in done]),
            "copies": _prompt_copies(first),
        },
        "generated": {"tokens_per_round": int(sum(len(c.tokens) for c in first)),
                      "tokens_per_prompt": float(np.mean([len(c.tokens) for c in first])),
                      "decode_steps_per_round": int(sum(len(c.ms) for c in first)), "stopped": stopped},
        "continuations_identical_over_rounds": bool(same),
        "per_prompt": per_prompt,
        "continuations": [{"key": c.key, "tokens": list(c.tokens)} for c in first],
    }


def task_records(rows: Sequence[Row], results: Results, tasks: Sequence[str], model_info: Mapping[str, Any],
                 capacity: Mapping[str, int], memory: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """task -> one record per row (``rows`` order): :func:`~psr_hf.bench.summary.row_records` of the row's decode
    steps on the task's prompts (ms per generated token over rounds, p99 over every step, copies per token over the
    generated tokens, the ratio to ``engine_resident`` on the steps both decoded), plus the prompt time, the
    generated tokens and the continuations."""
    out = {}
    for task in tasks:
        runs = {row.name: [[c.window_run() for c in done[task]] for done in results[row.name]] for row in rows}
        # row_records relates engine_resident to the transformers model's resident row, which free generation has
        # no use for: engine_resident stands in for it, and that self-ratio is cleared below
        runs[RESIDENT] = runs[ENGINE_RESIDENT]
        records = row_records(rows, runs, model_info, capacity, memory)
        for row, record in zip(rows, records):
            if row.kind == ENGINE_RESIDENT:
                record["ratio_to_resident"] = record["reference"] = None
            record["task"] = task
            record.update(_task_additions([done[task] for done in results[row.name]]))
        out[task] = records
    return out


def table_pairs(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """(PSR row, Cache-Prior row) at the same residency: the ratios of the paper's Table 6."""
    return [(a, b) for a in rows for b in rows
            if a.routing is not None and b.routing is not None and _steers_and_prefetches(a.routing)
            and _steers_only(b.routing) and a.residency == b.residency
            and not (a.copies_skipped or b.copies_skipped)]


def _steers_and_prefetches(routing: RoutingConfig) -> bool:
    """Whether ``routing`` is PSR's: biased selection and pre-gate prefetch insertion."""
    return routing.biased and routing.definition.can_prefetch


def _steers_only(routing: RoutingConfig) -> bool:
    """Whether ``routing`` is Cache-Prior's: biased selection, no insertion."""
    return routing.biased and not routing.definition.can_prefetch


def over_prompts(numerator: Sequence[Mapping[str, Any]], denominator: Sequence[Mapping[str, Any]], *,
                 seed: int, resamples: int) -> dict[str, Any]:
    """The ratio of ms per generated token (every round's steps of the task, numerator over denominator) with its
    95% interval from resampling the task's prompts with replacement (``scipy.stats.bootstrap``, paired: a
    resample draws the same prompts for both rows; percentile interval, ``seed``); the ``per_prompt`` entries of
    two rows of one task."""
    from scipy.stats import bootstrap

    # per prompt, summed over rounds: decode ms and decode steps of each row
    num_ms, num_steps, den_ms, den_steps = (np.asarray([sum(p[key]) for p in side], dtype=np.float64)
                                            for side in (numerator, denominator)
                                            for key in ("decode_ms", "decode_steps"))

    def ratio(a_ms: np.ndarray, a_n: np.ndarray, b_ms: np.ndarray, b_n: np.ndarray, axis: int = -1) -> np.ndarray:
        return (a_ms.sum(axis=axis) / a_n.sum(axis=axis)) / (b_ms.sum(axis=axis) / b_n.sum(axis=axis))

    point = float(ratio(num_ms, num_steps, den_ms, den_steps))
    out: dict[str, Any] = {"ratio": point, "ci95": [float("nan"), float("nan")], "prompts": len(numerator),
                           "resamples": resamples, "seed": seed, "method": "bootstrap percentile, paired prompts"}
    if len(numerator) >= 2 and num_steps.sum() > 0 and den_steps.sum() > 0:
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample of prompts without steps: nan, dropped
            result = bootstrap((num_ms, num_steps, den_ms, den_steps), ratio, paired=True, vectorized=True,
                               n_resamples=resamples, method="percentile", rng=np.random.default_rng(seed))
        out["ci95"] = [float(result.confidence_interval.low), float(result.confidence_interval.high)]
    return out


def sign_test(numerator: Sequence[Mapping[str, Any]], denominator: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """On how many prompts the numerator row is faster per generated token (``scipy.stats.binomtest`` at 1/2 over
    the prompts that are not ties; prompts without a decode step in either row are left out)."""
    from scipy.stats import binomtest

    pairs = [(a["ms_per_token"], b["ms_per_token"]) for a, b in zip(numerator, denominator)
             if sum(a["decode_steps"]) and sum(b["decode_steps"])]
    faster = sum(a < b for a, b in pairs)
    slower = sum(a > b for a, b in pairs)
    n = faster + slower
    return {"faster": int(faster), "slower": int(slower), "ties": len(pairs) - n,
            "without_steps": len(numerator) - len(pairs),
            "p": float(binomtest(faster, n, 0.5).pvalue) if n else None}


def table_ratios(rows: Sequence[Row], records: Mapping[str, Sequence[Mapping[str, Any]]], *, seed: int,
                 resamples: int) -> list[dict[str, Any]]:
    """Per task and pair of :func:`table_pairs`: the ratio of ms per generated token over rounds
    (:func:`~psr_hf.bench.common.paired_summary`: paired t on the per-round log ratios) with Holm's correction over
    every ratio of the table, :func:`over_prompts`, :func:`sign_test` (Holm over the table's sign tests) and the
    ratio of the prompt time per prompt token over rounds (the same prompts in both rows)."""
    out = []
    for task, task_rows in records.items():
        by_name = {r["configuration"]: r for r in task_rows}
        for num, den in table_pairs(rows):
            a, b = by_name[num.name], by_name[den.name]
            out.append({
                "task": task, "numerator": num.name, "denominator": den.name, "residency": num.residency,
                "over_rounds": paired_summary([r["ms_per_token"] for r in a["rounds"]],
                                              [r["ms_per_token"] for r in b["rounds"]]),
                "over_prompts": over_prompts(a["per_prompt"], b["per_prompt"], seed=seed, resamples=resamples),
                "sign_test": sign_test(a["per_prompt"], b["per_prompt"]),
                "prompt_time": paired_summary(a["prompt"]["ms_per_prompt_token"]["rounds"],
                                              b["prompt"]["ms_per_prompt_token"]["rounds"]),
            })
    for key, part in (("over_rounds", lambda r: r["over_rounds"]), ("sign_test", lambda r: r["sign_test"])):
        corrected = holm([part(r)["p"] for r in out])
        for r, adjusted, reject in zip(out, corrected.adjusted, corrected.reject):
            part(r)["holm_p"] = None if np.isnan(adjusted) else float(adjusted)
            part(r)["holm_significant"] = bool(reject)
    return out


__all__ = ["over_prompts", "sign_test", "table_pairs", "table_ratios",
           "task_records"]
