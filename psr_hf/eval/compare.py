"""Paired comparison of lm-eval runs on identical questions: the statistics of ``psr-hf compare``.

Input: the outputs of lm-evaluation-harness 0.4.x run with ``--output_path X --log_samples``. lm-eval writes
``X/<model_name_sanitized>/results_<timestamp>.json`` and one ``samples_<task>_<timestamp>.jsonl`` per task (per
leaf task: a group such as ``mmlu`` has no samples file of its own); when ``X`` ends in ``.json`` both go next to
it instead, the results as ``<stem>_<timestamp>.json``. The timestamp is ``datetime.now().isoformat()`` with
``:`` replaced by ``-``; as lm-eval does itself, the latest timestamp is the largest string. A run is given as
``X``, as the inner directory, or as one results file (then only that timestamp is read). When a directory holds
several evaluations, each task is read from its latest samples file (a rerun of a task replaces it; tasks run
separately into the same directory are all found); the files used are in the JSON record.

Each line of a samples file is one document under one filter: ``doc_id`` (index in the evaluation split),
``filter`` (``none``, ``strict-match``, ...), ``metrics`` (the names of the metric fields of the line),
``doc_hash``/``prompt_hash``/``target_hash``, and one field per metric: a number or bool for accuracies
(``acc``, ``exact_match``, ``pass@1`` of humaneval, ``pass_at_1`` of mbpp, ``prompt_level_strict_acc``), a list
of bools for IFEval's instruction level (``inst_level_strict_acc``: one entry per instruction of the prompt),
``[loglikelihood, count]`` for ``word_perplexity``/``byte_perplexity``/``bits_per_byte``. Samples are paired
across runs by (leaf task, ``doc_id``) under the column's filter; runs that cover different documents, or whose
``doc_hash`` differs on a document, are refused; differing ``prompt_hash`` (e.g. another chat template) is
logged and counted.

Tasks. The subtasks of a group (``group_subtasks`` of the results file: MMLU's 57 subjects, BBH's 27 tasks) are
pooled at the question level into one column named after the top-level group, as in the paper's Appendix A.
Default metric per task, from the metrics its samples carry (``--metric TASK=METRIC[,FILTER]`` overrides, and may
be repeated for several columns of one task):

- ``prompt_level_strict_acc`` and ``inst_level_strict_acc`` (IFEval: columns IFE-P and IFE-I);
- else ``pass@1`` or ``pass_at_1`` (HumanEval, MBPP);
- else ``exact_match`` (GSM8K, BBH chain of thought);
- else ``acc`` (MMLU, ARC, HellaSwag: accuracy, not length-normalised, as the paper);
- else ``word_perplexity``, ``byte_perplexity`` or ``bits_per_byte``;
- else the task's only metric; otherwise an error that lists the metrics.

The filter is the metric's only filter, else ``strict-match`` (GSM8K), else ``none``; otherwise an error.

Statistics, per column and run B against the reference A (the paper's Section 6.1 and Appendix A):

- 0/1 per question (``binary``): difference = 100 x mean(b - a) in points; SE = 100 x sd(b - a) / sqrt(n)
  (sd with n - 1); exact McNemar test on the discordant questions (statsmodels: two-sided binomial test of
  min(a_only, b_only) out of a_only + b_only at 1/2).
- a list of 0/1 per prompt (``clustered``, IFEval instruction level): the prompt is the unit. With per-prompt
  sums ``d_i = b_i - a_i`` of followed instructions and ``m_i`` instructions, difference = sum(d) / sum(m);
  cluster-robust SE = sqrt(G / (G - 1) * sum((d_i - diff * m_i)^2)) / sum(m) over G prompts, which is
  statsmodels' OLS of the per-instruction differences on a constant with ``cov_type="cluster"`` (its default
  small-sample factor G / (G - 1) * (N - 1) / (N - K) with K = 1); p-value from a sign-flip permutation test of
  sum(d) (scipy ``permutation_test``, ``permutation_type="samples"``) over the prompts with d_i != 0 (a zero
  flips to itself): every one of the 2^k sign patterns when 2^k <= ``permutations``, else ``permutations``
  seeded Monte Carlo draws (p = (hits + 1) / (draws + 1)); the record says which.
- ``[loglikelihood, count]`` per document (``ratio``: perplexities): difference in negative log-likelihood per
  word or byte, sum(nll_b - nll_a) / sum(count) (nats; bits for ``bits_per_byte``; positive = B worse), the same
  cluster-robust SE with documents as clusters, and a paired t-test (scipy) of the per-document NLL sums.
- other numbers per question (``continuous``): mean difference, SE = sd / sqrt(n), paired t-test (scipy); in
  points when every value lies in [0, 1], else in the metric's units.

Holm's correction (statsmodels ``multipletests``) runs over every test of the table (all runs x all columns).
Bold: significant after it at ``alpha``; dagger: p < ``alpha`` before correction only.

Mean over tasks: the mean of each task's first column (IFEval at prompt level) among columns in points, with
the interval mean +- z * sqrt(sum SE_t^2) / k (normal, ``level`` 0.95 by default), which treats tasks as
independent, as the paper does ("a 95% interval that treats tasks as independent"). Perplexity-like columns are
tested and shown but are not in the mean.

The library logs; ``psr-hf compare`` prints.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .stats import Interval, normal_interval, standard_error

logger = logging.getLogger(__name__)

# lm-eval: datetime.now().isoformat().replace(":", "-"), e.g. 2026-11-30T13-41-23.117940
_TIMESTAMP = r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?"
_SAMPLES_FILE = re.compile(rf"^samples_(?P<task>.+)_(?P<ts>{_TIMESTAMP})\.jsonl$")
_RESULTS_FILE = re.compile(rf"^(?P<stem>.+)_(?P<ts>{_TIMESTAMP})\.json$")
# the fixed fields of a samples line (lm_eval.result_schema.SampleResult); the rest are metrics
_SAMPLE_FIELDS = frozenset({"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                            "doc_hash", "prompt_hash", "target_hash"})

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


# ---------------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Sample:
    """One document of one leaf task under one filter: its metric values and hashes."""

    doc_id: int
    filter: str
    values: dict[str, Any]
    doc_hash: str | None = None
    prompt_hash: str | None = None


@dataclass(frozen=True)
class RunSummary:
    """Where a run came from (for the JSON record)."""

    label: str
    directory: str
    files: tuple[str, ...]
    model: str | None
    model_args: Any
    limit: Any
    lm_eval_version: str | None


@dataclass(frozen=True)
class Run:
    """One lm-eval output directory, loaded: table tasks (a leaf task, or a group pooling its leaves)."""

    label: str
    directory: Path
    tasks: dict[str, tuple[str, ...]]  # table task -> leaf tasks pooled into it
    samples: dict[str, tuple[Sample, ...]]  # leaf task -> its samples under every filter
    files: tuple[Path, ...]
    model: str | None = None
    model_args: Any = None
    limit: Any = None
    lm_eval_version: str | None = None

    def summary(self) -> RunSummary:
        return RunSummary(self.label, str(self.directory), tuple(str(f) for f in self.files), self.model,
                          self.model_args, self.limit, self.lm_eval_version)


def _samples_files(directory: Path) -> list[tuple[str, str, Path]]:
    found = []
    for path in directory.iterdir():
        match = _SAMPLES_FILE.match(path.name)
        if match and path.is_file():
            found.append((match["task"], match["ts"], path))
    return found


def _run_directory(path: Path) -> tuple[Path, str | None]:
    if path.is_file():
        match = _RESULTS_FILE.match(path.name)
        if not match:
            raise ValueError(f"{path}: not an lm-eval results file (<name>_<timestamp>.json)")
        return path.parent, match["ts"]
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if _samples_files(path):
        return path, None
    inner = sorted(d for d in path.iterdir() if d.is_dir() and _samples_files(d))
    if len(inner) == 1:
        return inner[0], None
    if len(inner) > 1:
        raise ValueError(f"{path} holds lm-eval outputs of several models ({', '.join(d.name for d in inner)}); "
                         "pass one of these directories")
    raise ValueError(f"{path}: no samples_<task>_<timestamp>.jsonl here or in a subdirectory "
                     "(run lm-eval with --output_path and --log_samples)")


def _read_samples(path: Path) -> tuple[Sample, ...]:
    samples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                names = record.get("metrics")
                if names is None:  # not written by 0.4.x; take every non-fixed field
                    names = [k for k in record if k not in _SAMPLE_FIELDS]
                samples.append(Sample(int(record["doc_id"]), str(record.get("filter", "none")),
                                      {name: record[name] for name in names if name in record},
                                      record.get("doc_hash"), record.get("prompt_hash")))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}, line {number}: not an lm-eval sample ({exc})") from None
    return tuple(samples)


def _leaves(group: str, subtasks: Mapping[str, Sequence[str]], seen: frozenset[str] = frozenset()) -> list[str]:
    out = []
    for child in subtasks.get(group, ()):
        if child in subtasks and child not in seen:
            out.extend(_leaves(child, subtasks, seen | {group}))
        else:
            out.append(child)
    return out


def _pool(leaves: Sequence[str], subtasks: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Table tasks: each top-level group with the leaves it holds, and each leaf in no group."""
    children = {c for group in subtasks.values() for c in group}
    tops = sorted(g for g in subtasks if g not in children)
    tasks: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for group in tops:
        members = tuple(leaf for leaf in dict.fromkeys(_leaves(group, subtasks)) if leaf in leaves)
        members = tuple(leaf for leaf in members if leaf not in owner)
        for leaf in members:
            owner[leaf] = group
        if members:
            tasks[group] = tuple(sorted(members))
    for leaf in leaves:
        if leaf not in owner:
            tasks[leaf] = (leaf,)
    return dict(sorted(tasks.items()))


