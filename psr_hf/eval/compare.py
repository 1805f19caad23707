"""The paired comparison of lm-eval runs on identical questions, behind ``psr-hf compare`` (docs/lm-eval.md).

:func:`compare_runs` pairs each run with the reference by (leaf task, ``doc_id``) under each column's filter: runs
over other documents, or whose ``doc_hash`` differs, are refused; a differing ``prompt_hash`` is logged and counted.
Each column is tested by its kind with :mod:`psr_hf.eval.stats` (the paper's Section 6.1 and Appendix A): ``binary``
(0/1 per question) by exact McNemar, ``clustered`` (IFEval's instruction level) by sign flips over prompts,
``ratio`` (perplexities, in NLL per word or byte) and ``continuous`` by a paired t-test. Holm's correction runs over
every test of the table (bold: significant after it at ``alpha``; dagger: p < ``alpha`` before it only; a cell
without a test stays out). The mean over tasks averages each task's first column in points with a normal interval
that treats tasks as independent, as the paper does; perplexity-like columns are not in it. :class:`Comparison`
gives the table (markdown, the paper's Tables 3-4) and the JSON record; :mod:`psr_hf.eval.lm_eval_runs` reads runs.
:func:`paired_columns` (columns and pairing) and :func:`paired_statistic` (a column's test) are shared with
:mod:`psr_hf.eval.implementations` (engine runs against harness runs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import stats
from .lm_eval_runs import Run, RunSummary, load_run, parse_run_argument

# load_run and parse_run_argument are psr-hf compare's names for reading runs, kept importable from here
__all__ = ["KINDS", "Cell", "Column", "Comparison", "MeanDifference", "PairedColumn", "as_run",
           "check_test_settings", "column_score", "compare_runs", "format_difference", "format_score", "jsonable",
           "load_run", "paired_columns", "paired_statistic", "parse_run_argument"]

logger = logging.getLogger(__name__)

_IFEVAL_METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc")
_METRIC_PREFERENCE = ("pass@1", "pass_at_1", "exact_match", "acc", "word_perplexity", "byte_perplexity",
                      "bits_per_byte")
_FILTER_PREFERENCE = ("strict-match", "none")
# [loglikelihood, count] per document: unit of the difference, and the factor from nats
_RATIO_METRICS = {"word_perplexity": ("nats/word", 1.0), "byte_perplexity": ("nats/byte", 1.0),
                  "bits_per_byte": ("bits/byte", 1.0 / math.log(2.0))}

# short column names of the paper's tables, in its order
_SHORT_NAMES = {"mmlu": "MMLU", "arc_challenge": "ARC-C", "arc_easy": "ARC-E", "hellaswag": "HellaS.",
                "gsm8k": "GSM8K", "bbh": "BBH", "bbh_cot_fewshot": "BBH", "bbh_cot_zeroshot": "BBH",
                "bbh_fewshot": "BBH", "bbh_zeroshot": "BBH", "ifeval": "IFE", "humaneval": "HumanE.",
                "mbpp": "MBPP"}
_ORDER = ("MMLU", "ARC-C", "ARC-E", "HellaS.", "GSM8K", "BBH", "IFE", "HumanE.", "MBPP")
# IFEval's metrics as column suffixes: ifeval -> IFE-P, IFE-I
_IFEVAL_SUFFIXES = {"prompt_level_strict_acc": "-P", "inst_level_strict_acc": "-I",
                    "prompt_level_loose_acc": "-P loose", "inst_level_loose_acc": "-I loose"}

KINDS = ("binary", "clustered", "ratio", "continuous")
# a cell whose test is undefined (fewer than 2 pairs, every difference equal) has no p-value: NaN in the table


# ---------------------------------------------------------------------------------------------------- columns
@dataclass(frozen=True)
class Column:
    """One column of the table: a metric of a task under a filter, and how it is tested."""

    name: str
    task: str
    metric: str
    filter: str
    kind: str  # binary | clustered | ratio | continuous
    unit: str  # points | nats/word | nats/byte | bits/byte | raw
    scale: float  # metric units -> table units (100 for points)
    in_mean: bool
    subtasks: tuple[str, ...]


def _parse_metric_spec(spec: str) -> tuple[str, str | None]:
    metric, _, filter_ = spec.partition(",")
    if not metric.strip():
        raise ValueError(f"metric {spec!r}: expected METRIC or METRIC,FILTER")
    return metric.strip(), (filter_.strip() or None)


def _available(run: Run, task: str) -> dict[str, list[str]]:
    """Metric -> filters under which the task's samples carry it (in order of appearance)."""
    out: dict[str, list[str]] = {}
    for leaf in run.tasks[task]:
        for sample in run.samples[leaf]:
            for metric in sample.values:
                filters = out.setdefault(metric, [])
                if sample.filter not in filters:
                    filters.append(sample.filter)
    return out


