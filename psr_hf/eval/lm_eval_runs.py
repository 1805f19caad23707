"""Reading lm-eval runs: the outputs of lm-evaluation-harness 0.4.x run with ``--output_path X --log_samples``.

lm-eval writes ``X/<model_name_sanitized>/results_<timestamp>.json`` and one ``samples_<task>_<timestamp>.jsonl``
per leaf task (a group such as ``mmlu`` has no samples file of its own); when ``X`` ends in ``.json`` both go next
to it, the results as ``<stem>_<timestamp>.json``. The timestamp is ``datetime.now().isoformat()`` with ``:``
replaced by ``-``; as lm-eval does itself, the latest timestamp is the largest string.

:func:`load_run` reads one run into a :class:`Run`: the :class:`Sample` lines of each leaf task, and the table
tasks, where the subtasks of a group (``group_subtasks`` of the results file: MMLU's 57 subjects, BBH's 27 tasks)
are pooled under the top-level group, as in the paper's Appendix A. :mod:`psr_hf.eval.compare` pairs runs;
docs/lm-eval.md shows the command.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# lm-eval: datetime.now().isoformat().replace(":", "-"), e.g. 2026-11-30T13-41-23.117940
_TIMESTAMP = r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?"
_SAMPLES_FILE = re.compile(rf"^samples_(?P<task>.+)_(?P<ts>{_TIMESTAMP})\.jsonl$")
_RESULTS_FILE = re.compile(rf"^(?P<stem>.+)_(?P<ts>{_TIMESTAMP})\.json$")
# the fixed fields of a samples line (lm_eval.result_schema.SampleResult); the rest are metrics
_SAMPLE_FIELDS = frozenset({"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                            "doc_hash", "prompt_hash", "target_hash"})


@dataclass(frozen=True)
class Sample:
    """One document of one leaf task under one filter: its metric values and hashes.

    A samples line holds ``doc_id`` (index in the evaluation split), ``filter`` (``none``, ``strict-match``, ...),
    ``metrics`` (the names of its metric fields), ``doc_hash``/``prompt_hash``/``target_hash``, and one field per
    metric: a number or bool for accuracies (``acc``, ``exact_match``, ``pass@1`` of humaneval, ``pass_at_1`` of
    mbpp, ``prompt_level_strict_acc``), a list of bools for IFEval's instruction level (``inst_level_strict_acc``:
    one entry per instruction of the prompt), ``[loglikelihood, count]`` for ``word_perplexity``,
    ``byte_perplexity`` and ``bits_per_byte``.
    """

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
                if not isinstance(record, dict):
                    raise TypeError(f"a JSON {_json_kind(record)}; expected an object")
                names = record.get("metrics")
                if names is None:  # not written by 0.4.x; take every non-fixed field
                    names = [k for k in record if k not in _SAMPLE_FIELDS]
                elif not isinstance(names, list):
                    raise TypeError(f"its metrics field is a JSON {_json_kind(names)}; expected a list of names")
                samples.append(Sample(int(record["doc_id"]), str(record.get("filter", "none")),
                                      {name: record[name] for name in names if name in record},
                                      record.get("doc_hash"), record.get("prompt_hash")))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}, line {number}: not an lm-eval sample ({exc})") from None
    return tuple(samples)


def _json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages about a record of the wrong shape."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


def _check_results(file: Path, record: Mapping[str, Any]) -> None:
    """``ValueError`` naming ``file`` and the field where a results file's fields have another shape than lm-eval's
    (the fields read here: ``group_subtasks``, ``config``)."""
    fix = "rerun lm-eval into this directory, or move this results file away (groups are then not pooled)"
    groups = record.get("group_subtasks")
    if groups is not None:
        if not isinstance(groups, dict):
            raise ValueError(f"{file}: group_subtasks is a JSON {_json_kind(groups)}; expected an object of group -> "
                             f"list of task names; {fix}")
        for group, children in groups.items():
            if not isinstance(children, list) or not all(isinstance(c, str) for c in children):
                raise ValueError(f"{file}: group_subtasks[{group!r}] is a JSON {_json_kind(children)}; expected a "
                                 f"list of task names; {fix}")
    config = record.get("config")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{file}: config is a JSON {_json_kind(config)}; expected an object; {fix}")


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
    From a results file only its timestamp is read. A directory may hold several evaluations: each task is read
    from its latest samples file (a rerun of a task replaces it; tasks run separately into the same directory are
    all found); :attr:`Run.files` lists the files used.
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
            _check_results(file, record)
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
    config = (used_results[-1][1].get("config") or {}) if used_results else {}
    files = tuple(sorted([file for _, file in latest.values()] + [file for file, _ in used_results]))
    for file in files:
        logger.info("%s: %s", label or path.name, file)
    return Run(label=label or path.name or str(path), directory=directory, tasks=tasks, samples=samples,
               files=files, model=config.get("model"), model_args=config.get("model_args"),
               limit=config.get("limit"),
               lm_eval_version=used_results[-1][1].get("lm_eval_version") if used_results else None)


def parse_run_argument(argument: str) -> tuple[str | None, str]:
    """``LABEL=PATH`` or ``PATH`` (a path that exists wins over the ``=`` reading) -> (label or None, path)."""
    if "=" in argument and not Path(argument).exists():
        label, _, path = argument.partition("=")
        if label and path:
            return label, path
    return None, argument
