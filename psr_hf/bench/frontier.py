"""The paper's outputs from a routing sweep's points: the latency-divergence frontier (Figure 1), the per
configuration table (Table 2), the ablations of Section 6.6 and the three orderings the paper claims, each with a
verdict from the measured intervals.

A point is one routing configuration at one residency, as the sweep writes it: ``name``, ``policy`` (``exact``,
``cache_prior``, ``psr``, ``spec``), ``lam``, ``budget`` (prefetch insertions per layer and token), ``eviction``
(``lru`` or ``score``, the paper's "A priority"), ``top_j``, ``delta_mode``, ``residency``, ``capacity``, ``ms``,
``ms_ci95``, ``p99_ms``, ``round_ms`` (per-round means, paired by index across the points of one residency),
``copies_per_token``, ``demand_per_token``, ``sg_pct`` (excess perplexity on self-generated text, %),
``sg_pct_ci95``, ``selfgen_excess_nll``, ``selfgen_window_excess`` (per-window excess NLL, paired by index),
``heldout_excess_nll`` and ``heldout_excess_nll_ci95``; optionally ``window`` (PSR's pre-gate window, None for the
architecture's default).

Latency comparisons are paired by round (:func:`psr_hf.bench.common.paired_summary`), divergence comparisons by
text window (:func:`psr_hf.eval.stats.mean_interval` of the per-window differences). matplotlib is imported when
the figure is drawn.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..eval.stats import mean_interval
from ..policy.policies import POLICY_TABLE, Policy
from .common import paired_summary

logger = logging.getLogger(__name__)

Point = Mapping[str, Any]

REQUIRED_KEYS = ("name", "policy", "lam", "budget", "eviction", "top_j", "delta_mode", "residency", "capacity", "ms",
                 "ms_ci95", "p99_ms", "round_ms", "copies_per_token", "demand_per_token", "sg_pct", "sg_pct_ci95",
                 "selfgen_excess_nll", "selfgen_window_excess", "heldout_excess_nll", "heldout_excess_nll_ci95")
LABELLED_FAMILIES = ("Cache-Prior", "PSR n=1")
FRONTIER_NOTE = "\\* on the latency-divergence frontier"
PREFETCH_KEYS = ("prefetch_late_per_token", "prefetch_in_time_per_token", "prefetch_unused_per_token")
VERDICTS = ("reproduced", "reversed", "not resolved")
CLAIM_A = "at the same lam PSR is both faster and closer than Cache-Prior"
CLAIM_B = "n=1 is the fastest at every divergence its lam sweep covers"
CLAIM_C = "exact+LRU is the slowest"
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "d")


# ---------------------------------------------------------------------------------------------------- families
def _entry(point: Point) -> Policy:
    """The policy table's entry of ``point``'s policy; raises ``ValueError`` for a policy that is not in the table."""
    policy = point.get("policy")
    if policy not in POLICY_TABLE:
        raise ValueError(f"point {point.get('name')!r} has unknown policy {policy!r}: use one of "
                         f"{tuple(POLICY_TABLE)}")
    return POLICY_TABLE[policy]


def _paper_entry(point: Point) -> Policy | None:
    """The entry of ``point``'s policy where it is one of the paper's (it draws the paper's curves), else None."""
    entry = _entry(point)
    return entry if entry.paper is not None else None


def _on_exact_curve(point: Point) -> bool:
    """Whether ``point`` is one of the paper's exact-routing points (the router's own top-K)."""
    entry = _paper_entry(point)
    return entry is not None and entry.follows_router


def _on_psr_curve(point: Point) -> bool:
    """Whether ``point`` is one of the paper's PSR points (biased selection and prefetch insertion)."""
    entry = _paper_entry(point)
    return entry is not None and entry.biased and entry.can_prefetch


def _on_cache_prior_curve(point: Point) -> bool:
    """Whether ``point`` is one of the paper's Cache-Prior points (biased selection, no insertion)."""
    entry = _paper_entry(point)
    return entry is not None and entry.biased and not entry.can_prefetch


def family(point: Point) -> str:
    """The curve ``point`` belongs to, as the paper's figure and tables name it: ``exact+LRU`` / ``exact+A+prefetch``
    (and ``exact+A`` / ``exact+LRU+prefetch`` for the other two exact combinations), ``Cache-Prior``,
    ``Cache-Prior (A)``, ``Cache-Prior J={j}``, ``Cache-Prior J={j} running``, ``PSR n={budget}`` (A eviction),
    ``PSR n={budget} (LRU)`` (``PSR n={budget}, window {w}`` with a pre-gate window other than the default),
    ``spec``, or another policy of the policy table by its name. The names start with the table's paper labels
    (``Policy.paper``). Raises ``ValueError`` for a policy that is not in the table or an unknown eviction."""
    entry = _entry(point)
    eviction = point.get("eviction")
    if entry.paper is not None and entry.executes_pregate:
        return entry.paper.label
    if eviction not in ("lru", "score"):
        raise ValueError(f"point {point.get('name')!r} has unknown eviction {eviction!r}: use 'lru' or 'score'")
    if entry.paper is None:
        return entry.name
    label = entry.paper.label
    budget = int(point.get("budget") or 0)
    if entry.follows_router:
        return f"{label}+{'LRU' if eviction == 'lru' else 'A'}" + "+prefetch" * entry.inserts(budget)
    if entry.can_prefetch:
        window = f", window {int(point['window'])}" if point.get("window") is not None else ""
        return f"{label} n={budget}{window}" if eviction == "score" else f"{label} n={budget}{window} (LRU)"
    top_j = int(point.get("top_j") or 0)
    if point.get("delta_mode") == "running":
        return f"{label} J={top_j} running"
    if top_j > 0:
        return f"{label} J={top_j}"
    return label if eviction == "lru" else f"{label} (A)"


def _order_key(point: Point) -> tuple:
    """Sort key of the paper's Table 2 rows: exact+LRU, exact+A+prefetch, the other exact rows, Cache-Prior by lam,
    PSR (A) by budget then lam, the other families (Cache-Prior variants, then PSR with LRU), other policies by
    name, spec last."""
    fam = family(point)
    lam = point.get("lam")
    tail = (lam is None, float(lam) if lam is not None else 0.0, float(point["sg_pct"]), str(point["name"]))
    budget = int(point.get("budget") or 0)
    entry = _paper_entry(point)
    if entry is None:  # a policy without a curve of the paper's
        head: tuple = (8, str(point["policy"]))
    elif entry.executes_pregate:
        head = (9,)
    elif entry.follows_router:
        head = {"exact+LRU": (0,), "exact+A+prefetch": (1,)}.get(fam, (2, fam))
    elif not entry.can_prefetch:
        head = (3,) if fam == "Cache-Prior" else (5, 0, int(point.get("top_j") or 0),
                                                  point.get("delta_mode") == "running", point["eviction"] != "lru")
    elif point["eviction"] == "score":
        head = (4, budget, point.get("window") is not None, int(point.get("window") or 0))
    else:
        head = (5, 1, budget)
    return head + tail


def _label(point: Point) -> str:
    """The row label of ``point``: its family, with ``lam=`` where it has one."""
    fam = family(point)
    return fam if point.get("lam") is None else f"{fam}, lam={float(point['lam']):g}"


# ---------------------------------------------------------------------------------------------------- checks
def _check_points(points: Iterable[Point], what: str) -> list[Point]:
    """``points`` as a list; raises ``ValueError`` when there are none or one lacks a key the sweep writes."""
    out = list(points)
    if not out:
        raise ValueError(f"{what}: no points given; pass the sweep's list of points (one dict per configuration "
                         f"and residency)")
    for p in out:
        missing = [k for k in REQUIRED_KEYS if k not in p]
        if missing:
            raise ValueError(f"{what}: point {p.get('name')!r} lacks {missing}; pass points as the sweep writes "
                             f"them (every key present, None where not applicable)")
    return out


def _by_residency(points: Sequence[Point]) -> list[tuple[float, list[Point]]]:
    """``points`` grouped by residency, the highest residency first; returns (residency, points) pairs."""
    groups: dict[float, list[Point]] = {}
    for p in points:
        groups.setdefault(round(float(p["residency"]), 9), []).append(p)
    return sorted(groups.items(), key=lambda kv: -kv[0])


def _residency_title(residency: float, points: Sequence[Point]) -> str:
    """``"50% residency (C=32)"``: the residency as a percentage and the slots per layer of its points."""
    capacities = sorted({int(p["capacity"]) for p in points if p.get("capacity") is not None})
    cap = "/".join(str(c) for c in capacities) if capacities else "?"
    return f"{100.0 * residency:g}% residency (C={cap})"


def _bounds(ci: Sequence[float] | None) -> tuple[float, float]:
    """An interval as two floats, nan where it is missing."""
    if ci is None:
        return math.nan, math.nan
    lo, hi = ci
    return (float(lo) if lo is not None else math.nan), (float(hi) if hi is not None else math.nan)


def _same_lam(a: float | None, b: float | None) -> bool:
    """Whether two lam values are the same setting (both None, or equal to 1e-9)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=0.0, abs_tol=1e-9)


# ---------------------------------------------------------------------------------------------------- frontier
def pareto_front(points: Iterable[Point]) -> list[str]:
    """The names of the points no other point dominates (lower ``ms`` and lower ``sg_pct`` are better; a point is
    dominated by one that is no worse in both and better in one), sorted by ``sg_pct`` (then ``ms``). Points equal
    in both stay on the front together. Returns [] for no points."""
    pts = [(float(p["sg_pct"]), float(p["ms"]), str(p["name"])) for p in points]
    front = []
    for sg, ms, name in pts:
        dominated = any(sg2 <= sg and ms2 <= ms and (sg2 < sg or ms2 < ms) for sg2, ms2, _ in pts)
        if not dominated:
            front.append((sg, ms, name))
    return [name for _, _, name in sorted(front)]


def _curve(points: Sequence[Point]) -> list[Point]:
    """A family's points in curve order: by lam, or by sg_pct (then ms) where lam is None."""
    return sorted(points, key=lambda p: (p.get("lam") is None, float(p["lam"]) if p.get("lam") is not None
                                         else float(p["sg_pct"]), float(p["sg_pct"]), float(p["ms"])))


def _errors(value: float, ci: Sequence[float] | None) -> tuple[float, float]:
    """The (below, above) error bar lengths of ``value`` from its interval, 0 where the interval is missing."""
    lo, hi = _bounds(ci)
    below = value - lo if math.isfinite(lo) else 0.0
    above = hi - value if math.isfinite(hi) else 0.0
    return max(below, 0.0), max(above, 0.0)


def plot_frontier(points: Iterable[Point], path: str | Path, title: str | None = None) -> Path:
    """Write the paper's Figure 1 as a PNG to ``path`` and return the path: one panel per residency (highest
    first), ms/token against the self-generated excess perplexity sg% on linear axes, one line with markers per
    family (:func:`family`) with 95% error bars in both directions, lam labels on the ``Cache-Prior`` and
    ``PSR n=1`` curves, exact-routing points as single markers and each residency's frontier points
    (:func:`pareto_front`) circled. Raises ``ValueError`` for no points."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    pts = _check_points(points, "plot_frontier")
    groups = _by_residency(pts)
    families = list(dict.fromkeys(family(p) for p in sorted(pts, key=_order_key)))
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(families) <= 10 else "tab20"]
    colours = {f: cmap(i % cmap.N) for i, f in enumerate(families)}
    markers = {f: _MARKERS[i % len(_MARKERS)] for i, f in enumerate(families)}
    fig = Figure(figsize=(6.0 * len(groups), 5.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(groups), squeeze=False)[0])
    handles: dict[str, Any] = {}
    for ax, (residency, group) in zip(axes, groups):
        front = set(pareto_front(group))
        by_family: dict[str, list[Point]] = {}
        for p in group:
            by_family.setdefault(family(p), []).append(p)
        for fam in families:
            if fam not in by_family:
                continue
            curve = _curve(by_family[fam])
            x = np.array([float(p["sg_pct"]) for p in curve])
            y = np.array([float(p["ms"]) for p in curve])
            xerr = np.array([_errors(float(p["sg_pct"]), p["sg_pct_ci95"]) for p in curve]).T
            yerr = np.array([_errors(float(p["ms"]), p["ms_ci95"]) for p in curve]).T
            single = _on_exact_curve(curve[0])
            container = ax.errorbar(x, y, xerr=xerr, yerr=yerr, color=colours[fam], marker=markers[fam],
                                    linestyle="none" if single else "-", markersize=9 if single else 6,
                                    capsize=2, elinewidth=0.8, linewidth=1.3, label=fam)
            handles.setdefault(fam, container)
            if fam in LABELLED_FAMILIES:
                for p in curve:
                    if p.get("lam") is not None:
                        ax.annotate(f"{float(p['lam']):g}", (float(p["sg_pct"]), float(p["ms"])),
                                    textcoords="offset points", xytext=(7, 7), fontsize=7, color="black")
        on_front = [p for p in group if p["name"] in front]
        circles = ax.scatter([float(p["sg_pct"]) for p in on_front], [float(p["ms"]) for p in on_front], s=260,
                             facecolors="none", edgecolors="black", linewidths=1.4, zorder=5,
                             label="latency-divergence frontier")
        handles.setdefault("latency-divergence frontier", circles)
        ax.set_title(_residency_title(residency, group))
        ax.set_xlabel("sg% (self-generated excess perplexity, %)")
        ax.set_ylabel("ms per token")
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
               ncol=max(1, min(len(handles), 3 * len(groups))), fontsize=8)
    fig.suptitle(title or "Latency against divergence from exact routing (circled: frontier)")
    path = Path(path)
    fig.savefig(path, dpi=120)
    logger.info("frontier figure of %d points at %d residencies written to %s", len(pts), len(groups), path)
    return path


# ---------------------------------------------------------------------------------------------------- tables
def _num(value: float | None, digits: int) -> str:
    """``value`` with ``digits`` decimals; an en dash for None, ``nan`` for a nan."""
    if value is None:
        return "–"
    v = float(value)
    return "nan" if math.isnan(v) else f"{v:.{digits}f}"


def _with_ci(value: float | None, ci: Sequence[float] | None, digits: int) -> str:
    """``"1.23 [1.10, 1.36]"``: a value with its interval, or the value alone where there is no interval."""
    if value is None:
        return "–"
    if ci is None:
        return _num(value, digits)
    lo, hi = _bounds(ci)
    return f"{_num(value, digits)} [{_num(lo, digits)}, {_num(hi, digits)}]"


def table2_markdown(points: Iterable[Point]) -> str:
    """The paper's Table 2 as Markdown, one table per residency (highest first) under a ``###`` heading: columns
    configuration, ms [95% CI], p99, copies (demand), prefetch copies late / in time / unused per token (a dash
    where a point has none: no offload), sg% [95% CI] and held-out excess NLL; rows exact+LRU,
    exact+A+prefetch, Cache-Prior by lam, PSR by budget then lam, the other families, spec last. Frontier points
    (each residency's :func:`pareto_front`) carry a ``*`` after the configuration, explained by a footnote line.
    Returns the Markdown text. Raises ``ValueError`` for no points."""
    pts = _check_points(points, "table2_markdown")
    lines: list[str] = []
    for residency, group in _by_residency(pts):
        front = set(pareto_front(group))
        lines += [f"### {_residency_title(residency, group)}", "",
                  "| configuration | ms [95% CI] | p99 | copies (demand) | prefetch late / in time / unused | "
                  "sg% [95% CI] | held-out excess NLL |",
                  "|---|---|---|---|---|---|---|"]
        for p in sorted(group, key=_order_key):
            star = "*" if p["name"] in front else ""
            copies = f"{_num(p['copies_per_token'], 1)} ({_num(p['demand_per_token'], 1)})"
            prefetch = " / ".join(_num(p.get(k), 1) for k in PREFETCH_KEYS)
            lines.append(f"| {_label(p)}{star} | {_with_ci(p['ms'], p['ms_ci95'], 2)} | {_num(p['p99_ms'], 2)} | "
                         f"{copies} | {prefetch} | {_with_ci(p['sg_pct'], p['sg_pct_ci95'], 1)} | "
                         f"{_with_ci(p['heldout_excess_nll'], p['heldout_excess_nll_ci95'], 4)} |")
        lines += ["", FRONTIER_NOTE, ""]
    return "\n".join(lines).rstrip() + "\n"


def _find(group: Sequence[Point], fam: str, lam: float | None) -> Point | None:
    """The point of ``group`` of family ``fam`` at ``lam`` (the first if several), None if there is none."""
    for p in group:
        if family(p) == fam and _same_lam(p.get("lam"), lam):
            return p
    return None


def ablation_markdown(points: Iterable[Point], lam: float = 0.2) -> str:
    """Section 6.6's ablations as Markdown, per residency (highest first): (a) steering x eviction at ``lam`` and
    n=1 (Cache-Prior and PSR n=1, each with LRU and A eviction), (b) the prefetch budget of PSR (A) at ``lam``
    (every budget present), (c) every Cache-Prior point (J, fixed or running delta, every lam); each row gives
    ms and sg% with their 95% intervals. A sub-table whose points are missing is replaced by one line naming
    them. Returns the Markdown text. Raises ``ValueError`` for no points."""
    pts = _check_points(points, "ablation_markdown")
    lam_text = f"lam={float(lam):g}"
    header = "| {} | ms [95% CI] | sg% [95% CI] |"
    lines: list[str] = []
    for residency, group in _by_residency(pts):
        lines += [f"### {_residency_title(residency, group)}", ""]
        # (a) steering x eviction
        cells = (("Cache-Prior", "LRU", "Cache-Prior"), ("Cache-Prior", "A", "Cache-Prior (A)"),
                 ("PSR n=1", "LRU", "PSR n=1 (LRU)"), ("PSR n=1", "A", "PSR n=1"))
        found = [(steer, ev, fam, _find(group, fam, lam)) for steer, ev, fam in cells]
        missing = [fam for _, _, fam, p in found if p is None]
        lines.append(f"(a) steering x eviction at {lam_text}, n=1")
        if missing:
            lines.append(f"skipped: missing {', '.join(missing)} at {lam_text}")
        else:
            lines += ["", "| steering | eviction | ms [95% CI] | sg% [95% CI] |", "|---|---|---|---|"]
            lines += [f"| {steer} | {ev} | {_with_ci(p['ms'], p['ms_ci95'], 2)} | "
                      f"{_with_ci(p['sg_pct'], p['sg_pct_ci95'], 1)} |" for steer, ev, _, p in found if p]
        lines.append("")
        # (b) prefetch budget
        budgets = sorted({int(p["budget"]) for p in group if _on_psr_curve(p) and p["eviction"] == "score"
                          and _same_lam(p.get("lam"), lam)})
        absent = [f"PSR n={n}" for n in (1, 2, 8) if n not in budgets]
        lines.append(f"(b) prefetch budget, PSR (A) at {lam_text}")
        if len(budgets) < 2:
            lines.append(f"skipped: missing {', '.join(absent)} at {lam_text}" if absent else
                         f"skipped: fewer than two budgets at {lam_text}")
        else:
            lines += ["", header.format("budget n"), "|---|---|---|"]
            for n in budgets:
                p = _find(group, f"PSR n={n}", lam)
                if p is not None:
                    lines.append(f"| {n} | {_with_ci(p['ms'], p['ms_ci95'], 2)} | "
                                 f"{_with_ci(p['sg_pct'], p['sg_pct_ci95'], 1)} |")
            if absent:
                lines.append(f"\nnot measured: {', '.join(absent)} at {lam_text}")
        lines.append("")
        # (c) Cache-Prior as published
        cache_prior = sorted((p for p in group if _on_cache_prior_curve(p)), key=_order_key)
        lines.append("(c) Cache-Prior as published (J, fixed or running delta, every lam)")
        if not cache_prior:
            lines.append("skipped: missing every Cache-Prior point")
        else:
            lines += ["", "| variant | lam | ms [95% CI] | sg% [95% CI] |", "|---|---|---|---|"]
            lines += [f"| {family(p)} | {'–' if p['lam'] is None else format(float(p['lam']), 'g')} | "
                      f"{_with_ci(p['ms'], p['ms_ci95'], 2)} | {_with_ci(p['sg_pct'], p['sg_pct_ci95'], 1)} |"
                      for p in cache_prior]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------- orderings
def _interval_text(value: float, ci: Sequence[float], digits: int) -> str:
    """``"1.234 [1.100, 1.370]"`` for the detail strings."""
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _window_difference(point: Point, baseline: Point) -> dict[str, Any]:
    """The per-window excess NLL of ``point`` minus ``baseline``'s, paired by window: ``mean`` and ``ci95`` (the
    95% t-interval, :func:`~psr_hf.eval.stats.mean_interval`). Raises ``ValueError`` for unpaired windows."""
    a = np.asarray(point["selfgen_window_excess"], dtype=np.float64)
    b = np.asarray(baseline["selfgen_window_excess"], dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"{point['name']!r} and {baseline['name']!r} have unpaired selfgen_window_excess "
                         f"(shapes {a.shape} and {b.shape}); score every configuration on the same windows")
    interval = mean_interval(a - b)
    return {"mean": interval.mean, "ci95": [interval.low, interval.high]}


def _paired_rounds(point: Point, baseline: Point) -> dict[str, Any]:
    """:func:`~psr_hf.bench.common.paired_summary` of the two points' ``round_ms``; raises ``ValueError`` naming
    both points when their rounds are not paired."""
    if len(point["round_ms"]) != len(baseline["round_ms"]):
        raise ValueError(f"{point['name']!r} has {len(point['round_ms'])} rounds and {baseline['name']!r} "
                         f"{len(baseline['round_ms'])}; time every configuration of a residency in the same rounds")
    return paired_summary(point["round_ms"], baseline["round_ms"])


def _claim_a(residency: float, group: Sequence[Point]) -> list[dict[str, Any]]:
    """Claim (a) at every lam with both a ``PSR n=1`` and a ``Cache-Prior`` point; returns one entry per lam."""
    out = []
    psr = [p for p in group if family(p) == "PSR n=1" and p.get("lam") is not None]
    for p in sorted(psr, key=lambda q: float(q["lam"])):
        cp = _find(group, "Cache-Prior", p["lam"])
        if cp is None:
            continue
        ratio = _paired_rounds(cp, p)
        diff = _window_difference(p, cp)
        r_lo, r_hi = ratio["ci95"]
        d_lo, d_hi = diff["ci95"]
        faster, slower = r_lo > 1.0, r_hi < 1.0
        closer, farther = d_hi < 0.0, d_lo > 0.0
        # the claim is a conjunction: refuted ("reversed") as soon as either half is reversed with its interval
        if faster and closer:
            verdict, how = "reproduced", "PSR is faster and closer"
        elif slower and farther:
            verdict, how = "reversed", "PSR is slower and farther"
        else:
            speed = "faster holds" if faster else ("slower (reversed)" if slower else "faster not resolved")
            distance = "closer holds" if closer else ("farther (reversed)" if farther else "closer not resolved")
            verdict, how = ("reversed" if slower or farther else "not resolved"), f"{speed}; {distance}"
        detail = (f"lam={float(p['lam']):g}: latency Cache-Prior/PSR {_interval_text(ratio['ratio'], ratio['ci95'], 3)}"
                  f" over {len(p['round_ms'])} rounds; excess NLL PSR-Cache-Prior "
                  f"{_interval_text(diff['mean'], diff['ci95'], 4)} over {len(p['selfgen_window_excess'])} windows; "
                  f"{how}")
        out.append({"claim": f"(a) {CLAIM_A}", "key": "a", "residency": residency, "verdict": verdict,
                    "detail": detail, "lam": float(p["lam"]), "psr": p["name"], "cache_prior": cp["name"],
                    "latency_ratio": ratio["ratio"], "latency_ratio_ci95": list(ratio["ci95"]), "latency_p": ratio["p"],
                    "nll_difference": diff["mean"], "nll_difference_ci95": list(diff["ci95"])})
    return out


def _claim_b(residency: float, group: Sequence[Point]) -> dict[str, Any]:
    """Claim (b): every other non-exact point within the n=1 curve's sg range is slower than the n=1 curve
    interpolated at its sg (with intervals); returns the entry."""
    base = {"claim": f"(b) {CLAIM_B}", "key": "b", "residency": residency}
    curve = sorted((p for p in group if family(p) == "PSR n=1"), key=lambda p: (float(p["sg_pct"]), float(p["ms"])))
    if not curve:
        return {**base, "verdict": "not resolved", "detail": "no PSR n=1 points", "covered": 0, "beaten": [],
                "not_beaten": [], "winners": [], "sg_range": None}
    # one n=1 point per sg value (the fastest), so the curve is a function of sg
    xs, mids, lows, highs = [], [], [], []
    for p in curve:
        if xs and math.isclose(xs[-1], float(p["sg_pct"]), rel_tol=0.0, abs_tol=1e-12):
            continue
        lo, hi = _bounds(p["ms_ci95"])
        xs.append(float(p["sg_pct"]))
        mids.append(float(p["ms"]))
        lows.append(lo)
        highs.append(hi)
    sg_range = [xs[0], xs[-1]]
    others = [p for p in group if not _on_exact_curve(p) and family(p) != "PSR n=1"
              and sg_range[0] <= float(p["sg_pct"]) <= sg_range[1]]
    if not others:
        return {**base, "verdict": "not resolved",
                "detail": f"no other non-exact point has sg% within the n=1 range [{xs[0]:.1f}, {xs[-1]:.1f}]",
                "covered": 0, "beaten": [], "not_beaten": [], "winners": [], "sg_range": sg_range}
    beaten, not_beaten, winners, supports = [], [], [], 0
    for p in others:
        sg = float(p["sg_pct"])
        n1_ms, n1_lo, n1_hi = (float(np.interp(sg, xs, ys)) for ys in (mids, lows, highs))
        lo, hi = _bounds(p["ms_ci95"])
        supports += float(p["ms"]) > n1_ms
        if lo > n1_hi:
            beaten.append(p["name"])
        else:
            not_beaten.append(p["name"])
            if hi < n1_lo:
                winners.append(p["name"])
    if winners:
        verdict = "reversed"
    elif not not_beaten:
        verdict = "reproduced"
    else:
        verdict = "not resolved"
    detail = (f"{len(others)} points within n=1's sg% range [{xs[0]:.1f}, {xs[-1]:.1f}]: slower than n=1 with "
              f"intervals {len(beaten)}, by point estimate {supports}")
    if not_beaten:
        detail += f"; not beaten: {', '.join(not_beaten)}"
    if winners:
        detail += f"; faster than n=1 with intervals: {', '.join(winners)}"
    return {**base, "verdict": verdict, "detail": detail, "covered": len(others), "beaten": beaten,
            "not_beaten": not_beaten, "winners": winners, "supports": supports, "sg_range": sg_range}


def _claim_c(residency: float, group: Sequence[Point]) -> dict[str, Any]:
    """Claim (c): exact+LRU is slower than every other point of the residency, paired by round; returns the
    entry."""
    base = {"claim": f"(c) {CLAIM_C}", "key": "c", "residency": residency}
    exact = [p for p in group if family(p) == "exact+LRU"]
    others = [p for p in group if family(p) != "exact+LRU"]
    if not exact or not others:
        reason = "no exact+LRU point" if not exact else "no other point to compare with"
        return {**base, "verdict": "not resolved", "detail": reason, "compared": 0, "slower_than": 0,
                "faster_than": [], "closest": None, "closest_ratio": None, "closest_ratio_ci95": None}
    reference = exact[0]
    ratios = {p["name"]: _paired_rounds(reference, p) for p in others}
    slower_than = [n for n, r in ratios.items() if r["ci95"][0] > 1.0]
    faster_than = [n for n, r in ratios.items() if r["ci95"][1] < 1.0]
    closest = min(ratios, key=lambda n: ratios[n]["ratio"])
    if faster_than:
        verdict = "reversed"
    elif len(slower_than) == len(others):
        verdict = "reproduced"
    else:
        verdict = "not resolved"
    c = ratios[closest]
    detail = (f"exact+LRU slower with intervals than {len(slower_than)} of {len(others)}; closest: {closest} "
              f"(exact+LRU/it {_interval_text(c['ratio'], c['ci95'], 3)})")
    if faster_than:
        detail += f"; exact+LRU faster than: {', '.join(faster_than)}"
    return {**base, "verdict": verdict, "detail": detail, "compared": len(others), "slower_than": len(slower_than),
            "faster_than": faster_than, "closest": closest, "closest_ratio": c["ratio"],
            "closest_ratio_ci95": list(c["ci95"])}


def orderings(points: Iterable[Point]) -> list[dict[str, Any]]:
    """The paper's three orderings, judged per residency (highest first) from the intervals: (a) at each lam PSR
    n=1 is faster (Cache-Prior/PSR ms ratio paired by round) and closer (PSR - Cache-Prior excess NLL paired by
    window) than Cache-Prior, reversed when either half is reversed with its interval; (b) n=1 is the fastest at
    every divergence its lam sweep covers (other points against the n=1 curve interpolated at their sg%); (c)
    exact+LRU is the slowest (its ms over each other point's, paired by round). Returns a list of dicts with
    ``claim``, ``key`` (``a``/``b``/``c``), ``residency``, ``verdict`` (``reproduced``, ``reversed`` or ``not
    resolved``), ``detail`` (the numbers and intervals in words) and the numbers as fields. Raises ``ValueError``
    for no points or unpaired rounds or windows."""
    pts = _check_points(points, "orderings")
    out: list[dict[str, Any]] = []
    for residency, group in _by_residency(pts):
        out += _claim_a(residency, group)
        out.append(_claim_b(residency, group))
        out.append(_claim_c(residency, group))
    for entry in out:
        logger.debug("residency %g %s: %s (%s)", entry["residency"], entry["claim"], entry["verdict"], entry["detail"])
    return out


def orderings_markdown(entries: Iterable[Mapping[str, Any]]) -> str:
    """The :func:`orderings` entries as a Markdown table (residency, claim, verdict, detail); returns the text.
    Raises ``ValueError`` for no entries."""
    rows = list(entries)
    if not rows:
        raise ValueError("orderings_markdown: no entries given; pass the list that orderings(points) returns")
    lines = ["| residency | claim | verdict | detail |", "|---|---|---|---|"]
    for e in rows:
        cells = (f"{100.0 * float(e['residency']):g}%", str(e["claim"]), str(e["verdict"]), str(e["detail"]))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