def load_run(path: str | Path, label: str | None = None, *, pool_groups: bool = True) -> Run:
    """Load one lm-eval ``--log_samples`` output.

    ``path``: the ``--output_path`` directory, the ``<model_name_sanitized>`` directory inside it, or one
    results file. ``label``: the run's name in tables (default: the last component of ``path``).
    ``pool_groups``: pool a group's subtasks into one table task (default) or keep every leaf task apart.
    """
    path = Path(path)
    directory, only_ts = _run_directory(path)
    latest: dict[str, tuple[str, Path]] = {}
    for task, ts, file in _samples_files(directory):
        if only_ts is not None and ts != only_ts:
            continue
        if task not in latest or ts > latest[task][0]:
            latest[task] = (ts, file)
    if not latest:
        raise ValueError(f"{path}: no samples file with the timestamp {only_ts}")
    results = []
    for file in sorted(directory.glob("*.json")):
        match = _RESULTS_FILE.match(file.name)
        if not match or (only_ts is not None and match["ts"] != only_ts):
            continue
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "results" in record:
            results.append((match["ts"], file, record))
    results.sort(key=lambda r: r[0])
    subtasks: dict[str, list[str]] = {}
    for _, _, record in results:  # later files win
        subtasks.update({g: list(c) for g, c in (record.get("group_subtasks") or {}).items()})
    if not results:
        logger.warning("%s: no lm-eval results file; subtasks of groups are not pooled", directory)
    leaves = sorted(latest)
    tasks = _pool(leaves, subtasks) if pool_groups else {leaf: (leaf,) for leaf in leaves}
    samples = {task: _read_samples(file) for task, (_, file) in latest.items()}
    used_ts = {ts for ts, _ in latest.values()}
    used_results = [(file, record) for ts, file, record in results if ts in used_ts]
    config = used_results[-1][1].get("config", {}) if used_results else {}
    files = tuple(sorted([file for _, file in latest.values()] + [file for file, _ in used_results]))
    for file in files:
        logger.info("%s: %s", label or path.name, file)
    return Run(label=label or path.name or str(path), directory=directory, tasks=tasks, samples=samples,
               files=files, model=config.get("model"), model_args=config.get("model_args"),
               limit=config.get("limit"),
               lm_eval_version=used_results[-1][1].get("lm_eval_version") if used_results else None)


