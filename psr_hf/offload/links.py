"""The copy links: how a copy into an expert slot is issued, completes and is waited for, behind one protocol
(:class:`CopyLink`) that :class:`~psr_hf.offload.scheduler.SlotScheduler` and the speculative engine's
:class:`~psr_hf.engine.speculative.ExpertSlots` call without asking which link it has.

Three links, one chosen per offloaded model (:func:`new_link`): :class:`ThreadLink` on the CPU (a copy thread),
:class:`RuntimeLink` on CUDA through raw runtime calls (:mod:`psr_hf.offload.cuda_runtime`, about 3 us of host
time per copy) and :class:`CudaLink` on CUDA through torch's calls (about 20-30 us), where cuda-python does not
import or ``OffloadConfig(copy_api="torch")`` asks for it. Each is one ordered copy stream: copies complete in
the order they are issued, so a copy's state is its issue number against the highest one known complete. Which
copies run, and when a layer may compute, are the scheduler's decisions; a link only carries them out.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

from . import cuda_runtime
from .cuda_runtime import Runtime

if TYPE_CHECKING:  # cuda-python is optional
    from cuda.bindings.runtime import cudaEvent_t

logger = logging.getLogger(__name__)

RING = 1024  # RuntimeLink's copy events; a copy's event is reused RING copies later (waited for first if in flight)
WAIT_PAIRS_COLLECTED = 4096  # timing events of waits kept before the completed ones are read
_LOGGED: set[str] = set()


@runtime_checkable
class CopyLink(Protocol):
    """One ordered copy stream into the expert slots, as the scheduler uses it.

    Copies are named by their issue numbers (``seq``, increasing; one may be missing where a copy failed to
    issue). A copy into a layer's slots waits for that layer's latest computation on them (:meth:`read_done`);
    a computation waits for the copies it reads (:meth:`wait`). ``wait_s``: time the computation waited for
    copies since the scheduler last zeroed it (device time measured with events on CUDA, wall time on the CPU).
    """

    wait_s: float

    def prepare(self, dst: list, src: list) -> tuple[list, list]:
        """The scheduler's ``dst[L][C]`` and ``src[L][E]`` (lists of a slot's or an expert's tensors) in the form
        :meth:`copy` takes them (called once per set of slot buffers)."""

    def copy(self, seq: int, layer: int, slot: int, expert: int, dst: Sequence, src: Sequence) -> None:
        """Issue copy ``seq`` of ``expert`` into ``slot`` of ``layer`` (``dst``, ``src``: from :meth:`prepare`)."""

    def done(self, seq: int) -> bool:
        """Whether copy ``seq`` is complete (asking the device if need be)."""

    def complete(self) -> int:
        """The highest issue number known complete (every earlier copy is complete too)."""

    def wait(self, seq: int) -> None:
        """Make the computation wait for copy ``seq`` and every copy issued before it."""

    def read_done(self, layer: int) -> None:
        """The computation reading ``layer``'s slots has been issued: the next copy into them waits for it."""

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the copy if one failed after it was issued."""

    def take_failures(self) -> list[int]:
        """The issue numbers of the copies that failed since the last call; forgets them."""

    def synchronize(self) -> None:
        """Wait on the host for every copy issued and every computation enqueued."""

    def close(self) -> None:
        """Synchronise and release the stream, events or thread (idempotent)."""


def new_link(device: torch.device, delay_ms: float, copy_api: str = "auto") -> CopyLink:
    """The copy link for slots on ``device``: a copy thread on the CPU; on CUDA raw runtime calls where
    cuda-python imports (``copy_api`` "auto" or "cuda-python", which raises ``ValueError`` saying why where it
    does not) and torch's calls otherwise or with "torch". ``delay_ms``: a diagnostic delay before each copy."""
    if device.type != "cuda":
        return ThreadLink(delay_ms)
    if copy_api != "torch":
        ok, why = cuda_runtime.available()
        if ok:
            return RuntimeLink(device, delay_ms)
        if copy_api == "cuda-python":
            raise ValueError(f"OffloadConfig(copy_api='cuda-python'): {why}")
        _log_once(f"psr_hf offload: copies are issued by torch's calls ({why}); about 20-30 us of host time "
                  "per copy instead of about 3")
    return CudaLink(device, delay_ms)


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def _sleep_cycles(device: torch.device, delay_ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs for about ``delay_ms`` (measured once)."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 1_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return max(int(per_ms * delay_ms), 1)


# ---------------------------------------------------------------------------------------------------- the CPU
class ThreadLink:
    """The CPU path: one copy thread working through a FIFO (an ordered copy stream) that publishes the issue
    number of its latest finished copy; the computation (the calling thread) blocks until a copy is finished."""

    def __init__(self, delay_ms: float):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._delay = delay_ms / 1e3
        self.wait_s = 0.0
        self._finished = -1  # issue number of the latest copy the thread finished (copies finish in order)
        self._last = -1  # the latest issued
        self._changed = threading.Condition()
        # ((layer, slot, expert, seq), error) appended by the copy thread, read by the caller
        self._failures: list[tuple[tuple[int, int, int, int], BaseException]] = []
        self._thread = threading.Thread(target=self._run, name="psr_hf-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, dst, src = item
            if dst is not None:
                try:
                    if self._delay:
                        time.sleep(self._delay)
                    for d, s in zip(dst, src):
                        d.copy_(s)
                except BaseException as error:  # surfaced by the next wait (check), the slot emptied by recover()
                    self._failures.append((name, error))
            with self._changed:
                self._finished = max(self._finished, name[3])
                self._changed.notify_all()

    @staticmethod
    def prepare(dst: list, src: list) -> tuple[list, list]:
        return dst, src  # the thread copies tensors

    def copy(self, seq: int, layer: int, slot: int, expert: int, dst: Sequence[torch.Tensor],
             src: Sequence[torch.Tensor]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("psr_hf offload: the copy thread has stopped (the model was unpatched)")
        self._last = seq
        self._queue.put(((layer, slot, expert, seq), dst, src))

    def done(self, seq: int) -> bool:
        return seq <= self._finished

    def complete(self) -> int:
        """The issue number of the latest copy finished (every earlier one is finished too)."""
        return self._finished

    def wait(self, seq: int) -> None:
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: self._finished >= seq)
        self.wait_s += time.perf_counter() - start
        self.check()

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the copy if one failed in the copy thread (kept until :meth:`take_failures`:
        every wait raises until the scheduler recovers)."""
        if self._failures:
            (layer, slot, expert, _), error = self._failures[0]
            raise RuntimeError(
                f"psr_hf offload: the copy of expert {expert} into slot {slot} of MoE layer {layer} "
                f"failed ({type(error).__name__}: {error}); the forward pass stopped, its sequence is closed and the "
                "slot is emptied: start a new sequence (generate() again), which copies the expert again"
            ) from error

    def take_failures(self) -> list[int]:
        """The issue numbers of the copies that failed since the last call; forgets them."""
        failures, self._failures = self._failures, []
        return [name[3] for name, _ in failures]

    def read_done(self, layer: int) -> None:
        pass  # the computation ran synchronously in this thread

    def synchronize(self) -> None:
        if not self._thread.is_alive():
            return  # closed: nothing is in flight
        last = self._last
        self._queue.put(((-1, -1, -1, last), None, None))  # a marker: finished once every earlier copy is
        with self._changed:
            self._changed.wait_for(lambda: self._finished >= last)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


# ---------------------------------------------------------------------------------------------------- CUDA, torch
class CudaLink:
    """Copies on one dedicated CUDA stream (ordered) through torch's calls, one torch event per copy; the compute
    stream waits on events."""

    def __init__(self, device: torch.device, delay_ms: float):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._events: dict[int, torch.cuda.Event] = {}  # issue number -> event, of copies not known complete
        self._complete = -1  # every copy numbered <= this is complete
        self._last = -1
        self._read: dict[int, torch.cuda.Event] = {}  # layer -> event after its latest computation on the slots
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wait_s = 0.0
        self._sleep_cycles = _sleep_cycles(device, delay_ms) if delay_ms > 0 else 0

    @staticmethod
    def prepare(dst: list, src: list) -> tuple[list, list]:
        return dst, src  # torch copies tensors

    def copy(self, seq: int, layer: int, slot: int, expert: int, dst: Sequence[torch.Tensor],
             src: Sequence[torch.Tensor]) -> None:
        with torch.cuda.stream(self.stream):
            read = self._read.pop(layer, None)
            if read is not None:  # the slot's previous contents may still be read by a queued computation
                self.stream.wait_event(read)
            if self._sleep_cycles:
                torch.cuda._sleep(self._sleep_cycles)
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[seq] = event
        self._last = seq

    def done(self, seq: int) -> bool:
        if seq <= self._complete:
            return True
        event = self._events.get(seq)
        if event is None or event.query():  # one ordered stream: every earlier copy is complete too
            self._forget(seq)
            return True
        return False

    def _forget(self, seq: int) -> None:
        self._complete = max(self._complete, seq)
        events = self._events
        while events:
            first = next(iter(events))
            if first > seq:
                break
            del events[first]

    def complete(self) -> int:
        """The highest issue number known complete (asking the device about the oldest copies in flight)."""
        for seq in list(self._events):
            if not self.done(seq):
                break
        return self._complete

    def wait(self, seq: int) -> None:
        """Make the computation wait for copy ``seq`` (and, the stream being ordered, every copy issued before it)."""
        event = self._events.get(seq)
        if event is None:
            return  # known complete
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(event)
        end.record(compute)
        self._waits.append((start, end))
        if len(self._waits) > WAIT_PAIRS_COLLECTED:
            self._collect(block=False)

    def read_done(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._read[layer] = event

    def _collect(self, block: bool) -> None:
        keep = []
        for start, end in self._waits:
            if block or end.query():
                end.synchronize()
                self.wait_s += start.elapsed_time(end) / 1e3
            else:
                keep.append((start, end))
        self._waits = keep

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
        self._forget(self._last)
        self._collect(block=True)

    def close(self) -> None:
        self.synchronize()

    def check(self) -> None:
        """Raise if a copy failed (a CUDA copy fails when it is issued, in :meth:`copy`: nothing to report here)."""

    def take_failures(self) -> list[int]:
        """The copies that failed since the last call (none on CUDA, see :meth:`check`)."""
        return []


# ---------------------------------------------------------------------------------------------------- CUDA, raw
class RuntimeLink:
    """The contract of :class:`CudaLink` at a fraction of its host cost: ``cudaMemcpyAsync`` on fixed addresses
    (:meth:`prepare` turns the scheduler's tensors into addresses once), events from a ring recorded with
    ``cudaEventRecord``, and the raw handle of torch's current stream instead of a ``torch.cuda.stream`` context.
    A ring event is recorded again only once the copy it marked is complete."""

    def __init__(self, device: torch.device, delay_ms: float, runtime: Runtime | None = None):
        """``runtime``: the :class:`~psr_hf.offload.cuda_runtime.Runtime` to call (default: a new one on
        ``device``; the tests pass a stand-in that models one ordered stream)."""
        self.device = device
        self.runtime = Runtime(device) if runtime is None else runtime
        self.stream = self.runtime.new_stream()
        self._stream = int(self.stream.cuda_stream)
        self._ring = [self.runtime.event() for _ in range(RING)]
        self._ring_seq = [-1] * RING  # issue number each ring event was last recorded after
        self._issued = 0
        self._complete = -1  # every copy with an issue number <= this is complete
        self._read_events: dict[int, cudaEvent_t] = {}  # layer -> its event after its latest computation on its slots
        self._read: dict[int, cudaEvent_t] = {}  # layers whose latest computation the next copy must wait for
        self._free_pairs: list[tuple[cudaEvent_t, cudaEvent_t]] = []
        self._waits: collections.deque[tuple[cudaEvent_t, cudaEvent_t]] = collections.deque()  # compute order
        self.wait_s = 0.0
        self._sleep_cycles = _sleep_cycles(device, delay_ms) if delay_ms > 0 else 0
        self._closed = False

    @staticmethod
    def prepare(dst: list, src: list) -> tuple[list, list]:
        """The scheduler's ``dst[L][C]`` and ``src[L][E]`` (lists of tensors) as addresses: ``dst`` ->
        tuples of device addresses, ``src`` -> tuples of ``(host address, bytes)``, in the same order."""
        views = (t for side in (dst, src) for layer in side for tensors in layer for t in tensors)
        if not all(view.is_contiguous() for view in views):
            raise ValueError("psr_hf offload: a slot or host-store view is not contiguous; the raw copy link "
                             "copies whole experts (OffloadConfig(copy_api='torch') copies any layout)")
        dst_addr = [[tuple(t.data_ptr() for t in tensors) for tensors in layer] for layer in dst]
        src_addr = [[tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors) for tensors in layer]
                    for layer in src]
        return dst_addr, src_addr

    def copy(self, seq: int, layer: int, slot: int, expert: int, dst: Sequence[int],
             src: Sequence[tuple[int, int]]) -> None:
        rt, stream = self.runtime, self._stream
        read = self._read.pop(layer, None)
        if read is not None:  # the slot's previous contents may still be read by a queued computation
            rt.wait(stream, read)
        if self._sleep_cycles:  # diagnostic delay (copy_delay_ms): torch's sleep kernel on the copy stream
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(self._sleep_cycles)
        for address, (source, nbytes) in zip(dst, src):
            rt.copy_h2d(address, source, nbytes, stream)
        index = seq % RING
        previous = self._ring_seq[index]
        if previous > self._complete:  # the event still marks an earlier copy in flight: wait for it first
            rt.synchronize(self._ring[index])
            self._complete = previous
        rt.record(self._ring[index], stream)
        self._ring_seq[index] = seq
        self._issued = seq + 1

    def done(self, seq: int) -> bool:
        if seq <= self._complete:
            return True
        index = seq % RING
        if self._ring_seq[index] != seq:  # recorded again (only after this copy completed), or never issued
            return True
        if self.runtime.query(self._ring[index]):
            self._complete = seq  # one ordered stream: every earlier copy is complete too
            return True
        return False

    def complete(self) -> int:
        """The highest issue number known complete: the latest copy if it is, else the copies from the oldest
        not known complete until one is in flight (every copy is asked about once when it completes)."""
        last = self._issued - 1
        if self._complete >= last or self.done(last):
            return self._complete
        for seq in range(self._complete + 1, last):
            if not self.done(seq):
                break
        return self._complete

    def _pair(self) -> tuple[cudaEvent_t, cudaEvent_t]:
        """Timing events for one wait: the oldest recorded pair if it is complete (read and reused; creating an
        event costs about 10 us), else a free or a new one."""
        waits = self._waits
        if waits and self.runtime.query(waits[0][1]):
            self._read_wait(waits.popleft())
            return self._free_pairs.pop()
        if self._free_pairs:
            return self._free_pairs.pop()
        return self.runtime.event(timing=True), self.runtime.event(timing=True)

    def _read_wait(self, pair: tuple[cudaEvent_t, cudaEvent_t]) -> None:
        start, end = pair
        self.runtime.synchronize(end)
        self.wait_s += self.runtime.elapsed_ms(start, end) / 1e3
        self._free_pairs.append(pair)

    def wait(self, seq: int) -> None:
        """Make the computation wait for copy ``seq`` (and, the stream being ordered, every copy issued before
        it)."""
        rt = self.runtime
        compute = rt.current_stream()
        start, end = pair = self._pair()
        rt.record(start, compute)
        rt.wait(compute, self._ring[seq % RING])  # recorded again only after seq: a later copy, never earlier
        rt.record(end, compute)
        self._waits.append(pair)
        if len(self._waits) > WAIT_PAIRS_COLLECTED:
            self._collect(block=False)

    def read_done(self, layer: int) -> None:
        event = self._read_events.get(layer)
        if event is None:
            event = self._read_events[layer] = self.runtime.event()
        self.runtime.record(event, self.runtime.current_stream())
        self._read[layer] = event

    def _collect(self, block: bool) -> None:
        """Read the waits' timings: all of them (``block``), or the complete ones at the front (recorded in order
        on one stream, so they complete in order)."""
        waits = self._waits
        while waits and (block or self.runtime.query(waits[0][1])):
            self._read_wait(waits.popleft())

    def synchronize(self) -> None:
        if self._closed:
            return
        self.runtime.synchronize_stream(self._stream)
        self.runtime.synchronize_stream(self.runtime.current_stream())
        self._complete = self._issued - 1
        self._collect(block=True)

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        self.runtime.close()

    def check(self) -> None:
        """Raise if a copy failed (a raw copy fails when it is issued, in :meth:`copy`: nothing to report here)."""

    def take_failures(self) -> list[int]:
        """The copies that failed since the last call (none: see :meth:`check`)."""
        return []