def _describe(available: Mapping[str, Sequence[str]]) -> str:
    return ", ".join(f"{m},{f}" for m, fs in available.items() for f in fs) or "none"


def _choose_filter(task: str, metric: str, filters: Sequence[str], available: Mapping[str, Sequence[str]]) -> str:
    if len(filters) == 1:
        return filters[0]
    for preferred in _FILTER_PREFERENCE:
        if preferred in filters:
            return preferred
    raise ValueError(f"task {task}: metric {metric} has several filters ({', '.join(filters)}); "
                     f"choose one with --metric {task}={metric},FILTER")


def _metric_choices(run: Run, task: str, specs: Sequence[str] | None) -> list[tuple[str, str]]:
    """(metric, filter) of each column of ``task``: ``specs`` (``--metric TASK=METRIC[,FILTER]``), else the default
    from the metrics its samples carry: ``prompt_level_strict_acc`` and ``inst_level_strict_acc`` (IFEval: columns
    IFE-P and IFE-I); else ``pass@1`` or ``pass_at_1`` (HumanEval, MBPP); else ``exact_match`` (GSM8K, BBH chain
    of thought); else ``acc`` (MMLU, ARC, HellaSwag: accuracy, not length-normalised, as the paper); else
    ``word_perplexity``, ``byte_perplexity`` or ``bits_per_byte``; else the task's only metric. The filter is the
    metric's only filter, else ``strict-match`` (GSM8K), else ``none``; otherwise an error that lists them."""
    available = _available(run, task)
    if specs:
        chosen = []
        for spec in specs:
            metric, filter_ = _parse_metric_spec(spec)
            if metric not in available:
                raise ValueError(f"task {task} ({run.label}): no metric {metric!r} in its samples; "
                                 f"available (metric,filter): {_describe(available)}")
            if filter_ is None:
                filter_ = _choose_filter(task, metric, available[metric], available)
            elif filter_ not in available[metric]:
                raise ValueError(f"task {task} ({run.label}): metric {metric} has no filter {filter_!r}; "
                                 f"available (metric,filter): {_describe(available)}")
            chosen.append((metric, filter_))
        return chosen
    if _IFEVAL_METRICS[0] in available:
        names = [m for m in _IFEVAL_METRICS if m in available]
    else:
        names = [next((m for m in _METRIC_PREFERENCE if m in available), None)]
        if names[0] is None:
            if len(available) != 1:
                raise ValueError(f"task {task} ({run.label}): no default metric among {_describe(available)}; "
                                 f"choose one with --metric {task}=METRIC")
            names = list(available)
    return [(m, _choose_filter(task, m, available[m], available)) for m in names]


def _short_names(tasks: Sequence[str]) -> dict[str, str]:
    short = {t: _SHORT_NAMES.get(t, t) for t in tasks}
    clashes = {s for s in short.values() if list(short.values()).count(s) > 1}
    return {t: (t if s in clashes else s) for t, s in short.items()}