# ---------------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class PairedStatistic:
    """A paired comparison of B with A on one column, in the metric's own units (proportions, nats).

    ``counts``: discordant counts (``reference_only``/``run_only`` questions; for clustered metrics also prompts
    where B or A followed more instructions); ``details``: what the test used (permutations, seed, df, ...).
    """

    difference: float
    se: float
    p: float
    test: str
    statistic: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def paired_binary(a: Sequence[float], b: Sequence[float]) -> PairedStatistic:
    """0/1 outcomes of A and B on the same questions: mean difference B - A, its paired SE, exact McNemar."""
    from statsmodels.stats.contingency_tables import mcnemar

    a = np.asarray(a, dtype=bool)
    b = np.asarray(b, dtype=bool)
    n = a.size
    d = b.astype(np.float64) - a.astype(np.float64)
    reference_only = int(np.sum(a & ~b))
    run_only = int(np.sum(b & ~a))
    table = [[int(np.sum(a & b)), reference_only], [run_only, int(np.sum(~a & ~b))]]
    result = mcnemar(table, exact=True)
    return PairedStatistic(float(d.mean()) if n else math.nan, standard_error(d), float(result.pvalue),
                           "mcnemar-exact", float(result.statistic),
                           {"reference_only": reference_only, "run_only": run_only, "both": table[0][0],
                            "neither": table[1][1]})


