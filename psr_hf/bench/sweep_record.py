"""The record file of a sweep (``psr-hf sweep --json``): written after every measured unit (floats to
:data:`RECORD_DIGITS` significant digits, compact JSON), read back to continue a sweep with the same settings, and
two records of one sweep's stages joined into one (:func:`join_stages`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .decode import WindowRun
from .rows import OFFLOAD, capacity_suffix, routed

RECORD_VERSION = 1
RECORD_DIGITS = 6  # significant digits of the floats a record keeps


def point_name(fields: Mapping[str, Any], residency: float) -> str:
    """The name of a grid entry's point at ``residency`` (its transformers row's: ``psr_lam0.3_n1_res50``), the key
    of its divergence in the record."""
    return routed(OFFLOAD, dict(fields), residency).name


def window_runs(data: Mapping[str, Any]) -> dict[str, list[list[WindowRun]]]:
    return {name: [[WindowRun(**w) for w in run] for run in runs] for name, runs in data.items()}


def runs_data(results: Mapping[str, list[list[WindowRun]]]) -> dict[str, Any]:
    return {name: [[dataclasses.asdict(dataclasses.replace(w, logits=None)) for w in run] for run in runs]
            for name, runs in results.items()}


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to :data:`RECORD_DIGITS` significant digits (far below any measured
    interval; keeps a sweep record small enough to travel to a lent GPU with the tree)."""
    if isinstance(value, float):
        return float(f"{value:.{RECORD_DIGITS}g}") if math.isfinite(value) else value
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    if isinstance(value, Mapping):
        return {k: rounded(v) for k, v in value.items()}
    return value


def save_record(record: Mapping[str, Any], path: Path | None) -> None:
    """Writes the record (floats to :data:`RECORD_DIGITS` significant digits, compact JSON)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rounded(record), separators=(",", ":")))
    tmp.replace(path)  # a kill while writing leaves the previous record whole


def load_record(path: Path | None, settings: Mapping[str, Any], option: str = "--json") -> dict[str, Any] | None:
    """The record at ``path`` to continue, or None where there is none; ``ValueError`` naming the file and what
    was expected where it is not a sweep record of this shape (``option``: the option that named it, for the
    message), or where it was made with other settings (continuing would mix two sweeps)."""
    if path is None or not path.is_file():
        return None
    fix = f"give another {option} path"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a sweep record (invalid JSON: {e}); {fix}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a sweep record (a record is a JSON object; this file holds another "
                         f"value); {fix}")
    if record.get("benchmark") != "sweep" or record.get("version") != RECORD_VERSION:
        raise ValueError(f"{path} is not a psr-hf sweep record (version {RECORD_VERSION}); {fix}")
    _check_shape(path, record, fix)
    theirs = record["settings"]
    differing = sorted(k for k in settings if k != "max_minutes" and theirs.get(k) != settings[k])
    if differing:
        raise ValueError(f"{path} holds a sweep with other settings ({', '.join(differing)}); to continue it, run "
                         f"the same command; to start another, give another --json path")
    return record


def _check_shape(path: Path, record: Mapping[str, Any], fix: str) -> None:
    """``ValueError`` naming ``path`` and the field where a record's fields that the sweep reads before measuring
    have another shape than the sweep writes."""
    def wrong(field: str, expected: str) -> ValueError:
        return ValueError(f"{path} is not a sweep record of this version: {field} is not {expected}; {fix}")

    for field in ("settings", "grid", "quality", "latency"):
        if not isinstance(record.get(field), dict):
            raise wrong(field, "a JSON object")
    if not isinstance(record["settings"].get("residencies"), list):
        raise wrong("settings.residencies", "a list of residencies")


QUALITY_KEYS = ("quality", "heldout", "selfgen", "quality_model", "quality_machine")
LATENCY_KEYS = ("latency", "latency_windows", "model", "machine", "versions")


def join_stages(path: str | Path, other: str | Path) -> None:
    """Complete the record at ``path`` with the stage it lacks from the record at ``other``: the divergence stage
    (``--stage quality``, e.g. on a CPU) and the timing (``--stage latency``, on the GPU) of one sweep, run at the
    same time on two machines. Both must hold the same settings and grid, and each stage must be complete in
    exactly one of them; ``ValueError`` otherwise. The record at ``path`` is rewritten with both stages (then
    ``--stage all`` derives the points)."""
    path, other = Path(path), Path(other)
    if path.resolve() == other.resolve():
        raise ValueError(f"--join {other} is the same record as --json; give the record of the other stage")
    for p in (path, other):
        if not p.is_file():
            raise ValueError(f"{p}: no such sweep record; give the records of the two stages")
    mine = load_record(path, {})  # the format checked; the settings are compared below
    theirs = load_record(other, {}, "--join")
    differing = sorted(k for k in set(mine["settings"]) | set(theirs["settings"])
                       if k != "max_minutes" and mine["settings"].get(k) != theirs["settings"].get(k))
    if differing or mine["grid"] != theirs["grid"]:
        raise ValueError(f"{path} and {other} are different sweeps (settings differ: "
                         f"{', '.join(differing) or 'grid'}); join the two stages of one command only")
    residencies = mine["settings"]["residencies"]
    names = [point_name(fields, r) for r in residencies for fields in mine["grid"].values()]

    def has_quality(record: Mapping[str, Any]) -> bool:
        return "selfgen" in record and all(n in record["quality"] for n in names)

    def has_latency(record: Mapping[str, Any]) -> bool:
        return all("rows" in record["latency"].get(capacity_suffix(r), {}) for r in residencies)

    for stage, has, keys in (("divergence", has_quality, QUALITY_KEYS), ("latency", has_latency, LATENCY_KEYS)):
        if has(mine) and has(theirs):
            raise ValueError(f"both {path} and {other} hold the {stage} stage; join a record of each stage")
        if not has(mine) and not has(theirs):
            raise ValueError(f"neither {path} nor {other} holds the whole {stage} stage; finish it first (the same "
                             f"command with --stage {'quality' if stage == 'divergence' else 'latency'})")
        if has(theirs):
            for key in keys:
                if key in theirs:
                    mine[key] = theirs[key]
    save_record(mine, path)
