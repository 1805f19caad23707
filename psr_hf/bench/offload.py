"""The offload latency benchmark behind ``psr-hf bench``: teacher-forced batch-1 decoding of fixed text windows.

Protocol (the paper's Section 6.1, "Latency"): every position of every window goes through the batch-1 decode
path (a new :class:`transformers.DynamicCache` per window, one one-token forward per position, the device
synchronised after each), so every configuration processes the same tokens. Position 0 starts the sequence
(the offloaded model copies its warm set then): it is not timed, and the routing and copy statistics are reset
after it, so both cover the decode positions 1..T only.

Rows (configurations):

- ``resident``: the unpatched model with every expert on the device (``grouped_mm``): the floor.
- ``accelerate``: a copy of the model dispatched by ``accelerate.dispatch_model`` with every ``...mlp.experts``
  module on ``"cpu"`` (its weights stream to the device at every forward): what a transformers user would pick
  without psr_hf. It is slow, so it decodes only the first ``accelerate_tokens`` positions of the first window.
- per capacity (residency 0.5 and 0.25 by default, suffix ``_res50`` / ``_res25``): ``exact_lru``,
  ``exact_a_pf`` (exact routing, A priority, logical prefetch budget 1), ``cp_lam0.2`` (Cache-Prior),
  ``psr_lam0.2_n1``, ``psr_lam0.3_n1`` and ``spec``. They share ONE offloaded copy of the model, patched with
  :class:`psr_hf.OffloadConfig` once and switched between configurations with ``Controller.reconfigure``.

Engine rows (``engine=True``, ``psr-hf bench --engine``): the same decode positions through psr_hf's own batch-1
decoder (:class:`psr_hf.engine.graphs.GraphDecoder`: CUDA graphs on CUDA, the same step eagerly on the CPU) instead
of the transformers forward:

- ``engine_resident``: a copy of the model patched with ``RoutingConfig(policy="exact", capacity=E)`` (every
  expert cached) and not offloaded: the engine's floor, the reference of the other engine rows' ratios.
- ``engine_<row>`` for every routed row above (same RoutingConfig, same capacity): one more offloaded copy of the
  model per capacity shared by that capacity's engine rows (switched with ``Controller.reconfigure`` as the HF rows'
  copy is, without a resize, so each decoder is built and captured once). Position 0 of every window starts the
  sequence (the warm set), is not timed, and the statistics are reset after it, exactly as for the HF rows, so an
  engine row and its HF row make the same routing decisions on the same tokens and copy the same experts.

A "copies skipped" engine row (the paper's Table 9 idea: the selection without the physical copies) is not
measured: the decoders have no such mode yet.

Rounds: every round runs every configuration once over the same windows, the order rotated by one per round
(interleaved, so drift in clocks and temperature falls on all rows alike); at least 3 rounds. Per row: mean
ms/token per round, the mean over rounds, the 99th percentile over every timed token of every round, copies per
token (means over rounds) split as in the paper's Section 6.5 (demand copies; prefetch copies that arrived in
time, that were still in flight when the layer needed them (late), never used), bytes moved and time waited per
token. Ratios between rows pair rounds: the exponentiated mean per-round log ratio with its 95% t-interval and
the p-value of a one-sample t-test on the log ratios (the repetition, not the token, is the unit; Kalibera and
Jones 2013). Where two rows decode different tokens (``accelerate``), the ratio uses the tokens both decoded.

The models and windows come from :mod:`psr_hf.bench.workloads`, the round summaries from :mod:`psr_hf.bench.common`,
the figure from :mod:`psr_hf.bench.plot`. The library logs; ``psr-hf bench`` (:mod:`psr_hf.cli`) prints.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from .._progress import tqdm

from ..hf.controller import cache_keyword
from ..hf.patching import controller, patch, unpatch
from ..policy.config import MAX_EXPERTS, RoutingConfig
from .common import device_sync, machine, paired_summary, quiet_uncalibrated, rotated, summarize, versions
from .workloads import (GROWN_OLMOE, WINDOW_MODULES, default_texts, load_model, model_calibration, module_sources,
                        text_windows)

logger = logging.getLogger(__name__)

RESIDENT = "resident"
ACCELERATE = "accelerate"
ENGINE_PREFIX = "engine_"
ENGINE_RESIDENT = "engine_resident"
MIN_ROUNDS = 3
# the default calibration: this many tokens of workloads.CALIBRATION_MODULES (never the windows' text)
CALIBRATION_TOKENS = 8192

# name -> RoutingConfig fields (the residency is added per capacity); the paper's Section 6.1 baselines
POLICY_CONFIGS: dict[str, dict[str, Any]] = {
    "exact_lru": dict(policy="exact", eviction="lru", budget=0),
    "exact_a_pf": dict(policy="exact", eviction="score", budget=1),
    "cp_lam0.2": dict(policy="cache_prior", lam=0.2, eviction="lru", budget=0),
    "psr_lam0.2_n1": dict(policy="psr", lam=0.2, eviction="score", budget=1),
    "psr_lam0.3_n1": dict(policy="psr", lam=0.3, eviction="score", budget=1),
    "spec": dict(policy="spec"),
}
DEFAULT_CAPACITIES = (0.5, 0.25)
PSR_GOAL = "psr_lam0.3_n1"
# the goals: PSR within 15% / 30% of resident at 50% / 25% residency; accelerate at least 50x slower
RESIDENT_GOALS = {0.5: 1.15, 0.25: 1.3}
ACCELERATE_GOAL = 50.0

# the engine's goals (GPU only): ms/token bounds and ratios within the engine rows
ENGINE_RESIDENT_MS_GOAL = 1.4  # llama.cpp all on the GPU: 1.65 on the same GPU and grown model
ENGINE_PSR_MS_GOALS = {0.5: 2.5, 0.25: 4.5}
ENGINE_LRU_GOALS = {0.5: 2.3, 0.25: 3.0}  # engine exact_lru / engine psr_lam0.3_n1 >= this (the paper: 2.31 at 50%)
ENGINE_CP_GOAL = 1.25  # engine cp_lam0.2 / engine psr_lam0.3_n1 >= this, at every goal residency
ENGINE_HOST_US_GOAL = 15.0  # host us per MoE layer (policy, scheduler, graph launches) on the copies-skipped rows
ENGINE_HOST_US_PER_COPY_GOAL = 5.0  # host us per issued copy: an offloaded row against its copies-skipped twin
ENGINE_PRED0_GOAL = 1.03  # SpecPrefetch's PRED0 (copies skipped) / OFF (exact_lru, copies skipped) at most this
NEEDS_GPU = "needs a GPU"

WARMUP_TOKENS = 16  # positions of the first window each warm-up round decodes per configuration

# per-token keys of the copy statistics (the Controller's logical totals and the offload scheduler's physical ones)
ROUTING_KEYS = ("copies_per_token", "demand_per_token", "prefetch_per_token", "replaced_per_token",
                "displaced_mass")
OFFLOAD_KEYS = ("copies_per_token", "demand_per_token", "prefetch_per_token", "prefetch_in_time_per_token",
                "prefetch_late_per_token", "prefetch_unused_per_token", "dropped_per_token", "bytes_per_token",
                "wait_ms_per_token")


# ---------------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: ``kind`` is ``resident``, ``accelerate``, ``offload`` (a routing config on the
    shared offloaded copy), ``engine_resident`` or ``engine`` (the engine's decoder on an all-cached patched copy, or
    on the engine's shared offloaded copy); ``policy`` is the name without the capacity suffix."""

    name: str
    kind: str
    policy: str
    routing: RoutingConfig | None = None
    residency: float | None = None
    skip_copies: bool = False  # an engine row on the all-resident copy: the same routing, no copy (compute only)


NOCOPY_SUFFIX = "_nocopy"
PREFETCH_ROWS = ("specprefetch_", "naive_")  # the names of prefetch_configs' rows


def capacity_suffix(residency: float) -> str:
    """``_res50`` for residency 0.5."""
    return f"_res{round(residency * 100)}"


def prefetch_configs(budgets: Sequence[int], predictor: bool = True) -> dict[str, dict[str, Any]]:
    """SpecPrefetch's system comparison (its Tables 4-5, Figure 4) as routed rows, per prefetch budget ``M``:
    ``specprefetch_mM`` (exact routing, prefetches ranked by the learned predictor, at most M per layer and token,
    over every expert) and ``naive_mM`` (the same with the previous token's scores: Naive Prefetch). OFF is
    ``exact_lru`` (no prefetch); PRED0 is the engine's copies-skipped row of ``specprefetch_mM``, measured against
    the copies-skipped ``exact_lru`` row (the bench adds both)."""
    out: dict[str, dict[str, Any]] = {}
    for m in budgets:
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"prefetch budget {m!r} must be an int >= 1 (prefetch copies per layer and token)")
        if predictor:
            out[f"specprefetch_m{m}"] = dict(policy="exact", eviction="score", budget=m, window=MAX_EXPERTS,
                                             prefetch="predictor")
        out[f"naive_m{m}"] = dict(policy="exact", eviction="score", budget=m, window=MAX_EXPERTS,
                                  prefetch="previous")
    return out


