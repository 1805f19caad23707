"""The decode loops the latency rows are timed with: teacher-forced batch-1 decoding of one text window through
the transformers forward (:func:`decode_window`) or psr_hf's decoder (:func:`decode_engine_window`).

Every position goes through the batch-1 decode path, the device synchronised after each. Position 0 starts the
sequence (an offloaded model copies its warm set then): it is not timed, and a patched model's routing and copy
statistics are reset after it, so both cover the decode positions 1..T only (the paper's Section 6.1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..hf.inputs import cache_keyword
from ..hf.patching import controller
from .common import device_sync

logger = logging.getLogger(__name__)


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


def _check_window(ids: torch.Tensor) -> None:
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [1, T + 1] with T >= 1 decode positions, got shape {tuple(ids.shape)}")


def _start_statistics(ctl: Any) -> dict[str, Any]:
    """The statistics of the sequence start (position 0: the warm set), then reset: from here on the totals count
    the decode positions only."""
    first = ctl.stats()
    start = dict(first.total)
    start_offload = _offload_dict(first)
    if start_offload is not None:
        start["offload"] = start_offload
    ctl.reset_stats()
    return start


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

    _check_window(ids)
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
                start_stats = _start_statistics(controller(model))
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
    :func:`decode_window`. A decoder that counts its late prefetches on the GPU (``count_late=True``) adds them to
    the offload statistics (``prefetch_late_per_token``, ``layers_waited_per_token``, over the timed positions)."""
    _check_window(ids)
    sync = device_sync(torch.device(device))
    tokens = [int(t) for t in ids[0].tolist()]  # host ints: no device read inside the timed steps
    ctl = decoder.controller
    ms: list[float] = []
    host_ms: list[float] | None = [] if hasattr(decoder, "blocked_s") else None
    start_stats = None
    counts_late = getattr(decoder, "_late", None) is not None
    late_at_start: dict[str, Any] = {}
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
            start_stats = _start_statistics(ctl)
            if counts_late:
                late_at_start = decoder.late_prefetches()
        else:
            ms.append((end - begin) * 1e3)
    stats = ctl.stats()
    offload_stats = _offload_dict(stats)
    if counts_late and offload_stats is not None:
        late = decoder.late_prefetches()
        offload_stats["prefetch_late_per_token"] = (late["late"] - late_at_start["late"]) / len(ms)
        offload_stats["layers_waited_per_token"] = (late["layers_waited"] - late_at_start["layers_waited"]) / len(ms)
        offload_stats["late_counted_on_device"] = 1.0
    return WindowRun(ms=ms, routing_stats=dict(stats.total), offload_stats=offload_stats,
                     start_stats=start_stats, host_ms=host_ms)
