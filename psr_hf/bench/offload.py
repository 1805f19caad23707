"""``psr-hf bench``: the offload latency benchmark (the paper's Section 6.1, "Latency"; docs/results.md) as one
JSON-ready record.

:func:`run_bench` loads or builds the model, cuts the text windows, calibrates, times the rows of
:func:`~psr_hf.bench.rows.latency_rows` with :func:`~psr_hf.bench.timing.bench_latency` (teacher-forced batch-1
decoding, interleaved rounds) and adds the comparisons and goals of :mod:`psr_hf.bench.goals`;
:mod:`psr_hf.bench.report` writes its text (:func:`format_table`, :func:`report_lines`) and
:mod:`psr_hf.bench.plot` its figure. The library logs; ``psr-hf bench`` (:mod:`psr_hf.cli`) prints.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..eval.grid import prefetch_source_named
from .common import CALIBRATION_TOKENS, describe_model, experts_modules, machine, quiet_uncalibrated, versions
from .goals import comparisons, evaluate_goals
from .report import format_table, report_lines
from .rows import DEFAULT_CAPACITIES, ENGINE, ROUTED_KINDS, Row, latency_rows, prefetch_configs
from .settings import frozen, settings_of
from .timing import MIN_ROUNDS, WARMUP_TOKENS, bench_latency, check_rounds
from .workloads import (GROWN_OLMOE, WINDOW_MODULES, default_texts, load_model, model_calibration, module_sources,
                        text_windows)

if TYPE_CHECKING:
    from ..prefetch.predictor import Predictor

__all__ = ["BenchSettings", "format_table", "load_bench_predictor", "report_lines", "run_bench"]

logger = logging.getLogger(__name__)

# the record's description of the engine rows' decoding
ENGINE_DECODING = ("psr_hf.engine.graphs.GraphDecoder (CUDA graphs on CUDA, the same step eagerly elsewhere), a new "
                   "sequence per window, one step per position, the device synchronised after each; position 0 "
                   "starts the sequence and is not timed; an engine_*_nocopy row decodes the same routing on the "
                   "all-resident copy (nothing is copied)")


def _copy_calls(device: torch.device) -> str:
    """How the offload's copies, the engine's graph launches and its waits are issued on ``device``."""
    if device.type != "cuda":
        return "a copy thread (CPU)"
    from ..offload import cuda_runtime

    ok, why = cuda_runtime.available()
    return "raw CUDA runtime calls (cuda-python)" if ok else f"torch's calls ({why})"


def load_bench_predictor(predictor: Predictor | str | Path,
                         model: torch.nn.Module) -> tuple[Predictor, dict[str, Any]]:
    """The SpecPrefetch predictor of the bench (a Predictor or its file) for ``model``, on the model's device, and
    its description for the record. A predictor trained on a small shipped model serves that model grown by
    :func:`psr_hf.assets.grow.grow` (same layers and experts, a larger hidden size whose first dimensions are the
    small model's, the rest zero in every router input): its ``A`` gets zero columns."""
    from ..prefetch.predictor import Predictor

    source = str(predictor) if not isinstance(predictor, Predictor) else "given"
    p = Predictor.coerce(predictor)
    hidden = int(model.config.get_text_config().hidden_size)
    info: dict[str, Any] = {"source": source, "rank": p.rank, "parameters": p.num_parameters,
                            "hidden_size": p.hidden_size, "metadata": dict(p.metadata)}
    if p.hidden_size < hidden:
        A = [torch.cat((a, torch.zeros(a.shape[0], hidden - a.shape[1])), dim=1) for a in p.A]
        p = Predictor(A, p.B, p.metadata)
        info["padded_to"] = hidden
    return p.to(next(model.parameters()).device), info


def _window_texts(model: str, texts: Sequence[str], windows: int) -> list[tuple[str, str]]:
    """(name, text) of the texts the windows are cut from (window i: text i % n; fewer windows, fewer texts):
    the files ``texts``, else the held-out text of a trained model psr_hf ships, else standard-library sources."""
    if texts:
        sources = []
        for name in texts:
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"--text {name}: no such file")
            sources.append((str(path), path.read_text(encoding="utf-8", errors="replace")))
    else:
        sources = default_texts(model) or module_sources(WINDOW_MODULES)
    return sources[:windows]