def default_configs(capacities: Sequence[float] = DEFAULT_CAPACITIES, *, accelerate: bool = True,
                    only: Sequence[str] | None = None, engine: bool = False,
                    hf_only: Sequence[str] | None = None, prefetch_budgets: Sequence[int] = (),
                    predictor: bool = False) -> list[BenchConfig]:
    """The benchmark's rows: ``resident`` (always: the reference of every ratio), ``accelerate`` (unless
    ``accelerate`` is False) and every :data:`POLICY_CONFIGS` entry at every residency in ``capacities``.

    ``only`` keeps the rows whose full name (``psr_lam0.3_n1_res50``) or policy name (``psr_lam0.3_n1``: every
    capacity) is listed, plus ``resident``; an unknown name raises ``ValueError``.

    ``engine`` appends ``engine_resident`` and an ``engine_<name>`` row (kind ``engine``) for every routed row kept.
    ``hf_only`` (with ``engine``): of the routed transformers rows, keep only these names (the same rule as
    ``only``; an empty list keeps none); the engine rows still mirror every routed row ``only`` keeps (the
    transformers rows are the slow ones: keep one or two as references). ``prefetch_budgets``: also the rows of
    :func:`prefetch_configs` (SpecPrefetch's ``specprefetch_mM`` only with ``predictor``), at every capacity."""
    if not capacities:
        raise ValueError("capacities is empty; give at least one residency in (0, 1], e.g. 0.5")
    for residency in capacities:
        if not (0.0 < float(residency) <= 1.0):
            raise ValueError(f"capacity {residency!r} must be a residency in (0, 1] (fraction of each layer's experts)")
    suffixes = [capacity_suffix(r) for r in capacities]
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"capacities {list(capacities)} repeat a residency (in whole percent)")
    rows = [BenchConfig(RESIDENT, "resident", RESIDENT)]
    if accelerate:
        rows.append(BenchConfig(ACCELERATE, "accelerate", ACCELERATE))
    table = {**POLICY_CONFIGS, **prefetch_configs(list(prefetch_budgets), predictor)}
    for residency in capacities:
        for policy, fields in table.items():
            rows.append(BenchConfig(policy + capacity_suffix(residency), "offload", policy,
                                    RoutingConfig(residency=float(residency), **fields), float(residency)))
    if only is not None:
        wanted = {name.strip() for name in only if name.strip()}
        if not predictor and any(name.startswith("specprefetch_") for name in wanted):
            raise ValueError("the specprefetch_m* rows rank prefetches by a learned predictor: they need a "
                             "predictor: --predictor FILE (psr-hf train-predictor) with --prefetch-budgets")
        known = {row.name for row in rows} | {row.policy for row in rows}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
                             + ("" if accelerate else " (accelerate is off: --no-accelerate)"))
        rows = [row for row in rows if row.name == RESIDENT or row.name in wanted or row.policy in wanted]
    if hf_only is not None and not engine:
        raise ValueError("hf_only (--hf-configs) selects the transformers rows kept beside the engine rows; it needs "
                         "engine=True (--engine)")
    if engine:
        routed = [row for row in rows if row.kind == "offload"]
        if hf_only is not None:
            keep = {name.strip() for name in hf_only if name.strip()}
            unknown = sorted(keep - ({row.name for row in routed} | {row.policy for row in routed}))
            if unknown:
                raise ValueError(f"--hf-configs: unknown {', '.join(unknown)}; allowed: the routed rows "
                                 f"{', '.join(row.name for row in routed)} or their policy names")
            rows = [row for row in rows if row.kind != "offload" or row.name in keep or row.policy in keep]
        rows.append(BenchConfig(ENGINE_RESIDENT, "engine_resident", ENGINE_RESIDENT))
        rows.extend(BenchConfig(ENGINE_PREFIX + row.name, "engine", row.policy, row.routing, row.residency)
                    for row in routed)
        # copies skipped (the paper's Table 9): the same routing decisions on the all-resident copy, no copy at all;
        # PRED0 (SpecPrefetch's Table 4: prediction and control, no transfers) is specprefetch_mM's, against OFF's
        # (exact_lru's) when there are prefetch rows: their ratio is the prediction and control path's cost
        # exact_lru's too: its twin gives the host cost per copy of the row that copies most
        nocopy = {PSR_GOAL, "exact_lru"}
        rows.extend(BenchConfig(ENGINE_PREFIX + row.name + NOCOPY_SUFFIX, "engine", row.policy, row.routing,
                                row.residency, skip_copies=True) for row in routed
                    if row.policy in nocopy or row.policy.startswith("specprefetch_"))
    return rows


# ---------------------------------------------------------------------------------------------------- one window
@dataclass(frozen=True)
class WindowRun:
    """One teacher-forced window: ms per decode position (1..T), the routing totals and the offload copy
    statistics over those positions (None for unpatched models), the statistics of the sequence start (position 0:
    the warm-set copies) and, if asked for, the logits of every position ``[T + 1, V]`` (position 0 included)."""

    ms: list[float]
    routing_stats: dict[str, float] | None
    offload_stats: dict[str, float] | None
    start_stats: dict[str, float] | None
    logits: torch.Tensor | None = None
    host_ms: list[float] | None = None  # engine rows: the host's own ms per position (not blocked on the GPU)


def _offload_dict(stats: Any) -> dict[str, float] | None:
    if stats.offload is None:
        return None
    return {key: float(value) for key, value in stats.offload.to_dict().items()}


@torch.no_grad()
def decode_window(model: torch.nn.Module, ids: torch.Tensor, *, device: torch.device | str | None = None,
                  keep_logits: bool = False) -> WindowRun:
    """Teacher-forced batch-1 decode of ``ids`` ``[1, T + 1]``: a new ``DynamicCache``, then one forward per
    position with ``use_cache=True``, the device synchronised after each and the wall time of every position but
    the first taken with ``time.perf_counter``.

    If ``model`` is patched by psr_hf, its statistics are reset after position 0 (which starts the sequence and
    copies the warm set) and read after the last position, so they cover positions 1..T. ``device``: where the
    inputs go (default: the device of the first parameter not on the meta device, else the CPU). ``keep_logits``
    returns the logits of every position (copied to the host after the timing of that position)."""
    from transformers import DynamicCache

    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [1, T + 1] with T >= 1 decode positions, got shape {tuple(ids.shape)}")
    if device is None:  # accelerate leaves offloaded parameters on the meta device
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    device = torch.device(device)
    sync = device_sync(device)
    ids = ids.to(device)
    ctl = getattr(model, "_psr_hf_controller", None)
    kv = DynamicCache(config=model.config)
    kwarg = cache_keyword(model)
    ms: list[float] = []
    logits: list[torch.Tensor] = []
    start_stats = None
    sync()
    for i in range(ids.shape[1]):
        begin = time.perf_counter()
        out = model(input_ids=ids[:, i : i + 1], use_cache=True, **{kwarg: kv})
        sync()
        end = time.perf_counter()
        if i == 0:
            if ctl is not None:
                first = controller(model).stats()
                start_stats = dict(first.total)
                start_offload = _offload_dict(first)
                if start_offload is not None:
                    start_stats["offload"] = start_offload
                controller(model).reset_stats()  # from here on the totals count the decode positions only
        else:
            ms.append((end - begin) * 1e3)
        if keep_logits:
            logits.append(out.logits[0, -1].float().cpu())
    routing_stats = offload_stats = None
    if ctl is not None:
        stats = controller(model).stats()
        routing_stats = dict(stats.total)
        offload_stats = _offload_dict(stats)
        T = ids.shape[1] - 1
        if int(routing_stats.get("tokens", T)) != T:
            logger.warning("routing statistics count %s tokens over a window of %d decode positions",
                           routing_stats.get("tokens"), T)
        if offload_stats is not None and "tokens" in offload_stats and int(offload_stats["tokens"]) != T:
            logger.warning("offload statistics count %s tokens over a window of %d decode positions",
                           offload_stats["tokens"], T)
    return WindowRun(ms=ms, routing_stats=routing_stats, offload_stats=offload_stats, start_stats=start_stats,
                     logits=torch.stack(logits) if keep_logits else None)


