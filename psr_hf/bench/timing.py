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
from typing import Any

import numpy as np
import torch

from .._progress import tqdm
from .common import describe_model, quiet_uncalibrated, rotated
from .decode import WindowRun
from .rows import ACCELERATE, ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, ROUTED_KINDS, Row, latency_rows
from .runners import AccelerateRunner, EngineRunner, ResidentRunner, Runner, TransformersRunner, offload_config, release
from .summary import row_records

logger = logging.getLogger(__name__)

MIN_ROUNDS = 3
WARMUP_TOKENS = 16  # positions of the first window each warm-up round decodes per configuration


def check_rounds(rounds: int) -> None:
    """``ValueError`` for fewer than :data:`MIN_ROUNDS` rounds, with the reason."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: at least {MIN_ROUNDS} rounds are needed; latency ratios come from a paired "
                         f"t-test on log latency over rounds (the round, not the token, is the unit)")


def bench_latency(
    model: torch.nn.Module, windows: Sequence[torch.Tensor], *, configs: Sequence[Row] | None = None,
    calibration: Any = None, rounds: int = MIN_ROUNDS, warmup: int = 1, accelerate_tokens: int = 8,
    offload: Any = True, max_in_flight: int = 2, copy_delay_ms: float = 0.0, graphs: bool | None = None,
    progress: Callable[[str], None] | None = None, predictor: Any = None, device_routing: bool | None = None,
    resume: Mapping[str, list[list[WindowRun]]] | None = None,
    on_round: Callable[[int, Mapping[str, list[list[WindowRun]]]], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """Time teacher-forced decoding of ``windows`` under each row, interleaved over ``rounds``.

    Args:
        model: an unpatched transformers MoE model with every expert on its device (the ``resident`` row runs it
            as it is); the routed rows run a patched copy of it, the ``accelerate`` row a dispatched copy.
        windows: ``[1, T + 1]`` token ids each (:func:`~psr_hf.assets.texts.text_windows`); position 0 of each
            is not timed.
        configs: the :class:`~psr_hf.bench.rows.Row` s (:func:`~psr_hf.bench.rows.latency_rows` by default);
            ``resident`` must be one of them.
        calibration: passed to :func:`psr_hf.patch` / ``reconfigure`` for every routed row.
        rounds: timed rounds (>= 3); each runs every row once over all windows, the order rotated by one per round.
        warmup: untimed rounds over the first :data:`WARMUP_TOKENS` positions of the first window (compilation,
            allocator, the first offload).
        accelerate_tokens: decode positions of the first window that the ``accelerate`` row times per round.
        offload: an :class:`psr_hf.OffloadConfig` for the routed rows; True builds one for the model's device
            (``max_in_flight``, ``copy_delay_ms``); False runs them patched without offload (logical cache only: no
            physical copies, the rows then measure the routing overhead alone). The routed engine rows use the same.
        graphs: whether the engine rows' :class:`~psr_hf.engine.graphs.GraphDecoder` replays CUDA graphs (default:
            on CUDA; the CPU runs the same step eagerly).
        predictor: the :class:`psr_hf.prefetch.Predictor` of the rows with ``prefetch="predictor"``.
        device_routing: the engine rows' decode steps routed on the device (one CUDA graph per token,
            :func:`psr_hf.engine.token_graph.graph_decoder`): None (default) where the row allows it, True
            required, False never (the host decides per layer).
        resume: rounds already timed (name -> one list of :class:`WindowRun` per round, the same number for every
            row, as ``on_round`` saw them): timing continues with the next round (a resumed sweep).
        on_round: called after each timed round with its index and every row's rounds so far (to save them).
        stop: checked before each timed round; True ends the timing there (the rows then hold fewer rounds; no
            rows at all if none was timed).

    Returns one dict per row, in ``configs`` order (:func:`~psr_hf.bench.summary.row_records`).
    """
    check_rounds(rounds)
    if warmup < 0 or accelerate_tokens < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and accelerate_tokens={accelerate_tokens} >= 1")
    if not windows:
        raise ValueError("no windows to decode")
    configs = list(latency_rows() if configs is None else configs)
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names repeat: {names}")
    if RESIDENT not in names:
        raise ValueError(f"the '{RESIDENT}' row is required: it is the reference of every ratio")
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("the model is patched by psr_hf; give the unpatched model (the resident row runs it)")
    device = next(model.parameters()).device
    model.eval()
    kinds = {c.kind for c in configs}
    if kinds & {ENGINE, ENGINE_RESIDENT} and ENGINE_RESIDENT not in names:
        raise ValueError(f"engine rows need the '{ENGINE_RESIDENT}' row: it is the reference of their ratios")
    if graphs is None:
        graphs = device.type == "cuda"
    routed = bool(kinds & set(ROUTED_KINDS))
    if offload is True:
        offload = offload_config(device, max_in_flight=max_in_flight, copy_delay_ms=copy_delay_ms) if routed else None
    elif offload is False:
        offload = None
    if calibration is None and routed:
        logger.info("bench_latency: routed rows are uncalibrated (warm set = the first C experts, no token prior)")
    results: dict[str, list[list[WindowRun]]] = {name: list((resume or {}).get(name, [])) for name in names}
    done_rounds = {len(v) for v in results.values()}
    if len(done_rounds) != 1:
        raise ValueError("resume: every row must hold the same number of timed rounds (as on_round saw them)")
    first_round = done_rounds.pop()
    runners: dict[str, Runner] = {RESIDENT: ResidentRunner(model, device)}
    if OFFLOAD in kinds:
        runners[OFFLOAD] = TransformersRunner(model, device, calibration, offload, predictor)
    if kinds & {ENGINE, ENGINE_RESIDENT}:
        runners[ENGINE] = runners[ENGINE_RESIDENT] = EngineRunner(
            model, device, calibration, offload, max(int(w.shape[1]) for w in windows), bool(graphs), predictor,
            device_routing)

    def windows_of(row: Row, limit: int | None = None) -> list[torch.Tensor]:
        if row.kind == ACCELERATE:
            n = min(accelerate_tokens, windows[0].shape[1] - 1)
            return [windows[0][:, : 1 + (n if limit is None else min(n, limit))]]
        if limit is None:
            return list(windows)
        return [windows[0][:, : 1 + min(limit, windows[0].shape[1] - 1)]]

    with quiet_uncalibrated(), contextlib.ExitStack() as stack:
        try:
            if ACCELERATE in kinds:
                if progress is not None:
                    progress("dispatching a copy of the model with accelerate (experts on the CPU)")
                runners[ACCELERATE] = AccelerateRunner(model, device)
            # a tqdm bar (stderr) over every row of every warm-up and timed round when the caller asks for progress
            bar = tqdm(total=(warmup + rounds) * len(configs), unit="row", desc="bench", disable=progress is None)
            stack.callback(bar.close)
            for w in range(warmup):
                for row in configs:
                    bar.set_postfix_str(f"warm-up {w + 1}/{warmup}: {row.name}")
                    runners[row.kind].run(row, windows_of(row, WARMUP_TOKENS))
                    bar.update(1)
                if progress is not None:
                    progress(f"warm-up {w + 1}/{warmup} done")
            bar.update(first_round * len(configs))
            for r in range(first_round, rounds):
                if stop is not None and stop():
                    break
                for row in rotated(configs, r):
                    bar.set_postfix_str(f"round {r + 1}/{rounds}: {row.name}")
                    results[row.name].append(runners[row.kind].run(row, windows_of(row)))
                    bar.update(1)
                if on_round is not None:
                    on_round(r, results)
                if progress is not None:
                    means = {n: np.mean([t for w in results[n][-1] for t in w.ms]) for n in names}
                    progress(f"round {r + 1}/{rounds}: ms/token " + ", ".join(f"{n} {m:.2f}" for n, m in means.items()))
        finally:
            capacity: dict[str, int] = {}
            memory: dict[str, Any] = {}
            decided_on: dict[str, str] = {}
            for kind in (RESIDENT, OFFLOAD, ENGINE, ACCELERATE):
                if kind in runners:
                    runners[kind].close()
                    capacity.update(runners[kind].capacity)
                    memory.update(runners[kind].memory)
                    decided_on.update(runners[kind].decided_on)
            runners.clear()
            release(device)

    if not results[RESIDENT]:
        return []  # stopped before the first timed round
    return row_records(configs, results, describe_model(model), capacity, memory, decided_on)
