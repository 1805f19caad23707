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

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .._progress import tqdm
from ..eval.grid import cache_prior, entry_name, exact_a_pf, exact_lru, psr, routing_grid, spec
from ..policy.config import RoutingConfig
from ..policy.policies import POLICY_TABLE
from .common import CALIBRATION_TOKENS, describe_model
from .decode import WindowRun
from .rows import ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, Row, capacity_suffix, routed
from .settings import frozen, settings_of
from .sweep_record import (RECORD_DIGITS, RECORD_VERSION, join_stages, load_record, point_name, rounded, runs_data,
                           save_record, window_runs)
from .timing import MIN_ROUNDS, bench_latency

if TYPE_CHECKING:
    import torch

    from ..policy.calibration import Calibration

__all__ = ["RECORD_DIGITS", "SweepSettings", "SweepStopped", "finish", "join_stages", "make_points", "point_name",
           "quality_model_name", "run_sweep", "select", "sweep_grid"]

logger = logging.getLogger(__name__)

SWEEP_LAMS = (0.1, 0.15, 0.2, 0.25, 0.3)
SWEEP_BUDGETS = (1, 2, 8)
SWEEP_RESIDENCIES = (0.5, 0.25)
EVICTIONS = ("score", "lru")
QUALITY_CHUNK = 8  # configurations per divergence call (one exact pass over the windows per call)
STAGES = ("quality", "latency", "all")


class SweepStopped(Exception):
    """The sweep stopped before the end (``--max-minutes``); its record holds everything measured so far."""


