"""The interleaved timing loop of the latency benchmark (:func:`bench_latency`): every round runs every row once
over the same windows, the order rotated by one per round, so drift in clocks and temperature falls on all rows
alike; at least :data:`MIN_ROUNDS` rounds, since ratios are paired t-tests over rounds (the repetition, not the
token, is the unit; Kalibera and Jones 2013). The rows come from :mod:`psr_hf.bench.rows`, the models they run on
from :mod:`psr_hf.bench.runners`, their records from :mod:`psr_hf.bench.summary`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._progress import tqdm
from .common import describe_model, quiet_uncalibrated, rotated
from .decode import WindowRun
from .rows import ACCELERATE, ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, ROUTED_KINDS, Row, latency_rows
from .runners import AccelerateRunner, EngineRunner, ResidentRunner, Runner, TransformersRunner, offload_config, release
from .settings import frozen, settings_of
from .summary import row_records

if TYPE_CHECKING:
    from ..offload.config import OffloadConfig
    from ..policy.calibration import Calibration
    from ..prefetch.predictor import Predictor

logger = logging.getLogger(__name__)

MIN_ROUNDS = 3
WARMUP_TOKENS = 16  # positions of the first window each warm-up round decodes per configuration
ENGINE_KINDS = {ENGINE, ENGINE_RESIDENT}
TimedRounds = dict[str, list[list[WindowRun]]]  # row name -> one list of window runs per timed round


def check_rounds(rounds: int) -> None:
    """``ValueError`` for fewer than :data:`MIN_ROUNDS` rounds, with the reason."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: at least {MIN_ROUNDS} rounds are needed; latency ratios come from a paired "
                         f"t-test on log latency over rounds (the round, not the token, is the unit)")


@dataclass(frozen=True)
class LatencySettings:
    """What :func:`bench_latency` times and how; validated here, once, before anything runs.

    Attributes:
        configs: the :class:`~psr_hf.bench.rows.Row` s (:func:`~psr_hf.bench.rows.latency_rows` by default), with
            distinct names; ``resident`` must be one of them, and engine rows need ``engine_resident``.
        rounds: timed rounds (>= 3); each runs every row once over all windows, the order rotated by one per round.
        warmup: untimed rounds over the first :data:`WARMUP_TOKENS` positions of the first window (compilation,
            allocator, the first offload).
        accelerate_tokens: decode positions of the first window that the ``accelerate`` row times per round.
        offload: an :class:`psr_hf.OffloadConfig` for the routed rows; True builds one for the model's device
            (``max_in_flight``, ``copy_delay_ms``); False runs them patched without offload (logical cache only: no
            physical copies, the rows then measure the routing overhead alone). The routed engine rows use the same.
        graphs: whether the engine rows' :class:`~psr_hf.engine.graphs.GraphDecoder` replays CUDA graphs (default:
            on CUDA; the CPU runs the same step eagerly).
        device_routing: the engine rows' decode steps routed on the device (one CUDA graph per token,
            :func:`psr_hf.engine.token_graph.graph_decoder`): None (default) where the row allows it, True
            required, False never (the host decides per layer).
        count_late: the device-routed offloaded engine rows also count, on the GPU, the prefetches each MoE layer
            still waits for (one small kernel per layer, timed with the row: leave it off for timings), so that
            their records say how many prefetches arrived late (``prefetch_late_per_token``).
    """

    configs: Sequence[Row] | None = None
    rounds: int = MIN_ROUNDS
    warmup: int = 1
    accelerate_tokens: int = 8
    offload: OffloadConfig | bool = True
    max_in_flight: int = 2
    copy_delay_ms: float = 0.0
    graphs: bool | None = None
    device_routing: bool | None = None
    count_late: bool = False

    def __post_init__(self) -> None:
        check_rounds(self.rounds)
        if self.count_late and self.device_routing is False:
            raise ValueError("count_late counts the late prefetches of rows routed on the device, and "
                             "device_routing=False routes none there; leave device_routing at None or True")
        if self.warmup < 0 or self.accelerate_tokens < 1:
            raise ValueError(f"warmup={self.warmup} must be >= 0 and accelerate_tokens={self.accelerate_tokens} >= 1")
        rows = tuple(latency_rows() if self.configs is None else self.configs)
        names = [row.name for row in rows]
        if len(set(names)) != len(names):
            raise ValueError(f"configuration names repeat: {names}")
        if RESIDENT not in names:
            raise ValueError(f"the '{RESIDENT}' row is required: it is the reference of every ratio")
        if {row.kind for row in rows} & ENGINE_KINDS and ENGINE_RESIDENT not in names:
            raise ValueError(f"engine rows need the '{ENGINE_RESIDENT}' row: it is the reference of their ratios")
        frozen(self, "configs", rows)

    @property
    def rows(self) -> tuple[Row, ...]:
        """The rows to time (``configs``, or the default rows), in order."""
        return tuple(self.configs or ())

    @property
    def kinds(self) -> set[str]:
        """The kinds of the rows (which runners the timing needs)."""
        return {row.kind for row in self.rows}


