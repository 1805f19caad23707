"""The Triton source of :mod:`psr_hf.engine.device_decisions`' kernel, kept in a module of its own because
``triton.jit`` decides at decoration time whether a function runs in the interpreter (``TRITON_INTERPRET=1``) or
is compiled: :func:`psr_hf.engine.device_decisions.kernel` loads this file once per mode as a separate module, so
that the kernel and the helpers it calls are always of the same mode. Only triton's builtins and ``tl.reduce``
with the standard library's combine functions, which the interpreter recognises."""

import triton
import triton.language as tl


@triton.jit
def _sum(x):
    return tl.reduce(x, 0, tl.standard._sum_combine)

@triton.jit
def _min(x):
    return tl.reduce(x, 0, tl.standard._elementwise_min)

@triton.jit
def _max(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)

@triton.jit
def _rank(x, y, offs):
    # each lane's place in the order (x descending, then y descending, then index ascending): the numba
    # kernels' _select_top order (ties toward the larger y, then the lower index)
    xe = x[:, None]
    xj = x[None, :]
    ye = y[:, None]
    yj = y[None, :]
    ahead = (xj > xe) | ((xj == xe) & ((yj > ye) | ((yj == ye) & (offs[None, :] < offs[:, None]))))
    return tl.reduce(ahead.to(tl.int32), 1, tl.standard._sum_combine)

@triton.jit
def _at(values, offs, index):
    # values[index] of an int vector (0 where index is outside it)
    return tl.reduce(tl.where(offs == index, values, 0), 0, tl.standard._sum_combine)

@triton.jit
def _lowest_first(v1, i1, v2, i2):
    # the smaller (value, index) pair: the lowest value, ties to the lower index
    second = (v2 < v1) | ((v2 == v1) & (i2 < i1))
    return tl.where(second, v2, v1), tl.where(second, i2, i1)

@triton.jit
def _both_sums(a1, b1, a2, b2):
    return a1 + a2, b1 + b2

@triton.jit
def _sum_min_sum(a1, b1, c1, a2, b2, c2):
    return a1 + a2, tl.minimum(b1, b2), c1 + c2

@triton.jit
def _max_min(a1, b1, a2, b2):
    return tl.maximum(a1, a2), tl.minimum(b1, b2)

@triton.jit
def _two_lowest_first(v1, i1, w1, j1, v2, i2, w2, j2):
    # _lowest_first of two (value, index) pairs at once
    second = (v2 < v1) | ((v2 == v1) & (i2 < i1))
    other = (w2 < w1) | ((w2 == w1) & (j2 < j1))
    return tl.where(second, v2, v1), tl.where(second, i2, i1), tl.where(other, w2, w1), tl.where(other, j2, j1)

@triton.jit
def _evict(priority, eligible, offs, BIG: tl.constexpr):
    # argmin priority over the eligible lanes, ties to the lower index, in one reduction; -1 if none (priorities
    # are finite)
    q = tl.where(eligible, priority, float("inf"))
    lowest, victim = tl.reduce((q, offs), 0, _lowest_first)
    return tl.where(lowest < float("inf"), victim, -1)

@triton.jit
def _evict_either(priority, first, second, offs):
    # _evict over two eligible sets in one reduction
    q = tl.where(first, priority, float("inf"))
    r = tl.where(second, priority, float("inf"))
    low1, v1, low2, v2 = tl.reduce((q, offs, r, offs), 0, _two_lowest_first)
    return tl.where(low1 < float("inf"), v1, -1), tl.where(low2 < float("inf"), v2, -1)

@triton.jit
def _priority(s_fast, s_slow, last_use, seen, experts, values, fallback, offs,
                     LRU: tl.constexpr, HAS_PRIOR: tl.constexpr):
    # ALGORITHM.md step 1 (numba _priority): last_use for LRU; s_fast + s_slow plus the token prior else (the
    # prior's row, `experts` and `values`, loaded by the caller; the fallback where the token was not seen)
    if LRU:
        priority = last_use
    else:
        priority = s_fast + s_slow
        if HAS_PRIOR:
            match = experts[None, :] == offs[:, None]
            added, hits = tl.reduce((tl.where(match, values[None, :], 0.0), match.to(tl.int32)), 1, _both_sums)
            has = hits > 0
            priority = tl.where(seen != 0, tl.where(has, priority + added, priority), priority + fallback)
    return priority