def cluster_robust_se(d: Sequence[float], sizes: Sequence[float]) -> float:
    """SE of sum(d) / sum(sizes) with clusters i: sqrt(G / (G - 1) * sum((d_i - r m_i)^2)) / sum(m).

    Equal to statsmodels' OLS of the per-item differences on a constant with ``cov_type="cluster"``.
    """
    d = np.asarray(d, dtype=np.float64)
    m = np.asarray(sizes, dtype=np.float64)
    g = d.size
    total = m.sum()
    if g < 2 or total <= 0:
        return math.nan
    u = d - (d.sum() / total) * m
    return float(math.sqrt(g / (g - 1) * float(np.sum(u * u))) / total)


@dataclass(frozen=True)
class SignFlip:
    """A sign-flip permutation test: ``method`` is ``exact`` (all ``resamples`` = 2^k sign patterns) or
    ``monte-carlo`` (``resamples`` seeded draws)."""

    p: float
    method: str
    resamples: int


def sign_flip_test(d: Sequence[float], *, permutations: int = 100_000, seed: int = 0) -> SignFlip:
    """Two-sided sign-flip permutation test of sum(d) = 0 (scipy ``permutation_test``): over all 2^k sign
    patterns of the k non-zero entries when 2^k <= ``permutations``, else ``permutations`` draws seeded by
    ``seed``."""
    from scipy.stats import permutation_test

    d = np.asarray(d, dtype=np.float64)
    nonzero = d[d != 0]
    k = nonzero.size
    if k == 0:
        return SignFlip(1.0, "exact", 1)
    exact = k < 63 and 2**k <= permutations
    result = permutation_test((nonzero,), lambda x, axis: np.sum(x, axis=axis), vectorized=True,
                              permutation_type="samples", n_resamples=permutations, alternative="two-sided",
                              rng=np.random.default_rng(seed))
    return SignFlip(float(result.pvalue), "exact" if exact else "monte-carlo", 2**k if exact else permutations)


def paired_clustered(a_sums: Sequence[float], b_sums: Sequence[float], sizes: Sequence[float], *,
                     permutations: int = 100_000, seed: int = 0) -> PairedStatistic:
    """Per-prompt sums of followed instructions of A and B and instructions per prompt (IFEval instruction level):
    difference sum(b - a) / sum(sizes), cluster-robust SE, sign-flip permutation test on the per-prompt sums."""
    a = np.asarray(a_sums, dtype=np.float64)
    b = np.asarray(b_sums, dtype=np.float64)
    m = np.asarray(sizes, dtype=np.float64)
    d = b - a
    flip = sign_flip_test(d, permutations=permutations, seed=seed)
    details: dict[str, Any] = {"units": "prompts", "items": int(m.sum()), "resamples": flip.resamples}
    if flip.method == "monte-carlo":
        details["seed"] = seed
    return PairedStatistic(float(d.sum() / m.sum()), cluster_robust_se(d, m), flip.p, f"sign-flip-{flip.method}",
                           float(d.sum()),
                           {"run_better": int(np.sum(d > 0)), "reference_better": int(np.sum(d < 0))},
                           details)


def _t_test(d: np.ndarray) -> tuple[float, float, int]:
    from scipy.stats import ttest_1samp

    n = d.size
    if n < 2:
        return math.nan, math.nan, 0
    if np.all(d == d[0]):  # no spread: t is 0/0 or infinite
        logger.warning("paired t-test: every difference equals %g", d[0])
        return (0.0, 1.0, n - 1) if d[0] == 0 else (math.copysign(math.inf, d[0]), 0.0, n - 1)
    result = ttest_1samp(d, 0.0)
    return float(result.statistic), float(result.pvalue), n - 1


