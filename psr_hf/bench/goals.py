"""The latency benchmark's ratios between rows and its goals.

:func:`comparisons` pairs rows by round (exact_lru / PSR, accelerate / PSR, within the engine rows, SpecPrefetch's
OFF / Naive / SpecPrefetch and PRED0); :func:`evaluate_goals` judges the goals set for a lent H100 or H200: a goal
is met only when the whole 95% interval of its ratio (or of a row's per-round means, for a bound) lies on the
goal's side, not met when it lies wholly on the other, otherwise not shown. Both read rows by name
(:meth:`Row.from_name`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..eval.grid import PREFETCH_STEMS, cache_prior, exact_lru, prefetch_only, psr
from ..policy.policies import POLICY_TABLE
from .common import matched_round_means, paired_summary
from .rows import ACCELERATE, BASELINES, ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, Row, capacity_suffix, routed

PSR_GOAL_ROUTING = psr(0.3, 1)  # the PSR row the goals are set for (rows.PSR_GOAL)
# the baselines that steer and prefetch (PSR's rows)
PSR_ROUTINGS = [fields for fields in BASELINES.values()
                if POLICY_TABLE[fields["policy"]].biased and POLICY_TABLE[fields["policy"]].can_prefetch]
# the goals: PSR within 15% / 30% of resident at 50% / 25% residency; accelerate at least 50x slower
RESIDENT_GOALS = {0.5: 1.15, 0.25: 1.3}
ACCELERATE_GOAL = 50.0

# the engine's goals (GPU only; issue 53): ms/token bounds and ratios within the engine rows
ENGINE_RESIDENT_MS_GOALS = {"H100": 1.2, "H200": 1.0}  # engine_resident at most this on that GPU
ENGINE_BOUND_GOAL = 1.15  # every routed engine row at most this times its physical bound (engine_bound)
ENGINE_LRU_GOALS = {0.5: 2.3}  # engine exact_lru / engine psr_lam0.3_n1 >= this (the paper: 2.31 at 50%)
ENGINE_CP_GOALS = {0.5: 1.1, 0.25: 1.3}  # engine cp_lam0.2 / engine psr_lam0.3_n1 >= this (the paper: 1.33)
ENGINE_CP_ROUTING = cache_prior(0.2)
ENGINE_HOST_US_PER_TOKEN_GOAL = 30.0  # host us per token on engine_resident and the copies-skipped rows
ENGINE_PRED0_GOAL = 1.03  # SpecPrefetch's PRED0 (copies skipped) / OFF (exact_lru, copies skipped) at most this
ENGINE_LLAMACPP_GOAL = 1.35  # llama.cpp's tg64 ms/token / engine_resident's, in the same call, at least this
# (benchmarks/engine/llamacpp/: judge.py and interleaved.py)
NEEDS_GPU = "needs a GPU"


def compare_rows(rows: Sequence[Mapping[str, Any]], numerator: str, denominator: str) -> dict[str, Any] | None:
    """:func:`~psr_hf.bench.common.paired_summary` of row ``numerator``'s per-round ms/token over row
    ``denominator``'s (on the tokens both decoded); None if either row is missing."""
    by_name = {row["configuration"]: row for row in rows}
    if numerator not in by_name or denominator not in by_name:
        return None
    a = [[*r["ms"]] for r in by_name[numerator]["rounds"]]
    b = [[*r["ms"]] for r in by_name[denominator]["rounds"]]
    return {"numerator": numerator, "denominator": denominator, **paired_summary(*matched_round_means(a, b))}


