"""numba kernels of the logical cache (ALGORITHM.md, parts 1 and 2). Private and array-only.

Everything here is called through :class:`psr_hf.policy.LogicalCache`, which validates shapes and dtypes and
turns error codes into ``ValueError``. The kernels validate the values they read (NaN scores, token ids) before
touching any state, so a bad block leaves the state as it was.

Arrays (few of them, because numba's per-call cost grows with the number of arguments):

- ``st   float64 [L, R, 6, E]``: per layer and row the planes ``S_FAST``, ``S_SLOW``, ``LAST_USE``, ``RESIDENT``
  (0/1), ``PROTECTED`` (in B, 0/1), ``INSERTED`` (prefetch-inserted this step, 0/1). float64 holds the integer
  planes exactly.
- ``rs   float64 [L, R, 8]``: running range sum and count, step counter, part-1-pending flag, and the counters
  steps / prefetch insertions / demand insertions / replaced router slots.
- ``mi   int64   [MI_SIZE + V]``: config integers, then the token-seen flags of the prior.
- ``mf   float64 [MF_SIZE + L + L * E]``: config floats, then ``delta [L]``, then the fallback prior ``[L, E]``.
- ``indptr int64 [V * L + 1]``, ``pexp uint16 [nnz]``, ``pval float32 [nnz]``: the token prior (CSR).

Per-step work is a handful of passes over the E experts: the router's top-K, the pre-gate ranking, the biased
top-K (bonus computed on the fly), the moving averages, and one priority pass per eviction; the priority is
computed lazily at the first eviction, which gives the same values as computing it first (nothing it reads
changes before step 7).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# policies, evictions
EXACT, CACHE_PRIOR, PSR, SPEC = 0, 1, 2, 3
EVICT_SCORE, EVICT_LRU = 0, 1

# mi fields (token-seen flags follow)
MI_POLICY, MI_EVICTION, MI_K, MI_C, MI_BUDGET, MI_WINDOW, MI_TOP_J, MI_RUNNING, MI_INSERTS, MI_VOCAB = range(10)
MI_SIZE = 10
# mf fields (delta [L] and the fallback prior [L, E] follow)
MF_LAM, MF_DECAY_FAST, MF_DECAY_SLOW = range(3)
MF_SIZE = 3

# st planes, rs fields
S_FAST, S_SLOW, LAST_USE, RESIDENT, PROTECTED, INSERTED = range(6)
N_PLANES = 6
R_RANGE_SUM, R_RANGE_COUNT, R_STEP, R_PENDING, R_STEPS, R_PREFETCH, R_DEMAND, R_REPLACED = range(8)
R_SIZE = 8

# s_fast below s_slow * FLUSH_RATIO is flushed to zero (see step 7); 2**-60 < half an ulp (2**-53)
FLUSH_RATIO = 2.0**-60

# modes
MODE_BOTH, MODE_INSERT, MODE_SELECT = 0, 1, 2

# error codes (see LogicalCache._raise)
OK, ERR_SCORES, ERR_PREGATE, ERR_TOKEN, ERR_FEW_FINITE, ERR_NO_PART1, ERR_PART1_TWICE, ERR_SHAPE = range(8)


def scratch_sizes(E: int, K: int, window: int, top_j: int, P: int) -> tuple[int, int]:
    """Sizes of the float64 and int64 scratch buffers of :func:`_step_layer` (allocate with zeros)."""
    nk = max(window, K, top_j)
    return 6 * E + nk, 2 * E + 4 * nk + P


@njit(cache=True, nogil=True)
def plan_width_of(K, P):
    return 3 * K + 2 * P + 3


def plan_width(K: int, P: int) -> int:
    """Columns of the plan: selected K | n_prefetch | prefetch P | prefetch victims P | n_demand | demand K |
    demand victims K | n_replaced."""
    return 3 * K + 2 * P + 3


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
def _priority(eviction, layer, token, E, L, row, mi, mf, indptr, pexp, pval, p):
    """Eviction priority of every expert (ALGORITHM.md step 1) into ``p``."""
    if eviction == EVICT_LRU:
        for e in range(E):
            p[e] = row[LAST_USE, e]
        return
    for e in range(E):
        p[e] = row[S_FAST, e] + row[S_SLOW, e]
    if mi[MI_VOCAB] > 0:
        if mi[MI_SIZE + token] != 0:
            r = token * L + layer
            for j in range(indptr[r], indptr[r + 1]):
                e = pexp[j]
                p[e] = p[e] + np.float64(pval[j])
        else:
            base = MF_SIZE + L + layer * E
            for e in range(E):
                p[e] = p[e] + mf[base + e]


@njit(cache=True, nogil=True)
def _evict(row, excl, p, use_prot):
    """argmin ``p`` over resident experts with ``excl[e] == 0`` (and, if ``use_prot``, not in B), ties to the
    lower index; -1 if there is none. Priorities are finite, so +inf marks the ineligible."""
    best = -1
    bp = np.inf
    for e in range(p.shape[0]):
        ok = row[RESIDENT, e] != 0.0 and excl[e] == 0.0 and (not use_prot or row[PROTECTED, e] == 0.0)
        q = p[e] if ok else np.inf
        if q < bp:
            best = e
            bp = q
    return best


@njit(cache=True, nogil=True)
def _validate(layer, mode, mi, z, g, tokens, valid, rs, plan, E):
    """Shapes and values of one block (``valid`` of shape (0, 0) means every position is real)."""
    B, S = tokens.shape
    L = rs.shape[0]
    K = mi[MI_K]
    vocab = mi[MI_VOCAB]
    if layer < 0 or layer >= L or B != rs.shape[1] or z.shape[0] != B or z.shape[1] != S or z.shape[2] != E:
        return ERR_SHAPE
    if plan.shape[0] != B or plan.shape[1] != S or plan.shape[2] != plan_width_of(K, mi[MI_BUDGET]):
        return ERR_SHAPE
    all_valid = valid.shape[0] == 0
    if not all_valid and (valid.shape[0] != B or valid.shape[1] != S):
        return ERR_SHAPE
    part1 = layer >= 1 and mi[MI_INSERTS] != 0
    check_g = layer >= 1 and ((part1 and mode != MODE_SELECT) or (mi[MI_POLICY] == SPEC and mode != MODE_INSERT))
    if check_g and (g.shape[0] != B or g.shape[1] != S or g.shape[2] != E):
        return ERR_SHAPE
    for b in range(B):
        for s in range(S):
            if not all_valid and valid[b, s] == 0:
                continue
            if check_g:
                bad = 0
                for e in range(E):
                    x = g[b, s, e]
                    bad += (x != x) | (x == np.inf)
                if bad:
                    return ERR_PREGATE
            if mode != MODE_INSERT:
                bad = 0
                finite = 0
                for e in range(E):
                    x = z[b, s, e]
                    bad += (x != x) | (x == np.inf)
                    finite += x != -np.inf
                if bad:
                    return ERR_SCORES
                if finite < K:
                    return ERR_FEW_FINITE
            t = tokens[b, s]
            if t < 0 or (vocab > 0 and t >= vocab):
                return ERR_TOKEN
            if mode == MODE_SELECT and part1 and rs[layer, b, R_PENDING] == 0.0:
                return ERR_NO_PART1
            if mode != MODE_SELECT and part1 and rs[layer, b, R_PENDING] != 0.0:
                return ERR_PART1_TWICE
    return OK


@njit(cache=True, nogil=True)
def _step_layer(layer, mode, mi, mf, z, g, tokens, valid, st, rs, indptr, pexp, pval, plan, fbuf, ibuf):
    """Validate the block (:func:`_validate`), then run :func:`_step_layer_checked` on it."""
    code = _validate(layer, mode, mi, z, g, tokens, valid, rs, plan, st.shape[3])
    if code != OK:
        return code
    return _step_layer_checked(layer, mode, mi, mf, z, g, tokens, valid, st, rs, indptr, pexp, pval, plan, fbuf, ibuf)


@njit(cache=True, nogil=True)
def _step_layer_checked(layer, mode, mi, mf, z, g, tokens, valid, st, rs, indptr, pexp, pval, plan, fbuf, ibuf):
    """One MoE layer over a block of positions ``[B, S]`` (positions in order; rows independent).

    ``mode``: MODE_BOTH runs part 1 then part 2 per position; MODE_INSERT runs part 1 only (S == 1), leaving B
    pending in the PROTECTED plane; MODE_SELECT runs part 2 only, consuming it. Writes the copy plan of every
    position into ``plan [B, S, plan_width]``. The block must have passed :func:`_validate`; returns OK.
    """
    B, S = tokens.shape
    E = st.shape[3]
    L = st.shape[0]
    policy = mi[MI_POLICY]
    eviction = mi[MI_EVICTION]
    K = mi[MI_K]
    C = mi[MI_C]
    budget = mi[MI_BUDGET]
    window = min(mi[MI_WINDOW], E)
    top_j = mi[MI_TOP_J]
    running = mi[MI_RUNNING] != 0
    lam = mf[MF_LAM]
    decay_fast = mf[MF_DECAY_FAST]
    decay_slow = mf[MF_DECAY_SLOW]
    flush = min(1.0, 1.0 - decay_fast) * FLUSH_RATIO

    all_valid = valid.shape[0] == 0
    P = budget
    o_npf = K
    o_pf = K + 1
    o_pv = K + 1 + P
    o_nd = K + 1 + 2 * P
    o_dm = o_nd + 1
    o_dv = o_dm + K
    o_nr = o_dv + K

    n_own = max(K, top_j)
    nk = max(window, n_own)
    # scratch (see scratch_sizes): flags and topj must be zero on entry and are left zero on exit
    p = fbuf[:E]
    flags = fbuf[E : 2 * E]  # 1.0 marks S during demand insertion; reused as the own-top-K indicator in step 7
    zf = fbuf[2 * E : 3 * E]  # this position's scores as float64
    gf = fbuf[3 * E : 4 * E]  # pre-gate as float64, or the biased scores
    fscratch = fbuf[4 * E :]  # scratch of _select_top: k + 2E
    topj = ibuf[:E]
    cand = ibuf[E : E + nk]
    own = ibuf[E + nk : E + 2 * nk]
    sel = ibuf[E + 2 * nk : E + 3 * nk]
    sel_sorted = ibuf[E + 3 * nk : E + 4 * nk]
    inserted = ibuf[E + 4 * nk : E + 4 * nk + P]
    scratch = ibuf[E + 4 * nk + P :]

    do_part1 = mi[MI_INSERTS] != 0 and layer >= 1 and mode != MODE_SELECT
    do_part2 = mode != MODE_INSERT
    part1_any = mi[MI_INSERTS] != 0 and layer >= 1

    for b in range(B):
        row = st[layer, b]  # [6, E]
        rsb = rs[layer, b]
        prot = row[PROTECTED]
        nres = 0
        for e in range(E):
            nres += row[RESIDENT, e] != 0.0
        for s in range(S):
            row_plan = plan[b, s]
            row_plan[:] = -1
            row_plan[o_npf] = 0
            row_plan[o_nd] = 0
            row_plan[o_nr] = 0
            zb = z[b, s]
            if not all_valid and valid[b, s] == 0:
                # padded position: the router's own top-K, state neither read nor changed
                if do_part2:
                    for e in range(E):
                        zf[e] = zb[e]
                    _select_top(zf, zf, K, own, fscratch, scratch, -np.inf)
                    for i in range(K):
                        row_plan[i] = own[i]
                continue
            token = tokens[b, s]
            have_p = False
            n_ins = 0

            # ---- part 1: pre-gate insertion
            if do_part1:
                gb = g[b, s]
                for e in range(E):
                    gf[e] = gb[e]
                _select_top(gf, gf, window, cand, fscratch, scratch, -np.inf)
                for i in range(window):
                    e = cand[i]
                    if row[RESIDENT, e] != 0.0:
                        prot[e] = 1.0
                    elif n_ins < budget:
                        victim = -1
                        if nres == C:
                            if not have_p:
                                _priority(eviction, layer, token, E, L, row, mi, mf, indptr, pexp, pval, p)
                                have_p = True
                            victim = _evict(row, prot, p, False)
                            if victim < 0:
                                break  # R \ B is empty: stop part 1
                            row[RESIDENT, victim] = 0.0
                            nres -= 1
                        row[RESIDENT, e] = 1.0
                        nres += 1
                        prot[e] = 1.0
                        row[INSERTED, e] = 1.0
                        inserted[n_ins] = e
                        row_plan[o_pf + n_ins] = e
                        row_plan[o_pv + n_ins] = victim
                        n_ins += 1
                row_plan[o_npf] = n_ins
                rsb[R_PREFETCH] += n_ins
                if mode == MODE_INSERT:
                    rsb[R_PENDING] = 1.0
                    continue
            elif mode == MODE_SELECT and part1_any:
                # B and the insertions were left by prefetch() in the PROTECTED / INSERTED planes
                for e in range(E):
                    if row[INSERTED, e] != 0.0:
                        inserted[n_ins] = e
                        n_ins += 1

            if not do_part2:
                continue

            # ---- part 2: selection
            for e in range(E):
                zf[e] = zb[e]
            _select_top(zf, zf, n_own, own, fscratch, scratch, -np.inf)
            if policy == EXACT:
                for i in range(K):
                    sel[i] = own[i]
            elif policy == SPEC and layer >= 1:
                gb = g[b, s]
                for e in range(E):
                    gf[e] = gb[e]
                _select_top(gf, gf, K, sel, fscratch, scratch, -np.inf)
            elif policy == SPEC:
                for i in range(K):
                    sel[i] = own[i]
            else:
                if running:
                    mx = -np.inf
                    mn = np.inf
                    for e in range(E):
                        x = zf[e]
                        if x != -np.inf:
                            mx = max(mx, x)
                            mn = min(mn, x)
                    rsb[R_RANGE_SUM] += mx - mn
                    rsb[R_RANGE_COUNT] += 1.0
                    d = rsb[R_RANGE_SUM] / rsb[R_RANGE_COUNT]
                else:
                    d = mf[MF_SIZE + layer]
                bonus = lam * d
                for i in range(top_j):
                    topj[own[i]] = 1
                res = row[RESIDENT]
                for e in range(E):
                    # z + lam * d * m with m in {0, 1}; z + 0.0 == z
                    gf[e] = zf[e] + (bonus if (res[e] != 0.0) | (topj[e] != 0) else 0.0)
                # every biased score is >= its raw score, so the K-th largest biased score is >= the router's
                # own K-th largest score: a tight lower bound that leaves few candidates
                _select_top(gf, zf, K, sel, fscratch, scratch, zf[own[K - 1]])
                for i in range(top_j):
                    topj[own[i]] = 0

            # ---- demand insertions, ascending expert index
            for i in range(K):
                e = sel[i]
                row_plan[i] = e
                flags[e] = 1.0
                pos = i
                while pos > 0 and sel_sorted[pos - 1] > e:
                    sel_sorted[pos] = sel_sorted[pos - 1]
                    pos -= 1
                sel_sorted[pos] = e
            nd = 0
            for i in range(K):
                e = sel_sorted[i]
                if row[RESIDENT, e] != 0.0:
                    continue
                victim = -1
                if nres == C:
                    if not have_p:
                        _priority(eviction, layer, token, E, L, row, mi, mf, indptr, pexp, pval, p)
                        have_p = True
                    victim = _evict(row, flags, p, True)
                    if victim < 0:
                        victim = _evict(row, flags, p, False)
                    row[RESIDENT, victim] = 0.0
                    nres -= 1
                row[RESIDENT, e] = 1.0
                nres += 1
                row_plan[o_dm + nd] = e
                row_plan[o_dv + nd] = victim
                nd += 1
            row_plan[o_nd] = nd

            # ---- statistics from the router's own top-K
            step = rsb[R_STEP]
            for i in range(K):
                flags[sel[i]] = 0.0
                row[LAST_USE, sel[i]] = step
            for i in range(n_ins):
                row[LAST_USE, inserted[i]] = step
                row[INSERTED, inserted[i]] = 0.0
            for i in range(K):
                flags[own[i]] = 1.0
            replaced = 0
            for i in range(K):
                replaced += flags[sel[i]] == 0.0
            s_fast = row[S_FAST]
            s_slow = row[S_SLOW]
            for e in range(E):
                sf = decay_fast * s_fast[e] + (1.0 - decay_fast) * flags[e]
                ss = decay_slow * s_slow[e] + (1.0 - decay_slow) * flags[e]
                # A fast average far below half an ulp of the slow one (and of 1 - decay_fast) can no longer
                # change a priority (s_fast + s_slow) or a later average, so zero is the same value to every
                # decision; it keeps the fast average out of the subnormal range, where arithmetic is slow.
                s_fast[e] = sf if sf >= ss * flush else 0.0
                s_slow[e] = ss
            for i in range(K):
                flags[own[i]] = 0.0
            if part1_any:
                for e in range(E):
                    prot[e] = 0.0
            row_plan[o_nr] = replaced
            rsb[R_STEP] = step + 1.0
            rsb[R_PENDING] = 0.0
            rsb[R_STEPS] += 1.0
            rsb[R_DEMAND] += nd
            rsb[R_REPLACED] += replaced
    return OK


@njit(cache=True, nogil=True)
def _reset_rows(rows, warm, st, rs):
    """Reset the given rows of every layer to the warm set ``warm [L, E]`` (0/1)."""
    L = st.shape[0]
    E = st.shape[3]
    for l in range(L):
        for r in rows:
            for e in range(E):
                st[l, r, S_FAST, e] = 0.0
                st[l, r, S_SLOW, e] = 0.0
                st[l, r, LAST_USE, e] = -1.0
                st[l, r, RESIDENT, e] = warm[l, e]
                st[l, r, PROTECTED, e] = 0.0
                st[l, r, INSERTED, e] = 0.0
            for j in range(rs.shape[2]):
                rs[l, r, j] = 0.0


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


def make_table(mi, mf, st, rs, indptr, pexp, pval, fbuf, ibuf) -> np.ndarray:
    """The address table of a cache's arrays (all C-contiguous, of the kernel's dtypes)."""
    for a, dt in ((mi, np.int64), (mf, np.float64), (st, np.float64), (rs, np.float64), (indptr, np.int64),
                  (pexp, np.uint16), (pval, np.float32), (fbuf, np.float64), (ibuf, np.int64)):
        if a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError("kernel arrays must be C-contiguous with the kernel's dtypes")
    L, R, _, E = st.shape
    t = np.zeros(TABLE_SIZE, dtype=np.int64)
    t[T_MI], t[T_MI_N] = mi.ctypes.data, mi.size
    t[T_MF], t[T_MF_N] = mf.ctypes.data, mf.size
    t[T_ST], t[T_L], t[T_R], t[T_E] = st.ctypes.data, L, R, E
    t[T_RS] = rs.ctypes.data
    t[T_INDPTR], t[T_INDPTR_N] = indptr.ctypes.data, indptr.size
    t[T_PEXP], t[T_NNZ] = pexp.ctypes.data, pexp.size
    t[T_PVAL] = pval.ctypes.data
    t[T_FBUF], t[T_FBUF_N] = fbuf.ctypes.data, fbuf.size
    t[T_IBUF], t[T_IBUF_N] = ibuf.ctypes.data, ibuf.size
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
def _step_table(layer, mode, table, z, g, tokens, valid, plan):
    """:func:`_step_layer` with the cache's arrays given by their address table."""
    L = table[T_L]
    R = table[T_R]
    E = table[T_E]
    mi = carray(_voidptr(table[T_MI]), (table[T_MI_N],), np.int64)
    mf = carray(_voidptr(table[T_MF]), (table[T_MF_N],), np.float64)
    st = carray(_voidptr(table[T_ST]), (L, R, N_PLANES, E), np.float64)
    rs = carray(_voidptr(table[T_RS]), (L, R, R_SIZE), np.float64)
    indptr = carray(_voidptr(table[T_INDPTR]), (table[T_INDPTR_N],), np.int64)
    pexp = carray(_voidptr(table[T_PEXP]), (table[T_NNZ],), np.uint16)
    pval = carray(_voidptr(table[T_PVAL]), (table[T_NNZ],), np.float32)
    fbuf = carray(_voidptr(table[T_FBUF]), (table[T_FBUF_N],), np.float64)
    ibuf = carray(_voidptr(table[T_IBUF]), (table[T_IBUF_N],), np.int64)
    return _step_layer(layer, mode, mi, mf, z, g, tokens, valid, st, rs, indptr, pexp, pval, plan, fbuf, ibuf)


