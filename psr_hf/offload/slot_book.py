"""The slot scheduler's bookkeeping as numba kernels over preallocated arrays (docs/offloading.md; the rules:
docs/ALGORITHM.md, "Physical scheduling"), so that following a layer's plan costs the host one compiled call
instead of a Python loop per expert and an object per copy. :class:`~psr_hf.offload.scheduler.SlotScheduler` owns
the arrays (:func:`new_book` makes them and gives their layout) and issues the copies these kernels decide, in
their order, through its link.

A copy's issue number orders it on the one copy stream; ``misc[COMPLETE]`` is the highest one the link has
reported complete, which the caller refreshes before a kernel that asks (every earlier copy is complete too).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..policy.numba_setup import use_user_cache_folder; use_user_cache_folder()  # noqa: E702 (before the njits)

WARM, DEMAND, PREFETCH = 0, 1, 2
QUEUED, ISSUED, DROPPED = 0, 1, 2

# slots[layer, field, slot]
S_EXPERT, S_LAST_USE, J_KIND, J_STATE, J_USED, J_SEQ, J_EXPERT, J_ID = range(8)
N_SLOT_FIELDS = 8
NO_JOB = -1

# misc fields
(C_DEMAND, C_PREFETCH, C_IN_TIME, C_LATE, C_UNUSED, C_DROPPED, C_WARM, C_BYTES,
 CLOCK, ISSUED_COUNT, NEXT_ID, Q_HEAD, Q_TAIL, F_HEAD, F_TAIL, N_ACTIONS, BYTES_PER_EXPERT, MAX_IN_FLIGHT,
 COMPLETE, P_N_DEMAND, P_DEMAND, P_DEMAND_EVICTED, P_N_PREFETCH, P_PREFETCH, P_PREFETCH_EVICTED,
 ERROR_LAYER) = range(26)
M_SIZE = 26
N_COUNTERS = 8

# what an entry kernel returns: NO_FREE_SLOT | LOW_ROOM | (copies to issue << 2); 0: nothing for the caller to do
OK, NO_FREE_SLOT, LOW_ROOM = 0, 1, 2
ACTIONS_SHIFT = 2


def new_book(num_layers: int, num_experts: int, capacity: int, max_in_flight: int,
             bytes_per_expert: int) -> dict[str, np.ndarray]:
    """Empty slots, no jobs, zero counters; rings sized for ``capacity`` (grown by the caller when needed).

    The arrays (few, because numba's per-call cost grows with the number of arguments):

    - ``slots`` int64 ``[L, N_SLOT_FIELDS, C]``: per slot its expert and the clock of its latest execution, and
      its latest copy (a *job*): kind (-1: none), state, used flag, issue number (-1: not issued), expert, job id;
    - ``experts`` int64 ``[L, E + 2]``: the slot of each expert (-1: none), then the layer's DIRTY flag (its
      device copy of the map is stale) and PENDING (the highest issue number its next computation must wait for,
      -1: none);
    - ``misc`` int64 ``[M_SIZE]``: the counters, the clocks, the rings' heads and tails, settings, the plan's
      columns;
    - ``queue`` int64 ``[Q, 3]``: queued prefetches ``(layer, slot, job id)`` in order (a ring; an entry is
      dropped when its slot holds another job);
    - ``flying`` int64 ``[F]``: issue numbers of the prefetch copies issued and not yet seen complete (a ring);
    - ``actions`` int64 ``[A, 4]``: the copies a kernel issued, ``(layer, slot, expert, issue number)``, in order.
    """
    L, E, C = num_layers, num_experts, capacity
    slots = np.zeros((L, N_SLOT_FIELDS, C), dtype=np.int64)
    slots[:, S_EXPERT] = -1
    slots[:, J_KIND] = NO_JOB
    slots[:, J_SEQ] = -1
    experts = np.full((L, E + 2), -1, dtype=np.int64)
    experts[:, E] = 1  # DIRTY
    misc = np.zeros(M_SIZE, dtype=np.int64)
    misc[BYTES_PER_EXPERT] = bytes_per_expert
    misc[MAX_IN_FLIGHT] = max_in_flight
    misc[COMPLETE] = -1
    return {
        "slots": slots, "experts": experts, "misc": misc,
        "queue": np.zeros((4 * L * C + 16, 3), dtype=np.int64),
        "flying": np.zeros(4 * (2 * C + min(max_in_flight, 4096)) + 64, dtype=np.int64),
        "actions": np.zeros((2 * C + min(max_in_flight, 4096) + 16, 4), dtype=np.int64),
    }


# ---------------------------------------------------------------------------------------------------- pieces
@njit(cache=True, nogil=True)
def _issue(slots, experts, misc, flying, actions, layer, slot):
    """The slot's queued job is issued: its issue number, the bytes, the flying ring (prefetches), an action."""
    seq = misc[ISSUED_COUNT]
    misc[ISSUED_COUNT] = seq + 1
    slots[layer, J_STATE, slot] = ISSUED
    slots[layer, J_SEQ, slot] = seq
    misc[C_BYTES] += misc[BYTES_PER_EXPERT]
    if slots[layer, J_KIND, slot] == PREFETCH:
        flying[misc[F_TAIL] % flying.shape[0]] = seq
        misc[F_TAIL] += 1
    n = misc[N_ACTIONS]
    actions[n, 0] = layer
    actions[n, 1] = slot
    actions[n, 2] = slots[layer, J_EXPERT, slot]
    actions[n, 3] = seq
    misc[N_ACTIONS] = n + 1
    return seq