@triton.jit
def _planes(base, offs, emask, E: tl.constexpr):
    # one layer's state planes (numba layout): s_fast, s_slow, last_use and the resident, protected, inserted flags
    s_fast = tl.load(base + 0 * E + offs, mask=emask, other=0.0)
    s_slow = tl.load(base + 1 * E + offs, mask=emask, other=0.0)
    last_use = tl.load(base + 2 * E + offs, mask=emask, other=0.0)
    resident = (tl.load(base + 3 * E + offs, mask=emask, other=0.0) != 0.0) & emask
    protected = (tl.load(base + 4 * E + offs, mask=emask, other=0.0) != 0.0) & emask
    inserted = (tl.load(base + 5 * E + offs, mask=emask, other=0.0) != 0.0) & emask
    return s_fast, s_slow, last_use, resident, protected, inserted

@triton.jit
def _prior_row(token, layer, indptr_ptr, pexp_ptr, pval_ptr, fallback_ptr, offs, emask, E: tl.constexpr,
               L: tl.constexpr):
    # the token prior's CSR row of (token, layer) and the layer's fallback prior, for _priority; loaded whether the
    # token was seen or not (only a seen token's row is read), so that these loads need not wait for `seen`
    r = token * L + layer
    j = tl.load(indptr_ptr + r) + offs
    jm = j < tl.load(indptr_ptr + r + 1)
    experts = tl.load(pexp_ptr + j, mask=jm, other=-1).to(tl.int32)
    values = tl.load(pval_ptr + j, mask=jm, other=0.0).to(tl.float64)
    fallback = tl.load(fallback_ptr + layer * E + offs, mask=emask, other=0.0)
    return experts, values, fallback

@triton.jit
def _take_slot(do, e, victim, slot_of, expert_of, offs, cidx, C: tl.constexpr, BIG: tl.constexpr):
    # expert e (inserted when do) takes the victim's slot, or the first free one: (slot, slot_of, expert_of)
    freed = tl.reduce(tl.where(offs == victim, slot_of, 0), 0, tl.standard._sum_combine)
    free = tl.reduce(tl.where(expert_of == -1, cidx, BIG), 0, tl.standard._elementwise_min)
    slot = tl.where(victim >= 0, freed, free)
    slot_of = tl.where(do & (offs == victim), -1, slot_of)
    slot_of = tl.where(do & (offs == e), slot, slot_of)
    expert_of = tl.where(do & (cidx == slot), e, expert_of)
    return slot, slot_of, expert_of