def _column_values(run: Run, task: str, metric: str, filter_: str
                   ) -> tuple[dict[tuple[str, int], Any], dict[tuple[str, int], tuple[str | None, str | None]]]:
    values: dict[tuple[str, int], Any] = {}
    hashes: dict[tuple[str, int], tuple[str | None, str | None]] = {}
    if task not in run.tasks:
        raise ValueError(f"task {task} is missing in {run.label} (tasks there: {', '.join(run.tasks) or 'none'}); "
                         "restrict the comparison with --tasks")
    for leaf in run.tasks[task]:
        for sample in run.samples[leaf]:
            if sample.filter != filter_:
                continue
            key = (leaf, sample.doc_id)
            if key in values:
                raise ValueError(f"task {task} ({run.label}): document {sample.doc_id} of {leaf} appears twice "
                                 f"under filter {filter_}")
            if metric not in sample.values:
                raise ValueError(f"task {task} ({run.label}): metric {metric} is missing on document "
                                 f"{sample.doc_id} of {leaf} (filter {filter_}); available (metric,filter): "
                                 f"{_describe(_available(run, task))}")
            values[key] = sample.values[metric]
            hashes[key] = (sample.doc_hash, sample.prompt_hash)
    if not values:
        raise ValueError(f"task {task} ({run.label}): no samples with metric {metric} under filter {filter_}; "
                         f"available (metric,filter): {_describe(_available(run, task))}")
    return values, hashes


def _is_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float)) and not (isinstance(v, float) and math.isnan(v))


def _kind(task: str, metric: str, values: Sequence[Any]) -> tuple[str, str, float]:
    """(kind, unit, scale) of a column from its values in every run: in points (x100) when every value lies in
    [0, 1], nats (bits for ``bits_per_byte``) per word or byte for perplexities, else the metric's units."""
    if metric in _RATIO_METRICS:
        if not all(isinstance(v, (list, tuple)) and len(v) == 2 and _is_number(v[0]) and _is_number(v[1])
                   for v in values):
            raise ValueError(f"task {task}: {metric} values are not [loglikelihood, count] pairs")
        unit, _ = _RATIO_METRICS[metric]
        return "ratio", unit, _RATIO_METRICS[metric][1]
    if any(isinstance(v, (list, tuple)) for v in values):
        if metric.startswith("inst_level") and all(
                isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_number(x) for x in v) for v in values):
            flat = [float(x) for v in values for x in v]
            return "clustered", *(("points", 100.0) if min(flat) >= 0 and max(flat) <= 1 else ("raw", 1.0))
        raise ValueError(f"task {task}: metric {metric} has no single score per question (a corpus-level "
                         "metric such as bleu, f1 or mcc?); choose a per-question metric with --metric")
    if not all(_is_number(v) for v in values):
        bad = next(v for v in values if not _is_number(v))
        raise ValueError(f"task {task}: metric {metric} has a value that is not a number ({bad!r})")
    floats = [float(v) for v in values]
    if all(v in (0.0, 1.0) for v in floats):
        return "binary", "points", 100.0
    if min(floats) >= 0 and max(floats) <= 1:
        return "continuous", "points", 100.0
    return "continuous", "raw", 1.0


def _check_pairing(task: str, reference: Run, run: Run, ref_keys: dict, run_keys: dict, filter_: str) -> None:
    if ref_keys.keys() == run_keys.keys():
        return
    common = len(ref_keys.keys() & run_keys.keys())
    per_leaf_ref: dict[str, int] = {}
    per_leaf_run: dict[str, int] = {}
    for leaf, _ in ref_keys:
        per_leaf_ref[leaf] = per_leaf_ref.get(leaf, 0) + 1
    for leaf, _ in run_keys:
        per_leaf_run[leaf] = per_leaf_run.get(leaf, 0) + 1
    where = ""
    differing = [leaf for leaf in sorted(set(per_leaf_ref) | set(per_leaf_run))
                 if per_leaf_ref.get(leaf, 0) != per_leaf_run.get(leaf, 0)]
    if differing and (len(per_leaf_ref) > 1 or len(per_leaf_run) > 1):
        where = " (subtasks: " + ", ".join(f"{leaf} {per_leaf_ref.get(leaf, 0)} vs {per_leaf_run.get(leaf, 0)}"
                                           for leaf in differing[:5]) + (", ..." if len(differing) > 5 else "") + ")"
    raise ValueError(f"task {task}, filter {filter_}: {reference.label} has {len(ref_keys)} documents and "
                     f"{run.label} has {len(run_keys)}, {common} in common{where}; paired statistics need the same "
                     "documents in every run (same --limit/--samples and task versions)")