@torch.no_grad()
def decode_engine_window(decoder: Any, ids: torch.Tensor, *, device: torch.device | str) -> WindowRun:
    """:func:`decode_window` through the engine: ``decoder`` (a :class:`~psr_hf.engine.graphs.GraphDecoder` or
    :class:`~psr_hf.engine.decoder.Decoder` of a patched model) starts a new sequence and steps through ``ids``
    ``[1, T + 1]`` teacher-forced, one token per step, the device synchronised after each; position 0 (the sequence
    start, the warm set) is not timed and the controller's statistics are reset after it, as in
    :func:`decode_window`."""
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [1, T + 1] with T >= 1 decode positions, got shape {tuple(ids.shape)}")
    sync = device_sync(torch.device(device))
    tokens = [int(t) for t in ids[0].tolist()]  # host ints: no device read inside the timed steps
    ctl = decoder.controller
    ms: list[float] = []
    host_ms: list[float] | None = [] if hasattr(decoder, "blocked_s") else None
    start_stats = None
    decoder.reset()
    sync()
    for i, token in enumerate(tokens):
        blocked = getattr(decoder, "blocked_s", 0.0)
        begin = time.perf_counter()
        decoder.step(token)
        stepped = time.perf_counter()
        sync()
        end = time.perf_counter()
        if host_ms is not None and i > 0:  # the step's wall time less its waits on the GPU (events, final sync)
            host_ms.append(((stepped - begin) - (decoder.blocked_s - blocked)) * 1e3)
        if i == 0:
            first = ctl.stats()
            start_stats = dict(first.total)
            start_offload = _offload_dict(first)
            if start_offload is not None:
                start_stats["offload"] = start_offload
            ctl.reset_stats()  # from here on the totals count the decode positions only
        else:
            ms.append((end - begin) * 1e3)
    stats = ctl.stats()
    return WindowRun(ms=ms, routing_stats=dict(stats.total), offload_stats=_offload_dict(stats),
                     start_stats=start_stats, host_ms=host_ms)


# ---------------------------------------------------------------------------------------------------- model copies
def experts_modules(model: torch.nn.Module) -> list[str]:
    """Names of the routed-experts modules (``...mlp.experts``) of ``model``."""
    return [name for name, _ in model.named_modules() if name.endswith("mlp.experts")]


def accelerate_device_map(model: torch.nn.Module, device: torch.device | str) -> dict[str, str]:
    """A flat ``device_map`` for ``accelerate.dispatch_model``: every ``...mlp.experts`` module on ``"cpu"``,
    every other module (the largest subtrees without experts) and the direct parameters and buffers of modules
    above the experts on ``device``. No key is a prefix of another, so no hook places a parent's children."""
    target = str(torch.device(device))
    experts = set(experts_modules(model))
    if not experts:
        raise ValueError(f"{type(model).__name__} has no '...mlp.experts' modules to put on the CPU")
    device_map: dict[str, str] = {}

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for leaf, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            device_map[f"{prefix}.{leaf}" if prefix else leaf] = target
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in experts:
                device_map[name] = "cpu"
            elif any(e.startswith(name + ".") for e in experts):
                walk(child, name)
            else:
                device_map[name] = target

    walk(model, "")
    return device_map


