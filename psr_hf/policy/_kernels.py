"""numba kernels of the logical cache: the rules of docs/ALGORITHM.md, parts 1 and 2. Private and array-only.

Everything here is called through :class:`psr_hf.policy.LogicalCache`, which validates shapes and dtypes and
turns error codes into ``ValueError``. The kernels validate the values they read (NaN scores, token ids) before
touching any state, so a bad block leaves the state as it was. State and config travel as a few flat arrays
(numba's per-call cost grows with the number of arguments), laid out in :func:`_step_layer_checked`.

The policy reaches the kernels as behaviour flags (``MI_INSERTS``, ``MI_BIASED``, ``MI_EXECUTES_PREGATE``, from
:mod:`.policies`), never as a name: the kernels branch on what a policy does (``MI_POLICY`` only names it).

One layer (:func:`_step_layer_checked`) reads its rules once (:func:`_layer_rules`, :func:`_cut_scratch`) and runs
each position, in ALGORITHM.md's order: :func:`_insert_predicted` (part 1, counted by :func:`_count_prefetch`), the
selection (:func:`_top_k_of` of the router or the pre-gate, or :func:`_bonus_scale` and :func:`_biased_top_k` for
biased policies), :func:`_insert_demanded` and :func:`_update_statistics` (counted by :func:`_count_step`); a padded
position :func:`_padded_position`. The small helpers of one layer are inlined into it (``inline="always"``), so the
split costs no call. Every kernel is tested against the slow reference
:mod:`psr_hf.policy.reference` (docs/policy.md).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange

from .numba_setup import use_user_cache_folder

use_user_cache_folder()  # before the decorators below: numba picks each function's cache folder as it decorates it

# evictions
EVICT_SCORE, EVICT_LRU = 0, 1

# config_ints fields (token-seen flags follow)
(MI_POLICY, MI_EVICTION, MI_K, MI_C, MI_BUDGET, MI_WINDOW, MI_TOP_J, MI_RUNNING, MI_INSERTS, MI_BIASED,
 MI_EXECUTES_PREGATE, MI_VOCAB, MI_DISTANCE) = range(13)
MI_SIZE = 13
# config_floats fields (delta [L] and the fallback prior [L, E] follow)
MF_LAM, MF_DECAY_FAST, MF_DECAY_SLOW = range(3)
MF_SIZE = 3

# state planes, counters fields
S_FAST, S_SLOW, LAST_USE, RESIDENT, PROTECTED, INSERTED = range(6)
N_PLANES = 6
R_RANGE_SUM, R_RANGE_COUNT, R_STEP, R_PENDING, R_STEPS, R_PREFETCH, R_DEMAND, R_REPLACED = range(8)
R_SIZE = 8

# s_fast below s_slow * FLUSH_RATIO is flushed to zero (see _update_statistics); 2**-60 < half an ulp (2**-53)
FLUSH_RATIO = 2.0**-60

# modes
MODE_BOTH, MODE_INSERT, MODE_SELECT = 0, 1, 2

# error codes (see LogicalCache._raise)
OK, ERR_SCORES, ERR_PREGATE, ERR_TOKEN, ERR_FEW_FINITE, ERR_NO_PART1, ERR_PART1_TWICE, ERR_SHAPE = range(8)


# ---------------------------------------------------------------------------------------------------- layouts
PlanColumns = namedtuple(
    "PlanColumns",
    "selected n_prefetch prefetch prefetch_evicted n_demand demand demand_evicted n_replaced width",
)
PlanColumns.__doc__ = "First column of each field of the copy plan, then the plan's width (see :func:`plan_layout`)."


@njit(cache=True, nogil=True)
def plan_layout(K, P):
    """The copy plan's columns for top-``K`` routing and at most ``P`` prefetch insertions: the one definition of
    the layout, read by the kernels and (through ``plan_layout.py_func``) by :class:`~psr_hf.policy.StepPlan`.

    ``selected [K] | n_prefetch | prefetch [P] | prefetch_evicted [P] | n_demand | demand [K] |
    demand_evicted [K] | n_replaced``: the experts to execute, the prefetch insertions (count, experts, the
    expert each evicted or -1), the demand insertions (likewise) and the number of router slots replaced.

    Returns a :class:`PlanColumns`: the first column of each field, then the width (columns in all).
    """
    selected = 0
    n_prefetch = selected + K
    prefetch = n_prefetch + 1
    prefetch_evicted = prefetch + P
    n_demand = prefetch_evicted + P
    demand = n_demand + 1
    demand_evicted = demand + K
    n_replaced = demand_evicted + K
    width = n_replaced + 1
    return PlanColumns(selected, n_prefetch, prefetch, prefetch_evicted, n_demand, demand, demand_evicted,
                       n_replaced, width)


@njit(cache=True, nogil=True)
def scratch_sizes(E, K, window, top_j, P):
    """Sizes of the float64 and int64 scratch buffers of :func:`_step_layer_checked` for ``E`` experts, top-``K``
    routing, a pre-gate ``window`` (at most E), ``top_j`` and at most ``P`` prefetch insertions (allocate with
    zeros). The buffers are cut in :func:`_cut_scratch`, next to which this layout is described."""
    ranked = max(window, K, top_j)
    return 6 * E + ranked, 2 * E + 4 * ranked + P


# ---------------------------------------------------------------------------------------------------- pieces
@njit(cache=True, nogil=True)
def _select_top(x, y, k, out, buf, cand, lo):
    """The ``k`` largest of ``x [E]`` (float64), ties toward the larger ``y``, then the lower index; indices in
    rank order into ``out[:k]``. For a plain top-k pass ``y = x``.

    Branch-free where it matters (unpredictable branches dominate a naive insertion): a lower bound of the k-th
    largest ``x`` is the smallest of the maxima of ``k`` disjoint groups (each group holds an element at least
    that large); only the few elements reaching it are ranked. ``lo`` is another known lower bound of the
    k-th largest (or -inf). ``buf`` (float64 >= k + 2E) and ``cand`` (int64 >= E) are scratch.
    """
    # (indices into buf instead of slices: a slice is a new array object with reference counting)
    E = x.shape[0]
    for c in range(k):
        buf[c] = -np.inf
    full = E - E % k  # group of element e: e mod k (keeps the inner loop contiguous)
    for base in range(0, full, k):
        for c in range(k):
            v = x[base + c]
            if v > buf[c]:
                buf[c] = v
    for e in range(full, E):
        v = x[e]
        if v > buf[e - full]:
            buf[e - full] = v
    thr = buf[0]
    for c in range(1, k):
        if buf[c] < thr:
            thr = buf[c]
    if lo > thr:
        thr = lo  # a caller's tighter lower bound of the k-th largest
    nc = 0
    for e in range(E):  # branch-free compaction, ascending index
        cand[nc] = e
        nc += x[e] >= thr
    cy0 = k + E
    for i in range(nc):
        buf[k + i] = x[cand[i]]
        buf[cy0 + i] = y[cand[i]]
    # insertion into a sorted list of the k best (few candidates reach the threshold, so few insertions)
    n = 0
    for i in range(nc):
        xi = buf[k + i]
        yi = buf[cy0 + i]
        if n == k:
            w = out[k - 1]
            if not (xi > buf[k + w] or (xi == buf[k + w] and yi > buf[cy0 + w])):
                continue
            pos = k - 1
        else:
            pos = n
            n += 1
        while pos > 0:
            w = out[pos - 1]
            if xi > buf[k + w] or (xi == buf[k + w] and yi > buf[cy0 + w]):
                out[pos] = w
                pos -= 1
            else:
                break
        out[pos] = i
    for r in range(k):
        out[r] = cand[out[r]]


@njit(cache=True, nogil=True)
def _top_k_of(values, k, as_f64, out, select_buf, select_idx):
    """``topk(values, k)`` (ALGORITHM.md: ties to the lower index) of one position's float32 ``values [E]`` into
    ``out[:k]``, in rank order; ``as_f64 [E]`` receives the values as float64 (read again by the caller).
    ``select_buf``, ``select_idx``: scratch of :func:`_select_top`."""
    for e in range(values.shape[0]):
        as_f64[e] = values[e]
    _select_top(as_f64, as_f64, k, out, select_buf, select_idx, -np.inf)


# What an eviction reads besides the row's state, fixed for one kernel call (one layer): built once per call.
Eviction = namedtuple(
    "Eviction", "rule layer num_layers config_ints config_floats prior_indptr prior_experts prior_values")
Eviction.__doc__ = """The eviction rule (EVICT_SCORE or EVICT_LRU), the MoE layer and layer count, and the arrays
the score priority reads (config arrays and token prior CSR, see :func:`_step_layer_checked`)."""


@njit(cache=True, nogil=True)
def _priority(eviction, token, row, priority):
    """Eviction priority of every expert (ALGORITHM.md step 1) into ``priority [E]``.

    ``eviction``: an :data:`Eviction`. LRU: ``last_use``. Score: ``s_fast + s_slow`` plus the token prior of
    ``token`` at the layer (the layer's fallback prior for a token never seen in calibration). ``row``: the
    state ``[6, E]`` of this layer and row.
    """
    E = priority.shape[0]
    if eviction.rule == EVICT_LRU:
        for e in range(E):
            priority[e] = row[LAST_USE, e]
        return
    for e in range(E):
        priority[e] = row[S_FAST, e] + row[S_SLOW, e]
    config_ints = eviction.config_ints
    if config_ints[MI_VOCAB] > 0:
        layer = eviction.layer
        L = eviction.num_layers
        if config_ints[MI_SIZE + token] != 0:
            r = token * L + layer
            indptr = eviction.prior_indptr
            experts = eviction.prior_experts
            values = eviction.prior_values
            for j in range(indptr[r], indptr[r + 1]):
                e = experts[j]
                priority[e] = priority[e] + np.float64(values[j])
        else:
            config_floats = eviction.config_floats
            base = MF_SIZE + L + layer * E
            for e in range(E):
                priority[e] = priority[e] + config_floats[base + e]


@njit(cache=True, nogil=True)
def _evict(row, excluded, priority, use_protected):
    """argmin ``priority`` over resident experts with ``excluded[e] == 0`` (and, if ``use_protected``, not in B),
    ties to the lower index; -1 if there is none. Priorities are finite, so +inf marks the ineligible."""
    best = -1
    bp = np.inf
    for e in range(priority.shape[0]):
        ok = row[RESIDENT, e] != 0.0 and excluded[e] == 0.0 and (not use_protected or row[PROTECTED, e] == 0.0)
        q = priority[e] if ok else np.inf
        if q < bp:
            best = e
            bp = q
    return best


@njit(cache=True, nogil=True)
def _victim(row, excluded, use_protected, eviction, token, priority, have_priority):
    """The expert to evict (:func:`_evict`), computing ``priority`` first if ``have_priority`` is False.
    Returns ``(victim or -1, True)``: the new ``have_priority``.

    The priority is computed at a position's first eviction, not before part 1 as in ALGORITHM.md step 1: nothing
    it reads changes before step 7, so the values are the same, and a position without evictions skips the pass."""
    if not have_priority:
        _priority(eviction, token, row, priority)
    return _evict(row, excluded, priority, use_protected), True


@njit(cache=True, nogil=True)
def _insert_predicted(pregate_row, window, budget, capacity, n_resident, row, token, eviction, priority,
                      have_priority, plan_row, columns, inserted, pregate_f64, candidates, select_buf, select_idx):
    """Part 1 (ALGORITHM.md step 2) for one position: scan the pre-gate's top-``window`` in rank order, add the
    resident candidates to B, insert non-resident ones while fewer than ``budget`` are inserted.

    Args:
        pregate_row: float32 ``[E]`` pre-gate scores of this position.
        window, budget, capacity: W (at most E), the prefetch budget n, the capacity C.
        n_resident: experts resident in ``row`` now.
        row: float64 ``[6, E]`` state of this layer and row; RESIDENT, PROTECTED (B) and INSERTED change.
        token, eviction: the position's token and the layer's :data:`Eviction` (for the priority).
        priority, have_priority: the eviction priority ``[E]`` and whether it is computed yet for this position.
        plan_row: int64 ``[W]`` plan of this position; insertion ``i`` and its victim (-1: a free slot) go to
            columns ``columns.prefetch + i`` and ``columns.prefetch_evicted + i``.
        columns: the plan's :class:`PlanColumns`.
        inserted: int64 ``[>= budget]`` receives the inserted experts, in insertion order.
        pregate_f64, candidates, select_buf, select_idx: scratch (``[E]`` float64, ``[>= window]`` int64, and
            :func:`_select_top`'s).

    Returns ``(insertions, n_resident, have_priority)`` after the scan.
    """
    n_inserted = 0
    _top_k_of(pregate_row, window, pregate_f64, candidates, select_buf, select_idx)
    for i in range(window):
        e = candidates[i]
        if row[RESIDENT, e] != 0.0:
            row[PROTECTED, e] = 1.0
        elif n_inserted < budget:
            victim = -1
            if n_resident == capacity:
                # never a member of B (the candidates kept or inserted so far)
                victim, have_priority = _victim(row, row[PROTECTED], False, eviction, token, priority,
                                                have_priority)
                if victim < 0:
                    break  # R \ B is empty: stop part 1
                row[RESIDENT, victim] = 0.0
                n_resident -= 1
            row[RESIDENT, e] = 1.0
            n_resident += 1
            row[PROTECTED, e] = 1.0
            row[INSERTED, e] = 1.0
            inserted[n_inserted] = e
            plan_row[columns.prefetch + n_inserted] = e
            plan_row[columns.prefetch_evicted + n_inserted] = victim
            n_inserted += 1
    return n_inserted, n_resident, have_priority


@njit(cache=True, nogil=True)
def _pending_insertions(row, inserted):
    """The experts part 1 inserted in a separate prefetch call (MODE_INSERT), read back from the INSERTED plane
    of ``row [6, E]`` into ``inserted`` in ascending order (order does not matter to step 7). Returns their
    number."""
    n_inserted = 0
    for e in range(row.shape[1]):
        if row[INSERTED, e] != 0.0:
            inserted[n_inserted] = e
            n_inserted += 1
    return n_inserted


@njit(cache=True, nogil=True)
def _bonus_scale(scores_f64, running, row_counters, fixed_delta):
    """The bonus scale d (ALGORITHM.md step 3): ``fixed_delta`` (the calibration's ``delta[l]``), or with
    ``running`` the mean of ``max z - min z`` over finite entries, updating the running sum and count in
    ``row_counters`` with this position's ``scores_f64 [E]`` first."""
    if not running:
        return fixed_delta
    mx = -np.inf
    mn = np.inf
    for e in range(scores_f64.shape[0]):
        x = scores_f64[e]
        if x != -np.inf:
            mx = max(mx, x)
            mn = min(mn, x)
    row_counters[R_RANGE_SUM] += mx - mn
    row_counters[R_RANGE_COUNT] += 1.0
    return row_counters[R_RANGE_SUM] / row_counters[R_RANGE_COUNT]


@njit(cache=True, nogil=True)
def _biased_top_k(scores_f64, own, K, top_j, bonus, resident, top_j_flags, biased_f64, selected, select_buf,
                  select_idx):
    """Biased selection (ALGORITHM.md step 4): the ``K`` largest of ``z + bonus * m`` into ``selected``, ties
    toward the larger raw ``z``, then the lower index.

    Args:
        scores_f64: float64 ``[E]`` raw scores z of this position.
        own: the router's own ranking, at least ``max(K, top_j)`` long (``own[:top_j]`` join ``m``).
        bonus: ``lam * d``.
        resident: the RESIDENT plane ``[E]`` of the row (``m[e] = 1`` for residents).
        top_j_flags: int64 ``[E]`` scratch, all zero on entry and left zero.
        biased_f64: float64 ``[E]`` receives the biased scores.
        select_buf, select_idx: scratch of :func:`_select_top`.
    """
    for i in range(top_j):
        top_j_flags[own[i]] = 1
    for e in range(scores_f64.shape[0]):
        # z + lam * d * m with m in {0, 1}; z + 0.0 == z
        biased_f64[e] = scores_f64[e] + (bonus if (resident[e] != 0.0) | (top_j_flags[e] != 0) else 0.0)
    # every biased score is >= its raw score, so the K-th largest biased score is >= the router's own K-th
    # largest score: a tight lower bound that leaves few candidates
    _select_top(biased_f64, scores_f64, K, selected, select_buf, select_idx, scores_f64[own[K - 1]])
    for i in range(top_j):
        top_j_flags[own[i]] = 0


@njit(cache=True, nogil=True)
def _insert_demanded(selected, K, capacity, n_resident, row, token, eviction, priority, have_priority, plan_row,
                     columns, in_selection, selected_sorted):
    """Demand insertions (ALGORITHM.md step 5): write the selection ``S = selected[:K]`` to the plan, then insert
    every non-resident expert of S in ascending index order, evicting from ``R - (S ∪ B)``, or from ``R - S``
    if that is empty.

    Args:
        selected: int64 ``[>= K]`` the selection, in selection order.
        capacity, n_resident: C and the experts resident in ``row`` now.
        row: float64 ``[6, E]`` state of this layer and row; RESIDENT changes (PROTECTED holds B).
        token, eviction, priority, have_priority: as in :func:`_insert_predicted`.
        plan_row, columns: the position's plan and its :class:`PlanColumns` (selected, demand, demand_evicted).
        in_selection: float64 ``[E]`` scratch, zero on entry; left 1.0 at the members of S (cleared by
            :func:`_update_statistics`).
        selected_sorted: int64 ``[>= K]`` scratch (S in ascending order).

    Returns ``(demand insertions, n_resident, have_priority)``.
    """
    for i in range(K):
        e = selected[i]
        plan_row[columns.selected + i] = e
        in_selection[e] = 1.0
        pos = i
        while pos > 0 and selected_sorted[pos - 1] > e:
            selected_sorted[pos] = selected_sorted[pos - 1]
            pos -= 1
        selected_sorted[pos] = e
    n_demand = 0
    for i in range(K):
        e = selected_sorted[i]
        if row[RESIDENT, e] != 0.0:
            continue
        victim = -1
        if n_resident == capacity:
            victim, have_priority = _victim(row, in_selection, True, eviction, token, priority, have_priority)
            if victim < 0:
                victim, have_priority = _victim(row, in_selection, False, eviction, token, priority, have_priority)
            row[RESIDENT, victim] = 0.0
            n_resident -= 1
        row[RESIDENT, e] = 1.0
        n_resident += 1
        plan_row[columns.demand + n_demand] = e
        plan_row[columns.demand_evicted + n_demand] = victim
        n_demand += 1
    return n_demand, n_resident, have_priority


@njit(cache=True, nogil=True)
def _update_statistics(row, step, selected, own, K, inserted, n_inserted, flags, decay_fast, decay_slow, flush,
                       clear_protected):
    """Statistics (ALGORITHM.md step 7) of one position, from the router's own top-K ``own[:K]`` (never from S,
    so the bias cannot reinforce itself).

    Args:
        row: float64 ``[6, E]`` state of this layer and row: S_FAST, S_SLOW, LAST_USE, INSERTED (cleared) and,
            with ``clear_protected``, PROTECTED (B, cleared) change.
        step: this row and layer's step counter (``last_use`` of S and of this step's prefetch insertions).
        selected: the selection S (``[:K]``); inserted, n_inserted: this step's prefetch insertions.
        flags: float64 ``[E]``: 1.0 at S on entry (from :func:`_insert_demanded`); left all zero.
        decay_fast, decay_slow: the moving averages' decays; flush: ``min(1, 1 - decay_fast) * FLUSH_RATIO``.

    Returns the number of router slots replaced (members of S outside the router's own top-K).
    """
    for i in range(K):
        flags[selected[i]] = 0.0
        row[LAST_USE, selected[i]] = step
    for i in range(n_inserted):
        row[LAST_USE, inserted[i]] = step
        row[INSERTED, inserted[i]] = 0.0
    for i in range(K):
        flags[own[i]] = 1.0  # now the router's own top-K indicator
    replaced = 0
    for i in range(K):
        replaced += flags[selected[i]] == 0.0
    s_fast = row[S_FAST]
    s_slow = row[S_SLOW]
    for e in range(s_fast.shape[0]):
        sf = decay_fast * s_fast[e] + (1.0 - decay_fast) * flags[e]
        ss = decay_slow * s_slow[e] + (1.0 - decay_slow) * flags[e]
        # A fast average far below half an ulp of the slow one (and of 1 - decay_fast) cannot change a
        # priority (s_fast + s_slow) or a later average, so zero is the same value to every decision; it keeps
        # the fast average out of the subnormal range, where arithmetic is slow.
        s_fast[e] = sf if sf >= ss * flush else 0.0
        s_slow[e] = ss
    for i in range(K):
        flags[own[i]] = 0.0
    if clear_protected:
        protected = row[PROTECTED]
        for e in range(protected.shape[0]):
            protected[e] = 0.0
    return replaced


# ---------------------------------------------------------------------------------------------------- one position
# The pieces of _step_layer_checked, in ALGORITHM.md's order. They are inlined into it (inline="always"), so the
# split costs no call. Each array an inlined helper takes, or takes out of a tuple, costs numba a reference count
# per position (measured: eleven arrays, about 3% of a step), so the per-position helpers take few arrays and the
# scratch tuple is unpacked once per call.
LayerRules = namedtuple(
    "LayerRules", "K capacity budget window top_j running biased executes_pregate lam decay_fast decay_slow flush "
                  "fixed_delta part1_runs do_part1 do_part2")
LayerRules.__doc__ = """One layer's rules for one kernel call (:func:`_layer_rules`): K, the capacity C, the budget
n, the window W (at most E), top_j, the bonus scale's kind (``running``), the policy's behaviour flags (``biased``,
``executes_pregate``), lam, the moving averages' decays and flush threshold, ``delta[l]``, and whether part 1 runs at
this layer (``part1_runs``: in this call or in a separate prefetch call), in this call (``do_part1``) and whether
part 2 does (``do_part2``)."""

Scratch = namedtuple(
    "Scratch", "priority flags scores_f64 other_f64 select_buf top_j_flags candidates own selected selected_sorted "
               "inserted select_idx")
Scratch.__doc__ = """The views of the scratch buffers one kernel call works in, cut by :func:`_cut_scratch` from the
buffers of :func:`scratch_sizes` (and unpacked once per call)."""


@njit(cache=True, nogil=True, inline="always")
def _layer_rules(layer, mode, config_ints, config_floats, E):
    """The :data:`LayerRules` of ``layer`` (``E`` experts) in ``mode``, read from the config arrays (their layout:
    :func:`_step_layer_checked`)."""
    decay_fast = config_floats[MF_DECAY_FAST]
    # in this call or in a separate prefetch call; a layer has a pre-gate from prefetch_distance on
    part1_runs = config_ints[MI_INSERTS] != 0 and layer >= config_ints[MI_DISTANCE]
    return LayerRules(config_ints[MI_K], config_ints[MI_C], config_ints[MI_BUDGET], min(config_ints[MI_WINDOW], E),
                      config_ints[MI_TOP_J], config_ints[MI_RUNNING] != 0, config_ints[MI_BIASED] != 0,
                      config_ints[MI_EXECUTES_PREGATE] != 0, config_floats[MF_LAM], decay_fast,
                      config_floats[MF_DECAY_SLOW], min(1.0, 1.0 - decay_fast) * FLUSH_RATIO,
                      config_floats[MF_SIZE + layer], part1_runs, part1_runs and mode != MODE_SELECT,
                      mode != MODE_INSERT)


@njit(cache=True, nogil=True, inline="always")
def _cut_scratch(float_scratch, int_scratch, E, rules):
    """The :data:`Scratch` views of ``float_scratch`` and ``int_scratch`` (the layout behind
    :func:`scratch_sizes`): ``flags`` and ``top_j_flags`` must be zero on entry and are left zero."""
    n_own = max(rules.K, rules.top_j)  # the router's own ranking is needed this far (statistics: K; top_j)
    ranked = max(rules.window, n_own)
    budget = rules.budget
    return Scratch(
        float_scratch[:E],  # priority: the eviction priority of the position
        float_scratch[E : 2 * E],  # flags: 1.0 marks S during demand insertion; the own-top-K indicator in step 7
        float_scratch[2 * E : 3 * E],  # scores_f64: this position's scores as float64
        float_scratch[3 * E : 4 * E],  # other_f64: pre-gate as float64, or the biased scores
        float_scratch[4 * E :],  # select_buf: scratch of _select_top, k + 2E
        int_scratch[:E],  # top_j_flags
        int_scratch[E : E + ranked],  # candidates: the pre-gate's ranking
        int_scratch[E + ranked : E + 2 * ranked],  # own: the router's own ranking
        int_scratch[E + 2 * ranked : E + 3 * ranked],  # selected: S
        int_scratch[E + 3 * ranked : E + 4 * ranked],  # selected_sorted: S ascending
        int_scratch[E + 4 * ranked : E + 4 * ranked + budget],  # inserted: this step's prefetch insertions
        int_scratch[E + 4 * ranked + budget :],  # select_idx: scratch of _select_top
    )


@njit(cache=True, nogil=True, inline="always")
def _count_resident(row):
    """``|R|``: the experts resident in ``row [6, E]``."""
    n_resident = 0
    for e in range(row.shape[1]):
        n_resident += row[RESIDENT, e] != 0.0
    return n_resident


@njit(cache=True, nogil=True, inline="always")
def _clear_plan_row(plan_row, columns):
    """A position's plan before its step: no experts (-1), no insertions, no replaced slots."""
    plan_row[:] = -1
    plan_row[columns.n_prefetch] = 0
    plan_row[columns.n_demand] = 0
    plan_row[columns.n_replaced] = 0


@njit(cache=True, nogil=True, inline="always")
def _padded_position(scores_row, K, plan_row, columns, scores_f64, own, select_buf, select_idx):
    """A padded position (ALGORITHM.md, "Batches, padding, prompts"): the router's own top-K of ``scores_row``
    into the plan, the state neither read nor changed. ``scores_f64``, ``own``, ``select_buf``, ``select_idx``:
    scratch (:func:`_top_k_of`'s)."""
    _top_k_of(scores_row, K, scores_f64, own, select_buf, select_idx)
    for i in range(K):
        plan_row[columns.selected + i] = own[i]


@njit(cache=True, nogil=True, inline="always")
def _count_prefetch(row_counters, plan_row, columns, n_inserted, mode):
    """After part 1 of a position (step 2, :func:`_insert_predicted`): its prefetch insertions into the plan and the
    row's counter; in MODE_INSERT the row's part 1 is then pending (a MODE_SELECT call consumes it)."""
    plan_row[columns.n_prefetch] = n_inserted
    row_counters[R_PREFETCH] += n_inserted
    if mode == MODE_INSERT:
        row_counters[R_PENDING] = 1.0


@njit(cache=True, nogil=True, inline="always")
def _count_step(row_counters, plan_row, columns, n_demand, replaced):
    """After the statistics of a position (step 7, :func:`_update_statistics`): its demand insertions (step 5) and
    replaced router slots into the plan; the row's step counter advanced, part 1 no longer pending, and its steps,
    demand insertions and replaced slots counted."""
    plan_row[columns.n_demand] = n_demand
    plan_row[columns.n_replaced] = replaced
    row_counters[R_STEP] += 1.0
    row_counters[R_PENDING] = 0.0
    row_counters[R_STEPS] += 1.0
    row_counters[R_DEMAND] += n_demand
    row_counters[R_REPLACED] += replaced


# ---------------------------------------------------------------------------------------------------- one layer
@njit(cache=True, nogil=True)
def _validate(layer, mode, config_ints, scores, pregate, tokens, valid, counters, plan, E):
    """Shapes and values of one block (``valid`` of shape (0, 0) means every position is real): OK or the first
    error code found. Reads only; the arguments are those of :func:`_step_layer_checked`."""
    B, S = tokens.shape
    L = counters.shape[0]
    K = config_ints[MI_K]
    vocab = config_ints[MI_VOCAB]
    if (layer < 0 or layer >= L or B != counters.shape[1] or scores.shape[0] != B or scores.shape[1] != S
            or scores.shape[2] != E):
        return ERR_SHAPE
    if plan.shape[0] != B or plan.shape[1] != S or plan.shape[2] != plan_layout(K, config_ints[MI_BUDGET]).width:
        return ERR_SHAPE
    all_valid = valid.shape[0] == 0
    if not all_valid and (valid.shape[0] != B or valid.shape[1] != S):
        return ERR_SHAPE
    part1 = layer >= config_ints[MI_DISTANCE] and config_ints[MI_INSERTS] != 0
    check_pregate = layer >= 1 and ((part1 and mode != MODE_SELECT)
                                    or (config_ints[MI_EXECUTES_PREGATE] != 0 and mode != MODE_INSERT))
    if check_pregate and (pregate.shape[0] != B or pregate.shape[1] != S or pregate.shape[2] != E):
        return ERR_SHAPE
    for b in range(B):
        for s in range(S):
            if not all_valid and valid[b, s] == 0:
                continue
            if check_pregate:
                bad = 0
                for e in range(E):
                    x = pregate[b, s, e]
                    bad += (x != x) | (x == np.inf)
                if bad:
                    return ERR_PREGATE
            if mode != MODE_INSERT:
                bad = 0
                finite = 0
                for e in range(E):
                    x = scores[b, s, e]
                    bad += (x != x) | (x == np.inf)
                    finite += x != -np.inf
                if bad:
                    return ERR_SCORES
                if finite < K:
                    return ERR_FEW_FINITE
            t = tokens[b, s]
            if t < 0 or (vocab > 0 and t >= vocab):
                return ERR_TOKEN
            if mode == MODE_SELECT and part1 and counters[layer, b, R_PENDING] == 0.0:
                return ERR_NO_PART1
            if mode != MODE_SELECT and part1 and counters[layer, b, R_PENDING] != 0.0:
                return ERR_PART1_TWICE
    return OK


@njit(cache=True, nogil=True)
def _step_layer(layer, mode, config_ints, config_floats, scores, pregate, tokens, valid, state, counters,
                prior_indptr, prior_experts, prior_values, plan, float_scratch, int_scratch):
    """Validate the block (:func:`_validate`), then run :func:`_step_layer_checked` on it."""
    code = _validate(layer, mode, config_ints, scores, pregate, tokens, valid, counters, plan, state.shape[3])
    if code != OK:
        return code
    return _step_layer_checked(layer, mode, config_ints, config_floats, scores, pregate, tokens, valid, state,
                               counters, prior_indptr, prior_experts, prior_values, plan, float_scratch,
                               int_scratch)


@njit(cache=True, nogil=True)
def _step_layer_checked(layer, mode, config_ints, config_floats, scores, pregate, tokens, valid, state, counters,
                        prior_indptr, prior_experts, prior_values, plan, float_scratch, int_scratch):
    """One MoE layer over a block of positions ``[B, S]`` (positions in order; rows independent).

    Args:
        layer: MoE-layer index.
        mode: MODE_BOTH runs part 1 then part 2 per position; MODE_INSERT runs part 1 only (S == 1), leaving B
            pending in the PROTECTED plane; MODE_SELECT runs part 2 only, consuming it.
        config_ints: int64 ``[MI_SIZE + V]``: the ``MI_*`` fields, then the token-seen flags of the prior.
        config_floats: float64 ``[MF_SIZE + L + L * E]``: the ``MF_*`` fields, then ``delta [L]``, then the
            fallback prior ``[L, E]``.
        state: float64 ``[L, R, N_PLANES, E]``: per layer and row the planes ``S_FAST``, ``S_SLOW``,
            ``LAST_USE``, ``RESIDENT`` (0/1), ``PROTECTED`` (in B, 0/1), ``INSERTED`` (prefetch-inserted this
            step, 0/1); float64 holds the integer planes exactly.
        counters: float64 ``[L, R, R_SIZE]``: running range sum and count, step counter, part-1-pending flag,
            and the counters steps / prefetch insertions / demand insertions / replaced router slots (``R_*``).
        prior_indptr, prior_experts, prior_values: the token prior as CSR (int64 ``[V * L + 1]``, uint16
            ``[nnz]``, float32 ``[nnz]``), row ``token * L + layer``.
        scores: float32 ``[B, S, E]`` selection scores z; pregate: float32 ``[B, S, E]`` (read at layers >= 1
            when part 1 runs or the policy executes the pre-gate; else any array).
        tokens: int64 ``[B, S]``; valid: uint8 ``[B, S]`` (0 = padding), or shape (0, 0) for all real.
        plan: int64 ``[B, S, W]`` receives the copy plan of every position (:func:`plan_layout`; unused entries
            -1).
        float_scratch, int_scratch: zeroed buffers of :func:`scratch_sizes`; left as they were found.

    The block must have passed :func:`_validate`; returns OK. The layer's :data:`LayerRules` and :data:`Scratch`
    are read once; then each position runs ALGORITHM.md's steps through the helpers above (a padded one
    :func:`_padded_position`). Per position the work is a handful of passes over the E experts (the router's
    top-K, the pre-gate ranking, the biased top-K with the bonus computed on the fly, the moving averages) and one
    priority pass per eviction (:func:`_victim`).
    """
    B, S = tokens.shape
    E = state.shape[3]
    rules = _layer_rules(layer, mode, config_ints, config_floats, E)
    K = rules.K
    eviction = Eviction(config_ints[MI_EVICTION], layer, state.shape[0], config_ints, config_floats, prior_indptr,
                        prior_experts, prior_values)
    columns = plan_layout(K, rules.budget)
    (priority, flags, scores_f64, other_f64, select_buf, top_j_flags, candidates, own, selected, selected_sorted,
     inserted, select_idx) = _cut_scratch(float_scratch, int_scratch, E, rules)
    all_valid = valid.shape[0] == 0
    for b in range(B):
        row = state[layer, b]  # [6, E]
        row_counters = counters[layer, b]
        n_resident = _count_resident(row)
        for s in range(S):
            plan_row = plan[b, s]
            _clear_plan_row(plan_row, columns)
            if not all_valid and valid[b, s] == 0:
                if rules.do_part2:
                    _padded_position(scores[b, s], K, plan_row, columns, scores_f64, own, select_buf, select_idx)
                continue
            token = tokens[b, s]
            have_priority = False
            n_inserted = 0
            # ---- part 1 (step 2): in this call, or left by a separate prefetch call
            if rules.do_part1:
                n_inserted, n_resident, have_priority = _insert_predicted(
                    pregate[b, s], rules.window, rules.budget, rules.capacity, n_resident, row, token, eviction,
                    priority, have_priority, plan_row, columns, inserted, other_f64, candidates, select_buf,
                    select_idx)
                _count_prefetch(row_counters, plan_row, columns, n_inserted, mode)
                if mode == MODE_INSERT:
                    continue
            elif mode == MODE_SELECT and rules.part1_runs:
                n_inserted = _pending_insertions(row, inserted)
            if not rules.do_part2:
                continue
            # ---- part 2, the selection (steps 3-4): the router's own ranking first (the statistics read it), then S
            # (written out here, not in a helper: passing its eleven arrays to an inlined one costs numba a reference
            # count each, about 3% of a step)
            _top_k_of(scores[b, s], max(K, rules.top_j), scores_f64, own, select_buf, select_idx)
            if rules.executes_pregate and layer >= 1:  # the pre-gate's top-K
                _top_k_of(pregate[b, s], K, other_f64, selected, select_buf, select_idx)
            elif rules.biased:  # the biased top-K
                bonus = rules.lam * _bonus_scale(scores_f64, rules.running, row_counters, rules.fixed_delta)
                _biased_top_k(scores_f64, own, K, rules.top_j, bonus, row[RESIDENT], top_j_flags, other_f64, selected,
                              select_buf, select_idx)
            else:  # the router's own top-K
                for i in range(K):
                    selected[i] = own[i]
            # ---- the demand insertions (step 5) and the statistics (step 7)
            n_demand, n_resident, have_priority = _insert_demanded(
                selected, K, rules.capacity, n_resident, row, token, eviction, priority, have_priority, plan_row,
                columns, flags, selected_sorted)
            replaced = _update_statistics(row, row_counters[R_STEP], selected, own, K, inserted, n_inserted, flags,
                                          rules.decay_fast, rules.decay_slow, rules.flush, rules.part1_runs)
            _count_step(row_counters, plan_row, columns, n_demand, replaced)
    return OK


@njit(cache=True, nogil=True)
def _reset_rows(rows, warm, state, counters):
    """Reset the given ``rows`` of every layer to the warm set ``warm [L, E]`` (0/1), statistics and counters
    to zero, ``last_use`` to -1."""
    L = state.shape[0]
    E = state.shape[3]
    for l in range(L):
        for r in rows:
            for e in range(E):
                state[l, r, S_FAST, e] = 0.0
                state[l, r, S_SLOW, e] = 0.0
                state[l, r, LAST_USE, e] = -1.0
                state[l, r, RESIDENT, e] = warm[l, e]
                state[l, r, PROTECTED, e] = 0.0
                state[l, r, INSERTED, e] = 0.0
            for j in range(counters.shape[2]):
                counters[l, r, j] = 0.0


# ---------------------------------------------------------------------------------------------------- hot path
# numba's per-call cost grows with the number of array arguments (about 0.3 us each). The arrays that belong to
# a LogicalCache (config, state, prior) are therefore passed as one table of addresses and sizes, rebuilt by the
# cache whenever it reallocates them; the cache keeps the arrays alive. The table layout is TABLE_* below.

from numba import carray, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

(T_MI, T_MI_N, T_MF, T_MF_N, T_ST, T_L, T_R, T_E, T_RS, T_INDPTR, T_INDPTR_N, T_PEXP, T_NNZ, T_PVAL, T_FBUF, T_FBUF_N,
 T_IBUF, T_IBUF_N, T_IN_Z, T_IN_G, T_IN_TOK, T_IN_VALID, T_IN_PLAN, T_IN_W) = range(24)
TABLE_SIZE = 24


@intrinsic
def _voidptr(typingctx, address):
    """An int64 address as a void pointer (for numba.carray)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


def make_table(config_ints, config_floats, state, counters, prior_indptr, prior_experts, prior_values,
               float_scratch, int_scratch) -> np.ndarray:
    """The address table of a cache's arrays (all C-contiguous, of the kernel's dtypes; see
    :func:`_step_layer_checked` and :func:`scratch_sizes`)."""
    for a, dt in ((config_ints, np.int64), (config_floats, np.float64), (state, np.float64),
                  (counters, np.float64), (prior_indptr, np.int64), (prior_experts, np.uint16),
                  (prior_values, np.float32), (float_scratch, np.float64), (int_scratch, np.int64)):
        if a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError("kernel arrays must be C-contiguous with the kernel's dtypes")
    L, R, _, E = state.shape
    t = np.zeros(TABLE_SIZE, dtype=np.int64)
    t[T_MI], t[T_MI_N] = config_ints.ctypes.data, config_ints.size
    t[T_MF], t[T_MF_N] = config_floats.ctypes.data, config_floats.size
    t[T_ST], t[T_L], t[T_R], t[T_E] = state.ctypes.data, L, R, E
    t[T_RS] = counters.ctypes.data
    t[T_INDPTR], t[T_INDPTR_N] = prior_indptr.ctypes.data, prior_indptr.size
    t[T_PEXP], t[T_NNZ] = prior_experts.ctypes.data, prior_experts.size
    t[T_PVAL] = prior_values.ctypes.data
    t[T_FBUF], t[T_FBUF_N] = float_scratch.ctypes.data, float_scratch.size
    t[T_IBUF], t[T_IBUF_N] = int_scratch.ctypes.data, int_scratch.size
    return t


def set_io_buffers(table, z, g, tokens, valid, plan) -> None:
    """Record the cache's one-position input/output buffers (``[R, 1, E]`` float32 scores and pre-gate,
    ``[R, 1]`` int64 tokens and uint8 mask, ``[R, 1, W]`` int64 plan) in the table, for :func:`_step_io`."""
    R, E = table[T_R], table[T_E]
    for a, dt, shape in ((z, np.float32, (R, 1, E)), (g, np.float32, (R, 1, E)), (tokens, np.int64, (R, 1)),
                         (valid, np.uint8, (R, 1))):
        if a.dtype != dt or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"io buffer must be a C-contiguous {np.dtype(dt).name} array of shape {shape}")
    if plan.dtype != np.int64 or plan.ndim != 3 or plan.shape[:2] != (R, 1) or not plan.flags.c_contiguous:
        raise ValueError("plan buffer must be a C-contiguous int64 array [R, 1, W]")
    table[T_IN_Z], table[T_IN_G], table[T_IN_TOK] = z.ctypes.data, g.ctypes.data, tokens.ctypes.data
    table[T_IN_VALID], table[T_IN_PLAN], table[T_IN_W] = valid.ctypes.data, plan.ctypes.data, plan.shape[2]


@njit(cache=True, nogil=True)
def _step_table(layer, mode, table, scores, pregate, tokens, valid, plan):
    """:func:`_step_layer` with the cache's arrays given by their address table (the block's arrays as in
    :func:`_step_layer_checked`); returns OK or an error code."""
    L = table[T_L]
    R = table[T_R]
    E = table[T_E]
    config_ints = carray(_voidptr(table[T_MI]), (table[T_MI_N],), np.int64)
    config_floats = carray(_voidptr(table[T_MF]), (table[T_MF_N],), np.float64)
    state = carray(_voidptr(table[T_ST]), (L, R, N_PLANES, E), np.float64)
    counters = carray(_voidptr(table[T_RS]), (L, R, R_SIZE), np.float64)
    prior_indptr = carray(_voidptr(table[T_INDPTR]), (table[T_INDPTR_N],), np.int64)
    prior_experts = carray(_voidptr(table[T_PEXP]), (table[T_NNZ],), np.uint16)
    prior_values = carray(_voidptr(table[T_PVAL]), (table[T_NNZ],), np.float32)
    float_scratch = carray(_voidptr(table[T_FBUF]), (table[T_FBUF_N],), np.float64)
    int_scratch = carray(_voidptr(table[T_IBUF]), (table[T_IBUF_N],), np.int64)
    return _step_layer(layer, mode, config_ints, config_floats, scores, pregate, tokens, valid, state, counters,
                       prior_indptr, prior_experts, prior_values, plan, float_scratch, int_scratch)


@njit(cache=True, nogil=True, parallel=True)
def _step_all_layers(mode, config_ints, config_floats, scores, pregate, tokens, valid, state, counters,
                     prior_indptr, prior_experts, prior_values, plan, codes):
    """Every layer over a whole recorded block in parallel: ``scores``, ``pregate`` ``[L, B, S, E]``, ``plan``
    ``[L, B, S, W]``, ``codes [L]`` receives each layer's OK or error code. Only for recorded traces, where all
    layers' inputs are known in advance (a layer's state depends only on that layer's own history). All layers
    are validated before any state changes."""
    L = scores.shape[0]
    E = state.shape[3]
    for layer in prange(L):
        codes[layer] = _validate(layer, mode, config_ints, scores[layer], pregate[layer], tokens, valid, counters,
                                 plan[layer], E)
    for layer in range(L):
        if codes[layer] != OK:
            return
    n_float, n_int = scratch_sizes(E, config_ints[MI_K], min(config_ints[MI_WINDOW], E), config_ints[MI_TOP_J],
                                   config_ints[MI_BUDGET])
    for layer in prange(L):
        float_scratch = np.zeros(n_float, dtype=np.float64)
        int_scratch = np.zeros(n_int, dtype=np.int64)
        codes[layer] = _step_layer_checked(layer, mode, config_ints, config_floats, scores[layer], pregate[layer],
                                           tokens, valid, state, counters, prior_indptr, prior_experts,
                                           prior_values, plan[layer], float_scratch, int_scratch)


@njit(cache=True, nogil=True)
def _step_io(layer, mode, table):
    """:func:`_step_table` on the cache's own io buffers: no array crosses the call (each array argument costs
    numba an unboxing with a heap allocation), which is what a decoder calls once per layer and token."""
    R = table[T_R]
    E = table[T_E]
    scores = carray(_voidptr(table[T_IN_Z]), (R, 1, E), np.float32)
    pregate = carray(_voidptr(table[T_IN_G]), (R, 1, E), np.float32)
    tokens = carray(_voidptr(table[T_IN_TOK]), (R, 1), np.int64)
    valid = carray(_voidptr(table[T_IN_VALID]), (R, 1), np.uint8)
    plan = carray(_voidptr(table[T_IN_PLAN]), (R, 1, table[T_IN_W]), np.int64)
    return _step_table(layer, mode, table, scores, pregate, tokens, valid, plan)

