"""The text of a ``psr-hf bench`` record (:func:`psr_hf.bench.offload.run_bench`): the table of its rows and the
lines printed under it (protocol, ReadyRecall, engine host times, comparisons, goals, model, machine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._text import text_table
from ..eval.grid import PREFETCH_STEMS
from .goals import NEEDS_GPU
from .rows import ACCELERATE, ENGINE, ENGINE_RESIDENT, EXACT_LRU, NOCOPY_SUFFIX, RESIDENT, ROUTED_KINDS, Row


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _capacity_label(row: Mapping[str, Any]) -> str:
    if row["kind"] == ENGINE_RESIDENT:
        return "all (cached)"
    if row["kind"] == RESIDENT:
        return "all"
    if row["kind"] == ACCELERATE:
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
    """The rows of a :func:`~psr_hf.bench.offload.run_bench` record as a text table."""
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


def _row_lines(record: Mapping[str, Any]) -> list[str]:
    """The protocol and what the rows' columns hold, ReadyRecall, the engine's host times."""
    s = record["settings"]
    rows = {row["configuration"]: row for row in record["results"]}
    acc = rows.get(ACCELERATE)
    lines = ["", f"teacher-forced batch-1 decode: {s['windows']} window(s) x {s['tokens']} timed positions, "
                 + (f"{s['rounds']} interleaved rounds" if s.get("rounds_timed", s["rounds"]) == s["rounds"] else
                    f"{s['rounds_timed']} of {s['rounds']} interleaved rounds (max_seconds {s['max_seconds']:g})")
                 + (f" (accelerate: the first {acc['tokens_per_round']} positions of window 1)" if acc else "")
                 + "; ms/token: mean over rounds, p99 over every timed token",
             ("ratios: paired over rounds (geometric mean of per-round ratios, 95% t-interval on the logs); copies "
              "per decoded token over all MoE layers: demand (the layer waits for the whole copy), prefetch late "
              "(still in flight when the layer needed it), in time, unused (never executed)")]
    if any(row["kind"] == ENGINE for row in rows.values()):
        how = "CUDA graphs" if s.get("engine_graphs") else "eager, no CUDA graphs"
        lines.append(f"engine_* rows: psr_hf's batch-1 decoder ({how}) on the same windows and positions; their "
                     "ratio column is to "
                     f"{ENGINE_RESIDENT} (engine_resident's own: to resident); engine_*{NOCOPY_SUFFIX}: the same "
                     "routing on the all-resident copy, no copy made (compute-only time, the paper's Table 9); its "
                     "copy columns are the logical copies an offloaded run makes")
    ready = [(name, row["copies"]["ready_recall"]) for name, row in rows.items()
             if row["copies"].get("ready_recall") is not None and _in_prefetch_comparison(name)]
    if ready:
        lines.append("ReadyRecall (executed experts already on the device when their layer starts): " + "; ".join(
            f"{name} {100 * value:.1f}%" for name, value in ready))
    for key, what in (("host_us_per_moe_layer", "engine host time per MoE layer (the step's wall time less its waits "
                                                "on the GPU: policy, scheduler, graph launches)"),
                      ("host_us_per_copy", "engine host time per issued copy (host us per token beyond the row's "
                                           "copies-skipped twin, over its issued copies per token)")):
        hosts = [(name, row[key]) for name, row in rows.items() if row.get(key)]
        if hosts:
            lines.append(f"{what}, us, mean [95% CI] over rounds: " + "; ".join(
                f"{name} {h['mean']:.1f} [{h['ci95'][0]:.1f}, {h['ci95'][1]:.1f}]" for name, h in hosts))
    if any(row["kind"] in ROUTED_KINDS and row["copies"]["source"] != "offload scheduler" for row in rows.values()):
        lines.append("? = not measured: routed rows ran without offload (logical cache only)")
    if s["copy_delay_ms"]:
        lines.append(f"copy delay: {s['copy_delay_ms']} ms added to every copy (emulated link)")
    return lines


def _in_prefetch_comparison(name: str) -> bool:
    """Whether row ``name`` belongs to SpecPrefetch's comparison: OFF (``exact_lru``), SpecPrefetch or Naive."""
    row = Row.from_name(name)
    return (row is not None and row.routing is not None
            and (row.routing_name == EXACT_LRU or row.routing.prefetch in PREFETCH_STEMS))


def goal_line(g: Mapping[str, Any], device: str) -> str:
    """One goal's verdict as the bench prints it (also for records judged again: bench_steady_state.py)."""
    if g["status"] == NEEDS_GPU:
        return (f"goal {g['goal']}: {NEEDS_GPU} (this run: {device}; the goals were set for a lent H100 or H200 "
                "and are judged on CUDA only)")
    across = "" if g["status"] != "not shown" else (f", point estimate on the "
                                                     f"{'goal' if g['point'] == 'met' else 'other'} side, 95% "
                                                     "interval across the bound")
    if g.get("ms") is not None or g.get("us") is not None:
        lo, hi = g["ci95"]
        unit, value, digits = ("ms", g["ms"], 2) if g.get("ms") is not None else ("us", g["us"], 1)
        interval = f" [{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
        return f"goal {g['goal']}: {g['status']} (mean {value:.{digits}f} {unit}{interval}{across})"
    detail = "" if g["ratio"] is None else f" (ratio {_ratio_text(g)}{across})"
    return f"goal {g['goal']}: {g['status']}{detail}"


def report_lines(record: Mapping[str, Any]) -> list[str]:
    """The lines ``psr-hf bench`` prints under the table: protocol, PSR comparisons, goals, model, machine."""
    model, machine = record["model"], record["machine"]
    lines = _row_lines(record)
    if record["comparisons"]:
        lines.append("")
        for c in record["comparisons"]:
            p = "-" if c["p"] is None else (f"{c['p']:.3g}" if c["p"] >= 0.001 else "<0.001")
            lines.append(f"{c['numerator']} / {c['denominator']}: {_ratio_text(c)} (p {p})")
    lines.append("")
    copy = record["settings"].get("expert_copy")
    if copy is not None:
        lines.append(f"physical bound of an offloaded engine row: max(its copies-skipped twin, copies x one expert's "
                     f"copy) where the policy prefetches, twin + demand copies x one copy where it does not; one "
                     f"copy: {copy['ms_median']:.3f} ms for {copy['bytes'] / 1e6:.1f} MB (median of "
                     f"{len(copy['ms'])}, measured in this run)")
    lines += [goal_line(g, machine["device"]) for g in record["goals"]]
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