def accelerate_copy(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """A copy of ``model`` dispatched by ``accelerate.dispatch_model`` with its experts on the CPU and everything
    else on ``device`` (the experts' weights are moved to the CPU first, so their weights map is host memory and
    every forward copies them to ``device``). With ``device`` cpu nothing moves: the row then measures only
    accelerate's hooks."""
    try:
        from accelerate import dispatch_model
    except ImportError as exc:
        raise ValueError("the accelerate row needs the accelerate package (pip install accelerate, or psr-hf[eval]); "
                         "or leave the row out (--no-accelerate)") from exc

    device = torch.device(device)
    device_map = accelerate_device_map(model, device)
    dispatched = copy.deepcopy(model)
    for name in experts_modules(dispatched):
        dispatched.get_submodule(name).to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # accelerate warns that "some parameters are on the meta device because they were offloaded": that is the point
    quiet = _QuietAccelerate()
    big_modeling = logging.getLogger("accelerate.big_modeling")
    big_modeling.addFilter(quiet)
    try:
        return dispatch_model(dispatched, device_map=device_map, main_device=device, force_hooks=True).eval()
    finally:
        big_modeling.removeFilter(quiet)


class _QuietAccelerate(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "offloaded to the cpu" not in str(record.msg)


def offload_config(device: torch.device | str, *, max_in_flight: int = 2, copy_delay_ms: float = 0.0) -> Any:
    """A :class:`psr_hf.OffloadConfig` for ``device`` (pinned host memory only on CUDA)."""
    from ..offload.config import OffloadConfig

    device = torch.device(device)
    return OffloadConfig(device=str(device), max_in_flight=max_in_flight, copy_delay_ms=copy_delay_ms,
               pin_memory=device.type == "cuda")


def _predictor_for(routing: RoutingConfig, predictor: Any) -> Any:
    """The predictor a row's patch needs: the bench's for ``prefetch="predictor"`` rows, none otherwise."""
    if routing.prefetch != "predictor":
        return None
    if predictor is None:
        raise ValueError("rows with prefetch='predictor' (specprefetch_m*) need a predictor: --predictor FILE "
                         "(psr-hf train-predictor)")
    return predictor


class _SharedCopy:
    """The one patched copy of the model that every routed row runs on: patched with the first configuration,
    switched with ``Controller.reconfigure`` afterwards (offloading a 13 GB model takes seconds)."""

    def __init__(self, source: torch.nn.Module, device: torch.device, calibration: Any, offload: Any,
                 predictor: Any = None):
        self.source, self.device, self.calibration, self.offload = source, device, calibration, offload
        self.predictor = predictor
        self.model: torch.nn.Module | None = None
        self.current: RoutingConfig | None = None

    def activate(self, routing: RoutingConfig) -> torch.nn.Module:
        predictor = _predictor_for(routing, self.predictor)
        if self.model is None:
            # on a GPU the copy doubles the experts only until patch() has moved them to the host store
            model = copy.deepcopy(self.source)
            patch(model, routing, calibration=self.calibration, offload=self.offload, predictor=predictor)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.model = model
        elif routing != self.current:
            if self.offload is None:  # logical cache only: a fresh patch costs nothing
                unpatch(self.model)
                patch(self.model, routing, calibration=self.calibration, predictor=predictor)
            else:
                controller(self.model).reconfigure(routing, calibration=self.calibration, predictor=predictor)
        self.current = routing
        return self.model

    def close(self) -> None:
        if self.model is not None:
            unpatch(self.model)
            self.model = None
            _release(self.device)


class _EngineRows:
    """The engine rows' models and decoders: ``engine_resident`` on a copy patched with every expert cached (no
    offload), the routed engine rows on one offloaded copy per capacity (:class:`_SharedCopy`, switched between
    that capacity's configurations with ``Controller.reconfigure``), each decoded by a
    :class:`~psr_hf.engine.graphs.GraphDecoder` (CUDA graphs on CUDA) built on first use and rebuilt if the
    offload's slot buffers were reallocated."""

    def __init__(self, source: torch.nn.Module, device: torch.device, calibration: Any, offload: Any, max_len: int,
                 graphs: bool, routed: bool, predictor: Any = None):
        self.source, self.device, self.calibration, self.max_len, self.graphs = source, device, calibration, max_len, graphs
        self.offload, self.routed, self.predictor = offload, routed, predictor
        # one offloaded copy per capacity: no resize, so each decoder is built (captured) once. (A first version
        # that rebuilt the decoder after each resize of one shared copy reported other copy counts than the HF
        # rows; rebuilding a Decoder or GraphDecoder after reconfigure/resize was then checked to give identical
        # logical and physical copies, so the cause lay in that version's bookkeeping, not in the decoders.)
        self.shared: dict[float | None, _SharedCopy] = {}
        self.resident: torch.nn.Module | None = None
        self.decoders: dict[str, Any] = {}  # "resident" / "shared" -> decoder

    def _decoder(self, key: str, model: torch.nn.Module) -> Any:
        from ..engine.graphs import GraphDecoder

        decoder = self.decoders.get(key)
        if decoder is not None and decoder.offloaded and decoder._addresses() != decoder._slot_addresses:
            decoder = None  # the slot buffers were reallocated (capacity change): its graphs point at the old ones
        if decoder is not None and decoder.layers.predictor is not controller(model).predictor:
            decoder = None  # its router stacks hold another prefetch ranking (a specprefetch row and the rest)
        if decoder is None:
            self.decoders.pop(key, None)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            decoder = GraphDecoder(model, self.max_len, graphs=self.graphs)
            self.decoders[key] = decoder
        return decoder

    def activate(self, config: BenchConfig) -> Any:
        if config.kind == "engine_resident" or config.skip_copies:
            num_experts = describe_model(self.source)["num_experts"]
            routing = config.routing if config.skip_copies else RoutingConfig(policy="exact", capacity=num_experts)
            predictor = _predictor_for(routing, self.predictor)
            if self.resident is None:
                model = copy.deepcopy(self.source)
                patch(model, routing, calibration=self.calibration, predictor=predictor)
                self.resident = model
            elif controller(self.resident).config != routing:
                # copies skipped: the row's routing on the all-resident copy (nothing is offloaded, so the
                # decoder's buffers stay valid); engine_resident: every expert cached again
                controller(self.resident).reconfigure(routing, calibration=self.calibration, predictor=predictor)
            return self._decoder("resident", self.resident)
        if config.residency not in self.shared:
            self.shared[config.residency] = _SharedCopy(self.source, self.device, self.calibration, self.offload,
                                                        self.predictor)
        return self._decoder(f"shared{config.residency}", self.shared[config.residency].activate(config.routing))

    def close(self) -> None:
        self.decoders.clear()
        for shared in self.shared.values():
            shared.close()
        self.shared.clear()
        if self.resident is not None:
            unpatch(self.resident)
            self.resident = None  # freed by the caller's _release (bench_latency's finally)


def _release(device: torch.device) -> None:
    """Free the memory of the bench's dropped model copies now: a patched copy, its hooks and its decoders refer to
    each other, so only the cycle collector frees them, and until it runs a real-size copy stays on the GPU (a
    sweep's next residency, which makes new copies, ran out of memory on a 141 GB GPU that way)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- statistics
def _matched_round_means(a: list[list[list[float]]], b: list[list[list[float]]]) -> tuple[list[float], list[float]]:
    """Per-round mean ms of two rows over the tokens both decoded (``[round][window][position]``)."""
    means_a, means_b = [], []
    for rounds_a, rounds_b in zip(a, b):
        xs, ys = [], []
        for wa, wb in zip(rounds_a, rounds_b):
            n = min(len(wa), len(wb))
            xs.extend(wa[:n])
            ys.extend(wb[:n])
        means_a.append(float(np.mean(xs)))
        means_b.append(float(np.mean(ys)))
    return means_a, means_b


def _weighted(dicts: list[dict[str, float] | None], weights: list[int], keys: Sequence[str]) -> dict[str, float] | None:
    """Token-weighted mean of per-token statistics over windows."""
    present = [(d, w) for d, w in zip(dicts, weights) if d is not None]
    if not present:
        return None
    total = float(sum(w for _, w in present))
    return {key: sum(d[key] * w for d, w in present) / total for key in keys if all(key in d for d, _ in present)}


def _round_stats(runs: list[WindowRun]) -> dict[str, Any] | None:
    """Copy statistics of one round of one routed row (token-weighted over its windows)."""
    if runs[0].routing_stats is None:
        return None
    weights = [len(run.ms) for run in runs]
    routing = _weighted([run.routing_stats for run in runs], weights, ROUTING_KEYS)
    offload = _weighted([run.offload_stats for run in runs], weights, OFFLOAD_KEYS)
    starts = [run.start_stats.get("offload", {}) for run in runs if run.start_stats is not None]
    if offload is not None and starts and all("warm_copies" in s for s in starts):
        offload["warm_copies_per_window"] = float(np.mean([s["warm_copies"] for s in starts]))
    return {"tokens": int(sum(weights)), "routing": routing, "offload": offload}


def _copies(kind: str, rounds: list[dict[str, Any] | None], model_info: Mapping[str, Any]) -> dict[str, Any]:
    """Copies per token of a row (means over rounds), in the table's categories; ``source`` says where they come
    from: the offload scheduler, the logical cache only, or the row's construction (resident, accelerate)."""
    if kind in ("resident", "engine_resident"):
        return {"source": "all experts resident: nothing is copied", "copies_per_token": 0.0,
                "demand_per_token": 0.0, "prefetch_per_token": 0.0, "prefetch_in_time_per_token": 0.0,
                "prefetch_late_per_token": 0.0, "prefetch_unused_per_token": 0.0, "bytes_per_token": 0.0,
                "wait_ms_per_token": None}
    if kind == "accelerate":
        moved = model_info.get("device_type") != "cpu"
        per_token = float(model_info["moe_layers"] * model_info["num_experts"]) if moved else 0.0
        return {"source": "by construction: dispatch_model copies every experts module at every forward"
                          if moved else "main device cpu: dispatch_model moves nothing",
                "copies_per_token": per_token, "demand_per_token": per_token, "prefetch_per_token": 0.0,
                "prefetch_in_time_per_token": 0.0, "prefetch_late_per_token": 0.0, "prefetch_unused_per_token": 0.0,
                "bytes_per_token": float(model_info["expert_bytes"]) if moved else 0.0, "wait_ms_per_token": None}
    out: dict[str, Any] = {}
    routing = [r["routing"] for r in rounds if r is not None and r["routing"] is not None]
    for key in ROUTING_KEYS:
        if routing and all(key in r for r in routing):
            out[key] = float(np.mean([r[key] for r in routing]))
    offload = [r["offload"] for r in rounds if r is not None and r["offload"] is not None]
    out["source"] = "offload scheduler" if offload else "logical cache only (no offload)"
    if offload:
        # the table shows physical copies (a dropped prefetch was never copied); the logical ones stay beside them
        out["logical_copies_per_token"] = out.get("copies_per_token")
        out["logical_demand_per_token"] = out.get("demand_per_token")
        out["logical_prefetch_per_token"] = out.get("prefetch_per_token")
        for key in (*OFFLOAD_KEYS, "warm_copies_per_window"):
            if all(key in r for r in offload):
                out[key] = float(np.mean([r[key] for r in offload]))
        executed = float(model_info["moe_layers"] * model_info["top_k"])  # experts executed per token
        if executed and "demand_per_token" in out and "prefetch_late_per_token" in out:
            # SpecPrefetch's ReadyRecall (exact routing: the executed experts are the router's own top-K): the share
            # of executed experts already on the device when their layer started, neither loaded on demand nor a
            # prefetch still in flight
            out["ready_recall"] = 1.0 - (out["demand_per_token"] + out["prefetch_late_per_token"]) / executed
    return out


# ---------------------------------------------------------------------------------------------------- benchmark
def bench_latency(
    model: torch.nn.Module, windows: Sequence[torch.Tensor], *, configs: Sequence[BenchConfig] | None = None,
    calibration: Any = None, rounds: int = MIN_ROUNDS, warmup: int = 1, accelerate_tokens: int = 8,
    offload: Any = True, max_in_flight: int = 2, copy_delay_ms: float = 0.0, graphs: bool | None = None,
    progress: Callable[[str], None] | None = None, predictor: Any = None,
    resume: Mapping[str, list[list[WindowRun]]] | None = None,
    on_round: Callable[[int, Mapping[str, list[list[WindowRun]]]], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """Time teacher-forced decoding of ``windows`` under each configuration, interleaved over ``rounds``.

    Args:
        model: an unpatched transformers MoE model with every expert on its device (the ``resident`` row runs it
            as it is); the routed rows run a patched copy of it, the ``accelerate`` row a dispatched copy.
        windows: ``[1, T + 1]`` token ids each (:func:`text_windows`); position 0 of each is not timed.
        configs: the rows (:func:`default_configs` by default); ``resident`` must be one of them.
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
        resume: rounds already timed (name -> one list of :class:`WindowRun` per round, the same number for every
            row, as ``on_round`` saw them): timing continues with the next round (a resumed sweep).
        on_round: called after each timed round with its index and every row's rounds so far (to save them).
        stop: checked before each timed round; True ends the timing there (the rows then hold fewer rounds; no
            rows at all if none was timed).

    Returns one dict per row, in ``configs`` order (see :func:`run_bench` for the record around them).
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: at least {MIN_ROUNDS} rounds are needed; latency ratios come from a paired "
                         f"t-test on log latency over rounds (the round, not the token, is the unit)")
    if warmup < 0 or accelerate_tokens < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and accelerate_tokens={accelerate_tokens} >= 1")
    if not windows:
        raise ValueError("no windows to decode")
    configs = list(default_configs() if configs is None else configs)
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names repeat: {names}")
    if RESIDENT not in names:
        raise ValueError(f"the '{RESIDENT}' row is required: it is the reference of every ratio")
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("the model is patched by psr_hf; give the unpatched model (the resident row runs it)")
    device = next(model.parameters()).device
    model.eval()
    by_name = {c.name: c for c in configs}
    routed = [c for c in configs if c.kind in ("offload", "engine")]
    engine_rows = [c for c in configs if c.kind in ("engine", "engine_resident")]
    if engine_rows and ENGINE_RESIDENT not in names:
        raise ValueError(f"engine rows need the '{ENGINE_RESIDENT}' row: it is the reference of their ratios")
    if graphs is None:
        graphs = device.type == "cuda"
    if offload is True:
        offload = offload_config(device, max_in_flight=max_in_flight, copy_delay_ms=copy_delay_ms) if routed else None
    elif offload is False:
        offload = None
    if calibration is None and routed:
        logger.info("bench_latency: routed rows are uncalibrated (warm set = the first C experts, no token prior)")
    shared = (_SharedCopy(model, device, calibration, offload, predictor) if any(c.kind == "offload" for c in configs)
              else None)
    engine = (_EngineRows(model, device, calibration, offload, max(int(w.shape[1]) for w in windows), bool(graphs),
                          any(c.kind == "engine" for c in configs), predictor) if engine_rows else None)
    accelerated = None
    results: dict[str, list[list[WindowRun]]] = {name: list((resume or {}).get(name, [])) for name in names}
    done_rounds = {len(v) for v in results.values()}
    if len(done_rounds) != 1:
        raise ValueError("resume: every row must hold the same number of timed rounds (as on_round saw them)")
    first_round = done_rounds.pop()
    memory: dict[str, Any] = {}
    capacity: dict[str, int] = {}
    with quiet_uncalibrated(), contextlib.ExitStack() as stack:
        try:
            if ACCELERATE in by_name:
                if progress is not None:
                    progress("dispatching a copy of the model with accelerate (experts on the CPU)")
                accelerated = accelerate_copy(model, device)

            def run_row(config: BenchConfig, row_windows: Sequence[torch.Tensor]) -> list[WindowRun]:
                if config.kind == "resident":
                    target = model
                elif config.kind == "accelerate":
                    target = accelerated
                elif config.kind in ("engine", "engine_resident"):
                    decoder = engine.activate(config)
                    ctl = decoder.controller
                    capacity.setdefault(config.name, int(ctl.capacity))
                    if config.name not in memory:
                        memory[config.name] = ctl.memory().to_dict() if ctl.offload is not None else None
                    return [decode_engine_window(decoder, ids, device=device) for ids in row_windows]
                else:
                    target = shared.activate(config.routing)
                    ctl = controller(target)
                    capacity.setdefault(config.name, int(ctl.capacity))
                    if config.name not in memory:
                        memory[config.name] = ctl.memory().to_dict() if offload is not None else None
                return [decode_window(target, ids, device=device) for ids in row_windows]

            def windows_of(config: BenchConfig, limit: int | None = None) -> list[torch.Tensor]:
                if config.kind == "accelerate":
                    n = min(accelerate_tokens, windows[0].shape[1] - 1)
                    return [windows[0][:, : 1 + (n if limit is None else min(n, limit))]]
                if limit is None:
                    return list(windows)
                return [windows[0][:, : 1 + min(limit, windows[0].shape[1] - 1)]]

            # a tqdm bar (stderr) over every row of every warm-up and timed round when the caller asks for progress
            bar = tqdm(total=(warmup + rounds) * len(configs), unit="row", desc="bench", disable=progress is None)
            stack.callback(bar.close)
            for w in range(warmup):
                for config in configs:
                    bar.set_postfix_str(f"warm-up {w + 1}/{warmup}: {config.name}")
                    run_row(config, windows_of(config, WARMUP_TOKENS))
                    bar.update(1)
                if progress is not None:
                    progress(f"warm-up {w + 1}/{warmup} done")
            bar.update(first_round * len(configs))
            for r in range(first_round, rounds):
                if stop is not None and stop():
                    break
                for config in rotated(configs, r):
                    bar.set_postfix_str(f"round {r + 1}/{rounds}: {config.name}")
                    results[config.name].append(run_row(config, windows_of(config)))
                    bar.update(1)
                if on_round is not None:
                    on_round(r, results)
                if progress is not None:
                    means = {n: np.mean([t for w in results[n][-1] for t in w.ms]) for n in names}
                    progress(f"round {r + 1}/{rounds}: ms/token " + ", ".join(f"{n} {m:.2f}" for n, m in means.items()))
        finally:
            if shared is not None:
                shared.close()
            if engine is not None:
                engine.close()
            accelerated = None
            _release(device)

    if not results[RESIDENT]:
        return []  # stopped before the first timed round
    model_info = describe_model(model)
    reference_ms = {RESIDENT: [[w.ms for w in run] for run in results[RESIDENT]]}
    if ENGINE_RESIDENT in results:
        reference_ms[ENGINE_RESIDENT] = [[w.ms for w in run] for run in results[ENGINE_RESIDENT]]
    rows = []
    for config in configs:
        done = results[config.name]
        ms = [[w.ms for w in run] for run in done]  # [round][window][position]
        round_means = [float(np.mean([t for window in run for t in window])) for run in ms]
        every = np.asarray([t for run in ms for window in run for t in window])
        round_stats = [_round_stats(run) for run in done]
        ratio = None
        # engine rows: to engine_resident; engine_resident itself and the HF rows: to resident (transformers)
        reference = ENGINE_RESIDENT if config.kind == "engine" else RESIDENT
        if config.name != RESIDENT:
            mine, base = _matched_round_means(ms, reference_ms[reference])
            ratio = paired_summary(mine, base)
        host = None
        if done and all(w.host_ms is not None for run in done for w in run):
            moe_layers = max(int(model_info["moe_layers"]), 1)
            host = summarize([1e3 * float(np.mean([t for w in run for t in w.host_ms])) / moe_layers
                              for run in done])
        rows.append({
            "configuration": config.name,
            "host_us_per_moe_layer": host,
            "kind": config.kind,
            "policy": config.policy,
            "residency": config.residency,
            "capacity": capacity.get(config.name),
            "routing": None if config.routing is None else config.routing.to_dict(),
            "tokens_per_round": int(sum(len(w) for w in ms[0])),
            "ms_per_token": summarize(round_means),
            "p50_ms": float(np.percentile(every, 50)),
            "p99_ms": float(np.percentile(every, 99)),
            "ratio_to_resident": ratio,
            "reference": None if config.name == RESIDENT else reference,
            "copies": _copies(config.kind, round_stats, model_info),
            "memory": memory.get(config.name),
            "rounds": [{"ms_per_token": mean, "ms": run, "stats": stats}
                       for mean, run, stats in zip(round_means, ms, round_stats)],
        })
    add_host_per_copy(rows, int(model_info["moe_layers"]))
    return rows


def _copy_calls(device: torch.device) -> str:
    """How the offload's copies, the engine's graph launches and its waits are issued on ``device``."""
    if device.type != "cuda":
        return "a copy thread (CPU)"
    from ..offload import cuda_runtime

    ok, why = cuda_runtime.available()
    return "raw CUDA runtime calls (cuda-python)" if ok else f"torch's calls ({why})"


def add_host_per_copy(rows: Sequence[dict[str, Any]], moe_layers: int) -> None:
    """``host_us_per_copy`` of each offloaded engine row that has a copies-skipped twin (``*_nocopy``: the same
    routing, nothing copied): per round, (the row's host us per token - the twin's) / the row's issued copies per
    token, so what the host spends on scheduling and issuing a copy beyond the decisions themselves; the mean and
    95% t-interval over rounds (:func:`summarize`). Left out where a round issued no copy or a host time is
    missing."""
    by_name = {row["configuration"]: row for row in rows}
    for row in rows:
        twin = by_name.get(row["configuration"] + NOCOPY_SUFFIX)
        host, base = row.get("host_us_per_moe_layer"), (twin or {}).get("host_us_per_moe_layer")
        if row["kind"] != "engine" or host is None or base is None:
            continue
        copies = [((r.get("stats") or {}).get("offload") or {}).get("copies_per_token") for r in row["rounds"]]
        if len(host["rounds"]) != len(base["rounds"]) or not all(copies):
            continue
        row["host_us_per_copy"] = summarize([(h - b) * moe_layers / c
                                             for h, b, c in zip(host["rounds"], base["rounds"], copies)])


def compare_rows(rows: Sequence[Mapping[str, Any]], numerator: str, denominator: str) -> dict[str, Any] | None:
    """:func:`~psr_hf.bench.common.paired_summary` of row ``numerator``'s per-round ms/token over row
    ``denominator``'s (on the tokens both decoded); None if either row is missing."""
    by_name = {row["configuration"]: row for row in rows}
    if numerator not in by_name or denominator not in by_name:
        return None
    a = [[*r["ms"]] for r in by_name[numerator]["rounds"]]
    b = [[*r["ms"]] for r in by_name[denominator]["rounds"]]
    mine, base = _matched_round_means(a, b)
    return {"numerator": numerator, "denominator": denominator, **paired_summary(mine, base)}


def comparisons(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """exact_lru / psr (how much longer exact routing with LRU takes than each PSR row, at the same capacity) and
    accelerate / psr_lam0.3_n1 per capacity: the paper's direction, > 1 means PSR is faster. With engine rows also
    engine_resident / resident, the same exact_lru / psr and cp_lam0.2 / psr_lam0.3_n1 within the engine rows, and
    each HF routed psr_lam0.3_n1 row over its engine row (> 1: the engine is faster than the transformers forward)."""
    out = []
    c = compare_rows(rows, ENGINE_RESIDENT, RESIDENT)
    if c is not None:
        out.append(c)
    residencies = sorted({row["residency"] for row in rows if row["residency"] is not None}, reverse=True)
    for residency in residencies:
        suffix = capacity_suffix(residency)
        for policy in POLICY_CONFIGS:
            if policy.startswith("psr"):
                c = compare_rows(rows, "exact_lru" + suffix, policy + suffix)
                if c is not None:
                    out.append(c)
        c = compare_rows(rows, ACCELERATE, PSR_GOAL + suffix)
        if c is not None:
            out.append(c)
        e = ENGINE_PREFIX
        for policy in POLICY_CONFIGS:
            if policy.startswith("psr"):
                c = compare_rows(rows, e + "exact_lru" + suffix, e + policy + suffix)
                if c is not None:
                    out.append(c)
        for numerator, denominator in ((e + "cp_lam0.2" + suffix, e + PSR_GOAL + suffix),
                                       (PSR_GOAL + suffix, e + PSR_GOAL + suffix)):
            c = compare_rows(rows, numerator, denominator)
            if c is not None:
                out.append(c)
        out.extend(_prefetch_comparisons(rows, suffix))
    return out


def _prefetch_comparisons(rows: Sequence[Mapping[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """SpecPrefetch's speed-ups (its Tables 4-5) at one capacity, per budget M, in the transformers rows and in the
    engine rows: OFF / SpecPrefetch (``exact_lru`` over ``specprefetch_mM``), Naive / SpecPrefetch and OFF / Naive
    (> 1: the denominator is faster); in the engine rows also PRED0 / OFF, both with copies skipped (> 1: the
    prediction and control path costs time)."""
    out = []
    names = {str(row["configuration"]) for row in rows}
    for prefix in ("", ENGINE_PREFIX):
        budgets = sorted({int(name[len(prefix) + len(kind):-len(suffix)]) for kind in ("naive_m", "specprefetch_m")
                          for name in names if name.startswith(prefix + kind) and name.endswith(suffix)
                          and name[len(prefix) + len(kind):-len(suffix)].isdigit()})
        for m in budgets:
            off, spec, naive = (prefix + name + suffix for name in ("exact_lru", f"specprefetch_m{m}", f"naive_m{m}"))
            pairs = [(off, spec), (naive, spec), (off, naive)]
            if prefix:  # PRED0 / OFF with no copy on either side: what prediction and control cost
                pairs.append((spec + NOCOPY_SUFFIX, off + NOCOPY_SUFFIX))
            for numerator, denominator in pairs:
                c = compare_rows(rows, numerator, denominator)
                if c is not None:
                    out.append(c)
    return out


def evaluate_goals(rows: Sequence[Mapping[str, Any]], *, cuda: bool | None = None) -> list[dict[str, Any]]:
    """The issue's goals, each ``met`` (the whole 95% interval of the paired ratio lies on the goal's side),
    ``not met`` (the whole interval lies on the other side), ``not shown`` (the interval crosses the bound, or there
    is none: too few rounds) or ``not measured``; ``point`` says on which side the point estimate lies.

    With engine rows (``engine_*``) also the engine's goals: ms/token bounds (the 95% t-interval of the per-round
    means against the bound, the same met / not met / not shown rule; ``ms`` holds the mean) and ratios within the
    engine rows. They are evaluated only when ``cuda`` is True (the device of the run); otherwise their status is
    ``needs a GPU``. Every goal was set for the H200: with ``cuda`` False (a CPU run) none is judged, each is ``needs
    a GPU``; ``cuda`` None (unknown) judges the transformers-path goals only."""
    goals = []

    def side(value: float, bound: float, op: str) -> bool:
        return value <= bound if op == "<=" else value >= bound if op == ">=" else value > bound

    def goal(text: str, numerator: str, denominator: str, bound: float, op: str) -> None:
        c = compare_rows(rows, numerator, denominator)
        entry: dict[str, Any] = {"goal": text, "numerator": numerator, "denominator": denominator, "bound": bound,
                                 "op": op, "status": "not measured", "ratio": None, "ci95": None, "p": None,
                                 "significant": None, "point": None}
        if c is not None:
            lo, hi = c["ci95"]
            defined = math.isfinite(lo) and math.isfinite(hi)
            # the whole interval on the goal's side: for "<=" its upper end, for ">=" / ">" its lower end
            inside = defined and side(hi if op == "<=" else lo, bound, op)
            outside = defined and not side(lo if op == "<=" else hi, bound, op)
            status = "met" if inside else "not met" if outside else "not shown"
            entry.update(status=status, ratio=c["ratio"], ci95=c["ci95"], p=c["p"],
                         significant=bool(inside) if defined else None,
                         point="met" if side(c["ratio"], bound, op) else "not met")
        goals.append(entry)

    for residency, bound in RESIDENT_GOALS.items():
        name = PSR_GOAL + capacity_suffix(residency)
        goal(f"{name} <= {bound:g}x resident", name, RESIDENT, bound, "<=")
    for residency in RESIDENT_GOALS:
        name = PSR_GOAL + capacity_suffix(residency)
        goal(f"accelerate >= {ACCELERATE_GOAL:g}x {name}", ACCELERATE, name, ACCELERATE_GOAL, ">=")
    residencies = sorted({row["residency"] for row in rows if row["residency"] is not None}, reverse=True)
    for residency in residencies or list(RESIDENT_GOALS):
        suffix = capacity_suffix(residency)
        for policy in ("psr_lam0.2_n1", PSR_GOAL):
            goal(f"{policy}{suffix} faster than exact_lru{suffix} (exact_lru / psr > 1)", "exact_lru" + suffix,
                 policy + suffix, 1.0, ">")

    if cuda is False:
        for entry in goals:
            entry.update(status=NEEDS_GPU, ratio=None, ci95=None, p=None, significant=None, point=None)
    if not any(str(row["configuration"]).startswith(ENGINE_PREFIX) for row in rows):
        return goals
    by_name = {row["configuration"]: row for row in rows}
    first_engine = len(goals)

    def bound_goal(text: str, name: str, bound: float, summary: Mapping[str, Any] | None, unit: str) -> None:
        """A bound on a row's per-round mean (``summary``: its mean and 95% t-interval; ``unit``: the entry's key
        for the mean, ``ms`` or ``us``), by the same met / not met / not shown rule."""
        entry: dict[str, Any] = {"goal": text, "row": name, "bound": bound, "op": "<=", "status": "not measured",
                                 "ratio": None, unit: None, "ci95": None, "p": None, "significant": None,
                                 "point": None}
        if summary is not None:
            lo, hi = summary["ci95"]
            defined = math.isfinite(lo) and math.isfinite(hi)
            inside, outside = defined and hi <= bound, defined and lo > bound
            entry.update({"status": "met" if inside else "not met" if outside else "not shown", unit: summary["mean"],
                          "ci95": [lo, hi], "significant": bool(inside) if defined else None,
                          "point": "met" if summary["mean"] <= bound else "not met"})
        goals.append(entry)

    def ms_goal(name: str, bound: float) -> None:
        row = by_name.get(name)
        bound_goal(f"{name} <= {bound:g} ms/token", name, bound, None if row is None else row["ms_per_token"], "ms")

    def host_goal(name: str, bound: float) -> None:
        bound_goal(f"{name} host time <= {bound:g} us per MoE layer", name, bound,
                   (by_name.get(name) or {}).get("host_us_per_moe_layer"), "us")

    def per_copy_goal(name: str) -> None:
        bound_goal(f"{name} host time <= {ENGINE_HOST_US_PER_COPY_GOAL:g} us per issued copy", name,
                   ENGINE_HOST_US_PER_COPY_GOAL, (by_name.get(name) or {}).get("host_us_per_copy"), "us")

    ms_goal(ENGINE_RESIDENT, ENGINE_RESIDENT_MS_GOAL)
    for residency, bound in ENGINE_PSR_MS_GOALS.items():
        ms_goal(ENGINE_PREFIX + PSR_GOAL + capacity_suffix(residency), bound)
    for residency, bound in ENGINE_LRU_GOALS.items():
        suffix = capacity_suffix(residency)
        goal(f"engine_exact_lru{suffix} >= {bound:g}x engine_{PSR_GOAL}{suffix}", ENGINE_PREFIX + "exact_lru" + suffix,
             ENGINE_PREFIX + PSR_GOAL + suffix, bound, ">=")
    for residency in RESIDENT_GOALS:
        suffix = capacity_suffix(residency)
        goal(f"engine_cp_lam0.2{suffix} >= {ENGINE_CP_GOAL:g}x engine_{PSR_GOAL}{suffix}",
             ENGINE_PREFIX + "cp_lam0.2" + suffix, ENGINE_PREFIX + PSR_GOAL + suffix, ENGINE_CP_GOAL, ">=")
    for name in by_name:
        pred0 = name.startswith(ENGINE_PREFIX + "specprefetch_m") and name.endswith(NOCOPY_SUFFIX)
        off = ENGINE_PREFIX + "exact_lru_" + name[len(ENGINE_PREFIX + "specprefetch_m"):].partition("_")[2]
        if pred0 and off in by_name:  # PRED0: prediction and control with no transfer, against OFF's
            goal(f"PRED0 {name} <= {ENGINE_PRED0_GOAL:g}x {off}", name, off, ENGINE_PRED0_GOAL, "<=")
    for name in by_name:
        if name.startswith(ENGINE_PREFIX) and name.endswith(NOCOPY_SUFFIX):
            host_goal(name, ENGINE_HOST_US_GOAL)
            if name[: -len(NOCOPY_SUFFIX)] in by_name:
                per_copy_goal(name[: -len(NOCOPY_SUFFIX)])
    if not cuda:  # the engine's goals are about GPU latency: on the CPU they are not evaluated
        for entry in goals[first_engine:]:
            entry.update(status=NEEDS_GPU, ratio=None, ms=None, ci95=None, p=None, significant=None, point=None)
    return goals


# ---------------------------------------------------------------------------------------------------- record
def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """Class, dtype, device, parameter count, MoE shape and the bytes of the routed experts of ``model``."""
    config = model.config.get_text_config()
    experts = experts_modules(model)
    expert_bytes = sum(p.numel() * p.element_size() for name in experts
                       for p in model.get_submodule(name).parameters())
    param = next(model.parameters())
    return {
        "class": type(model).__name__,
        "model_type": str(getattr(config, "model_type", "")),
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": str(param.device),
        "device_type": param.device.type,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "moe_layers": len(experts),
        "num_experts": int(getattr(config, "num_experts", getattr(config, "n_routed_experts", 0)) or 0),
        "top_k": int(getattr(config, "num_experts_per_tok", 0) or 0),
        "expert_bytes": int(expert_bytes),
        "experts_implementation": getattr(config, "_experts_implementation", None),
    }


def load_bench_predictor(predictor: Any, model: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
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


def run_bench(
    *, model: str = GROWN_OLMOE, device: str = "cuda:0", rounds: int = MIN_ROUNDS, windows: int = 2,
    tokens: int = 128, capacities: Sequence[float] = DEFAULT_CAPACITIES, configs: Sequence[str] | None = None,
    max_in_flight: int = 2, copy_delay_ms: float = 0.0, accelerate_tokens: int = 8, accelerate: bool = True,
    calibration: str | None = None, texts: Sequence[str] = (), seed: int = 0, warmup: int = 1,
    calibration_tokens: int = CALIBRATION_TOKENS, offload: bool = True, engine: bool = False,
    hf_configs: Sequence[str] | None = None, prefetch_budgets: Sequence[int] | str = (), predictor: Any = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Load or build the model, cut the windows, calibrate, run :func:`bench_latency`; returns the JSON-ready
    record: settings (the arguments), model, windows, calibration, machine, versions, results (one dict per row),
    comparisons, goals.

    ``texts``: text files to cut the windows from (default: :data:`WINDOW_MODULES`' sources). ``calibration``: a
    saved :class:`psr_hf.Calibration`; otherwise :func:`psr_hf.calibrate` on ``calibration_tokens`` tokens of
    :data:`CALIBRATION_MODULES`' sources. ``offload`` False runs the routed rows without offload (logical cache
    only). ``engine`` adds the engine rows (:func:`default_configs`): psr_hf's batch-1 decoder, CUDA graphs on
    CUDA. ``prefetch_budgets="window"``: the one budget ``M_max`` (at least 1, at most a layer's experts) that
    :func:`psr_hf.prefetch.window.profile_unpatched` measures on the loaded model first (SpecPrefetch's
    window-aware budget; the profile goes into the record's settings)."""
    if rounds < MIN_ROUNDS:  # before building anything
        raise ValueError(f"rounds={rounds}: at least {MIN_ROUNDS} rounds are needed; latency ratios come from a paired "
                         f"t-test on log latency over rounds (the round, not the token, is the unit)")
    from_window = isinstance(prefetch_budgets, str)
    if from_window and prefetch_budgets != "window":
        raise ValueError(f"prefetch_budgets={prefetch_budgets!r}: give budgets (ints >= 1) or 'window'")
    # names checked before loading anything (the prefetch rows of the profiled budget only after profiling)
    rows_wanted = default_configs(
        capacities, accelerate=accelerate, engine=engine, predictor=predictor is not None,
        only=None if configs is None else [c for c in configs if not (from_window and c.startswith(PREFETCH_ROWS))],
        hf_only=None if hf_configs is None else [c for c in hf_configs
                                                  if not (from_window and c.startswith(PREFETCH_ROWS))],
        prefetch_budgets=() if from_window else prefetch_budgets)
    if texts:
        sources = []
        for name in texts:
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"--text {name}: no such file")
            sources.append((str(path), path.read_text(encoding="utf-8", errors="replace")))
    else:  # the held-out text of a trained model psr_hf ships, else standard-library sources
        sources = default_texts(model) or module_sources(WINDOW_MODULES)
    sources = sources[:windows]  # the texts windows are cut from (window i: text i % n; fewer windows, fewer texts)
    if progress is not None:
        progress(f"loading {model} on {device}")
    net, tokenizer, description = load_model(model, device, seed=seed)
    beside = description.pop("calibration_file", None)  # the record names it by description["calibration"]
    ids = text_windows([text for _, text in sources], tokenizer, windows=windows, tokens=tokens)
    window_profile = None
    if from_window:
        from ..prefetch.window import profile_unpatched

        if progress is not None:
            progress("profiling the overlap window for the prefetch budget (psr-hf profile-window)")
        with quiet_uncalibrated():
            profile = profile_unpatched(net, ids[0][0].tolist())
        # at least 1, at most a layer's experts (a CPU's window holds hundreds of small copies)
        prefetch_budgets = [min(max(1, profile.budget), int(describe_model(net)["num_experts"]))]
        window_profile = {k: v for k, v in profile.to_dict().items() if k in (
            "copy_ms_median", "window_ms_median", "budget", "quantile", "budget_per_pair", "bytes_per_expert")}
        logger.info("prefetch budget from the overlap window: M_max %d (used: %d)", profile.budget,
                    prefetch_budgets[0])
        m = prefetch_budgets[0]
        wanted = [f"specprefetch_m{m}"] * (predictor is not None) + [f"naive_m{m}"]
        # the rows at the profiled budget are always kept; names of other budgets are dropped
        if configs is not None:
            configs = [c for c in configs if not c.startswith(PREFETCH_ROWS)] + wanted
        if hf_configs is not None:
            hf_configs = [c for c in hf_configs if not c.startswith(PREFETCH_ROWS)] + (
                wanted if any(c.startswith(PREFETCH_ROWS) for c in hf_configs) else [])
        rows_wanted = default_configs(capacities, accelerate=accelerate, only=configs, engine=engine,
                                      hf_only=hf_configs, prefetch_budgets=prefetch_budgets,
                                      predictor=predictor is not None)
    vocab = int(net.config.get_text_config().vocab_size)
    if max(int(w.max()) for w in ids) >= vocab:
        raise ValueError(f"token ids exceed the model's vocabulary ({vocab}): is the tokenizer the model's?")
    calib = None
    calibration_info: dict[str, Any]
    if any(row.kind in ("offload", "engine") for row in rows_wanted):
        calib, calibration_info = model_calibration(net, tokenizer, tokens=calibration_tokens,
                                                    calibration=calibration, beside=beside,
                                                    beside_name=description.get("calibration"), progress=progress)
    else:
        calibration_info = {"none": "no routed rows"}
    device_used = next(net.parameters()).device
    loaded_predictor, predictor_info = None, None
    if predictor is not None:
        loaded_predictor, predictor_info = load_bench_predictor(predictor, net)
    results = bench_latency(
        net, ids, configs=rows_wanted, calibration=calib, rounds=rounds, warmup=warmup,
        accelerate_tokens=accelerate_tokens, offload=offload, max_in_flight=max_in_flight,
        copy_delay_ms=copy_delay_ms, progress=progress, predictor=loaded_predictor)
    return {
        "benchmark": "latency",
        "settings": {
            "model": model, "device": str(device_used), "rounds": rounds, "windows": windows, "tokens": tokens,
            "capacities": [float(c) for c in capacities], "configs": None if configs is None else list(configs),
            "hf_configs": None if hf_configs is None else list(hf_configs),
            "prefetch_budgets": [int(m) for m in prefetch_budgets], "predictor": predictor_info,
            "prefetch_budget_from_window": window_profile,
            "max_in_flight": max_in_flight, "copy_delay_ms": copy_delay_ms, "copy_calls": _copy_calls(device_used),
            "accelerate_tokens": accelerate_tokens, "accelerate": accelerate, "calibration": calibration,
            "texts": list(texts), "seed": seed,
            "warmup": warmup, "warmup_tokens": WARMUP_TOKENS, "offload": offload, "batch": 1, "engine": engine,
            "engine_graphs": engine and device_used.type == "cuda",
            "engine_decoding": "psr_hf.engine.graphs.GraphDecoder (CUDA graphs on CUDA, the same step eagerly "
                               "elsewhere), a new sequence per window, one step per position, the device synchronised "
                               "after each; position 0 starts the sequence and is not timed; no copies-skipped row "
                               "(the decoders have no such mode)" if engine else None,
            "decoding": "teacher-forced: a new DynamicCache per window, one one-token forward per position, the "
                        "device synchronised after each; position 0 starts the sequence and is not timed",
            "order": "every configuration once per round over the same windows, order rotated by one per round",
            "statistics": "copy statistics over the decode positions (reset after position 0), token-weighted "
                          "over the windows of a round, mean over rounds; ratios: paired t on per-round log "
                          "ms/token (95% interval, two-sided p), on the tokens both rows decoded",
        },
        "model": {**description, **describe_model(net)},
        "windows": {"sources": [path for path, _ in sources], "ids": [w[0].tolist() for w in ids],
                    "rule": "window i: text i % n at token offset (i // n) * (tokens + 1), tokens + 1 ids"},
        "calibration": calibration_info,
        "machine": machine(device_used),
        "versions": versions(),
        "results": results,
        "comparisons": comparisons(results),
        "goals": evaluate_goals(results, cuda=device_used.type == "cuda"),
    }


# ---------------------------------------------------------------------------------------------------- text
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


ROUTED_KINDS = ("offload", "engine")


def _capacity_label(row: Mapping[str, Any]) -> str:
    if row["kind"] == "engine_resident":
        return "all (cached)"
    if row["kind"] == "resident":
        return "all"
    if row["kind"] == "accelerate":
        return "0 (CPU)"
    slots = "" if row.get("capacity") is None else f" (C={row['capacity']})"
    return f"{row['residency']:.0%}{slots}"


def _ratio_text(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return "1 (reference)"
    lo, hi = r["ci95"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{r['ratio']:.2f}"
    return f"{r['ratio']:.2f} [{lo:.2f}, {hi:.2f}]"


def format_table(record: Mapping[str, Any]) -> str:
    """The rows of a :func:`run_bench` record as a text table."""
    from .._text import text_table

    lines = []
    for row in record["results"]:
        c = row["copies"]
        physical = c["source"] == "offload scheduler"
        mb = c.get("bytes_per_token")
        lines.append([
            row["configuration"], _capacity_label(row), _fmt(row["ms_per_token"]["mean"]), _fmt(row["p99_ms"]),
            _ratio_text(row["ratio_to_resident"]), _fmt(c.get("copies_per_token")), _fmt(c.get("demand_per_token")),
            _fmt(c.get("prefetch_late_per_token")) if physical or row["kind"] not in ROUTED_KINDS else "?",
            _fmt(c.get("prefetch_in_time_per_token")) if physical or row["kind"] not in ROUTED_KINDS else "?",
            _fmt(c.get("prefetch_unused_per_token")) if physical or row["kind"] not in ROUTED_KINDS else "?",
            _fmt(None if mb is None else mb / 1e6, 1), _fmt(c.get("wait_ms_per_token"), 3),
        ])
    header = ["config", "capacity", "ms/token", "p99", "ratio to resident [95% CI]", "copies/tok", "demand",
              "late", "in time", "unused", "MB/tok", "wait ms/tok"]
    return text_table(lines, header)


def report_lines(record: Mapping[str, Any]) -> list[str]:
    """The lines ``psr-hf bench`` prints under the table: protocol, PSR comparisons, goals, model, machine."""
    s, model, machine = record["settings"], record["model"], record["machine"]
    rows = {row["configuration"]: row for row in record["results"]}
    acc = rows.get(ACCELERATE)
    lines = ["", f"teacher-forced batch-1 decode: {s['windows']} window(s) x {s['tokens']} timed positions, "
                 f"{s['rounds']} interleaved rounds"
                 + (f" (accelerate: the first {acc['tokens_per_round']} positions of window 1)" if acc else "")
                 + "; ms/token: mean over rounds, p99 over every timed token",
             ("ratios: paired over rounds (geometric mean of per-round ratios, 95% t-interval on the logs); copies "
              "per decoded token over all MoE layers: demand (the layer waits for the whole copy), prefetch late "
              "(still in flight when the layer needed it), in time, unused (never executed)")]
    if any(row["kind"] == "engine" for row in rows.values()):
        how = "CUDA graphs" if s.get("engine_graphs") else "eager, no CUDA graphs"
        lines.append(f"engine_* rows: psr_hf's batch-1 decoder ({how}) on the same windows and positions; their "
                     "ratio column is to "
                     f"{ENGINE_RESIDENT} (engine_resident's own: to resident); engine_*{NOCOPY_SUFFIX}: the same "
                     "routing on the all-resident copy, no copy made (compute-only time, the paper's Table 9); its "
                     "copy columns are the logical copies an offloaded run makes")
    ready = [(name, row["copies"]["ready_recall"]) for name, row in rows.items()
             if row["copies"].get("ready_recall") is not None and row.get("policy", "").startswith(
                 ("specprefetch_", "naive_", "exact_lru"))]
    if ready:
        lines.append("ReadyRecall (executed experts already on the device when their layer starts): " + "; ".join(
            f"{name} {100 * value:.1f}%" for name, value in ready))
    hosts = [(name, row["host_us_per_moe_layer"]) for name, row in rows.items() if row.get("host_us_per_moe_layer")]
    if hosts:
        lines.append("engine host time per MoE layer (the step's wall time less its waits on the GPU: policy, "
                     "scheduler, graph launches), us, mean [95% CI] over rounds: " + "; ".join(
                         f"{name} {h['mean']:.1f} [{h['ci95'][0]:.1f}, {h['ci95'][1]:.1f}]" for name, h in hosts))
    per_copy = [(name, row["host_us_per_copy"]) for name, row in rows.items() if row.get("host_us_per_copy")]
    if per_copy:
        lines.append("engine host time per issued copy (host us per token beyond the row's copies-skipped twin, over "
                     "its issued copies per token), us, mean [95% CI] over rounds: " + "; ".join(
                         f"{name} {h['mean']:.1f} [{h['ci95'][0]:.1f}, {h['ci95'][1]:.1f}]" for name, h in per_copy))
    if any(row["kind"] in ROUTED_KINDS and row["copies"]["source"] != "offload scheduler" for row in rows.values()):
        lines.append("? = not measured: routed rows ran without offload (logical cache only)")
    if s["copy_delay_ms"]:
        lines.append(f"copy delay: {s['copy_delay_ms']} ms added to every copy (emulated link)")
    if record["comparisons"]:
        lines.append("")
        for c in record["comparisons"]:
            p = "-" if c["p"] is None else (f"{c['p']:.3g}" if c["p"] >= 0.001 else "<0.001")
            lines.append(f"{c['numerator']} / {c['denominator']}: {_ratio_text(c)} (p {p})")
    lines.append("")
    for g in record["goals"]:
        if g["status"] == NEEDS_GPU:
            lines.append(f"goal {g['goal']}: {NEEDS_GPU} (this run: {machine['device']}; the goals were set for "
                         "the H200 and are judged on CUDA only)")
            continue
        if g.get("ms") is not None or g.get("us") is not None:
            lo, hi = g["ci95"]
            unit, value, digits = ("ms", g["ms"], 2) if g.get("ms") is not None else ("us", g["us"], 1)
            interval = f" [{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
            lines.append(f"goal {g['goal']}: {g['status']} (mean {value:.{digits}f} {unit}{interval}"
                         + ("" if g["status"] != "not shown" else
                            f", point estimate on the {'goal' if g['point'] == 'met' else 'other'} side, 95% "
                            f"interval across the bound") + ")")
            continue
        detail = "" if g["ratio"] is None else f" (ratio {_ratio_text(g)}" + (
            "" if g["status"] != "not shown" else f", point estimate on the {'goal' if g['point'] == 'met' else 'other'}"
                                                 f" side, 95% interval across the bound") + ")"
        lines.append(f"goal {g['goal']}: {g['status']}{detail}")
    n = model["parameters"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    lines.append("")
    lines.append(f"model: {model['name']} ({model['class']}), {size} parameters, {model['dtype']}, "
                 f"{model['moe_layers']} MoE layers x {model['num_experts']} experts, top-{model['top_k']}, experts "
                 f"{model['expert_bytes'] / 1e6:.1f} MB, {model['weights']}")
    calib = record["calibration"]
    if "file" in calib:
        lines.append(f"calibration: {calib['file']}")
    elif "modules" in calib:
        lines.append(f"calibration: {calib['tokens']} tokens of {', '.join(calib['modules'])} (windows: "
                     f"{', '.join(Path(p).name for p in record['windows']['sources'])})")
    lines.append(f"machine: {machine['device']}, torch {machine['torch']}, transformers {machine['transformers']}, "
                 f"accelerate {record['versions']['accelerate']}")
    return lines