# ---------------------------------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Cell:
    """One test of the table: a run against the reference on one column (scores and differences in the column's
    unit: points for accuracies). ``significant``: after Holm's correction; ``nominal``: p < alpha before it
    only."""

    run: str
    column: str
    task: str
    metric: str
    filter: str
    test: str
    n: int
    reference_score: float
    score: float
    difference: float
    se: float
    p: float  # NaN: no test (details["no_test"] says why)
    p_holm: float = math.nan
    significant: bool = False
    nominal: bool = False
    statistic: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MeanDifference:
    """Mean of a run's differences over tasks (in points) with the interval at ``level``."""

    run: str
    columns: tuple[str, ...]
    mean: float
    se: float
    low: float
    high: float
    level: float


def format_difference(x: float, unit: str) -> str:
    """A signed difference as the tables print it: one decimal in points, 3 significant digits otherwise."""
    if not math.isfinite(x):
        return "n/a"
    text = f"{x:+.1f}" if unit == "points" else f"{x:+.3g}"
    return text[1:] if float(text) == 0 else text


def format_score(x: float, unit: str) -> str:
    """A score as the tables print it: one decimal in points, 4 significant digits otherwise."""
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.1f}" if unit == "points" else f"{x:.4g}"


def jsonable(value: Any) -> Any:
    """``value`` with NaN and infinities as None, numpy scalars as Python numbers and paths as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return jsonable(value.item())
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass(frozen=True)
class Comparison:
    """Every run against the reference on every column, Holm-corrected over the table, and the means."""

    reference: RunSummary
    runs: tuple[RunSummary, ...]
    columns: tuple[Column, ...]
    reference_scores: dict[str, float]
    cells: tuple[Cell, ...]
    means: tuple[MeanDifference, ...]
    alpha: float
    level: float
    permutations: int
    seed: int

    def cell(self, run: str, column: str) -> Cell:
        for c in self.cells:
            if c.run == run and c.column == column:
                return c
        raise KeyError((run, column))

    def mean(self, run: str) -> MeanDifference | None:
        return next((m for m in self.means if m.run == run), None)

    def tests(self) -> int:
        """The tests of the table, over which Holm's correction runs: the cells with a p-value."""
        return sum(1 for c in self.cells if math.isfinite(c.p))

    def to_markdown(self) -> str:
        """The table in the layout of the paper's Tables 3-4: a row of the reference's scores, then one row per
        run with signed differences (bold: significant after Holm; dagger: p < alpha before correction only)
        and the mean over tasks +- its interval; a legend below."""
        in_mean = [c for c in self.columns if c.in_mean]
        header = ["run"] + [c.name for c in self.columns] + (["mean"] if in_mean else [])
        lines = ["| " + " | ".join(header) + " |", "|:--|" + "--:|" * (len(header) - 1)]
        ref_row = [f"{self.reference.label} (reference, score)"]
        ref_row += [format_score(self.reference_scores[c.name], c.unit) for c in self.columns]
        if in_mean:
            ref_row.append(format_score(float(np.mean([self.reference_scores[c.name] for c in in_mean])), "points"))
        lines.append("| " + " | ".join(ref_row) + " |")
        for run in self.runs:
            row = [run.label]
            for column in self.columns:
                cell = self.cell(run.label, column.name)
                text = format_difference(cell.difference, column.unit)
                if cell.significant:
                    text = f"**{text}**"
                elif cell.nominal:
                    text += "†"
                row.append(text)
            if in_mean:
                m = self.mean(run.label)
                row.append(f"{format_difference(m.mean, 'points')} ± {(m.high - m.low) / 2:.1f}" if m else "n/a")
            lines.append("| " + " | ".join(row) + " |")
        tests = self.tests()
        legend = [f"Differences {', '.join(r.label for r in self.runs)} minus {self.reference.label} on identical "
                  f"questions, in points unless noted; first row: {self.reference.label}'s scores. Bold: significant "
                  f"after Holm's correction over the table's {tests} tests (alpha = {self.alpha:g}); †: p < "
                  f"{self.alpha:g} before correction only."]
        if tests < len(self.cells):
            untested = len(self.cells) - tests
            legend.append(f"{untested} cell{'s' if untested != 1 else ''} without a test (fewer than 2 pairs, or "
                          "every difference equal: no p-value), outside the correction.")
        if in_mean:
            legend.append(f"Mean: average over the {len(in_mean)} task{'s' if len(in_mean) != 1 else ''} "
                          f"({', '.join(c.name for c in in_mean)}) "
                          f"± {self.level:.0%} interval treating tasks as independent.")
        for column in self.columns:
            if column.unit != "points":
                what = ("negative log-likelihood, positive = worse" if column.kind == "ratio"
                        else f"mean of {column.metric}")
                legend.append(f"{column.name}: {column.metric} ({column.filter}); differences in {column.unit} "
                              f"({what}); not in the mean.")
        return "\n".join(lines) + "\n\n" + "\n".join(legend) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: every number of the table (NaN as null)."""
        record = {
            "reference": asdict(self.reference),
            "runs": [asdict(r) for r in self.runs],
            "alpha": self.alpha,
            "level": self.level,
            "permutations": self.permutations,
            "seed": self.seed,
            "tests": self.tests(),
            "correction": "holm (statsmodels multipletests) over every test of the table",
            "mean_interval": "mean +- z * sqrt(sum se^2) / k, tasks independent (normal)",
            "columns": [asdict(c) for c in self.columns],
            "reference_scores": dict(self.reference_scores),
            "cells": [asdict(c) for c in self.cells],
            "means": [asdict(m) for m in self.means],
        }
        return jsonable(record)


def as_run(run: str | Path | Run, pool_groups: bool = True) -> Run:
    """``run`` loaded by :func:`load_run` when it is a path; a :class:`Run` as it is."""
    return run if isinstance(run, Run) else load_run(run, pool_groups=pool_groups)


def check_test_settings(alpha: float, level: float, permutations: int) -> None:
    """``ValueError`` naming the setting for an ``alpha`` or ``level`` outside (0, 1) or no permutations."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if permutations < 1:
        raise ValueError(f"permutations must be positive, got {permutations}")