@triton.jit
def decide_kernel(
    layer, scores_ptr, token_ptr, position_ptr, state_ptr, counters_ptr, saved_ptr, delta_ptr, seen_ptr,
    indptr_ptr, pexp_ptr, pval_ptr, fallback_ptr, ids_ptr, slot_ids_ptr, slot_of_ptr, expert_of_ptr,
    copies_ptr, plans_ptr, pplans_ptr, record_ptr, record_plans_ptr, error_ptr, vocab, params_ptr,
    E: tl.constexpr, BE: tl.constexpr, L: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    BUDGET: tl.constexpr, BP: tl.constexpr, WINDOW: tl.constexpr, TOP_J: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, CW: tl.constexpr, BCW: tl.constexpr,
    RUNNING: tl.constexpr, INSERTS: tl.constexpr, DISTANCE: tl.constexpr, BIASED: tl.constexpr,
    EXEC_PREGATE: tl.constexpr,
    LRU: tl.constexpr, HAS_PRIOR: tl.constexpr, OFFLOADED: tl.constexpr, RECORD: tl.constexpr,
    BIG: tl.constexpr,
):
    offs = tl.arange(0, BE)
    emask = offs < E
    pw = tl.arange(0, BW)
    cidx = tl.arange(0, BC)
    cw = tl.arange(0, BCW)
    NEG = float("-inf")
    # the plan's columns (numba plan_layout)
    N_PREFETCH: tl.constexpr = K
    PREFETCH: tl.constexpr = K + 1
    PREFETCH_EVICTED: tl.constexpr = K + 1 + BUDGET
    N_DEMAND: tl.constexpr = K + 1 + 2 * BUDGET
    DEMAND: tl.constexpr = K + 2 + 2 * BUDGET
    DEMAND_EVICTED: tl.constexpr = K + 2 + 2 * BUDGET + K
    N_REPLACED: tl.constexpr = K + 2 + 2 * BUDGET + 2 * K
    # a layer's copy list (CW int32): n_demand | demand (expert, slot) x K | n_prefetch | prefetch x BUDGET
    C_N_DEMAND: tl.constexpr = 0
    C_DEMAND: tl.constexpr = 1
    C_N_PREFETCH: tl.constexpr = 1 + 2 * K
    C_PREFETCH: tl.constexpr = 2 + 2 * K

    # the policy's floats as float64 from memory (a Python float argument would be a float32 scalar)
    lam = tl.load(params_ptr + 0)
    decay_fast = tl.load(params_ptr + 1)
    decay_slow = tl.load(params_ptr + 2)
    flush = tl.load(params_ptr + 3)
    token = tl.load(token_ptr)
    position = tl.load(position_ptr)
    error = tl.load(error_ptr)
    bad_token = (token < 0) | ((vocab > 0) & (token >= vocab))
    error = tl.where((error == 0) & bad_token, 2, error)
    token = tl.where(bad_token, 0, token)

    # ---------------------------------------------------------------- part 2 of this layer
    base = state_ptr + layer * (6 * E)
    s_fast, s_slow, last_use, resident, protected, inserted = _planes(base, offs, emask, E)
    cbase = counters_ptr + layer * 8
    step = tl.load(cbase + 2)
    steps_done = tl.load(cbase + 4)
    delta = tl.load(delta_ptr + layer)  # the bonus scale (read where it is not the running range)
    demand_done = tl.load(cbase + 6)
    replaced_done = tl.load(cbase + 7)
    slot_of = tl.full((BE,), -1, tl.int32)
    expert_of = tl.full((BC,), -1, tl.int32)
    if OFFLOADED:
        slot_of = tl.load(slot_of_ptr + layer * E + offs, mask=emask, other=-1)
        expert_of = tl.load(expert_of_ptr + layer * C + cidx, mask=cidx < C, other=-2)
    # the token prior's row of this layer (the eviction priority is computed only where a demand insertion evicts)
    seen = token * 0
    pexperts = offs
    pvalues = tl.full((BE,), 0.0, tl.float64)
    pfallback = tl.full((BE,), 0.0, tl.float64)
    if HAS_PRIOR:
        seen = tl.load(seen_ptr + token)
        pexperts, pvalues, pfallback = _prior_row(token, layer, indptr_ptr, pexp_ptr, pval_ptr, fallback_ptr, offs,
                                                  emask, E, L)
    # Every input of part 1 of layer + DISTANCE is loaded here too, before any store: in a decode step the weights
    # streamed between two tokens evict this state from L2, so each load misses, and loads issued together wait
    # for one miss where loads after a store or a reduction wait for one each. Part 2 writes only layer `layer`'s
    # rows and DISTANCE >= 1, so these rows are the ones part 1 would read after it.
    nxt = layer + DISTANCE
    nxt_c = tl.minimum(nxt, L - 1)  # past the last layer part 1 does nothing; the clamp keeps the loads in bounds
    if INSERTS:
        g32 = tl.load(scores_ptr + E + offs, mask=emask, other=NEG).to(tl.float32)
        nbase = state_ptr + nxt_c * (6 * E)
        nf, ns, nl, nres, nprot, nins = _planes(nbase, offs, emask, E)
        nc = counters_ptr + nxt_c * 8
        prefetched_done = tl.load(nc + 5)
        nslot_of = tl.full((BE,), -1, tl.int32)
        nexpert_of = tl.full((BC,), -1, tl.int32)
        ncopies = tl.full((BCW,), -1, tl.int32)
        if OFFLOADED:
            nslot_of = tl.load(slot_of_ptr + nxt_c * E + offs, mask=emask, other=-1)
            nexpert_of = tl.load(expert_of_ptr + nxt_c * C + cidx, mask=cidx < C, other=-2)
            ncopies = tl.load(copies_ptr + nxt_c * CW + cw, mask=cw < CW, other=-1)
        # the next layer's token prior, as this layer's above
        nexperts = offs
        nvalues = tl.full((BE,), 0.0, tl.float64)
        nfallback = tl.full((BE,), 0.0, tl.float64)
        if HAS_PRIOR:
            nexperts, nvalues, nfallback = _prior_row(token, nxt_c, indptr_ptr, pexp_ptr, pval_ptr, fallback_ptr,
                                                      offs, emask, E, L)

    z32 = tl.load(scores_ptr + offs, mask=emask, other=NEG).to(tl.float32)  # float32, or the router's logits
    nan_or_inf = ((z32 != z32) | (z32 == float("inf"))).to(tl.int32)
    bad, finite = tl.reduce((nan_or_inf, (emask & (z32 != NEG)).to(tl.int32)), 0, _both_sums)
    error = tl.where((error == 0) & ((bad > 0) | (finite < K)), 1, error)
    z32 = tl.where(z32 == z32, z32, NEG)
    z = z32.to(tl.float64)
    # ranks of float32 scores compare them in float32: widening is exact and keeps their order and ties, and the
    # [BE, BE] comparison tiles take half the registers
    own_rank = _rank(z32, z32, offs)
    own_k = (own_rank < K) & emask

    sel_rank = own_rank
    range_sum = tl.load(cbase + 0)
    range_count = tl.load(cbase + 1)
    if EXEC_PREGATE:
        g_saved = tl.load(saved_ptr + layer * E + offs, mask=emask, other=NEG).to(tl.float32)
        g_rank = _rank(g_saved, g_saved, offs)
        sel_rank = tl.where(layer >= 1, g_rank, own_rank)
    if BIASED:
        if RUNNING:
            fin = emask & (z != NEG)
            hi, lo = tl.reduce((tl.where(fin, z, NEG), tl.where(fin, z, float("inf"))), 0, _max_min)
            range_sum = range_sum + (hi - lo)
            range_count = range_count + 1.0
            d = range_sum / range_count
        else:
            d = delta
        bonus = lam * d
        marked = (resident | (own_rank < TOP_J)) & emask
        biased = z + tl.where(marked, bonus, 0.0)
        sel_rank = _rank(biased, z32, offs)
    in_sel = (sel_rank < K) & emask

    plan = tl.full((BW,), -1, tl.int64)
    # the selection in rank order: lane i of the plan holds the expert ranked i (i < K)
    ranked = tl.reduce(tl.where(sel_rank[None, :] == pw[:, None], offs[None, :], 0), 1, tl.standard._sum_combine)
    ids_out = tl.where(pw < K, ranked.to(tl.int64), 0)
    plan = tl.where(pw < K, ids_out, plan)

    copies = tl.full((BCW,), -1, tl.int32)

    # step 5: demand insertions in ascending expert order, evicting from R - (S u B), else R - S
    # only the selected experts not resident are inserted, and an insertion evicts only unselected experts, so
    # the loop visits just those (usually none) in ascending order. With the resident count and step 7's count of
    # replaced experts (neither the selection nor the router's top-K changes below) in one reduction.
    remaining = in_sel & (resident == 0)
    n_demand = 0
    n_resident, e, replaced = tl.reduce((resident.to(tl.int32), tl.where(remaining, offs, BIG),
                                         (in_sel & (own_k == 0)).to(tl.int32)), 0, _sum_min_sum)
    while e < E:
        # the eviction priority (the token prior's sums are a large part of the kernel's work) only where a
        # selected expert is missing: usually none is; the state it reads does not change within the loop
        priority = _priority(s_fast, s_slow, last_use, seen, pexperts, pvalues, pfallback, offs, LRU, HAS_PRIOR)
        remaining = remaining & (offs != e)
        full = n_resident == C
        v1, v2 = _evict_either(priority, resident & (in_sel == 0) & (protected == 0), resident & (in_sel == 0), offs)
        victim = tl.where(full, tl.where(v1 >= 0, v1, v2), -1)
        resident = tl.where(offs == victim, 0, resident) != 0
        resident = resident | (offs == e)
        n_resident = n_resident + tl.where(victim < 0, 1, 0)
        plan = tl.where(pw == DEMAND + n_demand, e.to(tl.int64), plan)
        plan = tl.where(pw == DEMAND_EVICTED + n_demand, victim.to(tl.int64), plan)
        if OFFLOADED:
            slot, slot_of, expert_of = _take_slot(e >= 0, e, victim, slot_of, expert_of, offs, cidx, C, BIG)
            error = tl.where((error == 0) & (slot >= C), 3, error)
            copies = tl.where(cw == C_DEMAND + 2 * n_demand, e, copies)
            copies = tl.where(cw == C_DEMAND + 2 * n_demand + 1, slot, copies)
        n_demand = n_demand + 1
        e = tl.reduce(tl.where(remaining, offs, BIG), 0, tl.standard._elementwise_min)

    # step 7: statistics from the router's own top-K
    part1_here = INSERTS & (layer >= DISTANCE)
    last_use = tl.where(in_sel | (inserted & part1_here), step, last_use)
    flag = tl.where(own_k, 1.0, 0.0).to(tl.float64)
    sf = decay_fast * s_fast + (1.0 - decay_fast) * flag
    ss = decay_slow * s_slow + (1.0 - decay_slow) * flag
    s_fast = tl.where(sf >= ss * flush, sf, 0.0)
    s_slow = ss
    protected = protected & (part1_here == 0)
    plan = tl.where(pw == N_PREFETCH, 0, plan)
    plan = tl.where(pw == N_DEMAND, n_demand.to(tl.int64), plan)
    plan = tl.where(pw == N_REPLACED, replaced.to(tl.int64), plan)

    ok = error == 0
    tl.store(base + 0 * E + offs, s_fast, mask=(emask & ok) != 0)
    tl.store(base + 1 * E + offs, s_slow, mask=(emask & ok) != 0)
    tl.store(base + 2 * E + offs, last_use, mask=(emask & ok) != 0)
    tl.store(base + 3 * E + offs, tl.where(resident, 1.0, 0.0).to(tl.float64), mask=(emask & ok) != 0)
    tl.store(base + 4 * E + offs, tl.where(protected, 1.0, 0.0).to(tl.float64), mask=(emask & ok) != 0)
    tl.store(base + 5 * E + offs, tl.full((BE,), 0.0, tl.float64), mask=(emask & ok) != 0)
    if RUNNING:
        if BIASED:
            tl.store(cbase + 0, range_sum, mask=ok)
            tl.store(cbase + 1, range_count, mask=ok)
    tl.store(cbase + 2, step + 1.0, mask=ok)
    tl.store(cbase + 3, 0.0, mask=ok)
    tl.store(cbase + 4, steps_done + 1.0, mask=ok)
    tl.store(cbase + 6, demand_done + n_demand.to(tl.float64), mask=ok)
    tl.store(cbase + 7, replaced_done + replaced.to(tl.float64), mask=ok)
    tl.store(plans_ptr + layer * W + pw, plan, mask=pw < W)
    tl.store(ids_ptr + pw, ids_out, mask=pw < K)
    if OFFLOADED:
        held_in = tl.reduce(tl.where(ids_out[:, None] == offs[None, :], slot_of[None, :], 0), 1,
                            tl.standard._sum_combine)
        slots_out = tl.where(pw < K, held_in.to(tl.int64), 0)
        tl.store(slot_ids_ptr + pw, slots_out, mask=pw < K)
        tl.store(slot_of_ptr + layer * E + offs, slot_of, mask=(emask & ok) != 0)
        tl.store(expert_of_ptr + layer * C + cidx, expert_of, mask=((cidx < C) & ok) != 0)
        copies = tl.where(cw == C_N_DEMAND, tl.where(ok, n_demand, 0), copies)
    else:
        tl.store(slot_ids_ptr + pw, ids_out, mask=pw < K)
    if RECORD:
        rbase = record_ptr + position * (L * E)
        tl.store(rbase + layer * E + offs, z32, mask=emask)
        tl.store(record_plans_ptr + (position * L + layer) * W + pw, plan, mask=pw < W)

    # ---------------------------------------------------------------- part 1 of layer + DISTANCE
    pplan = tl.full((BW,), -1, tl.int64)
    n_ins = 0
    if INSERTS:
        if nxt < L:
            g_nan_or_inf = ((g32 != g32) | (g32 == float("inf"))).to(tl.int32)
            gbad, n_res_next = tl.reduce((g_nan_or_inf, nres.to(tl.int32)), 0, _both_sums)
            error = tl.where((error == 0) & (gbad > 0), 1, error)
            ok = error == 0
            g32 = tl.where(g32 == g32, g32, NEG)
            tl.store(saved_ptr + nxt * E + offs, g32, mask=emask)
            grank = _rank(g32, g32, offs)
            # the next layer's eviction priority: its state does not change within the loop
            npri = _priority(nf, ns, nl, seen, nexperts, nvalues, nfallback, offs, LRU, HAS_PRIOR)
            # the window in rank order until the budget is spent or an insertion finds no victim. A held expert
            # is only protected, so each pass protects the held run up to the next expert not held (against the
            # residency as the insertions left it) in one vector step and inserts that one: the same order as one
            # expert per pass, in as many passes as insertions. After the budget the rest of the window only
            # protects what it holds, which the insertions no longer change.
            stopped = n_ins != 0  # False
            i = 0
            while (i < WINDOW) & (n_ins < BUDGET) & (stopped == 0):
                ahead = (grank >= i) & (grank < WINDOW) & emask
                # the next rank not held and its expert in one reduction (ranks are distinct; without one, e is
                # not read: nothing is inserted)
                nxt_rank, e = tl.reduce((tl.where(ahead & (nres == 0), grank, WINDOW), offs), 0, _lowest_first)
                nprot = nprot | (ahead & nres & (grank < nxt_rank))
                do = nxt_rank < WINDOW
                full = n_res_next == C
                v = _evict(npri, nres & (nprot == 0), offs, BIG)
                stop_now = do & full & (v < 0)
                stopped = stopped | stop_now
                do = do & (stop_now == 0)
                victim = tl.where(full, v, -1)
                nres = tl.where(do & (offs == victim), 0, nres) != 0
                n_res_next = n_res_next + tl.where(do & (victim < 0), 1, 0)
                hit = do & (offs == e)
                nres = nres | hit
                nprot = nprot | hit
                nins = nins | hit
                pplan = tl.where(do & (pw == PREFETCH + n_ins), e.to(tl.int64), pplan)
                pplan = tl.where(do & (pw == PREFETCH_EVICTED + n_ins), victim.to(tl.int64), pplan)
                if OFFLOADED:
                    slot, nslot_of, nexpert_of = _take_slot(do, e, victim, nslot_of, nexpert_of, offs, cidx, C, BIG)
                    error = tl.where((error == 0) & do & (slot >= C), 3, error)
                    ncopies = tl.where(do & (cw == C_PREFETCH + 2 * n_ins), e, ncopies)
                    ncopies = tl.where(do & (cw == C_PREFETCH + 2 * n_ins + 1), slot, ncopies)
                n_ins = n_ins + do.to(tl.int32)
                i = nxt_rank + 1
            nprot = nprot | ((stopped == 0) & nres & (grank >= i) & (grank < WINDOW))
            ok = error == 0
            pplan = tl.where(pw == N_PREFETCH, n_ins.to(tl.int64), pplan)
            pplan = tl.where(pw == N_DEMAND, 0, pplan)
            pplan = tl.where(pw == N_REPLACED, 0, pplan)
            tl.store(nbase + 3 * E + offs, tl.where(nres, 1.0, 0.0).to(tl.float64), mask=(emask & ok) != 0)
            tl.store(nbase + 4 * E + offs, tl.where(nprot, 1.0, 0.0).to(tl.float64), mask=(emask & ok) != 0)
            tl.store(nbase + 5 * E + offs, tl.where(nins, 1.0, 0.0).to(tl.float64), mask=(emask & ok) != 0)
            tl.store(nc + 3, 1.0, mask=ok)
            tl.store(nc + 5, prefetched_done + n_ins.to(tl.float64), mask=ok)
            tl.store(pplans_ptr + nxt * W + pw, pplan, mask=pw < W)
            if OFFLOADED:
                ncopies = tl.where(cw == C_N_PREFETCH, tl.where(ok, n_ins, 0), ncopies)
                tl.store(slot_of_ptr + nxt * E + offs, nslot_of, mask=(emask & ok) != 0)
                tl.store(expert_of_ptr + nxt * C + cidx, nexpert_of, mask=((cidx < C) & ok) != 0)
                tl.store(copies_ptr + nxt * CW + cw, ncopies, mask=((cw >= C_N_PREFETCH) & (cw < CW)) != 0)
    if OFFLOADED:
        tl.store(copies_ptr + layer * CW + cw, copies, mask=cw < C_N_PREFETCH)
    tl.store(error_ptr, error)