def _residencies(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    return sorted({row["residency"] for row in rows if row["residency"] is not None}, reverse=True)


def _rows_by_name(rows: Sequence[Mapping[str, Any]]) -> dict[str, Row | None]:
    return {str(row["configuration"]): Row.from_name(str(row["configuration"])) for row in rows}


def comparisons(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """exact_lru / psr (how much longer exact routing with LRU takes than each PSR row, at the same capacity) and
    accelerate / psr_lam0.3_n1 per capacity: the paper's direction, > 1 means PSR is faster. With engine rows also
    engine_resident / resident, the same exact_lru / psr and cp_lam0.2 / psr_lam0.3_n1 within the engine rows, and
    each HF routed psr_lam0.3_n1 row over its engine row (> 1: the engine is faster than the transformers forward)."""
    pairs: list[tuple[str, str]] = [(ENGINE_RESIDENT, RESIDENT)]
    parsed = _rows_by_name(rows)
    for residency in _residencies(rows):
        def name(kind: str, fields: dict[str, Any]) -> str:
            return routed(kind, fields, residency).name

        pairs += [(name(OFFLOAD, exact_lru()), name(OFFLOAD, fields)) for fields in PSR_ROUTINGS]
        pairs.append((ACCELERATE, name(OFFLOAD, PSR_GOAL_ROUTING)))
        pairs += [(name(ENGINE, exact_lru()), name(ENGINE, fields)) for fields in PSR_ROUTINGS]
        pairs += [(name(ENGINE, ENGINE_CP_ROUTING), name(ENGINE, PSR_GOAL_ROUTING)),
                  (name(OFFLOAD, PSR_GOAL_ROUTING), name(ENGINE, PSR_GOAL_ROUTING))]
        pairs += _prefetch_pairs(parsed, residency)
    return [c for c in (compare_rows(rows, numerator, denominator) for numerator, denominator in pairs)
            if c is not None]


def _prefetch_pairs(parsed: Mapping[str, Row | None], residency: float) -> list[tuple[str, str]]:
    """SpecPrefetch's speed-ups (its Tables 4-5) at one capacity, per budget M present, in the transformers rows and
    in the engine rows: OFF / SpecPrefetch (``exact_lru`` over ``specprefetch_mM``), Naive / SpecPrefetch and OFF /
    Naive (> 1: the denominator is faster); in the engine rows also PRED0 / OFF, both with copies skipped (> 1: the
    prediction and control path costs time)."""
    suffix = capacity_suffix(residency)
    out = []
    for kind in (OFFLOAD, ENGINE):
        budgets = sorted({row.routing.budget for row in parsed.values()
                          if row is not None and row.kind == kind and not row.copies_skipped
                          and row.routing.prefetch in PREFETCH_STEMS and capacity_suffix(row.residency) == suffix})
        for m in budgets:
            off, spec, naive = (routed(kind, fields, residency) for fields in (
                exact_lru(), prefetch_only(m, "predictor"), prefetch_only(m, "previous")))
            out += [(off.name, spec.name), (naive.name, spec.name), (off.name, naive.name)]
            if kind == ENGINE:  # PRED0 / OFF with no copy on either side: what prediction and control cost
                out.append((spec.replace(copies_skipped=True).name, off.replace(copies_skipped=True).name))
    return out


def judge_interval(lo: float, hi: float, point: float, bound: float, op: str) -> dict[str, Any]:
    """``status`` of a goal ``value op bound`` (``op``: ``<=``, ``>=`` or ``>``) from an interval ``[lo, hi]``:
    met when the whole interval is on the goal's side, not met when it is wholly on the other, else not shown;
    ``significant`` and on which side the ``point`` estimate lies."""
    def side(value: float) -> bool:
        return value <= bound if op == "<=" else value >= bound if op == ">=" else value > bound

    defined = math.isfinite(lo) and math.isfinite(hi)
    # the whole interval on the goal's side: for "<=" its upper end, for ">=" / ">" its lower end
    inside = defined and side(hi if op == "<=" else lo)
    outside = defined and not side(lo if op == "<=" else hi)
    return {"status": "met" if inside else "not met" if outside else "not shown",
            "significant": bool(inside) if defined else None, "point": "met" if side(point) else "not met"}


def _judge(entry: dict[str, Any], lo: float, hi: float, point: float, bound: float, op: str) -> None:
    """Sets ``status``, ``significant`` and ``point`` of ``entry`` (:func:`judge_interval`)."""
    entry.update(judge_interval(lo, hi, point, bound, op))


def evaluate_goals(rows: Sequence[Mapping[str, Any]], *, cuda: bool | None = None, device: str | None = None,
                   expert_copy_ms: float | None = None) -> list[dict[str, Any]]:
    """The issue's goals, each ``met`` (the whole 95% interval of the paired ratio lies on the goal's side),
    ``not met`` (the whole interval lies on the other side), ``not shown`` (the interval crosses the bound, or there
    is none: too few rounds) or ``not measured``; ``point`` says on which side the point estimate lies.

    With engine rows (``engine_*``) also the engine's goals: ms/token bounds (the 95% t-interval of the per-round
    means against the bound, the same met / not met / not shown rule; ``ms`` holds the mean) and ratios within the
    engine rows, each routed engine row against its physical bound (:func:`engine_bound`, from ``expert_copy_ms``,
    one expert's copy time measured in the run) and the host's time per token. They are evaluated only when
    ``cuda`` is True (the device of the run, ``device`` its name: the all-resident bound depends on the card);
    otherwise their status is ``needs a GPU``. With ``cuda`` False (a CPU run) no goal is judged, each is ``needs a
    GPU``; ``cuda`` None (unknown) judges the transformers-path goals only."""
    goals = _transformers_goals(rows)
    if cuda is False:
        for entry in goals:
            entry.update(status=NEEDS_GPU, ratio=None, ci95=None, p=None, significant=None, point=None)
    parsed = _rows_by_name(rows)
    if not any(row is not None and row.on_engine for row in parsed.values()):
        return goals
    engine_goals = _engine_goals(rows, parsed, device if cuda else None, expert_copy_ms)
    if not cuda:  # the engine's goals are about GPU latency: on the CPU they are not evaluated
        for entry in engine_goals:
            entry.update(status=NEEDS_GPU, ratio=None, ms=None, ci95=None, p=None, significant=None, point=None)
    return goals + engine_goals


def _name(kind: str, fields: dict[str, Any], residency: float, copies_skipped: bool = False) -> str:
    return routed(kind, fields, residency, copies_skipped).name


def _ratio_goal(rows: Sequence[Mapping[str, Any]], text: str, numerator: str, denominator: str, bound: float,
                op: str) -> dict[str, Any]:
    """A bound on the paired ratio of two rows' per-round ms/token (``op``: ``<=``, ``>=`` or ``>``)."""
    c = compare_rows(rows, numerator, denominator)
    entry: dict[str, Any] = {"goal": text, "numerator": numerator, "denominator": denominator, "bound": bound,
                             "op": op, "status": "not measured", "ratio": None, "ci95": None, "p": None,
                             "significant": None, "point": None}
    if c is not None:
        entry.update(ratio=c["ratio"], ci95=c["ci95"], p=c["p"])
        _judge(entry, *c["ci95"], c["ratio"], bound, op)
    return entry


def _bound_goal(text: str, row_name: str, bound: float, summary: Mapping[str, Any] | None,
                unit: str) -> dict[str, Any]:
    """A bound on a row's per-round mean (``summary``: its mean and 95% t-interval; ``unit``: the entry's key for
    the mean, ``ms`` or ``us``), by the same met / not met / not shown rule."""
    entry: dict[str, Any] = {"goal": text, "row": row_name, "bound": bound, "op": "<=", "status": "not measured",
                             "ratio": None, unit: None, "ci95": None, "p": None, "significant": None, "point": None}
    if summary is not None:
        lo, hi = summary["ci95"]
        entry.update({unit: summary["mean"], "ci95": [lo, hi]})
        _judge(entry, lo, hi, summary["mean"], bound, "<=")
    return entry


def _transformers_goals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """PSR near resident, accelerate far behind PSR, and every PSR row faster than exact_lru, on the transformers
    path."""
    goals = []
    for residency, bound in RESIDENT_GOALS.items():
        psr_row = _name(OFFLOAD, PSR_GOAL_ROUTING, residency)
        goals.append(_ratio_goal(rows, f"{psr_row} <= {bound:g}x resident", psr_row, RESIDENT, bound, "<="))
    for residency in RESIDENT_GOALS:
        psr_row = _name(OFFLOAD, PSR_GOAL_ROUTING, residency)
        goals.append(_ratio_goal(rows, f"accelerate >= {ACCELERATE_GOAL:g}x {psr_row}", ACCELERATE, psr_row,
                                 ACCELERATE_GOAL, ">="))
    for residency in _residencies(rows) or list(RESIDENT_GOALS):
        lru = _name(OFFLOAD, exact_lru(), residency)
        for fields in PSR_ROUTINGS:
            psr_row = _name(OFFLOAD, fields, residency)
            goals.append(_ratio_goal(rows, f"{psr_row} faster than {lru} (exact_lru / psr > 1)", lru, psr_row, 1.0,
                                     ">"))
    return goals


def engine_bound(row: Row, row_record: Mapping[str, Any], twin_record: Mapping[str, Any],
                 expert_copy_ms: float) -> list[float]:
    """Per round, the physical bound of an offloaded engine row: its copies-skipped twin's ms/token (the same
    decisions, nothing copied) and the link time of its copies (copies per token x ``expert_copy_ms``, one expert's
    copy time): their maximum for a row whose copies are prefetches (a policy that inserts: they can overlap the
    computation), the twin plus the link time of its demand copies for the others (the layer waits for them)."""
    copies = row_record["copies"]
    if row.routing.inserts:
        link = float(copies["copies_per_token"]) * expert_copy_ms
        return [max(float(twin), link) for twin in twin_record["ms_per_token"]["rounds"]]
    demand = float(copies["demand_per_token"]) * expert_copy_ms
    return [float(twin) + demand for twin in twin_record["ms_per_token"]["rounds"]]


def _engine_goals(rows: Sequence[Mapping[str, Any]], parsed: Mapping[str, Row | None], device: str | None,
                  expert_copy_ms: float | None) -> list[dict[str, Any]]:
    """Issue 53's goals: engine_resident's ms/token on the card of the run (every card's goal where it is not
    known), every offloaded engine row within :data:`ENGINE_BOUND_GOAL` of its physical bound, exact_lru and
    Cache-Prior over PSR, PRED0 over OFF, and the host's time per token on engine_resident and the copies-skipped
    rows."""
    by_name = {row["configuration"]: row for row in rows}
    cards = [card for card in ENGINE_RESIDENT_MS_GOALS if device is None or card in device]
    goals = []
    for card in cards:
        bound = ENGINE_RESIDENT_MS_GOALS[card]
        row = by_name.get(ENGINE_RESIDENT)
        goals.append(_bound_goal(f"{ENGINE_RESIDENT} <= {bound:g} ms/token on an {card}", ENGINE_RESIDENT, bound,
                                 None if row is None else row["ms_per_token"], "ms"))
    for row_name, row in parsed.items():
        if row is None or row.kind != ENGINE or row.copies_skipped:
            continue
        twin = by_name.get(row.replace(copies_skipped=True).name)
        entry = {"goal": f"{row_name} <= {ENGINE_BOUND_GOAL:g}x its physical bound", "numerator": row_name,
                 "denominator": "its physical bound", "bound": ENGINE_BOUND_GOAL, "op": "<=",
                 "status": "not measured", "ratio": None, "ci95": None, "p": None, "significant": None,
                 "point": None}
        if twin is not None and expert_copy_ms is not None:
            limit = engine_bound(row, by_name[row_name], twin, expert_copy_ms)
            c = paired_summary(by_name[row_name]["ms_per_token"]["rounds"], limit)
            entry.update(ratio=c["ratio"], ci95=c["ci95"], p=c["p"], physical_bound_ms=limit)
            _judge(entry, *c["ci95"], c["ratio"], ENGINE_BOUND_GOAL, "<=")
        goals.append(entry)
    for residency, bound in ENGINE_LRU_GOALS.items():
        lru, psr_row = _name(ENGINE, exact_lru(), residency), _name(ENGINE, PSR_GOAL_ROUTING, residency)
        goals.append(_ratio_goal(rows, f"{lru} >= {bound:g}x {psr_row}", lru, psr_row, bound, ">="))
    for residency, bound in ENGINE_CP_GOALS.items():
        cp, psr_row = _name(ENGINE, ENGINE_CP_ROUTING, residency), _name(ENGINE, PSR_GOAL_ROUTING, residency)
        goals.append(_ratio_goal(rows, f"{cp} >= {bound:g}x {psr_row}", cp, psr_row, bound, ">="))
    skipped = {row_name: row for row_name, row in parsed.items()
               if row is not None and row.kind == ENGINE and row.copies_skipped}
    for row_name, row in skipped.items():
        off = _name(ENGINE, exact_lru(), row.residency, copies_skipped=True)
        if row.routing.prefetch == "predictor" and off in by_name:  # PRED0: prediction and control, no transfer
            goals.append(_ratio_goal(rows, f"PRED0 {row_name} <= {ENGINE_PRED0_GOAL:g}x {off}", row_name, off,
                                     ENGINE_PRED0_GOAL, "<="))
    for row_name in [ENGINE_RESIDENT, *skipped]:
        goals.append(_bound_goal(f"{row_name} host time <= {ENGINE_HOST_US_PER_TOKEN_GOAL:g} us per token", row_name,
                                 ENGINE_HOST_US_PER_TOKEN_GOAL,
                                 (by_name.get(row_name) or {}).get("host_us_per_token"), "us"))
    return goals