def _window_budget(net: torch.nn.Module, ids: list[torch.Tensor],
                   progress: Callable[[str], None] | None) -> tuple[int, dict[str, Any]]:
    """The prefetch budget ``M_max`` that the overlap window allows on ``net`` (at least 1, at most a layer's
    experts: a CPU's window holds hundreds of small copies) and the profile's summary for the record."""
    from ..prefetch.window import profile_unpatched

    if progress is not None:
        progress("profiling the overlap window for the prefetch budget (psr-hf profile-window)")
    with quiet_uncalibrated():
        profile = profile_unpatched(net, ids[0][0].tolist())
    budget = min(max(1, profile.budget), int(describe_model(net)["num_experts"]))
    logger.info("prefetch budget from the overlap window: M_max %d (used: %d)", profile.budget, budget)
    return budget, {k: v for k, v in profile.to_dict().items() if k in (
        "copy_ms_median", "window_ms_median", "budget", "quantile", "budget_per_pair", "bytes_per_expert")}


def _without_prefetch_rows(names: Sequence[str] | None) -> list[str] | None:
    """``names`` less the prefetch rows (``specprefetch_*``, ``naive_*``) of any budget."""
    return None if names is None else [name for name in names if prefetch_source_named(name) is None]


@dataclass(frozen=True)
class BenchSettings:
    """What :func:`run_bench` measures; validated here, once, before anything loads. The record's ``settings``
    repeat them.

    Attributes:
        model, device, seed: the model name (:func:`~psr_hf.bench.workloads.load_model`), where it runs, the seed of
            random weights.
        rounds, warmup, accelerate_tokens, max_in_flight, copy_delay_ms, device_routing, count_late: as
            :class:`~psr_hf.bench.timing.LatencySettings`.
        windows, tokens, texts: ``windows`` windows of ``tokens`` decoded tokens, cut from the text files ``texts``
            (default: the model's held-out text, else :data:`WINDOW_MODULES`' sources).
        capacities: the residencies of the routed rows.
        configs, hf_configs: the row names ``only`` / ``hf_only`` of :func:`~psr_hf.bench.rows.latency_rows` keep.
        accelerate: whether the accelerate row runs.
        calibration, calibration_tokens: a saved :class:`psr_hf.Calibration`; otherwise :func:`psr_hf.calibrate` on
            ``calibration_tokens`` tokens of :data:`CALIBRATION_MODULES`' sources.
        offload: False runs the routed rows without offload (logical cache only).
        engine: adds the engine rows: psr_hf's batch-1 decoder, CUDA graphs on CUDA.
        prefetch_budgets: SpecPrefetch's budgets (ints >= 1), or ``"window"``: the one budget ``M_max`` (at least 1,
            at most a layer's experts) that :func:`psr_hf.prefetch.window.profile_unpatched` measures on the loaded
            model first (SpecPrefetch's window-aware budget; the profile goes into the record's settings).
        predictor: the SpecPrefetch predictor (a :class:`psr_hf.prefetch.Predictor` or its file).
        max_seconds: stop timing before a round that would end past this many seconds from the start (the last
            round's duration is the estimate): the record then holds the rounds timed (``rounds_timed``), at least
            one. None: all ``rounds``.
    """

    model: str = GROWN_OLMOE
    device: str = "cuda:0"
    rounds: int = MIN_ROUNDS
    windows: int = 2
    tokens: int = 128
    capacities: Sequence[float] = DEFAULT_CAPACITIES
    configs: Sequence[str] | None = None
    max_in_flight: int = 2
    copy_delay_ms: float = 0.0
    accelerate_tokens: int = 8
    accelerate: bool = True
    calibration: str | None = None
    texts: Sequence[str] = ()
    seed: int = 0
    warmup: int = 1
    calibration_tokens: int = CALIBRATION_TOKENS
    offload: bool = True
    engine: bool = False
    hf_configs: Sequence[str] | None = None
    prefetch_budgets: Sequence[int] | str = ()
    predictor: Predictor | str | Path | None = None
    device_routing: bool | None = None
    count_late: bool = False
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        check_rounds(self.rounds)
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds={self.max_seconds!r}: give a positive number of seconds, or None for "
                             "every round")
        if self.count_late and not self.engine:
            raise ValueError("count_late counts the late prefetches of the engine rows routed on the GPU; add the "
                             "engine rows (engine=True, --engine) or leave count_late off")
        if isinstance(self.prefetch_budgets, str) and self.prefetch_budgets != "window":
            raise ValueError(f"prefetch_budgets={self.prefetch_budgets!r}: give budgets (ints >= 1) or 'window'")
        for name in ("capacities", "configs", "hf_configs", "texts", "prefetch_budgets"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                frozen(self, name, tuple(value))

    @property
    def budget_from_window(self) -> bool:
        """Whether the prefetch budget is the one the overlap window allows (``prefetch_budgets="window"``)."""
        return isinstance(self.prefetch_budgets, str)

    def rows(self) -> list[Row]:
        """The rows to time; with the budget from the window (not measured yet), those without prefetch rows."""
        window = self.budget_from_window
        return latency_rows(
            self.capacities, accelerate=self.accelerate, engine=self.engine, predictor=self.predictor is not None,
            only=_without_prefetch_rows(self.configs) if window else self.configs,
            hf_only=_without_prefetch_rows(self.hf_configs) if window else self.hf_configs,
            prefetch_budgets=() if window else self.prefetch_budgets)

    def at_budget(self, budget: int) -> BenchSettings:
        """These settings with the prefetch budget ``budget`` the overlap window allows: the prefetch rows at that
        budget are always kept, names of other budgets are dropped."""
        wanted = list(prefetch_configs([budget], self.predictor is not None))
        configs, hf_configs = self.configs, self.hf_configs
        if configs is not None:
            configs = _without_prefetch_rows(configs) + wanted
        if hf_configs is not None:
            asked = any(prefetch_source_named(name) is not None for name in hf_configs)
            hf_configs = _without_prefetch_rows(hf_configs) + (wanted if asked else [])
        return dataclasses.replace(self, prefetch_budgets=(budget,), configs=configs, hf_configs=hf_configs)


def run_bench(settings: BenchSettings | None = None, /, *, progress: Callable[[str], None] | None = None,
              **fields: Any) -> dict[str, Any]:
    """Load or build the model, cut the windows, calibrate, run :func:`~psr_hf.bench.timing.bench_latency`; returns
    the JSON-ready record: settings (the arguments), model, windows, calibration, machine, versions, results (one
    dict per row), comparisons, goals.

    ``settings``: a :class:`BenchSettings`, or its fields as keywords (``run_bench(model="tiny", rounds=3)``).
    ``progress``: called with a line of text at each stage."""
    s = settings_of(BenchSettings, settings, fields, "run_bench")
    started = time.monotonic()
    rows = s.rows()  # names checked before loading anything (the prefetch rows of a profiled budget after it)
    sources = _window_texts(s.model, s.texts, s.windows)
    if progress is not None:
        progress(f"loading {s.model} on {s.device}")
    net, tokenizer, description = load_model(s.model, s.device, seed=s.seed)
    beside = description.pop("calibration_file", None)  # the record names it by description["calibration"]
    ids = text_windows([text for _, text in sources], tokenizer, windows=s.windows, tokens=s.tokens)
    window_profile = None
    if s.budget_from_window:
        budget, window_profile = _window_budget(net, ids, progress)
        s = s.at_budget(budget)
        rows = s.rows()
    vocab = int(net.config.get_text_config().vocab_size)
    if max(int(w.max()) for w in ids) >= vocab:
        raise ValueError(f"token ids exceed the model's vocabulary ({vocab}): is the tokenizer the model's?")
    calib, calibration_info = None, {"none": "no routed rows"}
    if any(row.kind in ROUTED_KINDS for row in rows):
        calib, calibration_info = model_calibration(net, tokenizer, tokens=s.calibration_tokens,
                                                    calibration=s.calibration, beside=beside,
                                                    beside_name=description.get("calibration"), progress=progress)
    device_used = next(net.parameters()).device
    loaded_predictor, predictor_info = None, None
    if s.predictor is not None:
        loaded_predictor, predictor_info = load_bench_predictor(s.predictor, net)
    copies = any(row.kind == ENGINE and not row.copies_skipped for row in rows)
    copy = _expert_copy(net, device_used) if copies else None
    results = bench_latency(
        net, ids, configs=rows, calibration=calib, rounds=s.rounds, warmup=s.warmup,
        accelerate_tokens=s.accelerate_tokens, offload=s.offload, max_in_flight=s.max_in_flight,
        copy_delay_ms=s.copy_delay_ms, progress=progress, predictor=loaded_predictor,
        device_routing=s.device_routing, count_late=s.count_late, **_deadline(s.max_seconds, started))
    timed = len(results[0]["rounds"]) if results else 0
    if timed < s.rounds:
        logger.warning("psr-hf bench: %d of %d rounds timed within max_seconds=%s", timed, s.rounds, s.max_seconds)
    return {
        "benchmark": "latency",
        "settings": {**_record_settings(s, device_used, predictor_info, window_profile), "expert_copy": copy,
                     "rounds_timed": timed},
        "model": {**description, **describe_model(net)},
        "windows": {"sources": [path for path, _ in sources], "ids": [w[0].tolist() for w in ids],
                    "rule": "window i: text i % n at token offset (i // n) * (tokens + 1), tokens + 1 ids"},
        "calibration": calibration_info,
        "machine": machine(device_used),
        "versions": versions(),
        "results": results,
        "comparisons": comparisons(results),
        "goals": evaluate_goals(results, cuda=device_used.type == "cuda", device=machine(device_used).get("device"),
                                expert_copy_ms=None if copy is None else copy["ms_median"]),
    }


def _deadline(max_seconds: float | None, started: float) -> dict[str, Any]:
    """``on_round`` and ``stop`` for :func:`~psr_hf.bench.timing.bench_latency` that end the timing before a round
    whose duration (estimated by the last one) would pass ``max_seconds`` since ``started``; none without a limit."""
    if max_seconds is None:
        return {}
    last = {"end": None, "duration": 0.0}  # when the last round ended (or the first began), and how long it took

    def on_round(index: int, rounds: Any) -> None:
        now = time.monotonic()
        last["duration"], last["end"] = now - last["end"], now

    def stop() -> bool:
        now = time.monotonic()
        if last["end"] is None:  # before the first round, which always runs
            last["end"] = now
            return False
        return now - started + last["duration"] > max_seconds

    return {"on_round": on_round, "stop": stop}


def _expert_copy(net: torch.nn.Module, device: torch.device) -> dict[str, Any] | None:
    """One routed expert's copy from pinned host memory to ``device`` (the first MoE layer's expert 0, timed 20
    times as the offload copies it): the link time per copy of the engine rows' physical bound. None where the
    experts are not fused 3-D ``gate_up_proj`` / ``down_proj`` tensors."""
    from ..prefetch.window import time_tensor_copy

    names = experts_modules(net)
    experts = net.get_submodule(names[0]) if names else None
    weights = [getattr(experts, name, None) for name in ("gate_up_proj", "down_proj")]
    if not all(isinstance(w, torch.Tensor) and w.ndim == 3 for w in weights):
        return None
    times, nbytes = time_tensor_copy([w[0] for w in weights], device)
    return {"ms_median": float(np.median(times)), "ms": times.tolist(), "bytes": nbytes,
            "what": "one routed expert (first MoE layer, expert 0) from pinned host memory, 20 copies, median"}


def _record_settings(s: BenchSettings, device_used: torch.device, predictor_info: dict[str, Any] | None,
                     window_profile: dict[str, Any] | None) -> dict[str, Any]:
    """The record's ``settings``: what was asked, and how the rows were decoded and summarised."""
    return {
        "model": s.model, "device": str(device_used), "rounds": s.rounds, "windows": s.windows, "tokens": s.tokens,
        "capacities": [float(c) for c in s.capacities], "configs": None if s.configs is None else list(s.configs),
        "hf_configs": None if s.hf_configs is None else list(s.hf_configs),
        "prefetch_budgets": [int(m) for m in s.prefetch_budgets], "predictor": predictor_info,
        "prefetch_budget_from_window": window_profile,
        "max_in_flight": s.max_in_flight, "copy_delay_ms": s.copy_delay_ms, "copy_calls": _copy_calls(device_used),
        "accelerate_tokens": s.accelerate_tokens, "accelerate": s.accelerate, "calibration": s.calibration,
        "texts": list(s.texts), "seed": s.seed,
        "warmup": s.warmup, "warmup_tokens": WARMUP_TOKENS, "offload": s.offload, "batch": 1, "engine": s.engine,
        "device_routing": s.device_routing,
        "count_late": s.count_late, "max_seconds": s.max_seconds,
        "engine_graphs": s.engine and device_used.type == "cuda",
        "engine_decoding": ENGINE_DECODING if s.engine else None,
        "decoding": "teacher-forced: a new DynamicCache per window, one one-token forward per position, the "
                    "device synchronised after each; position 0 starts the sequence and is not timed",
        "order": "every configuration once per round over the same windows, order rotated by one per round",
        "statistics": "copy statistics over the decode positions (reset after position 0), token-weighted "
                      "over the windows of a round, mean over rounds; ratios: paired t on per-round log "
                      "ms/token (95% interval, two-sided p), on the tokens both rows decoded",
    }