def sweep_grid(*, lams: Sequence[float] = SWEEP_LAMS, budgets: Sequence[int] = SWEEP_BUDGETS,
               evictions: Sequence[str] = EVICTIONS, published: bool = True,
               psr_windows: Sequence[int] = (), psr_distances: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """name -> :class:`RoutingConfig` fields (no residency): ``exact_lru``, ``exact_a_pf`` (A priority, prefetch
    budget 1), ``spec``, and per lam ``cp_lam{lam}`` (Cache-Prior, LRU) and ``cp_lam{lam}_a`` (A priority),
    ``psr_lam{lam}_n{n}`` (A priority) and ``psr_lam{lam}_n{n}_lru`` per budget ``n``, and with ``published``
    Cache-Prior as published: ``cp_lam{lam}_j1``, ``cp_lam{lam}_j2`` (top-J protected, LRU) and
    ``cp_lam{lam}_j2_run`` (J = 2 with the running bonus scale). ``evictions`` ("score", "lru") limits the
    Cache-Prior and PSR rows to those evictions. ``psr_windows`` adds PSR (A priority) with each of these pre-gate
    windows, ``psr_lam{lam}_n{n}_w{window}`` (the paper times 2 beside Qwen3.6's default of 4); ``psr_distances``
    PSR (A priority) with each of these prefetch distances, ``psr_lam{lam}_n{n}_d{distance}`` (each layer's
    prefetches ranked that many MoE layers ahead; 1 is the plain row)."""
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
    if any(not isinstance(d, int) or d < 2 for d in psr_distances):
        raise ValueError(f"psr_distances {list(psr_distances)}: give prefetch distances as ints >= 2 (1 is the plain "
                         "PSR row, always in the grid)")
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
                entries += [psr(lam, n, distance=d) for d in psr_distances]
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


# ---------------------------------------------------------------------------------------------------- points
def _interval_pct(ci: Sequence[float]) -> list[float]:
    from ..eval.divergence import excess_ppl_percent

    return [excess_ppl_percent(float(v)) for v in ci]


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
@dataclass(frozen=True)
class SweepSettings:
    """What :func:`run_sweep` measures; validated here, once, before anything loads. The record's ``settings``
    repeat them (:meth:`record_settings`), and a record continues only under the same settings.

    Attributes:
        model, device, seed: the model name (a grown model's divergence is its small model's), where the latency is
            timed, the seed of random weights and of the selfgen sampling.
        residencies: the residencies, each in (0, 1).
        grid: name -> routing fields (:func:`sweep_grid` by default; names as :func:`~psr_hf.eval.grid.entry_name`
            gives them).
        rounds, windows, tokens: the latency's interleaved rounds (>= 3) over ``windows`` windows of ``tokens``.
        selfgen_windows, selfgen_tokens, heldout_windows, heldout_tokens: the divergence's text windows (>= 2 each).
        engine: time the engine rows (default: on a GPU) rather than the transformers offload path.
        calibration, calibration_tokens: a saved calibration, else one computed on ``calibration_tokens`` tokens.
        json_path: the record, written after every measured unit and continued from.
        max_minutes: stop (:class:`SweepStopped`, after saving) when this much time has passed.
        quality_device: where the divergence stage runs (default ``device``).
        stage: ``quality`` (divergence only), ``latency`` (timing only) or ``all``.
    """

    model: str
    device: str = "cuda:0"
    residencies: Sequence[float] = SWEEP_RESIDENCIES
    grid: Mapping[str, dict[str, Any]] | None = None
    rounds: int = MIN_ROUNDS
    windows: int = 2
    tokens: int = 64
    selfgen_windows: int = 8
    selfgen_tokens: int = 256
    heldout_windows: int = 8
    heldout_tokens: int = 256
    seed: int = 0
    engine: bool | None = None
    calibration: str | None = None
    calibration_tokens: int = CALIBRATION_TOKENS
    json_path: str | Path | None = None
    max_minutes: float | None = None
    quality_device: str | None = None
    stage: str = "all"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r}: use 'quality' (divergence only), 'latency' (timing only) or "
                             f"'all'")
        if self.rounds < MIN_ROUNDS:
            raise ValueError(f"rounds={self.rounds}: at least {MIN_ROUNDS} (latency intervals are over rounds)")
        for name in ("windows", "tokens", "selfgen_windows", "selfgen_tokens", "heldout_windows", "heldout_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (2 if name.endswith("windows") and name != "windows" else 1):
                raise ValueError(f"{name}={value!r} is too small (windows: intervals over windows need at least 2)")
        residencies = tuple(float(r) for r in self.residencies)
        if not residencies or any(not 0.0 < r < 1.0 for r in residencies):
            raise ValueError(f"residencies {list(residencies)}: give one or more in (0, 1) (0.5 = half of each "
                             f"layer's experts)")
        grid = dict(sweep_grid() if self.grid is None else self.grid)
        misnamed = {name: entry_name(fields) for name, fields in grid.items() if entry_name(fields) != name}
        if misnamed:
            raise ValueError("grid names must be the names of their entries (psr_hf.eval.grid.routing_grid): "
                             + ", ".join(f"{name!r} is {right!r}" for name, right in misnamed.items()))
        frozen(self, "residencies", residencies)
        frozen(self, "grid", grid)

    @property
    def path(self) -> Path | None:
        return None if self.json_path is None else Path(self.json_path)

    @property
    def routings(self) -> Mapping[str, dict[str, Any]]:
        """The grid (name -> routing fields), :func:`sweep_grid` where none was given."""
        return self.grid or {}

    def record_settings(self) -> dict[str, Any]:
        """The settings as the record keeps them (a record continues only under equal ones, ``max_minutes`` aside)."""
        import torch

        return {"model": self.model, "device": str(self.device), "residencies": list(self.residencies),
                "rounds": self.rounds, "windows": self.windows, "tokens": self.tokens,
                "selfgen_windows": self.selfgen_windows, "selfgen_tokens": self.selfgen_tokens,
                "heldout_windows": self.heldout_windows, "heldout_tokens": self.heldout_tokens, "seed": self.seed,
                "calibration": self.calibration, "calibration_tokens": self.calibration_tokens,
                "configs": list(self.routings),
                "engine": torch.device(self.device).type == "cuda" if self.engine is None else bool(self.engine),
                "quality_device": str(self.quality_device or self.device), "max_minutes": self.max_minutes}


def run_sweep(settings: SweepSettings | None = None, /, *, progress: Callable[[str], None] | None = None,
              **fields: Any) -> dict[str, Any]:
    """Run (or continue, from the record at ``json_path``) the sweep; returns the record, with ``points``,
    ``frontier`` and ``orderings`` once every unit is measured (as the record file holds it: floats to
    :data:`RECORD_DIGITS` significant digits). Raises :class:`SweepStopped` (after saving) when
    ``max_minutes`` ran out first: the same call continues it.

    ``settings``: a :class:`SweepSettings`, or its fields as keywords (``run_sweep(model="tiny", rounds=3)``).
    ``quality_device`` (default ``device``) runs the divergence stage elsewhere, e.g. on the CPU for a grown
    model's small float32 twin while the GPU is busy or lent for minutes only; ``stage="quality"`` stops after that
    stage and ``stage="latency"`` runs only the timing (each raising :class:`SweepStopped` while the other stage
    is missing); ``stage="all"`` with the same record completes whichever is missing. A grown model's divergence
    belongs to the exact small model it was grown from: time and score the same model files."""
    s = settings_of(SweepSettings, settings, fields, "run_sweep")
    started = time.monotonic()
    record = load_record(s.path, s.record_settings())
    if record is None:
        record = {"benchmark": "sweep", "version": RECORD_VERSION, "settings": s.record_settings(),
                  "grid": {name: dict(fields) for name, fields in s.routings.items()}, "quality": {}, "latency": {}}
    else:
        record["settings"]["max_minutes"] = s.max_minutes
        if "points" in record:  # finished: nothing left to measure; the points, front and verdicts are derived
            return _completed(record, s.path)  # again, so that this version of psr_hf judges the measurements
    sweep = _Sweep(s, record, started, progress)
    calibration = sweep.measure_divergence() if s.stage != "latency" else None
    if s.stage == "quality":
        sweep.save()
        raise SweepStopped("the divergence stage is done (stage 'quality'); time the rows with the same command "
                           "and --stage all (or latency), on the latency device")
    sweep.measure_latency(calibration)
    if s.stage == "latency" and any(point_name(fields, r) not in record["quality"] for r in s.residencies
                                    for fields in s.routings.values()):
        sweep.save()
        raise SweepStopped("the rows are timed (stage 'latency'); the divergence stage is still to run: the same "
                           "command with --stage quality (on the CPU: --quality-device cpu), then --stage all")
    return _completed(record, s.path)


class _Sweep:
    """The measuring of one :func:`run_sweep` call: its settings, the record it fills (saved after every measured
    unit) and the deadline of ``max_minutes``."""

    def __init__(self, s: SweepSettings, record: dict[str, Any], started: float,
                 progress: Callable[[str], None] | None):
        from .workloads import WINDOW_MODULES, default_texts, module_sources

        self.s, self.record, self.started, self.progress = s, record, started, progress
        self.deadline = None if s.max_minutes is None else started + 60.0 * float(s.max_minutes)
        self.held_texts = default_texts(s.model) or module_sources(WINDOW_MODULES)

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def save(self) -> None:
        save_record(self.record, self.s.path)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stop_here(self) -> NoReturn:
        self.save()
        raise SweepStopped(f"stopped after {(time.monotonic() - self.started) / 60:.1f} minutes (--max-minutes "
                           f"{self.s.max_minutes}); the record holds what was measured: run the same command to "
                           f"continue")

    # ---- divergence, on the quality model
    def measure_divergence(self) -> Calibration | None:
        """Score every configuration not yet in the record on the quality model (sampling the selfgen windows
        first where the record has none); returns the calibration it used, None where nothing was left."""
        from .workloads import load_model, model_calibration

        s, record = self.s, self.record
        pending = [(row.name, row.routing) for r in s.residencies
                   for row in (routed(OFFLOAD, f, r) for f in s.routings.values()) if row.name not in record["quality"]]
        if not pending and "selfgen" in record:
            return None
        quality_name = quality_model_name(s.model)
        quality_device = str(s.quality_device or s.device)
        self.say(f"loading {quality_name} on {quality_device} (divergence)")
        qmodel, qtokenizer, qinfo = load_model(quality_name, quality_device, seed=s.seed)
        calibration, _ = model_calibration(qmodel, qtokenizer, tokens=s.calibration_tokens, calibration=s.calibration,
                                           beside=qinfo.get("calibration_file"), progress=self.say)
        held, selfgen = self._divergence_windows(qmodel, qtokenizer, qinfo)
        self._score(qmodel, calibration, pending, selfgen, held)
        return calibration

    def _divergence_windows(self, qmodel: torch.nn.Module, qtokenizer: Any,
                            qinfo: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The held-out and selfgen windows of the divergence, cut and sampled once and kept in the record."""
        import torch

        from ..eval.selfgen import describe, sample_windows, start_tokens
        from .common import machine
        from .workloads import text_windows

        s, record = self.s, self.record
        if "heldout" not in record:
            held = text_windows([t for _, t in self.held_texts], qtokenizer, windows=s.heldout_windows,
                                tokens=s.heldout_tokens)
            record["heldout"] = {"sources": [n for n, _ in self.held_texts], "ids": [w[0].tolist() for w in held]}
        held = [torch.tensor([ids]) for ids in record["heldout"]["ids"]]
        if "selfgen" not in record:
            self.say(f"sampling {s.selfgen_windows} selfgen windows of {s.selfgen_tokens} tokens from the exact model")
            prompts = start_tokens(qmodel, held[:s.selfgen_windows] + held[:1] * max(0, s.selfgen_windows - len(held)))
            sampled = sample_windows(qmodel, prompts, tokens=s.selfgen_tokens, seed=s.seed,
                                     progress=self.progress is not None)
            record["selfgen"] = describe(sampled, prompts=prompts, seed=s.seed, temperature=1.0,
                                         tokens=s.selfgen_tokens)
            record["quality_model"] = {**{k: v for k, v in qinfo.items() if k != "calibration_file"},
                                       **describe_model(qmodel)}
            record["quality_machine"] = machine(torch.device(str(s.quality_device or s.device)))
            self.save()
        return held, [torch.tensor([ids]) for ids in record["selfgen"]["ids"]]

    def _score(self, qmodel: torch.nn.Module, calibration: Calibration | None,
               pending: Sequence[tuple[str, RoutingConfig]], selfgen: Sequence[torch.Tensor],
               held: Sequence[torch.Tensor]) -> None:
        """The excess NLL of the ``pending`` configurations on both texts, in chunks (the exact NLLs once per
        chunk), saved per chunk."""
        from ..eval.divergence import divergence
        from .common import quiet_uncalibrated

        bar = tqdm(total=len(pending), unit="config", desc="divergence", disable=self.progress is None)
        with quiet_uncalibrated(), bar:
            for begin in range(0, len(pending), QUALITY_CHUNK):
                if self.out_of_time():
                    self.stop_here()
                chunk = dict(pending[begin:begin + QUALITY_CHUNK])
                sg_rows = divergence(qmodel, selfgen, chunk, calibration=calibration)
                ho_rows = divergence(qmodel, held, chunk, calibration=calibration)
                for key, sg, ho in zip(chunk, sg_rows, ho_rows):
                    self.record["quality"][key] = {"selfgen": sg.to_dict(), "heldout": ho.to_dict()}
                    logger.info("divergence %s: sg %.2f%%, held-out excess %.4f nats/token, %.1f copies/token", key,
                                sg.excess_ppl_pct, ho.excess_nll, sg.copies_per_token)
                bar.update(len(chunk))
                self.save()

    # ---- latency, on the latency model (a grown model routes with the small model's calibration: same routing)
    def measure_latency(self, calibration: Calibration | None) -> None:
        """Time every residency not yet in the record on the latency model; ``calibration``: the divergence
        stage's (None: the same one computed here)."""
        import torch

        from .common import machine, versions
        from .workloads import load_model, model_calibration, text_windows

        s, record = self.s, self.record
        if all("rows" in record["latency"].get(capacity_suffix(r), {}) for r in s.residencies):
            return
        self.say(f"loading {s.model} on {s.device} (latency)")
        lmodel, ltokenizer, linfo = load_model(s.model, s.device, seed=s.seed)
        if calibration is None:  # the latency stage alone: the same calibration the divergence stage uses
            calibration, _ = model_calibration(lmodel, ltokenizer, tokens=s.calibration_tokens,
                                               calibration=s.calibration, beside=linfo.get("calibration_file"),
                                               progress=self.say)
        windows = text_windows([t for _, t in self.held_texts], ltokenizer, windows=s.windows, tokens=s.tokens)
        record["model"] = {**{k: v for k, v in linfo.items() if k != "calibration_file"}, **describe_model(lmodel)}
        record["latency_windows"] = {"sources": [n for n, _ in self.held_texts],
                                     "ids": [w[0].tolist() for w in windows]}
        for residency in s.residencies:
            self._time_residency(lmodel, windows, calibration, residency)
        del lmodel
        record["machine"], record["versions"] = machine(torch.device(s.device)), versions()
        if s.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _time_residency(self, lmodel: torch.nn.Module, windows: Sequence[torch.Tensor],
                        calibration: Calibration | None, residency: float) -> None:
        """Time the rows of one residency (continuing its saved rounds), saving after every round."""
        from .common import quiet_uncalibrated

        entry = self.record["latency"].setdefault(capacity_suffix(residency), {"runs": {}})
        if "rows" in entry:
            return
        engine_rows = self.record["settings"]["engine"]
        configs = [Row(RESIDENT), Row(ENGINE_RESIDENT)] if engine_rows else [Row(RESIDENT)]
        kind = ENGINE if engine_rows else OFFLOAD
        configs += [routed(kind, fields, residency) for fields in self.s.routings.values()]

        def saved(r: int, results: Mapping[str, list[list[WindowRun]]]) -> None:
            entry["runs"] = runs_data(results)
            self.save()

        self.say(f"timing {len(configs)} rows at {100 * residency:g}% residency, {self.s.rounds} rounds "
                 f"(done: {len(next(iter(entry['runs'].values()), []))})")
        with quiet_uncalibrated():
            rows = bench_latency(lmodel, windows, configs=configs, calibration=calibration, rounds=self.s.rounds,
                                 resume=window_runs(entry["runs"]) or None, on_round=saved, stop=self.out_of_time,
                                 progress=self.progress)
        if not rows or len(rows[0]["rounds"]) < self.s.rounds:
            self.stop_here()
        entry.pop("runs", None)
        entry["rows"] = rows
        self.save()


def _completed(record: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """:func:`finish` a complete record, save it, and return what the record file holds (rounded)."""
    finish(record)
    save_record(record, path)
    return json.loads(json.dumps(rounded(record)))


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
