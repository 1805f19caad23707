"""``psr-hf sweep``: the latency-divergence frontier (the paper's Figure 1, Table 2 and the ablations of its
Section 6.6) in one resumable run; docs/frontier.md.

For every residency and every entry of :func:`sweep_grid` (exact routing with LRU and with the A priority and
prefetch, Cache-Prior with LRU and with the A priority, PSR with budgets n in {1, 2, 8} and both evictions,
speculative execution, Cache-Prior as published, each at every lam) it measures the **divergence** on the quality
model (excess NLL over exact routing on selfgen and held-out text, :mod:`psr_hf.eval.divergence`; for a grown model
the small trained model it was grown from, in float32: the same function and routing without bf16 rounding) and
the **latency** on the latency model (:func:`~psr_hf.bench.timing.bench_latency`: the engine rows on a GPU, the
transformers offload path on the CPU, interleaved with the resident reference rows). The record (``--json``) is
written after every measured unit; the same command with the same record continues where it stopped. The outputs
come from :mod:`psr_hf.bench.frontier`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._progress import tqdm

from ..eval.grid import cache_prior, entry_name, exact_a_pf, exact_lru, psr, routing_grid, spec
from ..policy.policies import POLICY_TABLE
from .common import CALIBRATION_TOKENS, describe_model
from .decode import WindowRun
from .rows import ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, Row, capacity_suffix, routed
from .timing import MIN_ROUNDS, bench_latency

logger = logging.getLogger(__name__)

SWEEP_LAMS = (0.1, 0.15, 0.2, 0.25, 0.3)
SWEEP_BUDGETS = (1, 2, 8)
SWEEP_RESIDENCIES = (0.5, 0.25)
EVICTIONS = ("score", "lru")
RECORD_VERSION = 1
QUALITY_CHUNK = 8  # configurations per divergence call (one exact pass over the windows per call)
RECORD_DIGITS = 6  # significant digits of the floats a record keeps


class SweepStopped(Exception):
    """The sweep stopped before the end (``--max-minutes``); its record holds everything measured so far."""


def sweep_grid(*, lams: Sequence[float] = SWEEP_LAMS, budgets: Sequence[int] = SWEEP_BUDGETS,
               evictions: Sequence[str] = EVICTIONS, published: bool = True,
               psr_windows: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """name -> :class:`RoutingConfig` fields (no residency): ``exact_lru``, ``exact_a_pf`` (A priority, prefetch
    budget 1), ``spec``, and per lam ``cp_lam{lam}`` (Cache-Prior, LRU) and ``cp_lam{lam}_a`` (A priority),
    ``psr_lam{lam}_n{n}`` (A priority) and ``psr_lam{lam}_n{n}_lru`` per budget ``n``, and with ``published``
    Cache-Prior as published: ``cp_lam{lam}_j1``, ``cp_lam{lam}_j2`` (top-J protected, LRU) and
    ``cp_lam{lam}_j2_run`` (J = 2 with the running bonus scale). ``evictions`` ("score", "lru") limits the
    Cache-Prior and PSR rows to those evictions. ``psr_windows`` adds PSR (A priority) with each of these pre-gate
    windows, ``psr_lam{lam}_n{n}_w{window}`` (the paper times 2 beside Qwen3.6's default of 4)."""
    unknown = sorted(set(evictions) - set(EVICTIONS))
    if unknown or not evictions:
        raise ValueError(f"evictions {list(evictions)}: give a non-empty subset of {', '.join(EVICTIONS)}")
    if not lams or any(not 0.0 < float(lam) for lam in lams):
        raise ValueError(f"lams {list(lams)}: give one or more bonus scales > 0 (the paper sweeps 0.1 .. 0.3)")
    if not budgets or any(not isinstance(n, int) or n < 1 for n in budgets):
        raise ValueError(f"budgets {list(budgets)}: give prefetch budgets n as ints >= 1 (the paper: 1, 2, 8)")
    if any(not isinstance(w, int) or w < 1 for w in psr_windows):
        raise ValueError(f"psr_windows {list(psr_windows)}: give pre-gate windows as ints >= 1 (the paper: 4 and 2 "
                         "on Qwen3.6)")
    entries = [exact_lru(), exact_a_pf()]
    for lam in lams:
        lam = float(lam)
        if "lru" in evictions:
            entries.append(cache_prior(lam))
        if "score" in evictions:
            entries.append(cache_prior(lam, eviction="score"))
        for n in budgets:
            if "score" in evictions:
                entries.append(psr(lam, n))
                entries += [psr(lam, n, window=w) for w in psr_windows]
            if "lru" in evictions:
                entries.append(psr(lam, n, eviction="lru"))
        if published:
            entries += [cache_prior(lam, top_j=1), cache_prior(lam, top_j=2), cache_prior(lam, top_j=2, running=True)]
    entries.append(spec())
    return routing_grid(entries)  # every entry valid before anything runs


def select(grid: Mapping[str, dict[str, Any]], only: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """The entries of ``grid`` named in ``only`` (all when None); an unknown name raises ``ValueError``."""
    if only is None:
        return dict(grid)
    wanted = [name.strip() for name in only if name.strip()]
    unknown = [name for name in wanted if name not in grid]
    if unknown or not wanted:
        raise ValueError(f"--configs: unknown {', '.join(unknown) or '(none given)'}; allowed: {', '.join(grid)}")
    return {name: grid[name] for name in grid if name in wanted}


def quality_model_name(model: str) -> str:
    """The model whose function the divergence is measured on: the small trained model of a grown one."""
    from .workloads import GROWN

    return GROWN[model][0] if model in GROWN else model


# ---------------------------------------------------------------------------------------------------- record
def _window_runs(data: Mapping[str, Any]) -> dict[str, list[list[WindowRun]]]:
    return {name: [[WindowRun(**w) for w in run] for run in runs] for name, runs in data.items()}


def _runs_data(results: Mapping[str, list[list[WindowRun]]]) -> dict[str, Any]:
    return {name: [[dataclasses.asdict(dataclasses.replace(w, logits=None)) for w in run] for run in runs]
            for name, runs in results.items()}


def _rounded(value: Any) -> Any:
    """``value`` with every float rounded to :data:`RECORD_DIGITS` significant digits (far below any measured
    interval; keeps a sweep record small enough to travel to a lent GPU with the tree)."""
    if isinstance(value, float):
        return float(f"{value:.{RECORD_DIGITS}g}") if math.isfinite(value) else value
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _save(record: Mapping[str, Any], path: Path | None) -> None:
    """Writes the record (floats to :data:`RECORD_DIGITS` significant digits, compact JSON)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_rounded(record), separators=(",", ":")))
    tmp.replace(path)  # a kill while writing leaves the previous record whole


def _load_record(path: Path | None, settings: Mapping[str, Any], option: str = "--json") -> dict[str, Any] | None:
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


_QUALITY_KEYS = ("quality", "heldout", "selfgen", "quality_model", "quality_machine")
_LATENCY_KEYS = ("latency", "latency_windows", "model", "machine", "versions")


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
    mine = _load_record(path, {})  # the format checked; the settings are compared below
    theirs = _load_record(other, {}, "--join")
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

    for stage, has, keys in (("divergence", has_quality, _QUALITY_KEYS), ("latency", has_latency, _LATENCY_KEYS)):
        if has(mine) and has(theirs):
            raise ValueError(f"both {path} and {other} hold the {stage} stage; join a record of each stage")
        if not has(mine) and not has(theirs):
            raise ValueError(f"neither {path} nor {other} holds the whole {stage} stage; finish it first (the same "
                             f"command with --stage {'quality' if stage == 'divergence' else 'latency'})")
        if has(theirs):
            for key in keys:
                if key in theirs:
                    mine[key] = theirs[key]
    _save(mine, path)


# ---------------------------------------------------------------------------------------------------- points
def _interval_pct(ci: Sequence[float]) -> list[float]:
    from ..eval.divergence import excess_ppl_percent

    return [excess_ppl_percent(float(v)) for v in ci]


def point_name(fields: Mapping[str, Any], residency: float) -> str:
    """The name of a grid entry's point at ``residency`` (its transformers row's: ``psr_lam0.3_n1_res50``), the key
    of its divergence in the record."""
    return routed(OFFLOAD, dict(fields), residency).name


def make_points(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One point per configuration and residency with both measurements (the schema of
    :mod:`psr_hf.bench.frontier`): routing fields, latency (mean ms/token with its interval, p99, per-round
    means, copies and demand copies per token) and divergence (sg% and the selfgen excess NLL with intervals and
    per-window values; the held-out excess NLL)."""
    from ..eval.divergence import excess_ppl_percent

    points = []
    timed_kind = ENGINE if record["settings"]["engine"] else OFFLOAD
    for residency in record["settings"]["residencies"]:
        latency = record.get("latency", {}).get(capacity_suffix(residency), {})
        rows = {row["configuration"]: row for row in latency.get("rows", [])}
        for fields in record["grid"].values():
            name = point_name(fields, residency)
            row = rows.get(routed(timed_kind, fields, residency).name)
            quality = record.get("quality", {}).get(name)
            if row is None or quality is None:
                continue
            routing, selfgen, held = row["routing"], quality["selfgen"], quality.get("heldout")
            copies = row["copies"]
            points.append({
                "name": name, "policy": routing["policy"],
                "lam": routing["lam"] if "lam" in POLICY_TABLE[routing["policy"]].options else None,
                "budget": 0 if routing["budget"] is None else int(routing["budget"]),  # None: spec's K
                "eviction": routing["eviction"], "top_j": int(routing["top_j"]), "delta_mode": routing["delta_mode"],
                "window": routing.get("window"),
                "residency": float(residency), "capacity": row["capacity"],
                "ms": row["ms_per_token"]["mean"], "ms_ci95": row["ms_per_token"]["ci95"], "p99_ms": row["p99_ms"],
                "round_ms": [r["ms_per_token"] for r in row["rounds"]],
                "copies_per_token": copies.get("copies_per_token"), "demand_per_token": copies.get("demand_per_token"),
                "prefetch_late_per_token": copies.get("prefetch_late_per_token"),
                "prefetch_in_time_per_token": copies.get("prefetch_in_time_per_token"),
                "prefetch_unused_per_token": copies.get("prefetch_unused_per_token"),
                "sg_pct": excess_ppl_percent(selfgen["excess_nll"]), "sg_pct_ci95": _interval_pct(selfgen["excess_nll_ci95"]),
                "selfgen_excess_nll": selfgen["excess_nll"], "selfgen_window_excess": selfgen["window_excess"],
                "heldout_excess_nll": None if held is None else held["excess_nll"],
                "heldout_excess_nll_ci95": None if held is None else held["excess_nll_ci95"],
            })
    return points


# ---------------------------------------------------------------------------------------------------- running
def run_sweep(*, model: str, device: str = "cuda:0", residencies: Sequence[float] = SWEEP_RESIDENCIES,
              grid: Mapping[str, dict[str, Any]] | None = None, rounds: int = MIN_ROUNDS, windows: int = 2,
              tokens: int = 64, selfgen_windows: int = 8, selfgen_tokens: int = 256, heldout_windows: int = 8,
              heldout_tokens: int = 256, seed: int = 0, engine: bool | None = None, calibration: str | None = None,
              calibration_tokens: int = CALIBRATION_TOKENS, json_path: str | Path | None = None,
              max_minutes: float | None = None, quality_device: str | None = None, stage: str = "all",
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (or continue, from the record at ``json_path``) the sweep; returns the record, with ``points``,
    ``frontier`` and ``orderings`` once every unit is measured (as the record file holds it: floats to
    :data:`RECORD_DIGITS` significant digits). Raises :class:`SweepStopped` (after saving) when
    ``max_minutes`` ran out first: the same call continues it.

    ``quality_device`` (default ``device``) runs the divergence stage elsewhere, e.g. on the CPU for a grown
    model's small float32 twin while the GPU is busy or lent for minutes only; ``stage="quality"`` stops after that
    stage and ``stage="latency"`` runs only the timing (each raising :class:`SweepStopped` while the other stage
    is missing); ``stage="all"`` with the same record completes whichever is missing. A grown model's divergence
    belongs to the exact small model it was grown from: time and score the same model files."""
    import torch

    from ..eval.divergence import divergence
    from ..eval.selfgen import describe, sample_windows, start_tokens
    from .common import machine, quiet_uncalibrated, versions
    from .workloads import WINDOW_MODULES, default_texts, load_model, model_calibration, module_sources, text_windows

    if stage not in ("quality", "latency", "all"):
        raise ValueError(f"stage={stage!r}: use 'quality' (divergence only), 'latency' (timing only) or 'all'")
    quality_device = str(quality_device or device)
    started = time.monotonic()
    deadline = None if max_minutes is None else started + 60.0 * float(max_minutes)
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: at least {MIN_ROUNDS} (latency intervals are over rounds)")
    for name, value in (("windows", windows), ("tokens", tokens), ("selfgen_windows", selfgen_windows),
                        ("selfgen_tokens", selfgen_tokens), ("heldout_windows", heldout_windows),
                        ("heldout_tokens", heldout_tokens)):
        if not isinstance(value, int) or value < (2 if name.endswith("windows") and name != "windows" else 1):
            raise ValueError(f"{name}={value!r} is too small (windows: intervals over windows need at least 2)")
    residencies = [float(r) for r in residencies]
    if not residencies or any(not 0.0 < r < 1.0 for r in residencies):
        raise ValueError(f"residencies {residencies}: give one or more in (0, 1) (0.5 = half of each layer's experts)")
    grid = dict(sweep_grid() if grid is None else grid)
    misnamed = {name: entry_name(fields) for name, fields in grid.items() if entry_name(fields) != name}
    if misnamed:
        raise ValueError("grid names must be the names of their entries (psr_hf.eval.grid.routing_grid): "
                         + ", ".join(f"{name!r} is {right!r}" for name, right in misnamed.items()))
    path = None if json_path is None else Path(json_path)
    settings = {"model": model, "device": str(device), "residencies": residencies, "rounds": rounds,
                "windows": windows, "tokens": tokens, "selfgen_windows": selfgen_windows,
                "selfgen_tokens": selfgen_tokens, "heldout_windows": heldout_windows,
                "heldout_tokens": heldout_tokens, "seed": seed, "calibration": calibration,
                "calibration_tokens": calibration_tokens, "configs": list(grid),
                "engine": bool(torch.device(device).type == "cuda") if engine is None else bool(engine),
                "quality_device": quality_device, "max_minutes": max_minutes}
    record = _load_record(path, settings)
    if record is None:
        record = {"benchmark": "sweep", "version": RECORD_VERSION, "settings": settings,
                  "grid": {name: dict(fields) for name, fields in grid.items()},
                  "quality": {}, "latency": {}}
    else:
        record["settings"]["max_minutes"] = max_minutes
        if "points" in record:  # finished: nothing left to measure; the points, front and verdicts are derived
            return _completed(record, path)  # again, so that this version of psr_hf judges the measurements
    say = progress or (lambda text: None)

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() > deadline

    def stop_here() -> None:
        _save(record, path)
        raise SweepStopped(f"stopped after {(time.monotonic() - started) / 60:.1f} minutes (--max-minutes "
                           f"{max_minutes}); the record holds what was measured: run the same command to continue")

    held_texts = default_texts(model) or module_sources(WINDOW_MODULES)
    calib = None
    pending = [(row.name, row.routing) for r in residencies for row in (routed(OFFLOAD, f, r) for f in grid.values())
               if row.name not in record["quality"]]
    if stage != "latency" and (pending or "selfgen" not in record):
        # ---- divergence, on the quality model
        quality_name = quality_model_name(model)
        say(f"loading {quality_name} on {quality_device} (divergence)")
        qmodel, qtokenizer, qinfo = load_model(quality_name, quality_device, seed=seed)
        calib, _ = model_calibration(qmodel, qtokenizer, tokens=calibration_tokens, calibration=calibration,
                                     beside=qinfo.get("calibration_file"), progress=say)
        if "heldout" not in record:
            held = text_windows([t for _, t in held_texts], qtokenizer, windows=heldout_windows,
                                tokens=heldout_tokens)
            record["heldout"] = {"sources": [n for n, _ in held_texts], "ids": [w[0].tolist() for w in held]}
        held = [torch.tensor([ids]) for ids in record["heldout"]["ids"]]
        if "selfgen" not in record:
            say(f"sampling {selfgen_windows} selfgen windows of {selfgen_tokens} tokens from the exact model")
            prompts = start_tokens(qmodel, held[:selfgen_windows] + held[:1] * max(0, selfgen_windows - len(held)))
            sampled = sample_windows(qmodel, prompts, tokens=selfgen_tokens, seed=seed, progress=progress is not None)
            record["selfgen"] = describe(sampled, prompts=prompts, seed=seed, temperature=1.0, tokens=selfgen_tokens)
            record["quality_model"] = {**{k: v for k, v in qinfo.items() if k != "calibration_file"},
                                       **describe_model(qmodel)}
            record["quality_machine"] = machine(torch.device(quality_device))
            _save(record, path)
        selfgen = [torch.tensor([ids]) for ids in record["selfgen"]["ids"]]
        bar = tqdm(total=len(pending), unit="config", desc="divergence", disable=progress is None)
        with quiet_uncalibrated(), bar:
            for begin in range(0, len(pending), QUALITY_CHUNK):  # the exact NLLs once per chunk, saved per chunk
                if out_of_time():
                    stop_here()
                chunk = dict(pending[begin:begin + QUALITY_CHUNK])
                sg_rows = divergence(qmodel, selfgen, chunk, calibration=calib)
                ho_rows = divergence(qmodel, held, chunk, calibration=calib)
                for key, sg, ho in zip(chunk, sg_rows, ho_rows):
                    record["quality"][key] = {"selfgen": sg.to_dict(), "heldout": ho.to_dict()}
                    logger.info("divergence %s: sg %.2f%%, held-out excess %.4f nats/token, %.1f copies/token", key,
                                sg.excess_ppl_pct, ho.excess_nll, sg.copies_per_token)
                bar.update(len(chunk))
                _save(record, path)
        del qmodel
    if stage == "quality":
        _save(record, path)
        raise SweepStopped("the divergence stage is done (stage 'quality'); time the rows with the same command "
                           "and --stage all (or latency), on the latency device")
    # ---- latency, on the latency model (a grown model routes with the small model's calibration: same routing)
    untimed = [r for r in residencies if "rows" not in record["latency"].get(capacity_suffix(r), {})]
    if untimed:
        say(f"loading {model} on {device} (latency)")
        lmodel, ltokenizer, linfo = load_model(model, device, seed=seed)
        if calib is None:  # the latency stage alone: the same calibration the divergence stage uses
            calib, _ = model_calibration(lmodel, ltokenizer, tokens=calibration_tokens, calibration=calibration,
                                         beside=linfo.get("calibration_file"), progress=say)
        lat_ids = text_windows([t for _, t in held_texts], ltokenizer, windows=windows, tokens=tokens)
        record["model"] = {**{k: v for k, v in linfo.items() if k != "calibration_file"}, **describe_model(lmodel)}
        record["latency_windows"] = {"sources": [n for n, _ in held_texts],
                                     "ids": [w[0].tolist() for w in lat_ids]}
        engine_rows = record["settings"]["engine"]
        for residency in residencies:
            suffix = capacity_suffix(residency)
            entry = record["latency"].setdefault(suffix, {"runs": {}})
            if "rows" in entry:
                continue
            configs = [Row(RESIDENT), Row(ENGINE_RESIDENT)] if engine_rows else [Row(RESIDENT)]
            configs += [routed(ENGINE if engine_rows else OFFLOAD, fields, residency) for fields in grid.values()]

            def saved(r: int, results: Mapping[str, list[list[WindowRun]]], entry: dict = entry) -> None:
                entry["runs"] = _runs_data(results)
                _save(record, path)

            say(f"timing {len(configs)} rows at {100 * residency:g}% residency, {rounds} rounds "
                f"(done: {len(next(iter(entry['runs'].values()), []))})")
            with quiet_uncalibrated():
                rows = bench_latency(lmodel, lat_ids, configs=configs, calibration=calib, rounds=rounds,
                                     resume=_window_runs(entry["runs"]) or None, on_round=saved, stop=out_of_time,
                                     progress=progress)
            if not rows or len(rows[0]["rounds"]) < rounds:
                stop_here()
            entry.pop("runs", None)
            entry["rows"] = rows
            _save(record, path)
        del lmodel
        record["machine"], record["versions"] = machine(torch.device(device)), versions()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if stage == "latency" and any(point_name(fields, r) not in record["quality"] for r in residencies
                                  for fields in grid.values()):
        _save(record, path)
        raise SweepStopped("the rows are timed (stage 'latency'); the divergence stage is still to run: the same "
                           "command with --stage quality (on the CPU: --quality-device cpu), then --stage all")
    return _completed(record, path)


def _completed(record: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """:func:`finish` a complete record, save it, and return what the record file holds (rounded)."""
    finish(record)
    _save(record, path)
    return json.loads(json.dumps(_rounded(record)))


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """Adds ``points``, ``frontier`` (names per residency) and ``orderings`` (the paper's claims, verdicts with
    intervals) to a complete record (:mod:`psr_hf.bench.frontier`)."""
    from .frontier import orderings, pareto_front

    points = make_points(record)
    record["points"] = points
    record["frontier"] = {capacity_suffix(r): pareto_front([p for p in points if p["residency"] == r])
                          for r in record["settings"]["residencies"]}
    record["orderings"] = orderings(points)
    return record