@njit(cache=True, nogil=True)
def _pend(experts, layer, seq):
    """The layer's next computation waits for copy ``seq`` (and so for every earlier one)."""
    column = experts.shape[1] - 1
    if seq > experts[layer, column]:
        experts[layer, column] = seq


@njit(cache=True, nogil=True)
def _assign(slots, experts, misc, queue, flying, actions, layer, expert, slot, kind):
    """Put ``expert`` in ``slot``: retire the slot's previous job (a queued prefetch never used is dropped, an
    issued one counted unused), update the maps, issue the new job (demand, warm) or queue it (prefetch)."""
    if slots[layer, J_KIND, slot] == PREFETCH and slots[layer, J_USED, slot] == 0:
        if slots[layer, J_STATE, slot] == QUEUED:
            slots[layer, J_STATE, slot] = DROPPED
            misc[C_DROPPED] += 1
        else:
            misc[C_UNUSED] += 1
    E = experts.shape[1] - 2
    old = slots[layer, S_EXPERT, slot]
    if old >= 0:
        experts[layer, old] = -1
    slots[layer, S_EXPERT, slot] = expert
    experts[layer, expert] = slot
    experts[layer, E] = 1  # DIRTY
    job = misc[NEXT_ID]
    misc[NEXT_ID] = job + 1
    slots[layer, J_KIND, slot] = kind
    slots[layer, J_STATE, slot] = QUEUED
    slots[layer, J_USED, slot] = 0
    slots[layer, J_SEQ, slot] = -1
    slots[layer, J_EXPERT, slot] = expert
    slots[layer, J_ID, slot] = job
    if kind == PREFETCH:
        misc[C_PREFETCH] += 1
        tail = misc[Q_TAIL]
        row = tail % queue.shape[0]
        queue[row, 0] = layer
        queue[row, 1] = slot
        queue[row, 2] = job
        misc[Q_TAIL] = tail + 1
    else:
        misc[C_WARM if kind == WARM else C_DEMAND] += 1
        _pend(experts, layer, _issue(slots, experts, misc, flying, actions, layer, slot))


@njit(cache=True, nogil=True)
def _victim(slots, layer, protect, avoid):
    """A slot to load into: the first empty one; else the least recently executed slot (lowest index on ties)
    whose expert is not in ``protect`` (experts needed now) and not cached in ``avoid`` ([E], nonzero: in the
    logical cache; empty: no preference); else ignoring ``avoid``. -1: every slot is protected."""
    C = slots.shape[2]
    for s in range(C):
        if slots[layer, S_EXPERT, s] < 0:
            return s
    best, preferred = -1, -1
    use_avoid = avoid.shape[0] > 0
    for s in range(C):
        e = slots[layer, S_EXPERT, s]
        needed = False
        for i in range(protect.shape[0]):
            if protect[i] == e:
                needed = True
                break
        if needed:
            continue
        last = slots[layer, S_LAST_USE, s]
        if best < 0 or last < slots[layer, S_LAST_USE, best]:
            best = s
        if use_avoid and avoid[e] == 0 and (preferred < 0 or last < slots[layer, S_LAST_USE, preferred]):
            preferred = s
    return preferred if preferred >= 0 else best


@njit(cache=True, nogil=True)
def _load(slots, experts, misc, queue, flying, actions, layer, expert, protect, avoid, kind):
    """Put ``expert`` in the slot :func:`_victim` picks; NO_FREE_SLOT (the layer noted) when every slot is
    protected."""
    slot = _victim(slots, layer, protect, avoid)
    if slot < 0:
        misc[ERROR_LAYER] = layer
        return NO_FREE_SLOT
    _assign(slots, experts, misc, queue, flying, actions, layer, expert, slot, kind)
    return OK


