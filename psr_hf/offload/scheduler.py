"""The slot cache and the copy scheduler of the offload path (docs/offloading.md; the rules: docs/ALGORITHM.md,
"Physical scheduling"; paper Section 4.2).

Each MoE layer has ``C`` device slots. :class:`SlotScheduler` keeps a map expert -> slot per layer in step with
the logical cache and turns its insertions into copies: demand copies at once, prefetch copies queued and issued
at layer boundaries, all through one ordered copy stream (a :class:`~psr_hf.offload.links.CopyLink`). Nothing here
is read by the policy: which slot an expert occupies and when its copy completes change latency only.

Decoding (one row, one position) keeps the slots equal to the row's logical cache. A block (a prompt, or several
rows, each with its own logical cache but sharing the layer's slots) loads the experts it executes in groups of
at most ``C`` (:meth:`SlotScheduler.groups`); after a block of one row, :meth:`SlotScheduler.reconcile` brings
the slots back in line with its logical cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from . import slot_book as B
from .links import CopyLink

if TYPE_CHECKING:
    from ..policy.cache import StepPlan
from .slot_book import DEMAND, DROPPED, ISSUED, PREFETCH, QUEUED, WARM  # noqa: F401  (the kinds and states)

logger = logging.getLogger(__name__)


@dataclass
class CopyCounters:
    """The scheduler's copy counts since its last :meth:`SlotScheduler.reset_counters` (``OffloadStats`` reports
    them per token). A snapshot: the scheduler counts in its arrays as copies are assigned, issued and used."""

    demand: int = 0  # demand copies (the layer waits for all of it)
    prefetch: int = 0  # prefetch insertions (queued copies)
    prefetch_in_time: int = 0  # prefetches that had arrived when their expert first executed
    prefetch_late: int = 0  # prefetches still in flight or queued then
    prefetch_unused: int = 0  # prefetches copied but evicted (or the sequence ended) before any use
    dropped: int = 0  # prefetches reassigned before they were issued (no copy)
    warm: int = 0  # warm-set copies at sequence starts
    bytes: int = 0  # bytes copied
    wait_s: float = 0.0  # time the computation waited for copies (the link's, filled in by stats())


# ---------------------------------------------------------------------------------------------------- scheduler
class _LayerView:
    """One layer's part of the scheduler's arrays (views: they change as the scheduler does)."""

    __slots__ = ("_experts", "_layer", "_E", "slot_expert", "expert_slot", "last_use", "job_kind", "job_state",
                 "job_used", "job_seq")

    def __init__(self, book: dict, layer: int, num_experts: int):
        slots, self._experts, self._layer, self._E = book["slots"], book["experts"], layer, num_experts
        self.slot_expert = slots[layer, B.S_EXPERT]  # [C] expert in each slot (-1: empty)
        self.expert_slot = self._experts[layer, :num_experts]  # [E] slot of each expert (-1: none)
        self.last_use = slots[layer, B.S_LAST_USE]  # [C] clock of the slot's latest execution
        self.job_kind = slots[layer, B.J_KIND]  # [C] kind of the slot's latest copy (-1: never copied)
        self.job_state = slots[layer, B.J_STATE]  # [C] QUEUED, ISSUED or DROPPED
        self.job_used = slots[layer, B.J_USED]  # [C] whether the slot's latest copy was executed
        self.job_seq = slots[layer, B.J_SEQ]  # [C] its issue number (-1: not issued)

    @property
    def dirty(self) -> bool:
        """The engine's device copy of ``expert_slot`` is stale."""
        return bool(self._experts[self._layer, self._E])

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._experts[self._layer, self._E] = int(value)

    @property
    def pending(self) -> int:
        """The issue number of the latest copy this layer's next computation waits for (-1: none)."""
        return int(self._experts[self._layer, self._E + 1])


