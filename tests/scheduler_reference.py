"""The slot scheduler as it was written in Python, one object per copy, before its bookkeeping moved to numba
kernels over arrays (:mod:`psr_hf.offload.slot_book`): the reference that ``tests/test_offload_slot_book.py`` checks
the package's scheduler against, decision by decision. Its links take a copy object (``job``)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from psr_hf.offload.scheduler import CopyCounters
from psr_hf.offload.slot_book import DEMAND, DROPPED, ISSUED, PREFETCH, QUEUED, WARM


class Copy:
    """One expert copy into one slot; the slot's latest copy until the slot is reassigned."""

    __slots__ = ("layer", "slot", "expert", "kind", "state", "event", "used", "seq")

    def __init__(self, layer: int, slot: int, expert: int, kind: int):
        self.layer, self.slot, self.expert, self.kind = layer, slot, expert, kind
        self.state = QUEUED
        self.seq = -1  # issue order (one ordered stream: a later copy completes after an earlier one)
        self.event: Any = None
        self.used = False


@dataclass
class _Layer:
    slot_expert: np.ndarray  # [C] expert in each slot (-1: empty)
    expert_slot: np.ndarray  # [E] slot of each expert (-1: none)
    jobs: list  # [C] latest Copy of each slot (None: never copied)
    last_use: np.ndarray  # [C] clock of the slot's latest execution
    dirty: bool = True  # the engine's device copy of expert_slot is stale
    pending: list = field(default_factory=list)  # Copies this layer must wait for before it computes