def bench_latency(
    model: torch.nn.Module, windows: Sequence[torch.Tensor], settings: LatencySettings | None = None, /, *,
    calibration: Calibration | None = None, predictor: Predictor | None = None,
    progress: Callable[[str], None] | None = None, resume: Mapping[str, list[list[WindowRun]]] | None = None,
    on_round: Callable[[int, TimedRounds], None] | None = None,
    stop: Callable[[], bool] | None = None, **fields: Any,
) -> list[dict[str, Any]]:
    """Time teacher-forced decoding of ``windows`` under each row, interleaved over rounds.

    Args:
        model: an unpatched transformers MoE model with every expert on its device (the ``resident`` row runs it
            as it is); the routed rows run a patched copy of it, the ``accelerate`` row a dispatched copy.
        windows: ``[1, T + 1]`` token ids each (:func:`~psr_hf.assets.texts.text_windows`); position 0 of each
            is not timed.
        settings, fields: a :class:`LatencySettings` or its fields as keywords (``configs=``, ``rounds=``, ...).
        calibration: passed to :func:`psr_hf.patch` / ``reconfigure`` for every routed row.
        predictor: the :class:`psr_hf.prefetch.Predictor` of the rows with ``prefetch="predictor"``.
        resume: rounds already timed (name -> one list of :class:`WindowRun` per round, the same number for every
            row, as ``on_round`` saw them): timing continues with the next round (a resumed sweep).
        on_round: called after each timed round with its index and every row's rounds so far (to save them).
        stop: checked before each timed round; True ends the timing there (the rows then hold fewer rounds; no
            rows at all if none was timed).

    Returns one dict per row, in ``configs`` order (:func:`~psr_hf.bench.summary.row_records`).
    """
    s = settings_of(LatencySettings, settings, fields, "bench_latency")
    if not windows:
        raise ValueError("no windows to decode")
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("the model is patched by psr_hf; give the unpatched model (the resident row runs it)")
    device = next(model.parameters()).device
    model.eval()
    routed = bool(s.kinds & set(ROUTED_KINDS))
    if calibration is None and routed:
        logger.info("bench_latency: routed rows are uncalibrated (warm set = the first C experts, no token prior)")
    results = _resumed(s.rows, resume)
    first_round = len(results[RESIDENT])
    runners = _runners(model, windows, s, calibration, _offload_for(s, device, routed), predictor)
    with quiet_uncalibrated(), contextlib.ExitStack() as stack:
        try:
            if ACCELERATE in s.kinds:
                if progress is not None:
                    progress("dispatching a copy of the model with accelerate (experts on the CPU)")
                runners[ACCELERATE] = AccelerateRunner(model, device)
            timing = _Timing(s, runners, windows, progress)
            stack.callback(timing.bar.close)
            timing.warm_up()
            timing.time(results, first_round, on_round, stop)
        finally:
            capacity, memory, decided_on, kernels = _close(runners, device)
    if not results[RESIDENT]:
        return []  # stopped before the first timed round
    return row_records(list(s.rows), results, describe_model(model), capacity, memory, decided_on, kernels)


def _offload_for(s: LatencySettings, device: torch.device, routed: bool) -> OffloadConfig | None:
    """The offload of the routed rows: the given config, one for ``device`` (``offload=True``), or None."""
    if s.offload is True:
        return offload_config(device, max_in_flight=s.max_in_flight, copy_delay_ms=s.copy_delay_ms) if routed else None
    return None if s.offload is False else s.offload


def _resumed(rows: Sequence[Row], resume: Mapping[str, list[list[WindowRun]]] | None) -> TimedRounds:
    """Every row's timed rounds so far (none, or those of ``resume``); ``ValueError`` where rows hold different
    numbers of rounds."""
    results = {row.name: list((resume or {}).get(row.name, [])) for row in rows}
    if len({len(v) for v in results.values()}) != 1:
        raise ValueError("resume: every row must hold the same number of timed rounds (as on_round saw them)")
    return results