def column_score(column: Column, values: Sequence[Any]) -> float:
    """A run's own score on ``column`` from its ``values``, as lm-eval aggregates it, in the column's unit (points
    for accuracies; perplexity, not nats, for ``ratio`` columns)."""
    if column.kind == "ratio":
        ll = sum(float(v[0]) for v in values)
        count = sum(float(v[1]) for v in values)
        nll = -ll / count
        return nll / math.log(2.0) if column.metric == "bits_per_byte" else math.exp(nll)
    if column.kind == "clustered":
        score = sum(float(x) for v in values for x in v) / sum(len(v) for v in values)
    else:
        score = float(np.mean([float(v) for v in values]))
    return score * (100.0 if column.unit == "points" else 1.0)


def paired_statistic(column: Column, keys: Sequence[tuple[str, int]], a: Sequence[Any], b: Sequence[Any],
                     runs: str, permutations: int, seed: int) -> stats.PairedStatistic:
    """The column's test of B's values ``b`` against A's ``a`` on the documents ``keys`` (in the metric's units)."""
    task = column.task
    if column.kind == "binary":
        return stats.paired_binary([float(v) for v in a], [float(v) for v in b])
    if column.kind == "clustered":
        for k, x, y in zip(keys, a, b):
            if len(x) != len(y):
                raise ValueError(f"task {task}: document {k[1]} of {k[0]} has {len(x)} and {len(y)} instructions "
                                 f"in {runs}")
        stat = stats.paired_clustered([sum(map(float, x)) for x in a], [sum(map(float, y)) for y in b],
                                      [len(x) for x in a], permutations=permutations, seed=seed)
        flat_a = np.array([float(v) for x in a for v in x])
        flat_b = np.array([float(v) for y in b for v in y])
        return replace(stat, counts={
            **stat.counts, "instructions_reference_only": int(np.sum((flat_a == 1) & (flat_b == 0))),
            "instructions_run_only": int(np.sum((flat_b == 1) & (flat_a == 0)))})
    if column.kind == "ratio":
        for k, x, y in zip(keys, a, b):
            if float(x[1]) != float(y[1]):
                raise ValueError(f"task {task}: document {k[1]} of {k[0]} counts {x[1]} and {y[1]} units in {runs}")
        stat = stats.paired_perplexity_ratio([-float(x[0]) for x in a], [-float(y[0]) for y in b],
                                             [float(x[1]) for x in a])
        if column.metric != "bits_per_byte":
            stat = replace(stat, details={**stat.details, "perplexity_ratio": math.exp(stat.difference)})
        return stat
    return stats.paired_continuous([float(v) for v in a], [float(v) for v in b])