def paired_ratio(nll_a: Sequence[float], nll_b: Sequence[float], counts: Sequence[float]) -> PairedStatistic:
    """Per-document negative log-likelihoods of A and B and the words (bytes) of each document: difference in
    NLL per word sum(b - a) / sum(counts), cluster-robust SE, paired t-test of the per-document NLL."""
    a = np.asarray(nll_a, dtype=np.float64)
    b = np.asarray(nll_b, dtype=np.float64)
    m = np.asarray(counts, dtype=np.float64)
    d = b - a
    t, p, df = _t_test(d)
    return PairedStatistic(float(d.sum() / m.sum()), cluster_robust_se(d, m), p, "paired-t", t,
                           {"run_better": int(np.sum(d < 0)), "reference_better": int(np.sum(d > 0))},
                           {"units": "documents", "items": int(m.sum()), "df": df})


def paired_continuous(a: Sequence[float], b: Sequence[float]) -> PairedStatistic:
    """Numbers of A and B on the same questions: mean difference, SE sd / sqrt(n), paired t-test."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = b - a
    t, p, df = _t_test(d)
    return PairedStatistic(float(d.mean()), standard_error(d), p, "paired-t", t,
                           {"run_better": int(np.sum(d > 0)), "reference_better": int(np.sum(d < 0))},
                           {"df": df})


@dataclass(frozen=True)
class Holm:
    """Holm-adjusted p-values and which hypotheses are rejected at the family's alpha (NaN p: never)."""

    adjusted: np.ndarray  # [tests]
    reject: np.ndarray  # [tests] bool


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> Holm:
    """Holm's step-down correction (statsmodels ``multipletests``) over ``pvalues``; NaN ones stay out."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, dtype=np.float64)
    adjusted = np.full(p.shape, np.nan)
    reject = np.zeros(p.shape, dtype=bool)
    finite = np.isfinite(p)
    if finite.any():
        reject[finite], adjusted[finite], _, _ = multipletests(p[finite], alpha=alpha, method="holm")
    return Holm(adjusted, reject)


def mean_over_tasks(differences: Sequence[float], ses: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of per-task differences with a normal interval that treats tasks as independent:
    se = sqrt(sum se_t^2) / k, mean +- z_(1+level)/2 * se (:func:`~psr_hf.eval.stats.normal_interval`)."""
    d = np.asarray(differences, dtype=np.float64)
    s = np.asarray(ses, dtype=np.float64)
    k = d.size
    if k == 0:
        return Interval(math.nan, math.nan, math.nan, math.nan, level)
    return normal_interval(float(d.mean()), float(math.sqrt(float(np.sum(s * s))) / k), level)


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
    """(kind, unit, scale) of a column from its values in every run."""
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
    p: float
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


def _fmt_signed(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "n/a"
    text = f"{x:+.1f}" if unit == "points" else f"{x:+.3g}"
    return text[1:] if float(text) == 0 else text


def _fmt_score(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.1f}" if unit == "points" else f"{x:.4g}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return _jsonable(value.item())
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

    def to_markdown(self) -> str:
        """The table in the layout of the paper's Tables 3-4: a row of the reference's scores, then one row per
        run with signed differences (bold: significant after Holm; dagger: p < alpha before correction only)
        and the mean over tasks +- its interval; a legend below."""
        in_mean = [c for c in self.columns if c.in_mean]
        header = ["run"] + [c.name for c in self.columns] + (["mean"] if in_mean else [])
        lines = ["| " + " | ".join(header) + " |", "|:--|" + "--:|" * (len(header) - 1)]
        ref_row = [f"{self.reference.label} (reference, score)"]
        ref_row += [_fmt_score(self.reference_scores[c.name], c.unit) for c in self.columns]
        if in_mean:
            ref_row.append(_fmt_score(float(np.mean([self.reference_scores[c.name] for c in in_mean])), "points"))
        lines.append("| " + " | ".join(ref_row) + " |")
        for run in self.runs:
            row = [run.label]
            for column in self.columns:
                cell = self.cell(run.label, column.name)
                text = _fmt_signed(cell.difference, column.unit)
                if cell.significant:
                    text = f"**{text}**"
                elif cell.nominal:
                    text += "†"
                row.append(text)
            if in_mean:
                m = self.mean(run.label)
                row.append(f"{_fmt_signed(m.mean, 'points')} ± {(m.high - m.low) / 2:.1f}" if m else "n/a")
            lines.append("| " + " | ".join(row) + " |")
        tests = len(self.cells)
        legend = [f"Differences {', '.join(r.label for r in self.runs)} minus {self.reference.label} on identical "
                  f"questions, in points unless noted; first row: {self.reference.label}'s scores. Bold: significant "
                  f"after Holm's correction over the table's {tests} tests (alpha = {self.alpha:g}); †: p < "
                  f"{self.alpha:g} before correction only."]
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
            "tests": len(self.cells),
            "correction": "holm (statsmodels multipletests) over every test of the table",
            "mean_interval": "mean +- z * sqrt(sum se^2) / k, tasks independent (normal)",
            "columns": [asdict(c) for c in self.columns],
            "reference_scores": dict(self.reference_scores),
            "cells": [asdict(c) for c in self.cells],
            "means": [asdict(m) for m in self.means],
        }
        return _jsonable(record)