@njit(cache=True, nogil=True, parallel=True)
def _step_all_layers(mode, mi, mf, z, g, tokens, valid, st, rs, indptr, pexp, pval, plan, codes):
    """Every layer over a whole recorded block in parallel: ``z``, ``g`` ``[L, B, S, E]``, ``plan``
    ``[L, B, S, W]``. Only for recorded traces, where all layers' inputs are known in advance (a layer's state
    depends only on that layer's own history). All layers are validated before any state changes."""
    L = z.shape[0]
    E = st.shape[3]
    for layer in prange(L):
        codes[layer] = _validate(layer, mode, mi, z[layer], g[layer], tokens, valid, rs, plan[layer], E)
    for layer in range(L):
        if codes[layer] != OK:
            return
    nk = max(min(mi[MI_WINDOW], E), mi[MI_K], mi[MI_TOP_J])
    for layer in prange(L):
        fbuf = np.zeros(6 * E + nk, dtype=np.float64)
        ibuf = np.zeros(2 * E + 4 * nk + mi[MI_BUDGET], dtype=np.int64)
        codes[layer] = _step_layer_checked(layer, mode, mi, mf, z[layer], g[layer], tokens, valid, st, rs, indptr,
                                           pexp, pval, plan[layer], fbuf, ibuf)


@njit(cache=True, nogil=True)
def _step_io(layer, mode, table):
    """:func:`_step_table` on the cache's own io buffers: no array crosses the call (each array argument costs
    numba an unboxing with a heap allocation), which is what a decoder calls once per layer and token."""
    R = table[T_R]
    E = table[T_E]
    z = carray(_voidptr(table[T_IN_Z]), (R, 1, E), np.float32)
    g = carray(_voidptr(table[T_IN_G]), (R, 1, E), np.float32)
    tokens = carray(_voidptr(table[T_IN_TOK]), (R, 1), np.int64)
    valid = carray(_voidptr(table[T_IN_VALID]), (R, 1), np.uint8)
    plan = carray(_voidptr(table[T_IN_PLAN]), (R, 1, table[T_IN_W]), np.int64)
    return _step_table(layer, mode, table, z, g, tokens, valid, plan)