def _differing(ref_hashes: Mapping, hashes: Mapping, which: int) -> list[tuple[str, int]]:
    """Documents whose doc_hash (0) or prompt_hash (1) both runs recorded and that differ."""
    return [k for k, h in ref_hashes.items() if h[which] and hashes[k][which] and h[which] != hashes[k][which]]


def _normalised_metrics(metrics: Mapping[str, str | Sequence[str]] | None) -> dict[str, list[str]]:
    return {t: ([s] if isinstance(s, str) else list(s)) for t, s in (metrics or {}).items()}


@dataclass(frozen=True)
class PairedColumn:
    """One column's values in every run on the documents they all hold, in the order of ``keys``."""

    column: Column
    keys: tuple[tuple[str, int], ...]  # (leaf task, doc_id)
    values: dict[str, tuple[Any, ...]]  # run label -> its values, the reference's included
    prompt_mismatches: dict[str, int]  # run label -> documents whose prompt_hash differs from the reference's


def paired_columns(reference: Run, runs: Sequence[Run], *,
                   metrics: Mapping[str, str | Sequence[str]] | None = None,
                   tasks: Sequence[str] | None = None) -> tuple[PairedColumn, ...]:
    """The table's columns (see :func:`compare_runs` for ``metrics`` and ``tasks``) with every run's values,
    paired with ``reference`` by (leaf task, ``doc_id``). Raises ``ValueError`` when the runs cannot be paired:
    labels that repeat, a missing task or metric, other documents, a differing ``doc_hash``."""
    labels = [reference.label] + [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must differ: {', '.join(labels)} (name them LABEL=PATH)")
    metrics = _normalised_metrics(metrics)
    table_tasks = list(reference.tasks) if tasks is None else list(dict.fromkeys(tasks))
    unknown = [t for t in table_tasks if t not in reference.tasks] + [t for t in metrics if t not in reference.tasks]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}: tasks of {reference.label} are {', '.join(reference.tasks)}")
    for run in runs if tasks is None else ():
        extra = [t for t in run.tasks if t not in reference.tasks]
        if extra:
            logger.warning("%s: tasks not in the reference %s are ignored: %s", run.label, reference.label,
                           ", ".join(extra))
    short = _short_names(table_tasks)
    table_tasks.sort(key=lambda t: (_ORDER.index(short[t]) if short[t] in _ORDER else len(_ORDER), t))
    paired: list[PairedColumn] = []
    for task in table_tasks:
        choices = _metric_choices(reference, task, metrics.get(task))
        for index, (metric, filter_) in enumerate(choices):
            if metric in _IFEVAL_SUFFIXES:
                name = short[task] + _IFEVAL_SUFFIXES[metric]
            elif len(choices) == 1:
                name = short[task]
            else:
                twice = sum(1 for m, _ in choices if m == metric) > 1
                name = f"{short[task]} {metric}" + (f",{filter_}" if twice else "")
            if any(p.column.name == name for p in paired):
                raise ValueError(f"two columns are named {name}; check --metric")
            ref_values, ref_hashes = _column_values(reference, task, metric, filter_)
            keys = tuple(sorted(ref_values))
            values = {reference.label: tuple(ref_values[k] for k in keys)}
            mismatches: dict[str, int] = {}
            for run in runs:
                run_values, hashes = _column_values(run, task, metric, filter_)
                _check_pairing(task, reference, run, ref_values, run_values, filter_)
                changed = _differing(ref_hashes, hashes, 0)
                if changed:
                    raise ValueError(f"task {task}: {len(changed)} of {len(ref_values)} documents differ between "
                                     f"{reference.label} and {run.label} (doc_hash, e.g. {changed[0][0]} document "
                                     f"{changed[0][1]}); the runs evaluated different data")
                prompts = len(_differing(ref_hashes, hashes, 1))
                if prompts:
                    logger.warning("task %s: %d of %d prompts differ between %s and %s (prompt_hash: chat template, "
                                   "few-shot examples?)", task, prompts, len(ref_values), reference.label, run.label)
                    mismatches[run.label] = prompts
                values[run.label] = tuple(run_values[k] for k in keys)
            kind, unit, scale = _kind(task, metric, [v for column in values.values() for v in column])
            column = Column(name, task, metric, filter_, kind, unit, scale, index == 0 and unit == "points",
                            tuple(reference.tasks[task]))
            paired.append(PairedColumn(column, keys, values, mismatches))
    return tuple(paired)