def _as_run(run: str | Path | Run, pool_groups: bool) -> Run:
    return run if isinstance(run, Run) else load_run(run, pool_groups=pool_groups)


def _reference_score(kind: str, values: Sequence[Any], metric: str) -> float:
    """The run's own score on the column, as lm-eval aggregates it (before scaling)."""
    if kind == "ratio":
        ll = sum(float(v[0]) for v in values)
        count = sum(float(v[1]) for v in values)
        nll = -ll / count
        return nll / math.log(2.0) if metric == "bits_per_byte" else math.exp(nll)
    if kind == "clustered":
        return sum(float(x) for v in values for x in v) / sum(len(v) for v in values)
    return float(np.mean([float(v) for v in values]))


def _paired_statistic(column: Column, keys: Sequence[tuple[str, int]], a: Sequence[Any], b: Sequence[Any],
                      runs: str, permutations: int, seed: int) -> PairedStatistic:
    """The column's test of B's values ``b`` against A's ``a`` on the documents ``keys`` (in the metric's units)."""
    task = column.task
    if column.kind == "binary":
        return paired_binary([float(v) for v in a], [float(v) for v in b])
    if column.kind == "clustered":
        for k, x, y in zip(keys, a, b):
            if len(x) != len(y):
                raise ValueError(f"task {task}: document {k[1]} of {k[0]} has {len(x)} and {len(y)} instructions "
                                 f"in {runs}")
        stat = paired_clustered([sum(map(float, x)) for x in a], [sum(map(float, y)) for y in b],
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
        stat = paired_ratio([-float(x[0]) for x in a], [-float(y[0]) for y in b], [float(x[1]) for x in a])
        if column.metric != "bits_per_byte":
            stat = replace(stat, details={**stat.details, "perplexity_ratio": math.exp(stat.difference)})
        return stat
    return paired_continuous([float(v) for v in a], [float(v) for v in b])


def _differing(ref_hashes: Mapping, hashes: Mapping, which: int) -> list[tuple[str, int]]:
    """Documents whose doc_hash (0) or prompt_hash (1) both runs recorded and that differ."""
    return [k for k, h in ref_hashes.items() if h[which] and hashes[k][which] and h[which] != hashes[k][which]]


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
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if permutations < 1:
        raise ValueError(f"permutations must be positive, got {permutations}")
    ref = _as_run(reference, pool_groups)
    others = [_as_run(r, pool_groups) for r in runs]
    labels = [ref.label] + [r.label for r in others]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must differ: {', '.join(labels)} (name them LABEL=PATH)")
    metrics = {t: ([s] if isinstance(s, str) else list(s)) for t, s in (metrics or {}).items()}
    table_tasks = list(ref.tasks) if tasks is None else list(dict.fromkeys(tasks))
    unknown = [t for t in table_tasks if t not in ref.tasks] + [t for t in metrics if t not in ref.tasks]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}: tasks of {ref.label} are {', '.join(ref.tasks)}")
    for run in others if tasks is None else ():
        extra = [t for t in run.tasks if t not in ref.tasks]
        if extra:
            logger.warning("%s: tasks not in the reference %s are ignored: %s", run.label, ref.label, ", ".join(extra))
    short = _short_names(table_tasks)
    table_tasks.sort(key=lambda t: (_ORDER.index(short[t]) if short[t] in _ORDER else len(_ORDER), t))

    columns: list[Column] = []
    raw: list[tuple[Column, str, PairedStatistic, int, float, float]] = []
    reference_scores: dict[str, float] = {}
    for task in table_tasks:
        choices = _metric_choices(ref, task, metrics.get(task))
        for index, (metric, filter_) in enumerate(choices):
            if metric in _IFEVAL_SUFFIXES:
                name = short[task] + _IFEVAL_SUFFIXES[metric]
            elif len(choices) == 1:
                name = short[task]
            else:
                twice = sum(1 for m, _ in choices if m == metric) > 1
                name = f"{short[task]} {metric}" + (f",{filter_}" if twice else "")
            ref_values, ref_hashes = _column_values(ref, task, metric, filter_)
            run_values = []
            for run in others:
                values, hashes = _column_values(run, task, metric, filter_)
                _check_pairing(task, ref, run, ref_values, values, filter_)
                changed = _differing(ref_hashes, hashes, 0)
                if changed:
                    raise ValueError(f"task {task}: {len(changed)} of {len(ref_values)} documents differ between "
                                     f"{ref.label} and {run.label} (doc_hash, e.g. {changed[0][0]} document "
                                     f"{changed[0][1]}); the runs evaluated different data")
                prompts = len(_differing(ref_hashes, hashes, 1))
                if prompts:
                    logger.warning("task %s: %d of %d prompts differ between %s and %s (prompt_hash: chat template, "
                                   "few-shot examples?)", task, prompts, len(ref_values), ref.label, run.label)
                run_values.append((run, values, prompts))
            keys = sorted(ref_values)
            kind, unit, scale = _kind(task, metric, [ref_values[k] for k in keys]
                                      + [v[k] for _, v, _ in run_values for k in keys])
            column = Column(name, task, metric, filter_, kind, unit, scale, index == 0 and unit == "points",
                            tuple(ref.tasks[task]))
            if any(c.name == name for c in columns):
                raise ValueError(f"two columns are named {name}; check --metric")
            columns.append(column)
            ref_score = _reference_score(kind, [ref_values[k] for k in keys], metric)
            reference_scores[name] = ref_score * (100.0 if unit == "points" else 1.0)
            for run, values, prompts in run_values:
                a = [ref_values[k] for k in keys]
                b = [values[k] for k in keys]
                stat = _paired_statistic(column, keys, a, b, f"{ref.label} and {run.label}", permutations, seed)
                if prompts:
                    stat = replace(stat, details={**stat.details, "prompt_hash_mismatches": prompts})
                raw.append((column, run.label, stat, len(keys), reference_scores[name],
                            _reference_score(kind, b, metric) * (100.0 if unit == "points" else 1.0)))

    family = holm([stat.p for _, _, stat, *_ in raw], alpha)
    cells = []
    for (column, label, stat, n, ref_score, score), p_holm, significant in zip(raw, family.adjusted, family.reject):
        nominal = bool(math.isfinite(stat.p) and stat.p < alpha and not significant)
        cells.append(Cell(label, column.name, column.task, column.metric, column.filter, stat.test, n, ref_score,
                          score, stat.difference * column.scale, stat.se * column.scale, stat.p, float(p_holm),
                          bool(significant), nominal, stat.statistic, dict(stat.counts), dict(stat.details)))
    means = []
    in_mean = [c for c in columns if c.in_mean]
    for run in others:
        if not in_mean:
            break
        chosen = [next(c for c in cells if c.run == run.label and c.column == col.name) for col in in_mean]
        interval = mean_over_tasks([c.difference for c in chosen], [c.se for c in chosen], level)
        means.append(MeanDifference(run.label, tuple(c.name for c in in_mean), interval.mean, interval.se,
                                    interval.low, interval.high, level))
    comparison = Comparison(ref.summary(), tuple(r.summary() for r in others), tuple(columns), reference_scores,
                            tuple(cells), tuple(means), alpha, level, permutations, seed)
    logger.info("compared %d runs with %s on %d columns: %d tests, %d significant after Holm", len(others),
                ref.label, len(columns), len(cells), sum(c.significant for c in cells))
    return comparison


def parse_run_argument(argument: str) -> tuple[str | None, str]:
    """``LABEL=PATH`` or ``PATH`` (a path that exists wins over the ``=`` reading) -> (label or None, path)."""
    if "=" in argument and not Path(argument).exists():
        label, _, path = argument.partition("=")
        if label and path:
            return label, path
    return None, argument