class SlotScheduler:
    """Slot maps and copies of every MoE layer; the engine calls it, the policy never reads it. The bookkeeping
    is :mod:`psr_hf.offload.slot_book`'s kernels over this object's arrays; this class refreshes what the link
    knows of completed copies before a kernel asks, and issues the copies a kernel decided, in its order."""

    def __init__(self, num_layers: int, num_experts: int, capacity: int, link: CopyLink, max_in_flight: int,
                 bytes_per_expert: int, src: list, dst: list):
        self.num_layers, self.num_experts, self.capacity = num_layers, num_experts, capacity
        self.link = link
        self.max_in_flight = max_in_flight
        self.bytes_per_expert = bytes_per_expert
        self._src = src  # [L][E] -> the host tensors (or addresses) of that expert
        self._dst = dst  # [L][C] -> the slot tensors (or addresses)
        self._book = B.new_book(num_layers, num_experts, capacity, max_in_flight, bytes_per_expert)
        self._bind()
        self._layout = None  # the plan layout whose columns misc holds
        self._no_avoid = np.zeros(0, dtype=np.float64)
        self._none = np.zeros(0, dtype=np.int64)

    def _bind(self) -> None:
        book = self._book
        self._slots, self._experts, self._misc = book["slots"], book["experts"], book["misc"]
        self._queue, self._flying, self._actions = book["queue"], book["flying"], book["actions"]
        self._args = (self._slots, self._experts, self._misc, self._queue, self._flying, self._actions)
        self.layers = [_LayerView(book, layer, self.num_experts) for layer in range(self.num_layers)]

    # ------------------------------------------------------------------ counters
    @property
    def counters(self) -> CopyCounters:
        """The copy counts since :meth:`reset_counters` (a snapshot; wait time in :meth:`stats`)."""
        m = self._misc
        return CopyCounters(demand=int(m[B.C_DEMAND]), prefetch=int(m[B.C_PREFETCH]),
                            prefetch_in_time=int(m[B.C_IN_TIME]), prefetch_late=int(m[B.C_LATE]),
                            prefetch_unused=int(m[B.C_UNUSED]), dropped=int(m[B.C_DROPPED]), warm=int(m[B.C_WARM]),
                            bytes=int(m[B.C_BYTES]))

    @counters.setter
    def counters(self, counters: CopyCounters) -> None:
        m = self._misc
        m[B.C_DEMAND], m[B.C_PREFETCH], m[B.C_IN_TIME], m[B.C_LATE] = (
            counters.demand, counters.prefetch, counters.prefetch_in_time, counters.prefetch_late)
        m[B.C_UNUSED], m[B.C_DROPPED], m[B.C_WARM], m[B.C_BYTES] = (
            counters.prefetch_unused, counters.dropped, counters.warm, counters.bytes)

    # ------------------------------------------------------------------ copies
    def _poll(self) -> None:
        """Refresh the highest issue number known complete, when a copy is in flight."""
        m = self._misc
        if m[B.COMPLETE] < m[B.ISSUED_COUNT] - 1:
            m[B.COMPLETE] = self.link.complete()

    def _room(self) -> None:
        """A kernel said a ring has less room than one more call may need: the queue compacted (else grown), the
        ring of copies in flight grown."""
        m, C = self._misc, self.capacity
        queue = self._queue
        if m[B.Q_TAIL] - m[B.Q_HEAD] + C > queue.shape[0]:
            B.compact_queue(self._slots, m, queue)
            if m[B.Q_TAIL] - m[B.Q_HEAD] + C > queue.shape[0]:
                self._book["queue"] = self._grown(queue, B.Q_HEAD, B.Q_TAIL)
        flying = self._flying
        need = self._actions.shape[0]
        if m[B.F_TAIL] - m[B.F_HEAD] + need > flying.shape[0]:
            self._book["flying"] = self._grown(flying, B.F_HEAD, B.F_TAIL, extra=need)
        if self._book["queue"] is not queue or self._book["flying"] is not flying:
            self._bind()

    def _grown(self, ring: np.ndarray, head: int, tail: int, extra: int = 0) -> np.ndarray:
        m = self._misc
        live = B.ring_in_order(ring, int(m[head]), int(m[tail]))
        grown = np.zeros((2 * ring.shape[0] + extra,) + ring.shape[1:], dtype=ring.dtype)
        grown[: live.shape[0]] = live
        m[head], m[tail] = 0, live.shape[0]
        return grown

    def _after(self, result: int) -> None:
        """What a kernel's nonzero ``result`` asks for: room in the rings; the copies it decided issued, in
        order; then a ``RuntimeError`` if it found no free slot. A copy that cannot be issued, or an interrupt
        anywhere in here, leaves it and the later ones QUEUED, so that :meth:`recover` empties their slots (an
        action still counted in ``misc`` was never issued)."""
        if result & B.LOW_ROOM:
            self._room()
        m = self._misc
        n = int(m[B.N_ACTIONS])
        if n:
            actions = self._actions[:n].tolist()
            link, src, dst = self.link, self._src, self._dst
            i = 0
            try:
                for i, (layer, slot, expert, seq) in enumerate(actions):
                    link.copy(seq, layer, slot, expert, dst[layer][slot], src[layer][expert])
                m[B.N_ACTIONS] = 0
            except BaseException as error:
                self._unissue(actions[i:])
                m[B.N_ACTIONS] = 0
                if not isinstance(error, Exception):
                    raise
                layer, slot, expert, _ = actions[i]
                raise RuntimeError(
                    f"psr_hf offload: the copy of expert {expert} into slot {slot} of MoE layer {layer} could "
                    f"not be issued ({type(error).__name__}: {error}); the forward pass stopped, its sequence is "
                    "closed and the slot is emptied: start a new sequence (generate() again), which copies the "
                    "expert again"
                ) from error
        if result & B.NO_FREE_SLOT:
            layer = int(m[B.ERROR_LAYER])
            raise RuntimeError(f"psr_hf offload: no free slot in layer {layer} (every slot is needed now)")

    def _unissue(self, actions: list) -> None:
        slots = self._slots
        for layer, slot, _, seq in actions:
            if slots[layer, B.J_SEQ, slot] == seq:
                slots[layer, B.J_STATE, slot] = B.QUEUED
                slots[layer, B.J_SEQ, slot] = -1
            self._misc[B.C_BYTES] -= self.bytes_per_expert

    def _avoid(self, resident: np.ndarray | None) -> np.ndarray:
        """The kernels' form of a logical cache: float64 [E] (nonzero: cached); empty for none."""
        if resident is None:
            return self._no_avoid
        if resident.dtype == np.float64 and resident.flags.c_contiguous:
            return resident
        return np.ascontiguousarray(resident, dtype=np.float64)

    def _columns(self, plan: StepPlan) -> None:
        """The plan layout's columns, where the decode kernels read them (once per layout)."""
        layout = plan.layout
        c, m = layout.columns, self._misc
        m[B.P_N_DEMAND], m[B.P_DEMAND], m[B.P_DEMAND_EVICTED] = c.n_demand, c.demand, c.demand_evicted
        m[B.P_N_PREFETCH], m[B.P_PREFETCH], m[B.P_PREFETCH_EVICTED] = c.n_prefetch, c.prefetch, c.prefetch_evicted
        self._layout = layout

    # ------------------------------------------------------------------ what the engine calls
    def insert(self, layer: int, expert: int, evicted: int, kind: int, resident: np.ndarray | None) -> None:
        """Follow a logical insertion of ``expert`` (evicting ``evicted``, -1 for a free slot): the evicted
        expert's slot if it holds one, else a slot outside the logical cache ``resident`` ([E], nonzero: cached)."""
        result = B.insert(*self._args, layer, expert, evicted, kind, self._avoid(resident))
        if result:
            self._after(result)

    def pump(self) -> None:
        """A layer boundary: issue queued prefetches while fewer than ``max_in_flight`` are in flight."""
        m = self._misc
        if m[B.Q_HEAD] == m[B.Q_TAIL]:
            return
        self._poll()
        result = B.pump(*self._args)
        if result:
            self._after(result)

    def wait(self, layer: int) -> None:
        """Make ``layer``'s computation wait for the copies it uses that are not complete (only those)."""
        experts, E = self._experts, self.num_experts
        latest = int(experts[layer, E + 1])  # one ordered stream: the latest completes last
        if latest >= 0:
            experts[layer, E + 1] = -1
            if latest > self._misc[B.COMPLETE] and not self.link.done(latest):
                self.link.wait(latest)
        self.link.check()  # a copy that failed must not be computed with, even one that is done

    def refresh(self, layer: int) -> None:
        """The host store of ``layer`` changed (new values for the same experts): copy every slot whose copy was
        issued again, in place; the layer's next computation waits for them. Queued copies read the new values
        when they are issued. Counted as ``warm`` copies (slot fills without a logical insertion)."""
        result = B.refresh(*self._args, layer)
        if result:
            self._after(result)

    def recover(self) -> None:
        """Make the slots consistent after a forward pass that stopped anywhere (an exception, ``KeyboardInterrupt``,
        a failed copy): wait for every issued copy, drop the queued ones, and empty every slot that does not
        certainly hold its expert (its latest copy never issued, failed, or the maps were left half-updated).
        The next sequence's warm set fills the slots again. Idempotent."""
        self.link.synchronize()
        failed = np.asarray(self.link.take_failures(), dtype=np.int64)
        m = self._misc
        if m[B.N_ACTIONS]:  # decided, not (all) issued: an interrupt came between the kernel and its copies
            self._unissue(self._actions[: int(m[B.N_ACTIONS])].tolist())
            m[B.N_ACTIONS] = 0
        B.recover(self._slots, self._experts, self._misc, self._queue, failed)

    def new_sequence(self, warm: Sequence[np.ndarray]) -> None:
        """A new sequence: queued prefetches are dropped and each layer's warm set ``warm[layer]`` (experts) is
        copied into slots that do not hold it yet."""
        B.end_sequence(self._slots, self._experts, self._misc, self._queue)
        for layer, experts in enumerate(warm):
            result = B.warm(*self._args, layer, np.ascontiguousarray(experts, dtype=np.int64))
            if result:
                self._after(result)

    def decode_select(self, layer: int, plan: StepPlan, chosen: np.ndarray, resident: np.ndarray) -> None:
        """One row, one position: follow the plan's demand insertions, then make ``chosen`` ([K] experts) present.
        ``resident``: [E] the row's logical cache after the step (nonzero: cached)."""
        if plan.layout is not self._layout:
            self._columns(plan)
        m = self._misc
        if m[B.COMPLETE] < m[B.ISSUED_COUNT] - 1:  # a copy in flight: refresh what is known complete
            m[B.COMPLETE] = self.link.complete()
        result = B.decode_select(*self._args, layer, plan.plan[0, 0], chosen, self._avoid(resident))
        if result:
            self._after(result)

    def decode_prefetch(self, layer: int, plan: StepPlan, resident: np.ndarray) -> None:
        """One row, one position: queue the copies of the plan's prefetch insertions into ``layer``."""
        if plan.layout is not self._layout:
            self._columns(plan)
        result = B.decode_prefetch(*self._args, layer, plan.plan[0, 0], self._avoid(resident))
        if result:
            self._after(result)

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
        self._poll()
        result = B.use(*self._args, layer, np.ascontiguousarray(experts, dtype=np.int64), self._avoid(target))
        if result:
            self._after(result)

    def reconcile(self, layer: int, target: np.ndarray) -> None:
        """After a block of one row: queue prefetches so the slots hold the row's logical cache ``target``."""
        result = B.reconcile(*self._args, layer, self._avoid(target))
        if result:
            self._after(result)

    def drain(self) -> np.ndarray:
        """Issue every queued prefetch and wait for every copy: afterwards each slot holds its expert. Returns the
        ``[L, E]`` slot of each expert (-1: none), for a copier that takes over the slots (the engine's device
        copies); :meth:`adopt` hands them back."""
        m = self._misc
        limit = int(m[B.MAX_IN_FLIGHT])
        m[B.MAX_IN_FLIGHT] = np.iinfo(np.int64).max // 2
        try:
            while m[B.Q_HEAD] != m[B.Q_TAIL]:
                self._poll()
                result = B.pump(*self._args)
                if result:
                    self._after(result)
        finally:
            m[B.MAX_IN_FLIGHT] = limit
        self._synchronize()
        return self._experts[:, : self.num_experts].copy()

    def adopt(self, expert_slot: np.ndarray, demand: int, prefetch: int) -> None:
        """The slots were filled by another copier since :meth:`drain`: each layer's slots now hold
        ``expert_slot`` (``[L, E]``, -1: none), after ``demand`` and ``prefetch`` copies, which are counted (every
        copy the other copier made is complete). No job is left queued or in flight."""
        self._synchronize()
        E = self.num_experts
        slots, experts, m = self._slots, self._experts, self._misc
        slots[:, B.S_EXPERT] = -1
        for layer in range(self.num_layers):
            held = np.flatnonzero(expert_slot[layer] >= 0)
            slots[layer, B.S_EXPERT, expert_slot[layer, held]] = held
        slots[:, B.J_KIND] = B.NO_JOB
        slots[:, B.J_SEQ] = -1
        slots[:, B.J_STATE] = B.QUEUED
        slots[:, B.J_USED] = 0
        experts[:, :E] = expert_slot
        experts[:, E] = 1  # DIRTY: the device copy of the map is stale
        experts[:, E + 1] = -1  # nothing pending
        m[B.Q_HEAD] = m[B.Q_TAIL]
        m[B.C_DEMAND] += int(demand)
        m[B.C_PREFETCH] += int(prefetch)
        m[B.C_BYTES] += (int(demand) + int(prefetch)) * self.bytes_per_expert

    def stats(self) -> CopyCounters:
        """A copy of the counts since :meth:`reset_counters` with the link's wait time (waits on the copies in
        flight to read it)."""
        self._synchronize()
        return replace(self.counters, wait_s=float(self.link.wait_s))

    def _synchronize(self) -> None:
        self.link.synchronize()
        self._misc[B.COMPLETE] = self._misc[B.ISSUED_COUNT] - 1

    def reset_counters(self) -> None:
        """Start a new statistics interval. A prefetch belongs to the interval in which it was issued: copies
        issued before and not used yet are closed (their later use is not counted), queued ones count in the
        new interval, where they are issued or dropped."""
        self._synchronize()
        self.link.wait_s = 0.0
        B.close_interval(self._slots, self._misc, self._queue)