def compare_runs(reference: str | Path | Run, runs: Sequence[str | Path | Run], *,
                 metrics: Mapping[str, str | Sequence[str]] | None = None, tasks: Sequence[str] | None = None,
                 alpha: float = 0.05, level: float = 0.95, permutations: int = 100_000, seed: int = 0,
                 pool_groups: bool = True) -> Comparison:
    """Compare each of ``runs`` with ``reference`` on identical questions.

    ``reference``/``runs``: lm-eval output paths (see :func:`load_run`) or loaded :class:`Run` objects.
    ``metrics``: task -> ``"metric"`` or ``"metric,filter"`` (or a list of them: several columns), overriding
    the defaults. ``tasks``: table tasks to compare (default: every task of the reference). ``alpha``: level of
    Holm's correction and of the dagger; ``level``: of the interval of the mean; ``permutations``/``seed``: the
    sign-flip test of clustered metrics. Returns a :class:`Comparison`; raises ``ValueError`` when the runs
    cannot be paired (different documents, a missing task or metric).
    """
    if not runs:
        raise ValueError("compare needs a reference run and at least one run to compare with it")
    check_test_settings(alpha, level, permutations)
    ref = as_run(reference, pool_groups)
    others = [as_run(r, pool_groups) for r in runs]
    columns: list[Column] = []
    raw: list[tuple[Column, str, stats.PairedStatistic, int, float, float]] = []
    reference_scores: dict[str, float] = {}
    for paired in paired_columns(ref, others, metrics=metrics, tasks=tasks):
        column, keys = paired.column, paired.keys
        columns.append(column)
        a = paired.values[ref.label]
        reference_scores[column.name] = column_score(column, a)
        for run in others:
            b = paired.values[run.label]
            stat = paired_statistic(column, keys, a, b, f"{ref.label} and {run.label}", permutations, seed)
            if run.label in paired.prompt_mismatches:
                stat = replace(stat, details={**stat.details,
                                              "prompt_hash_mismatches": paired.prompt_mismatches[run.label]})
            raw.append((column, run.label, stat, len(keys), reference_scores[column.name], column_score(column, b)))

    family = stats.holm([stat.p for _, _, stat, *_ in raw], alpha)
    cells = []
    for (column, label, stat, n, ref_score, score), p_holm, significant in zip(raw, family.adjusted, family.reject):
        p = math.nan if stat.p is None else stat.p
        if "no_test" in stat.details:
            logger.warning("%s on %s: no %s test: %s", label, column.name, stat.test, stat.details["no_test"])
        nominal = bool(math.isfinite(p) and p < alpha and not significant)
        cells.append(Cell(label, column.name, column.task, column.metric, column.filter, stat.test, n, ref_score,
                          score, stat.difference * column.scale, stat.se * column.scale, p, float(p_holm),
                          bool(significant), nominal, stat.statistic, dict(stat.counts), dict(stat.details)))
    means = []
    in_mean = [c for c in columns if c.in_mean]
    for run in others:
        if not in_mean:
            break
        chosen = [next(c for c in cells if c.run == run.label and c.column == col.name) for col in in_mean]
        interval = stats.mean_over_tasks([c.difference for c in chosen], [c.se for c in chosen], level)
        means.append(MeanDifference(run.label, tuple(c.name for c in in_mean), interval.mean, interval.se,
                                    interval.low, interval.high, level))
    comparison = Comparison(ref.summary(), tuple(r.summary() for r in others), tuple(columns), reference_scores,
                            tuple(cells), tuple(means), alpha, level, permutations, seed)
    logger.info("compared %d runs with %s on %d columns: %d tests, %d significant after Holm", len(others),
                ref.label, len(columns), comparison.tests(), sum(c.significant for c in cells))
    return comparison

