"""The paper's outputs from a sweep's points (psr_hf.bench.frontier): families, the frontier, the figure, the
tables and the verdicts on the three orderings, on synthetic points whose answers are known."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from psr_hf.bench.frontier import (
    ablation_markdown,
    family,
    orderings,
    orderings_markdown,
    pareto_front,
    plot_frontier,
    table2_markdown,
)
from psr_hf.eval.stats import mean_interval

ROUNDS = 4
WINDOWS = 7


def point(policy: str, lam: float | None = None, *, budget: int = 0, eviction: str = "lru", top_j: int = 0,
          delta_mode: str = "fixed", residency: float = 0.5, ms: float = 10.0, sg: float = 0.0,
          noise: float = 0.01, sg_noise: float = 0.002, phase: float = 0.0, name: str | None = None,
          window: int | None = None) -> dict[str, Any]:
    """A sweep point with ``round_ms`` around ``ms`` (relative deterministic noise ``noise``) and per-window excess
    NLLs around log(1 + sg/100) (absolute noise ``sg_noise``); ``phase`` shifts both noises so that two points'
    noises differ."""
    rounds = [ms * (1.0 + noise * math.sin(1.7 * k + phase)) for k in range(ROUNDS)]
    excess = math.log1p(sg / 100.0)
    windows = [0.0] * WINDOWS if policy == "exact" else [
        excess + sg_noise * math.cos(2.3 * k + phase) for k in range(WINDOWS)]
    ms_iv = mean_interval(rounds)
    w_iv = mean_interval(windows)
    capacity = int(round(64 * residency))
    if name is None:
        lam_part = f"_lam{lam:g}" if lam is not None else ""
        name = f"{policy}{lam_part}_n{budget}_{eviction}_j{top_j}_{delta_mode}_res{round(100 * residency)}"
    return {
        "name": name, "policy": policy, "lam": lam, "budget": budget, "eviction": eviction, "top_j": top_j,
        "delta_mode": delta_mode, "window": window, "residency": residency, "capacity": capacity,
        "ms": ms_iv.mean, "ms_ci95": [ms_iv.low, ms_iv.high], "p99_ms": max(rounds) * 1.2, "round_ms": rounds,
        "copies_per_token": 3.0, "demand_per_token": 1.0,
        "sg_pct": 0.0 if policy == "exact" else 100.0 * math.expm1(w_iv.mean),
        "sg_pct_ci95": [0.0, 0.0] if policy == "exact" else [100.0 * math.expm1(w_iv.low),
                                                              100.0 * math.expm1(w_iv.high)],
        "selfgen_excess_nll": float(np.mean(windows)), "selfgen_window_excess": windows,
        "heldout_excess_nll": None, "heldout_excess_nll_ci95": None,
    }


def sweep(residency: float = 0.5) -> list[dict[str, Any]]:
    """A small sweep at one residency where PSR n=1 dominates, exact+LRU is slowest and every family occurs."""
    r = residency
    return [
        point("exact", residency=r, ms=20.0, phase=0.1),
        point("exact", budget=1, eviction="score", residency=r, ms=16.0, phase=0.2),
        point("cache_prior", 0.1, residency=r, ms=14.0, sg=2.0, phase=0.3),
        point("cache_prior", 0.2, residency=r, ms=12.0, sg=4.0, phase=0.4),
        point("cache_prior", 0.2, eviction="score", residency=r, ms=11.5, sg=3.8, phase=0.5),
        point("cache_prior", 0.2, top_j=2, residency=r, ms=13.0, sg=3.0, phase=0.6),
        point("cache_prior", 0.2, top_j=2, delta_mode="running", residency=r, ms=13.5, sg=2.5, phase=0.7),
        point("psr", 0.1, budget=1, eviction="score", residency=r, ms=10.0, sg=1.0, phase=0.8),
        point("psr", 0.2, budget=1, eviction="score", residency=r, ms=8.0, sg=2.0, phase=0.9),
        point("psr", 0.4, budget=1, eviction="score", residency=r, ms=6.0, sg=4.5, phase=1.0),
        point("psr", 0.2, budget=1, eviction="lru", residency=r, ms=9.0, sg=2.2, phase=1.1),
        point("psr", 0.2, budget=2, eviction="score", residency=r, ms=9.5, sg=2.1, phase=1.2),
        point("psr", 0.2, budget=8, eviction="score", residency=r, ms=11.0, sg=2.4, phase=1.3),
        point("spec", residency=r, ms=15.0, sg=5.0, phase=1.4),
    ]


def by_key(entries: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [e for e in entries if e["key"] == key]


# ---------------------------------------------------------------------------------------------------- family
@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"policy": "exact"}, "exact+LRU"),
    ({"policy": "exact", "budget": 1, "eviction": "score"}, "exact+A+prefetch"),
    ({"policy": "cache_prior", "lam": 0.2}, "Cache-Prior"),
    ({"policy": "cache_prior", "lam": 0.2, "eviction": "score"}, "Cache-Prior (A)"),
    ({"policy": "cache_prior", "lam": 0.2, "top_j": 1}, "Cache-Prior J=1"),
    ({"policy": "cache_prior", "lam": 0.2, "top_j": 2, "eviction": "score"}, "Cache-Prior J=2"),
    ({"policy": "cache_prior", "lam": 0.2, "top_j": 2, "delta_mode": "running"}, "Cache-Prior J=2 running"),
    ({"policy": "cache_prior", "lam": 0.2, "top_j": 3, "delta_mode": "running"}, "Cache-Prior J=3 running"),
    ({"policy": "psr", "lam": 0.2, "budget": 1, "eviction": "score"}, "PSR n=1"),
    ({"policy": "psr", "lam": 0.2, "budget": 2, "eviction": "score"}, "PSR n=2"),
    ({"policy": "psr", "lam": 0.2, "budget": 8, "eviction": "score"}, "PSR n=8"),
    ({"policy": "psr", "lam": 0.2, "budget": 1, "eviction": "lru"}, "PSR n=1 (LRU)"),
    ({"policy": "psr", "lam": 0.2, "budget": 1, "eviction": "score", "window": 2}, "PSR n=1, window 2"),
    ({"policy": "psr", "lam": 0.2, "budget": 1, "eviction": "score", "window": None}, "PSR n=1"),
    ({"policy": "spec"}, "spec"),
])
def test_family_names_each_curve(kwargs, expected):
    kw = dict(kwargs)
    assert family(point(kw.pop("policy"), kw.pop("lam", None), **kw)) == expected


def test_family_rejects_an_unknown_policy():
    p = point("psr", 0.2, budget=1, eviction="score")
    p["policy"] = "oracle"
    with pytest.raises(ValueError, match="unknown policy 'oracle'"):
        family(p)


# ---------------------------------------------------------------------------------------------------- frontier
def test_pareto_front_drops_dominated_points_and_keeps_ties():
    def at(name: str, sg: float, ms: float) -> dict[str, Any]:
        p = point("psr", 0.2, budget=1, eviction="score", name=name)
        p["sg_pct"], p["ms"] = sg, ms
        return p

    pts = [at("e", 3.0, 10.0), at("c", 2.0, 16.0), at("a", 0.0, 20.0), at("b", 1.0, 15.0), at("d", 1.0, 15.0),
           at("f", 3.0, 12.0), at("g", 0.0, 21.0)]
    # c is dominated by b; f by e (same sg, slower); g by a (same sg, slower); b and d tie and both stay
    assert pareto_front(pts) == ["a", "b", "d", "e"]
    assert pareto_front([]) == []


def test_plot_frontier_writes_a_png_for_two_residencies(tmp_path):
    path = plot_frontier(sweep(0.5) + sweep(0.25), tmp_path / "frontier.png", title="synthetic")
    assert path == tmp_path / "frontier.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_frontier_rejects_no_points(tmp_path):
    with pytest.raises(ValueError, match="no points given"):
        plot_frontier([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


# ---------------------------------------------------------------------------------------------------- tables
def test_table2_orders_rows_marks_the_frontier_and_formats_numbers():
    pts = sweep(0.5)[::-1] + sweep(0.25)  # input order must not matter
    p = next(q for q in pts if q["name"].startswith("psr_lam0.2_n1_score") and q["residency"] == 0.5)
    p.update(ms=7.98765, ms_ci95=[7.5, 8.456], p99_ms=9.999, copies_per_token=3.14159, demand_per_token=1.26,
             sg_pct=2.0, sg_pct_ci95=[1.84, 2.36], heldout_excess_nll=0.012345,
             heldout_excess_nll_ci95=[0.01, 0.0149], prefetch_late_per_token=0.84, prefetch_in_time_per_token=0.5,
             prefetch_unused_per_token=0.45)
    text = table2_markdown(pts)
    sections = text.split("### ")
    assert sections[1].startswith("50% residency (C=32)") and sections[2].startswith("25% residency (C=16)")
    rows = [line for line in sections[1].splitlines() if line.startswith("| ") and "configuration" not in line]
    labels = [row.split(" | ")[0][2:].rstrip("*") for row in rows]
    assert labels == ["exact+LRU", "exact+A+prefetch", "Cache-Prior, lam=0.1", "Cache-Prior, lam=0.2",
                      "PSR n=1, lam=0.1", "PSR n=1, lam=0.2", "PSR n=1, lam=0.4", "PSR n=2, lam=0.2",
                      "PSR n=8, lam=0.2", "Cache-Prior (A), lam=0.2", "Cache-Prior J=2, lam=0.2",
                      "Cache-Prior J=2 running, lam=0.2", "PSR n=1 (LRU), lam=0.2", "spec"]
    front = set(pareto_front([q for q in pts if q["residency"] == 0.5]))
    starred = {label for label, row in zip(labels, rows) if row.split(" | ")[0].endswith("*")}
    assert starred == {"exact+A+prefetch", "PSR n=1, lam=0.1", "PSR n=1, lam=0.2", "PSR n=1, lam=0.4"}
    assert len(front) == len(starred)
    row = rows[labels.index("PSR n=1, lam=0.2")]
    assert row == ("| PSR n=1, lam=0.2* | 7.99 [7.50, 8.46] | 10.00 | 3.1 (1.3) | 0.8 / 0.5 / 0.5 | 2.0 [1.8, 2.4] | "
                   "0.0123 [0.0100, 0.0149] |")
    assert "| – / – / – |" in rows[2]  # a point without the prefetch breakdown (no offload)
    assert rows[0].endswith("| – |")  # no held-out NLL
    assert text.count("\\* on the latency-divergence frontier") == 2


def test_ablation_names_missing_subtables():
    pts = [p for p in sweep(0.5) if family(p) not in ("Cache-Prior (A)", "PSR n=1 (LRU)", "PSR n=2", "PSR n=8")]
    text = ablation_markdown(pts, lam=0.2)
    assert "skipped: missing Cache-Prior (A), PSR n=1 (LRU) at lam=0.2" in text
    assert "skipped: missing PSR n=2, PSR n=8 at lam=0.2" in text
    assert "| variant | lam |" in text and "| Cache-Prior J=2 running | 0.2 |" in text
    no_cp = ablation_markdown([p for p in sweep(0.5) if p["policy"] != "cache_prior"], lam=0.2)
    assert "skipped: missing every Cache-Prior point" in no_cp


def test_ablation_tables_when_every_point_is_there():
    text = ablation_markdown(sweep(0.5), lam=0.2)
    assert "skipped" not in text and "not measured" not in text
    assert "| PSR n=1 | LRU | 9.00 [" in text and "| Cache-Prior | A | 11.50 [" in text
    budgets = [line.split(" | ")[0] for line in text.splitlines() if line.startswith(("| 1 ", "| 2 ", "| 8 "))]
    assert budgets == ["| 1", "| 2", "| 8"]
    # another lam: only n=1 and Cache-Prior exist at 0.1
    other = ablation_markdown(sweep(0.5), lam=0.1)
    assert "skipped: missing Cache-Prior (A), PSR n=1 (LRU) at lam=0.1" in other


# ---------------------------------------------------------------------------------------------------- orderings
def pair(lam: float, psr_ms: float, psr_sg: float, cp_ms: float, cp_sg: float, **kw) -> list[dict[str, Any]]:
    return [point("psr", lam, budget=1, eviction="score", ms=psr_ms, sg=psr_sg, phase=lam, **kw),
            point("cache_prior", lam, ms=cp_ms, sg=cp_sg, phase=lam + 2.0, **kw)]


def test_claim_a_reproduced_when_psr_is_faster_and_closer_at_every_lam():
    pts = pair(0.1, 8.0, 1.0, 10.0, 3.0) + pair(0.4, 6.0, 3.0, 9.0, 6.0)
    a = by_key(orderings(pts), "a")
    assert [e["lam"] for e in a] == [0.1, 0.4]
    assert all(e["verdict"] == "reproduced" for e in a)
    assert a[0]["latency_ratio"] == pytest.approx(10.0 / 8.0, rel=0.02)
    assert a[0]["latency_ratio_ci95"][0] > 1.0 and a[0]["nll_difference_ci95"][1] < 0.0
    assert a[0]["nll_difference"] == pytest.approx(math.log(1.01) - math.log(1.03), abs=1e-3)
    assert "faster and closer" in a[0]["detail"]


def test_claim_a_reversed_when_psr_is_slower_and_farther():
    a = by_key(orderings(pair(0.2, 12.0, 5.0, 10.0, 2.0)), "a")
    assert len(a) == 1 and a[0]["verdict"] == "reversed"
    assert a[0]["latency_ratio_ci95"][1] < 1.0 and a[0]["nll_difference_ci95"][0] > 0.0


def test_claim_a_not_resolved_when_the_intervals_overlap():
    a = by_key(orderings(pair(0.2, 10.0, 2.0, 10.05, 2.02, noise=0.05, sg_noise=0.02)), "a")
    assert len(a) == 1 and a[0]["verdict"] == "not resolved"
    lo, hi = a[0]["latency_ratio_ci95"]
    assert lo < 1.0 < hi
    assert "faster not resolved" in a[0]["detail"] and "closer not resolved" in a[0]["detail"]
    # one half holds: faster with intervals, distance unresolved
    half = by_key(orderings(pair(0.2, 8.0, 2.0, 10.0, 2.02, sg_noise=0.02)), "a")[0]
    assert half["verdict"] == "not resolved" and "faster holds" in half["detail"]


def test_claim_a_reversed_when_one_half_is_reversed():
    # closer with its interval but slower with its interval: "both faster and closer" is refuted
    slower = by_key(orderings(pair(0.2, 12.0, 1.0, 10.0, 3.0)), "a")[0]
    assert slower["verdict"] == "reversed"
    assert "slower (reversed)" in slower["detail"] and "closer holds" in slower["detail"]
    farther = by_key(orderings(pair(0.2, 8.0, 3.0, 10.0, 1.0)), "a")[0]
    assert farther["verdict"] == "reversed"
    assert "faster holds" in farther["detail"] and "farther (reversed)" in farther["detail"]


def n1_curve() -> list[dict[str, Any]]:
    return [point("psr", lam, budget=1, eviction="score", ms=ms, sg=sg, phase=lam)
            for lam, sg, ms in ((0.1, 1.0, 10.0), (0.2, 2.0, 8.0), (0.4, 4.0, 6.0))]


def test_claim_b_reproduced_when_n1_beats_every_covered_point():
    pts = n1_curve() + [point("cache_prior", 0.2, ms=14.0, sg=1.5, phase=3.0),
                        point("psr", 0.2, budget=2, eviction="score", ms=12.0, sg=3.0, phase=3.5),
                        point("spec", ms=1.0, sg=10.0, phase=4.0),  # outside n=1's sg range: not compared
                        point("exact", ms=1.0)]  # exact: not compared
    b = by_key(orderings(pts), "b")
    assert len(b) == 1
    assert b[0]["verdict"] == "reproduced" and b[0]["covered"] == 2 and b[0]["not_beaten"] == []
    assert b[0]["sg_range"] == pytest.approx([1.0, 4.0], abs=0.05)


def test_claim_b_reversed_when_a_covered_point_is_faster_than_n1():
    fast = point("psr", 0.2, budget=2, eviction="score", ms=4.0, sg=3.0, phase=3.5)
    close = point("cache_prior", 0.2, ms=7.05, sg=3.0, phase=3.0)  # n=1 at sg 3 is 7 ms: within the intervals
    b = by_key(orderings(n1_curve() + [fast, close]), "b")[0]
    assert b["verdict"] == "reversed" and b["winners"] == [fast["name"]]
    assert set(b["not_beaten"]) == {fast["name"], close["name"]} and fast["name"] in b["detail"]
    only_close = by_key(orderings(n1_curve() + [close]), "b")[0]
    assert only_close["verdict"] == "not resolved" and close["name"] in only_close["detail"]
    nothing = by_key(orderings(n1_curve() + [point("spec", ms=1.0, sg=10.0)]), "b")[0]
    assert nothing["verdict"] == "not resolved" and "no other non-exact point" in nothing["detail"]


def test_claim_c_reproduced_and_reversed():
    pts = sweep(0.5)
    c = by_key(orderings(pts), "c")[0]
    assert c["verdict"] == "reproduced" and c["compared"] == len(pts) - 1
    assert c["closest"] == pts[1]["name"] and c["closest_ratio"] == pytest.approx(20.0 / 16.0, rel=0.02)
    assert pts[1]["name"] in c["detail"]
    slower = point("psr", 0.9, budget=8, eviction="lru", ms=30.0, sg=1.0, phase=5.0)
    reversed_c = by_key(orderings(pts + [slower]), "c")[0]
    assert reversed_c["verdict"] == "reversed" and reversed_c["faster_than"] == [slower["name"]]
    assert reversed_c["closest"] == slower["name"] and reversed_c["closest_ratio"] < 1.0


def test_orderings_per_residency_and_markdown():
    entries = orderings(sweep(0.5) + sweep(0.25))
    assert [e["residency"] for e in entries][0] == 0.5 and entries[-1]["residency"] == 0.25
    assert {e["verdict"] for e in entries} <= {"reproduced", "reversed", "not resolved"}
    assert [e["key"] for e in entries if e["residency"] == 0.5] == ["a", "a", "b", "c"]
    text = orderings_markdown(entries)
    lines = text.strip().splitlines()
    assert lines[0] == "| residency | claim | verdict | detail |" and len(lines) == 2 + len(entries)
    assert lines[2].startswith("| 50% | (a) at the same lam PSR is both faster and closer than Cache-Prior |")
    with pytest.raises(ValueError, match="no entries"):
        orderings_markdown([])


def test_orderings_reject_unpaired_rounds():
    pts = pair(0.2, 8.0, 1.0, 10.0, 3.0)
    pts[0]["round_ms"] = pts[0]["round_ms"][:-1]
    with pytest.raises(ValueError, match="same rounds"):
        orderings(pts)
