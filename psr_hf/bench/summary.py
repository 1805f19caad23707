"""The record of a timed latency row: ms/token over rounds with its interval and percentiles, the ratio to the
row's reference paired by round (the engine rows': ``engine_resident``; every other row's: ``resident``), copies per
token in the paper's Section 6.5 categories (demand; prefetch in time, late, unused), bytes moved and time waited,
and the engine rows' host time per MoE layer and per issued copy (against the copies-skipped twin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .common import matched_round_means, paired_summary, summarize
from .decode import WindowRun
from .rows import ACCELERATE, ENGINE, ENGINE_RESIDENT, RESIDENT, Row

# per-token keys of the copy statistics (the Controller's logical totals and the offload scheduler's physical ones)
ROUTING_KEYS = ("copies_per_token", "demand_per_token", "prefetch_per_token", "replaced_per_token",
                "displaced_mass")
OFFLOAD_KEYS = ("copies_per_token", "demand_per_token", "prefetch_per_token", "prefetch_in_time_per_token",
                "prefetch_late_per_token", "prefetch_unused_per_token", "dropped_per_token", "bytes_per_token",
                "wait_ms_per_token", "layers_waited_per_token", "late_counted_on_device")


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


#: the prefetch timing categories the host sees only where it issues the copies itself
PREFETCH_TIMING_KEYS = ("prefetch_in_time_per_token", "prefetch_late_per_token", "prefetch_unused_per_token")


def _copies(kind: str, rounds: list[dict[str, Any] | None], model_info: Mapping[str, Any],
            decided_on: str | None = None) -> dict[str, Any]:
    """Copies per token of a row (means over rounds), in the table's categories; ``source`` says where they come
    from: the offload scheduler, the logical cache only, or the row's construction (resident, accelerate).
    ``decided_on="device"`` (the engine's token graph): the GPU issued the copies, so whether a prefetch arrived in
    time was not observed and those categories are None, not 0."""
    if kind in (RESIDENT, ENGINE_RESIDENT):
        return {"source": "all experts resident: nothing is copied", "copies_per_token": 0.0,
                "demand_per_token": 0.0, "prefetch_per_token": 0.0, "prefetch_in_time_per_token": 0.0,
                "prefetch_late_per_token": 0.0, "prefetch_unused_per_token": 0.0, "bytes_per_token": 0.0,
                "wait_ms_per_token": None}
    if kind == ACCELERATE:
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
        if decided_on == "device":
            counted = all(r.get("late_counted_on_device") for r in offload)
            for key in PREFETCH_TIMING_KEYS:
                if not (counted and key == "prefetch_late_per_token"):
                    out[key] = None
            out["prefetch_timing"] = (
                "late prefetches counted on the GPU (count_late): a prefetch still in flight where its layer was "
                "about to wait for it; in time and unused not observed (token graph)" if counted else
                "not observed: the GPU decided and issued the copies (token graph)")
        executed = float(model_info["moe_layers"] * model_info["top_k"])  # experts executed per token
        if executed and "demand_per_token" in out and out.get("prefetch_late_per_token") is not None:
            # SpecPrefetch's ReadyRecall (exact routing: the executed experts are the router's own top-K): the share
            # of executed experts already on the device when their layer started, neither loaded on demand nor a
            # prefetch still in flight
            out["ready_recall"] = 1.0 - (out["demand_per_token"] + out["prefetch_late_per_token"]) / executed
    return out


def add_host_per_copy(records: Sequence[dict[str, Any]], rows: Sequence[Row], moe_layers: int) -> None:
    """``host_us_per_copy`` of each offloaded engine row (``records[i]`` of ``rows[i]``) that has a copies-skipped
    twin (the same routing, nothing copied): per round, (the row's host us per token - the twin's) / the row's
    issued copies per token, so what the host spends on scheduling and issuing a copy beyond the decisions
    themselves; the mean and 95% t-interval over rounds (:func:`summarize`). Left out where a round issued no copy
    or a host time is missing."""
    by_name = {record["configuration"]: record for record in records}
    for row, record in zip(rows, records):
        if row.kind != ENGINE or row.copies_skipped:
            continue
        twin = by_name.get(row.replace(copies_skipped=True).name)
        host, base = record.get("host_us_per_moe_layer"), (twin or {}).get("host_us_per_moe_layer")
        if host is None or base is None:
            continue
        copies = [((r.get("stats") or {}).get("offload") or {}).get("copies_per_token") for r in record["rounds"]]
        if len(host["rounds"]) != len(base["rounds"]) or not all(copies):
            continue
        record["host_us_per_copy"] = summarize([(h - b) * moe_layers / c
                                                for h, b, c in zip(host["rounds"], base["rounds"], copies)])


def row_records(rows: Sequence[Row], results: Mapping[str, list[list[WindowRun]]], model_info: Mapping[str, Any],
                capacity: Mapping[str, int], memory: Mapping[str, Any],
                decided_on: Mapping[str, str] | None = None,
                kernels: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One record per row (in ``rows`` order) from its timed rounds ``results[name]`` (one list of
    :class:`WindowRun` per round); ``capacity``, ``memory``, ``decided_on`` and ``kernels`` (an engine row's
    optional kernels) as the runners noted them."""
    reference_ms = {name: [[w.ms for w in run] for run in results[name]]
                    for name in (RESIDENT, ENGINE_RESIDENT) if name in results}
    records = []
    for row in rows:
        done = results[row.name]
        ms = [[w.ms for w in run] for run in done]  # [round][window][position]
        round_means = [float(np.mean([t for window in run for t in window])) for run in ms]
        every = np.asarray([t for run in ms for window in run for t in window])
        round_stats = [_round_stats(run) for run in done]
        ratio = None
        # engine rows: to engine_resident; engine_resident itself and the HF rows: to resident (transformers)
        reference = ENGINE_RESIDENT if row.kind == ENGINE else RESIDENT
        if row.name != RESIDENT:
            ratio = paired_summary(*matched_round_means(ms, reference_ms[reference]))
        host = host_token = None
        if done and all(w.host_ms is not None for run in done for w in run):
            moe_layers = max(int(model_info["moe_layers"]), 1)
            per_token = [1e3 * float(np.mean([t for w in run for t in w.host_ms])) for run in done]
            host, host_token = summarize([us / moe_layers for us in per_token]), summarize(per_token)
        records.append({
            "configuration": row.name,
            "host_us_per_moe_layer": host,
            "host_us_per_token": host_token,
            "kind": row.kind,
            "policy": row.routing_name,
            "residency": row.residency,
            "capacity": capacity.get(row.name),
            "routing": None if row.routing is None else row.routing.to_dict(),
            "tokens_per_round": int(sum(len(w) for w in ms[0])),
            "ms_per_token": summarize(round_means),
            "p50_ms": float(np.percentile(every, 50)),
            "p99_ms": float(np.percentile(every, 99)),
            "ratio_to_resident": ratio,
            "reference": None if row.name == RESIDENT else reference,
            "copies": _copies(row.kind, round_stats, model_info, (decided_on or {}).get(row.name)),
            "memory": memory.get(row.name),
            "decided_on": (decided_on or {}).get(row.name),
            "engine_kernels": (kernels or {}).get(row.name),
            "rounds": [{"ms_per_token": mean, "ms": run, "stats": stats}
                       for mean, run, stats in zip(round_means, ms, round_stats)],
        })
    add_host_per_copy(records, rows, int(model_info["moe_layers"]))
    return records