@njit(cache=True, nogil=True)
def _queued(slots, queue, row):
    """Whether queue entry ``row`` is still its slot's job and not issued yet (else it was dropped or issued)."""
    layer, slot = queue[row, 0], queue[row, 1]
    return slots[layer, J_ID, slot] == queue[row, 2] and slots[layer, J_STATE, slot] == QUEUED


@njit(cache=True, nogil=True)
def _insert(slots, experts, misc, queue, flying, actions, layer, expert, evicted, kind, avoid):
    """Follow a logical insertion of ``expert`` (evicting ``evicted``, -1: a free slot): the evicted expert's slot
    if it holds one, else a slot outside the logical cache ``avoid``. Nothing if ``expert`` is in a slot."""
    if experts[layer, expert] >= 0:
        return OK
    slot = experts[layer, evicted] if evicted >= 0 else -1
    if slot < 0:
        return _load(slots, experts, misc, queue, flying, actions, layer, expert, experts[layer, :0], avoid, kind)
    _assign(slots, experts, misc, queue, flying, actions, layer, expert, slot, kind)
    return OK


@njit(cache=True, nogil=True)
def _use(slots, experts, misc, queue, flying, actions, layer, chosen, avoid):
    """Make ``chosen`` present for an execution (demand loads for missing ones, never evicting one of them) and
    record first uses: a prefetch issued and complete arrived in time; one in flight or still queued (issued now)
    is late, and the layer waits for it."""
    misc[CLOCK] += 1
    clock = misc[CLOCK]
    for i in range(chosen.shape[0]):
        e = chosen[i]
        if experts[layer, e] < 0 and _load(slots, experts, misc, queue, flying, actions, layer, e, chosen, avoid,
                                           DEMAND) != OK:
            return NO_FREE_SLOT
        slot = experts[layer, e]
        slots[layer, S_LAST_USE, slot] = clock
        if slots[layer, J_KIND, slot] == NO_JOB or slots[layer, J_USED, slot]:
            continue
        slots[layer, J_USED, slot] = 1
        if slots[layer, J_KIND, slot] != PREFETCH:
            continue
        if slots[layer, J_STATE, slot] == QUEUED:
            _pend(experts, layer, _issue(slots, experts, misc, flying, actions, layer, slot))
            misc[C_LATE] += 1
        elif slots[layer, J_SEQ, slot] <= misc[COMPLETE]:
            misc[C_IN_TIME] += 1
        else:
            misc[C_LATE] += 1
            _pend(experts, layer, slots[layer, J_SEQ, slot])
    return OK


@njit(cache=True, nogil=True)
def _outcome(slots, misc, flying, actions, queue, code):
    """``code`` with LOW_ROOM when a ring has less room than one more call may need (the caller grows it), and
    the number of copies to issue."""
    low = (queue.shape[0] - (misc[Q_TAIL] - misc[Q_HEAD]) < slots.shape[2]
           or flying.shape[0] - (misc[F_TAIL] - misc[F_HEAD]) < actions.shape[0])
    return code | (LOW_ROOM if low else 0) | (misc[N_ACTIONS] << ACTIONS_SHIFT)


# ---------------------------------------------------------------------------------------------------- entries
@njit(cache=True, nogil=True)
def decode_select(slots, experts, misc, queue, flying, actions, layer, plan, chosen, avoid):
    """One row, one position: the plan row's demand insertions, then ``chosen`` present (see :func:`_use`)."""
    base_e, base_v = misc[P_DEMAND], misc[P_DEMAND_EVICTED]
    code = OK
    for i in range(plan[misc[P_N_DEMAND]]):
        code = _insert(slots, experts, misc, queue, flying, actions, layer, plan[base_e + i], plan[base_v + i],
                       DEMAND, avoid)
        if code != OK:
            break
    if code == OK:
        code = _use(slots, experts, misc, queue, flying, actions, layer, chosen, avoid)
    return _outcome(slots, misc, flying, actions, queue, code)


@njit(cache=True, nogil=True)
def decode_prefetch(slots, experts, misc, queue, flying, actions, layer, plan, avoid):
    """One row, one position: queue the plan row's prefetch insertions into ``layer``."""
    base_e, base_v = misc[P_PREFETCH], misc[P_PREFETCH_EVICTED]
    code = OK
    for i in range(plan[misc[P_N_PREFETCH]]):
        code = _insert(slots, experts, misc, queue, flying, actions, layer, plan[base_e + i], plan[base_v + i],
                       PREFETCH, avoid)
        if code != OK:
            break
    return _outcome(slots, misc, flying, actions, queue, code)