class SlotScheduler:
    """Slot maps and copies of every MoE layer; the engine calls it, the policy never reads it."""

    def __init__(self, num_layers: int, num_experts: int, capacity: int, link: Any, max_in_flight: int,
                 bytes_per_expert: int, src: list, dst: list):
        self.num_layers, self.num_experts, self.capacity = num_layers, num_experts, capacity
        self.link = link
        self.max_in_flight = max_in_flight
        self.bytes_per_expert = bytes_per_expert
        self._src = src  # [L][E] -> list of host tensors of that expert
        self._dst = dst  # [L][C] -> list of slot tensors
        self.layers = [self._empty_layer() for _ in range(num_layers)]
        self.queue: collections.deque[Copy] = collections.deque()
        self.in_flight: collections.deque[Copy] = collections.deque()  # issued prefetch copies, oldest first
        self.counters = CopyCounters()
        self._clock = 0
        self._issued = 0

    def _empty_layer(self) -> _Layer:
        C, E = self.capacity, self.num_experts
        return _Layer(np.full(C, -1, dtype=np.int64), np.full(E, -1, dtype=np.int64), [None] * C,
                      np.zeros(C, dtype=np.int64))

    # ------------------------------------------------------------------ copies
    def _issue(self, job: Copy) -> None:
        try:
            self.link.copy(job, self._dst[job.layer][job.slot], self._src[job.layer][job.expert])
        except Exception as error:  # the job stays QUEUED: recover() empties its slot
            raise RuntimeError(
                f"psr_hf offload: the copy of expert {job.expert} into slot {job.slot} of MoE layer {job.layer} could "
                f"not be issued ({type(error).__name__}: {error}); the forward pass stopped, its sequence is closed "
                "and the slot is emptied: start a new sequence (generate() again), which copies the expert again"
            ) from error
        job.state = ISSUED
        job.seq = self._issued
        self._issued += 1
        self.counters.bytes += self.bytes_per_expert
        if job.kind == PREFETCH:
            self.in_flight.append(job)

    def _assign(self, layer: int, expert: int, slot: int, kind: int) -> Copy:
        """Put ``expert`` in ``slot`` (a logical insertion or a load): retire the slot's previous copy, update the
        maps, issue the copy (demand, warm) or queue it (prefetch)."""
        st = self.layers[layer]
        previous = st.jobs[slot]
        if previous is not None and previous.kind == PREFETCH and not previous.used:
            if previous.state == QUEUED:
                previous.state = DROPPED  # never issued: skipped when the queue reaches it
                self.counters.dropped += 1
            else:
                self.counters.prefetch_unused += 1
        old = st.slot_expert[slot]
        if old >= 0:
            st.expert_slot[old] = -1
        st.slot_expert[slot] = expert
        st.expert_slot[expert] = slot
        st.dirty = True
        job = st.jobs[slot] = Copy(layer, slot, expert, kind)
        if kind == PREFETCH:
            self.counters.prefetch += 1
            self.queue.append(job)
        else:
            if kind == WARM:
                self.counters.warm += 1
            else:
                self.counters.demand += 1
            self._issue(job)
            st.pending.append(job)
        return job

    def pump(self) -> None:
        """A layer boundary: issue queued prefetches while fewer than ``max_in_flight`` are in flight."""
        flying = self.in_flight
        while flying and self.link.done(flying[0]):  # one ordered stream: copies complete in issue order
            flying.popleft()
        while self.queue and len(flying) < self.max_in_flight:
            job = self.queue.popleft()
            if job.state == QUEUED:
                self._issue(job)

    def _victim(self, layer: int, protect: np.ndarray | None, avoid: np.ndarray | None) -> int:
        """A slot to load into: an empty one; else the least recently executed slot whose expert is neither
        ``protect``-ed ([E] bool: needed now) nor in ``avoid`` ([E]: the logical cache, nonzero for a cached expert;
        a view of the cache's state is read only here, when a slot must be chosen); else ignoring ``avoid``."""
        st = self.layers[layer]
        empty = np.flatnonzero(st.slot_expert < 0)
        if empty.size:
            return int(empty[0])
        held = st.slot_expert
        free = np.ones(self.capacity, dtype=bool) if protect is None else ~protect[held]
        if avoid is not None:
            preferred = free & (avoid[held] == 0)
            if preferred.any():
                free = preferred
        if not free.any():
            raise RuntimeError(f"psr_hf offload: no free slot in layer {layer} (every slot is needed now)")
        candidates = np.flatnonzero(free)
        return int(candidates[np.argmin(st.last_use[candidates])])

    def insert(self, layer: int, expert: int, evicted: int, kind: int, resident: np.ndarray | None) -> None:
        """Follow a logical insertion of ``expert`` (evicting ``evicted``, -1 for a free slot): the evicted
        expert's slot if it holds one, else a slot outside the logical cache ``resident`` ([E] bool)."""
        st = self.layers[layer]
        if st.expert_slot[expert] >= 0:
            return  # already in a slot (the slots had not followed the logical cache exactly)
        slot = st.expert_slot[evicted] if evicted >= 0 else -1
        if slot < 0:
            slot = self._victim(layer, None, resident)
        self._assign(layer, expert, int(slot), kind)

    def _use(self, layer: int, experts: np.ndarray, protect: np.ndarray | None, resident: np.ndarray | None) -> None:
        """Make ``experts`` present for an execution (demand loads for missing ones) and record first uses.
        ``protect``: [E] bool, the experts no load may evict (None: ``experts``, built only when a load is needed)."""
        st = self.layers[layer]
        self._clock += 1
        clock, expert_slot, jobs = self._clock, st.expert_slot, st.jobs
        for e in experts.tolist():
            slot = expert_slot[e]
            if slot < 0:
                if protect is None:
                    protect = np.zeros(self.num_experts, dtype=bool)
                    protect[experts] = True
                self._assign(layer, e, self._victim(layer, protect, resident), DEMAND)
                slot = expert_slot[e]
            st.last_use[slot] = clock
            job = jobs[slot]
            if job is None or job.used:
                continue
            job.used = True
            if job.kind != PREFETCH:
                continue
            if job.state == QUEUED:  # needed before the queue reached it: issue now, the layer waits for all of it
                self._issue(job)
                self.counters.prefetch_late += 1
                st.pending.append(job)
            elif self.link.done(job):
                self.counters.prefetch_in_time += 1
            else:
                self.counters.prefetch_late += 1
                st.pending.append(job)

    def wait(self, layer: int) -> None:
        """Make ``layer``'s computation wait for the copies it uses that are not complete (only those)."""
        st = self.layers[layer]
        if st.pending:
            latest = max(st.pending, key=lambda job: job.seq)  # one ordered stream: the latest completes last
            st.pending = []
            if not self.link.done(latest):
                self.link.wait(latest)
        self.link.check()  # a copy that failed must not be computed with, even one that is done

    @staticmethod
    def _empty(st: _Layer, slot: int) -> None:
        expert = st.slot_expert[slot]
        if expert >= 0 and st.expert_slot[expert] == slot:
            st.expert_slot[expert] = -1
        st.slot_expert[slot] = -1
        st.jobs[slot] = None
        st.dirty = True

    def refresh(self, layer: int) -> None:
        """The host store of ``layer`` changed (new values for the same experts): copy every slot whose copy was
        issued again, in place; the layer's next computation waits for them. Queued copies read the new values
        when they are issued. Counted as ``warm`` copies (slot fills without a logical insertion)."""
        st = self.layers[layer]
        for slot, job in enumerate(st.jobs):
            if job is None or job.state != ISSUED:
                continue
            again = Copy(layer, slot, job.expert, job.kind)
            again.used = job.used
            st.jobs[slot] = again
            self.counters.warm += 1
            self._issue(again)
            st.pending.append(again)

    def recover(self) -> None:
        """Make the slots consistent after a forward pass that stopped anywhere (an exception, ``KeyboardInterrupt``,
        a failed copy): wait for every issued copy, drop the queued ones, and empty every slot that does not
        certainly hold its expert (its latest copy never issued, failed, or the maps were left half-updated).
        The next sequence's warm set fills the slots again. Idempotent."""
        self.link.synchronize()
        failed = {id(job) for job, _ in self.link.take_failures() if job is not None}
        while self.queue:
            job = self.queue.popleft()
            if job.state == QUEUED:
                job.state = DROPPED
                self.counters.dropped += 1
        self.in_flight.clear()  # every issued copy is complete
        for st in self.layers:
            st.pending = []
            for slot in range(self.capacity):
                job, expert = st.jobs[slot], int(st.slot_expert[slot])
                if job is None or job.state != ISSUED or job.expert != expert or id(job) in failed:
                    st.slot_expert[slot] = -1
                    st.jobs[slot] = None
            st.expert_slot[:] = -1
            for slot in range(self.capacity):
                expert = int(st.slot_expert[slot])
                if expert < 0:
                    continue
                if st.expert_slot[expert] >= 0:  # two slots name one expert (maps left half-updated)
                    st.slot_expert[slot] = -1
                    st.jobs[slot] = None
                else:
                    st.expert_slot[expert] = slot
            st.dirty = True

    # ------------------------------------------------------------------ what the engine calls
    def new_sequence(self, warm: Sequence[np.ndarray]) -> None:
        """A new sequence: queued prefetches are dropped and each layer's warm set ``warm[layer]`` (experts) is
        copied into slots that do not hold it yet."""
        while self.queue:
            job = self.queue.popleft()
            if job.state == QUEUED and not job.used:
                job.state = DROPPED
                self.counters.dropped += 1
            st = self.layers[job.layer]
            if job.state != ISSUED and st.jobs[job.slot] is job:  # never copied: the slot does not hold the expert
                self._empty(st, job.slot)
        for st in self.layers:  # prefetches of the sequence that ended and were never used
            for job in st.jobs:
                if job is not None and job.kind == PREFETCH and not job.used:
                    job.used = True
                    self.counters.prefetch_unused += 1
        E = self.num_experts
        for layer, experts in enumerate(warm):
            st = self.layers[layer]
            wanted = np.zeros(E, dtype=bool)
            wanted[experts] = True
            for e in experts:
                if st.expert_slot[e] < 0:
                    self._assign(layer, int(e), self._victim(layer, wanted, None), WARM)

    def decode_select(self, layer: int, plan: Any, chosen: np.ndarray, resident: np.ndarray) -> None:
        """One row, one position: follow the plan's demand insertions, then make ``chosen`` ([K] experts) present.
        ``resident``: [E] bool, the row's logical cache after the step."""
        count = int(plan.plan[0, 0, plan.layout.columns.n_demand])
        if count:
            experts, evicted = plan.demand_experts[0, 0], plan.demand_evicted[0, 0]
            for i in range(count):
                self.insert(layer, int(experts[i]), int(evicted[i]), DEMAND, resident)
        self._use(layer, chosen, None, resident)

    def decode_prefetch(self, layer: int, plan: Any, resident: np.ndarray) -> None:
        """One row, one position: queue the copies of the plan's prefetch insertions into ``layer``."""
        count = int(plan.plan[0, 0, plan.layout.columns.n_prefetch])
        if count:
            experts, evicted = plan.prefetch_experts[0, 0], plan.prefetch_evicted[0, 0]
            for i in range(count):
                self.insert(layer, int(experts[i]), int(evicted[i]), PREFETCH, resident)

    def groups(self, layer: int, experts: np.ndarray) -> list[np.ndarray]:
        """``experts`` (distinct) in groups of at most C for one block: the ones already in a slot first (they cost
        no copy), then the rest in ascending order. One group when they all fit."""
        if experts.size <= self.capacity:
            return [experts]
        held = self.layers[layer].expert_slot[experts] >= 0
        ordered = np.concatenate([experts[held], experts[~held]])
        return [ordered[i : i + self.capacity] for i in range(0, ordered.size, self.capacity)]

    def load(self, layer: int, experts: np.ndarray, target: np.ndarray | None) -> None:
        """Make ``experts`` (distinct, at most C) present for one group of a block; loads avoid the experts of
        ``target`` ([E] bool, the logical cache the slots should end up mirroring; None: plain LRU)."""
        protect = np.zeros(self.num_experts, dtype=bool)
        protect[experts] = True
        self._use(layer, experts, protect, target)

    def reconcile(self, layer: int, target: np.ndarray) -> None:
        """After a block of one row: queue prefetches so the slots hold the row's logical cache ``target``."""
        st = self.layers[layer]
        for e in np.flatnonzero(target & (st.expert_slot < 0)):
            self._assign(layer, int(e), self._victim(layer, None, target), PREFETCH)

    def stats(self) -> CopyCounters:
        """A copy of the counts since :meth:`reset_counters` with the link's wait time (waits on the copies in
        flight to read it)."""
        self.link.synchronize()
        return replace(self.counters, wait_s=float(self.link.wait_s))

    def reset_counters(self) -> None:
        """Start a new statistics interval. A prefetch belongs to the interval in which it was issued: copies
        issued before and not used yet are closed (their later use is not counted), queued ones count in the
        new interval, where they are issued or dropped."""
        self.link.synchronize()
        self.counters = CopyCounters()
        self.link.wait_s = 0.0
        for st in self.layers:
            for job in st.jobs:
                if job is not None and job.kind == PREFETCH and not job.used and job.state == ISSUED:
                    job.used = True
        self.counters.prefetch = sum(1 for job in self.queue if job.state == QUEUED)