def _runners(model: torch.nn.Module, windows: Sequence[torch.Tensor], s: LatencySettings,
             calibration: Calibration | None, offload: OffloadConfig | None,
             predictor: Predictor | None) -> dict[str, Runner]:
    """The runner of each kind of row but ``accelerate`` (whose copy is dispatched inside the timing's guard)."""
    device = next(model.parameters()).device
    runners: dict[str, Runner] = {RESIDENT: ResidentRunner(model, device)}
    if OFFLOAD in s.kinds:
        runners[OFFLOAD] = TransformersRunner(model, device, calibration, offload, predictor)
    if s.kinds & ENGINE_KINDS:
        graphs = device.type == "cuda" if s.graphs is None else s.graphs
        runners[ENGINE] = runners[ENGINE_RESIDENT] = EngineRunner(
            model, device, calibration, offload, max(int(w.shape[1]) for w in windows), bool(graphs), predictor,
            s.device_routing, s.count_late)
    return runners


def _close(runners: dict[str, Runner], device: torch.device) -> tuple[dict[str, int], dict[str, Any], dict[str, str],
                                                                        dict[str, dict[str, Any]]]:
    """Close every runner and free its copies; returns what they noted: capacity, memory, where the decode steps
    were decided and the engine's optional kernels, per row."""
    capacity: dict[str, int] = {}
    memory: dict[str, Any] = {}
    decided_on: dict[str, str] = {}
    kernels: dict[str, dict[str, Any]] = {}
    for kind in (RESIDENT, OFFLOAD, ENGINE, ACCELERATE):
        if kind in runners:
            runners[kind].close()
            capacity.update(runners[kind].capacity)
            memory.update(runners[kind].memory)
            decided_on.update(runners[kind].decided_on)
            kernels.update(runners[kind].kernels)
    runners.clear()
    release(device)
    return capacity, memory, decided_on, kernels


class _Timing:
    """The warm-up and timed rounds of one :func:`bench_latency` call over its runners, with a tqdm bar (stderr)
    over every row of every round when the caller asks for progress."""

    def __init__(self, s: LatencySettings, runners: Mapping[str, Runner], windows: Sequence[torch.Tensor],
                 progress: Callable[[str], None] | None):
        self.s, self.runners, self.windows, self.progress = s, runners, windows, progress
        self.rows = list(s.rows)
        self.bar = tqdm(total=(s.warmup + s.rounds) * len(self.rows), unit="row", desc="bench",
                        disable=progress is None)

    def windows_of(self, row: Row, limit: int | None = None) -> list[torch.Tensor]:
        """The windows ``row`` decodes: all of them, the ``accelerate`` row's first positions, or the first
        ``limit`` positions of the first window (warm-up)."""
        first = self.windows[0]
        if row.kind == ACCELERATE:
            n = min(self.s.accelerate_tokens, first.shape[1] - 1)
            return [first[:, : 1 + (n if limit is None else min(n, limit))]]
        if limit is None:
            return list(self.windows)
        return [first[:, : 1 + min(limit, first.shape[1] - 1)]]

    def warm_up(self) -> None:
        for w in range(self.s.warmup):
            for row in self.rows:
                self.bar.set_postfix_str(f"warm-up {w + 1}/{self.s.warmup}: {row.name}")
                self.runners[row.kind].run(row, self.windows_of(row, WARMUP_TOKENS))
                self.bar.update(1)
            if self.progress is not None:
                self.progress(f"warm-up {w + 1}/{self.s.warmup} done")

    def time(self, results: TimedRounds, first_round: int,
             on_round: Callable[[int, TimedRounds], None] | None,
             stop: Callable[[], bool] | None) -> None:
        """Time rounds ``first_round`` .. ``rounds - 1`` into ``results`` (until ``stop`` says so)."""
        rounds = self.s.rounds
        self.bar.update(first_round * len(self.rows))
        for r in range(first_round, rounds):
            if stop is not None and stop():
                break
            for row in rotated(self.rows, r):
                self.bar.set_postfix_str(f"round {r + 1}/{rounds}: {row.name}")
                results[row.name].append(self.runners[row.kind].run(row, self.windows_of(row)))
                self.bar.update(1)
            if on_round is not None:
                on_round(r, results)
            if self.progress is not None:
                means = {n: np.mean([t for w in timed[-1] for t in w.ms]) for n, timed in results.items()}
                self.progress(f"round {r + 1}/{rounds}: ms/token "
                              + ", ".join(f"{n} {m:.2f}" for n, m in means.items()))