@njit(cache=True, nogil=True)
def insert(slots, experts, misc, queue, flying, actions, layer, expert, evicted, kind, avoid):
    code = _insert(slots, experts, misc, queue, flying, actions, layer, expert, evicted, kind, avoid)
    return _outcome(slots, misc, flying, actions, queue, code)


@njit(cache=True, nogil=True)
def use(slots, experts, misc, queue, flying, actions, layer, chosen, avoid):
    code = _use(slots, experts, misc, queue, flying, actions, layer, chosen, avoid)
    return _outcome(slots, misc, flying, actions, queue, code)


@njit(cache=True, nogil=True)
def pump(slots, experts, misc, queue, flying, actions):
    """A layer boundary: forget the prefetches known complete, then issue queued ones (skipping dropped entries)
    while fewer than ``max_in_flight`` are in flight."""
    F, Q = flying.shape[0], queue.shape[0]
    while misc[F_HEAD] < misc[F_TAIL] and flying[misc[F_HEAD] % F] <= misc[COMPLETE]:
        misc[F_HEAD] += 1
    while misc[Q_HEAD] < misc[Q_TAIL] and misc[F_TAIL] - misc[F_HEAD] < misc[MAX_IN_FLIGHT]:
        row = misc[Q_HEAD] % Q
        misc[Q_HEAD] += 1
        if _queued(slots, queue, row):
            _issue(slots, experts, misc, flying, actions, queue[row, 0], queue[row, 1])
    return _outcome(slots, misc, flying, actions, queue, OK)


@njit(cache=True, nogil=True)
def warm(slots, experts, misc, queue, flying, actions, layer, wanted):
    """A sequence starts: copy the experts of ``wanted`` not in a slot yet, never evicting one of ``wanted``."""
    for i in range(wanted.shape[0]):
        e = wanted[i]
        if experts[layer, e] < 0 and _load(slots, experts, misc, queue, flying, actions, layer, e, wanted,
                                           wanted[:0].astype(np.float64), WARM) != OK:
            return _outcome(slots, misc, flying, actions, queue, NO_FREE_SLOT)
    return _outcome(slots, misc, flying, actions, queue, OK)


@njit(cache=True, nogil=True)
def end_sequence(slots, experts, misc, queue):
    """The queue is emptied (a queued prefetch never used is dropped and its slot emptied, the slot never having
    received it) and the prefetches of the ending sequence that were never used are counted unused."""
    L, C, Q = slots.shape[0], slots.shape[2], queue.shape[0]
    E = experts.shape[1] - 2
    while misc[Q_HEAD] < misc[Q_TAIL]:
        row = misc[Q_HEAD] % Q
        misc[Q_HEAD] += 1
        layer, slot = queue[row, 0], queue[row, 1]
        if slots[layer, J_ID, slot] != queue[row, 2]:
            continue  # replaced: dropped (or issued) when it was
        if slots[layer, J_STATE, slot] == QUEUED and slots[layer, J_USED, slot] == 0:
            slots[layer, J_STATE, slot] = DROPPED
            misc[C_DROPPED] += 1
        if slots[layer, J_STATE, slot] != ISSUED:
            expert = slots[layer, S_EXPERT, slot]
            if expert >= 0 and experts[layer, expert] == slot:
                experts[layer, expert] = -1
            slots[layer, S_EXPERT, slot] = -1
            slots[layer, J_KIND, slot] = NO_JOB
            experts[layer, E] = 1
    for layer in range(L):
        for slot in range(C):
            if slots[layer, J_KIND, slot] == PREFETCH and slots[layer, J_USED, slot] == 0:
                slots[layer, J_USED, slot] = 1
                misc[C_UNUSED] += 1


@njit(cache=True, nogil=True)
def refresh(slots, experts, misc, queue, flying, actions, layer):
    """The host store of ``layer`` changed: every slot whose copy was issued is copied again (a new job of the
    same kind and use, counted warm); the layer's next computation waits for them."""
    for slot in range(slots.shape[2]):
        if slots[layer, J_KIND, slot] == NO_JOB or slots[layer, J_STATE, slot] != ISSUED:
            continue
        job = misc[NEXT_ID]
        misc[NEXT_ID] = job + 1
        slots[layer, J_ID, slot] = job
        slots[layer, J_STATE, slot] = QUEUED
        misc[C_WARM] += 1
        _pend(experts, layer, _issue(slots, experts, misc, flying, actions, layer, slot))
    return _outcome(slots, misc, flying, actions, queue, OK)


