"""The figure of a ``psr-hf bench`` record (:func:`psr_hf.bench.offload.run_bench`): latency against copies per
token, and the copies of each routed row by kind (the paper's Figure 4). matplotlib is imported when a plot is
drawn, so the benchmark itself runs without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .rows import ACCELERATE, ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, ROUTED_KINDS, Row

if TYPE_CHECKING:
    from matplotlib.axes import Axes

RowRecord = Mapping[str, Any]  # one row of a record's results (a JSON object)

_CATEGORIES = (("demand_per_token", "demand", "#c0392b"), ("prefetch_late_per_token", "prefetch, late", "#e67e22"),
               ("prefetch_in_time_per_token", "prefetch, in time", "#27ae60"),
               ("prefetch_unused_per_token", "prefetch, unused", "#95a5a6"))
_MARKERS = ("o", "s", "^", "D", "v", "P")


def _copies_skipped(row: Mapping[str, Any]) -> bool:
    named = Row.from_name(str(row["configuration"]))
    return named is not None and named.copies_skipped


@dataclass(frozen=True)
class _PlotRows:
    """A record's rows as the figure draws them. With engine rows the figure is about them (the transformers rows
    stay as reference lines): the offloaded engine rows are the routed points, engine_resident a line, the
    copies-skipped rows hollow markers."""

    engine: bool
    routed: list[RowRecord]
    skipped: list[RowRecord]
    by_kind: dict[str, RowRecord]  # the rows of the kinds that are not routed (resident, engine_resident, accelerate)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> _PlotRows:
        rows = list(record["results"])
        engine = any(row["kind"] == ENGINE for row in rows)
        kind = ENGINE if engine else OFFLOAD
        return cls(engine=engine,
                   routed=[row for row in rows if row["kind"] == kind and not _copies_skipped(row)],
                   skipped=[row for row in rows if row["kind"] == kind and _copies_skipped(row)],
                   by_kind={row["kind"]: row for row in rows if row["kind"] not in ROUTED_KINDS})

    @property
    def resident(self) -> RowRecord | None:
        """The reference of the routed points: engine_resident with engine rows, else resident."""
        return self.by_kind.get(ENGINE_RESIDENT if self.engine else RESIDENT)


def plot(record: Mapping[str, Any], path: str | Path) -> Path:
    """Write a PNG of a :func:`~psr_hf.bench.offload.run_bench` record to ``path`` and return the path. Two panels:
    (a) ms/token against copies per token, one point per routed row (marker per capacity, colour per policy, bars:
    95% interval of the mean), the resident row (and accelerate's, if measured) as horizontal lines; (b) copies per
    token of each routed row stacked by kind (demand, late, in-time and unused prefetch), with ms/token as dots on
    a second axis (the paper's Figure 4). A record with engine rows (``--engine``) plots those: the offloaded engine
    rows as the routed points, the copies-skipped rows as hollow markers, engine_resident and the transformers
    resident row as lines."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    rows = _PlotRows.of(record)
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    ax_a, ax_b = fig.subplots(1, 2, width_ratios=[1, 1.35])
    _latency_panel(ax_a, rows)
    _copies_panel(ax_b, rows)
    model = record["model"]
    what = "psr_hf engine (CUDA graphs)" if rows.engine and record["settings"].get("engine_graphs") else (
        "psr_hf engine" if rows.engine else "transformers")
    fig.suptitle(f"psr-hf bench: {model['name']}, {what}, {record['machine']['device']}, "
                 f"{record['settings']['rounds']} rounds")
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def _latency_panel(ax: Axes, rows: _PlotRows) -> None:
    """Panel (a): ms/token against copies per token, with the reference rows as lines."""
    policies = list(dict.fromkeys(row["policy"] for row in rows.routed))
    residencies = list(dict.fromkeys(row["residency"] for row in rows.routed))
    colours = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    markers = {r: _MARKERS[i % len(_MARKERS)] for i, r in enumerate(residencies)}
    for row in rows.routed:
        ms = row["ms_per_token"]
        lo, hi = ms["ci95"]
        err = [[ms["mean"] - lo], [hi - ms["mean"]]] if math.isfinite(lo) and math.isfinite(hi) else None
        ax.errorbar(row["copies"].get("copies_per_token", float("nan")), ms["mean"], yerr=err,
                    marker=markers[row["residency"]], color=colours[row["policy"]], linestyle="none", capsize=3,
                    markersize=7)
    for row in rows.skipped:
        ax.plot(row["copies"].get("copies_per_token", float("nan")), row["ms_per_token"]["mean"],
                marker=markers.get(row["residency"], "o"), color=colours.get(row["policy"], "grey"),
                markerfacecolor="none", linestyle="none", markersize=8)
    if rows.skipped:
        ax.plot([], [], marker="o", color="grey", markerfacecolor="none", linestyle="none",
                label="same routing, copies skipped")
    _reference_lines(ax, rows)
    for p in policies:
        ax.plot([], [], marker="o", color=colours[p], linestyle="none", label=p)
    for r in residencies:
        ax.plot([], [], marker=markers[r], color="grey", linestyle="none", label=f"{r:.0%} resident")
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_xlabel("expert copies per token")
    ax.set_ylabel("ms per token")
    ax.set_title("(a) latency vs copies")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below: never on a point
    ax.grid(alpha=0.3)


def _reference_lines(ax: Axes, rows: _PlotRows) -> None:
    """The resident rows (and accelerate's) as horizontal lines; a log scale where they are far apart."""
    resident, hf_resident = rows.resident, rows.by_kind.get(RESIDENT)
    if rows.engine:
        if resident is not None:
            ax.axhline(resident["ms_per_token"]["mean"], color="black", linewidth=1,
                       label=f"engine, all resident {resident['ms_per_token']['mean']:.2f} ms")
        if hf_resident is not None:
            ax.axhline(hf_resident["ms_per_token"]["mean"], color="black", linestyle="-.", linewidth=1,
                       label=f"transformers, all resident {hf_resident['ms_per_token']['mean']:.1f} ms")
            if resident is not None and hf_resident["ms_per_token"]["mean"] > 8 * resident["ms_per_token"]["mean"]:
                ax.set_yscale("log")
    elif resident is not None:
        ax.axhline(resident["ms_per_token"]["mean"], color="black", linewidth=1,
                   label=f"resident (grouped_mm) {resident['ms_per_token']['mean']:.2f} ms")
    accelerated = rows.by_kind.get(ACCELERATE)
    if accelerated is not None:
        ax.axhline(accelerated["ms_per_token"]["mean"], color="black", linestyle="--", linewidth=1,
                   label=f"accelerate dispatch_model {accelerated['ms_per_token']['mean']:.1f} ms")
        if resident is not None and accelerated["ms_per_token"]["mean"] > 20 * resident["ms_per_token"]["mean"]:
            ax.set_yscale("log")


def _copies_panel(ax: Axes, rows: _PlotRows) -> None:
    """Panel (b): each routed row's copies per token stacked by kind, ms/token as dots on a second axis."""
    routed, resident = rows.routed, rows.resident
    x = np.arange(len(routed), dtype=float)
    physical = bool(routed) and all(row["copies"]["source"] == "offload scheduler"
                                    and row["copies"].get("prefetch_late_per_token") is not None for row in routed)
    if physical:
        categories = _CATEGORIES
    else:
        categories = (("demand_per_token", "demand", "#c0392b"),
                      ("prefetch_per_token", "prefetch (timing not measured)", "#7f8c8d"))
    bottom = np.zeros(len(routed))
    for key, label, colour in categories:
        values = np.array([float(row["copies"].get(key) or 0.0) for row in routed])
        ax.bar(x, values, bottom=bottom, color=colour, label=label, width=0.75)
        bottom += values
    ax.set_ylim(0, 1.45 * max(float(bottom.max(initial=0.0)), 1e-9))  # room for the legend above the bars
    ax.set_xticks(x, [row["configuration"] for row in routed], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("expert copies per token")
    ax.set_title("(b) copies per token by kind; dots: ms/token")
    twin = ax.twinx()
    twin.plot(x, [row["ms_per_token"]["mean"] for row in routed], "o", color="black", label="ms/token")
    if resident is not None:
        twin.axhline(resident["ms_per_token"]["mean"], color="black", linewidth=0.8, linestyle=":",
                     label=f"{'engine ' if rows.engine else ''}resident ms/token")
    twin.set_ylabel("ms per token")
    highest = max([row["ms_per_token"]["mean"] for row in routed]
                  + ([resident["ms_per_token"]["mean"]] if resident is not None else []), default=1.0)
    twin.set_ylim(0, 1.45 * highest)
    handles, labels = ax.get_legend_handles_labels()
    more_h, more_l = twin.get_legend_handles_labels()
    ax.legend(handles + more_h, labels + more_l, fontsize=8, loc="upper left", ncol=3)