@njit(cache=True, nogil=True)
def reconcile(slots, experts, misc, queue, flying, actions, layer, target):
    """After a block of one row: queue prefetches so the slots hold the row's logical cache ``target`` ([E]): one
    for each expert of ``target`` in no slot when the call starts, in ascending order."""
    missing = np.flatnonzero((target != 0) & (experts[layer, : target.shape[0]] < 0))
    for e in missing:
        if _load(slots, experts, misc, queue, flying, actions, layer, e, experts[layer, :0], target, PREFETCH) != OK:
            return _outcome(slots, misc, flying, actions, queue, NO_FREE_SLOT)
    return _outcome(slots, misc, flying, actions, queue, OK)


@njit(cache=True, nogil=True)
def recover(slots, experts, misc, queue, failed):
    """After a forward pass that stopped anywhere, with every issued copy complete: queued prefetches dropped,
    every slot emptied that does not certainly hold its expert (its job never issued, a copy in ``failed``
    (issue numbers), or the maps half-updated), the expert map rebuilt, nothing pending or in flight."""
    L, C, Q = slots.shape[0], slots.shape[2], queue.shape[0]
    E = experts.shape[1] - 2
    while misc[Q_HEAD] < misc[Q_TAIL]:
        row = misc[Q_HEAD] % Q
        misc[Q_HEAD] += 1
        if _queued(slots, queue, row):
            slots[queue[row, 0], J_STATE, queue[row, 1]] = DROPPED
            misc[C_DROPPED] += 1
    misc[F_HEAD] = misc[F_TAIL]
    misc[COMPLETE] = misc[ISSUED_COUNT] - 1
    for layer in range(L):
        experts[layer, E + 1] = -1
        for slot in range(C):
            bad = (slots[layer, J_KIND, slot] == NO_JOB or slots[layer, J_STATE, slot] != ISSUED
                   or slots[layer, J_EXPERT, slot] != slots[layer, S_EXPERT, slot])
            for i in range(failed.shape[0]):
                if failed[i] == slots[layer, J_SEQ, slot]:
                    bad = True
            if bad:
                slots[layer, S_EXPERT, slot] = -1
                slots[layer, J_KIND, slot] = NO_JOB
        for e in range(E):
            experts[layer, e] = -1
        for slot in range(C):
            expert = slots[layer, S_EXPERT, slot]
            if expert < 0:
                continue
            if experts[layer, expert] >= 0:  # two slots name one expert
                slots[layer, S_EXPERT, slot] = -1
                slots[layer, J_KIND, slot] = NO_JOB
            else:
                experts[layer, expert] = slot
        experts[layer, E] = 1


@njit(cache=True, nogil=True)
def close_interval(slots, misc, queue):
    """A new statistics interval (every copy complete): counters zeroed, issued prefetches not used yet closed
    (their later use is not counted), the live queued ones counted in the new interval."""
    for i in range(N_COUNTERS):
        misc[i] = 0
    L, C, Q = slots.shape[0], slots.shape[2], queue.shape[0]
    for layer in range(L):
        for slot in range(C):
            if (slots[layer, J_KIND, slot] == PREFETCH and slots[layer, J_USED, slot] == 0
                    and slots[layer, J_STATE, slot] == ISSUED):
                slots[layer, J_USED, slot] = 1
    queued = 0
    for position in range(misc[Q_HEAD], misc[Q_TAIL]):
        if _queued(slots, queue, position % Q):
            queued += 1
    misc[C_PREFETCH] = queued


@njit(cache=True, nogil=True)
def compact_queue(slots, misc, queue):
    """Keep only the live queued entries, in order, from the ring's start (what :func:`pump` would skip goes)."""
    Q = queue.shape[0]
    kept = 0
    for position in range(misc[Q_HEAD], misc[Q_TAIL]):
        row = position % Q
        if _queued(slots, queue, row):
            # kept <= position - head: the write never overtakes an entry still to be read
            target = (misc[Q_HEAD] + kept) % Q
            queue[target, 0], queue[target, 1], queue[target, 2] = queue[row, 0], queue[row, 1], queue[row, 2]
            kept += 1
    misc[Q_TAIL] = misc[Q_HEAD] + kept


def ring_in_order(ring: np.ndarray, head: int, tail: int) -> np.ndarray:
    """The entries of a ring from ``head`` to ``tail`` (monotonic counters), in order (to grow it)."""
    rows = np.arange(head, tail) % ring.shape[0]
    return ring[rows]
