"""The copy link of a CUDA device through raw runtime calls (:mod:`psr_hf.offload.cuda_runtime`).

The same contract as :class:`~psr_hf.offload.scheduler.CudaLink` (one ordered copy stream; a slot's copy waits for
the layer's latest computation on the slots; the computation waits for a copy's event), at a fraction of its host
cost: ``cudaMemcpyAsync`` on fixed addresses (:meth:`RuntimeLink.prepare` turns the scheduler's tensors into
addresses once), events from a ring recorded with ``cudaEventRecord``, and the raw handle of torch's current
stream instead of a ``torch.cuda.stream`` context. Which copies run, and when a layer may compute, are the
scheduler's decisions, unchanged.

Copies complete in issue order (one stream), so a copy's state is its issue number against the highest one known
complete: the ring's events are reused, and an event is recorded again only once the copy it marked is complete.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

from .cuda_runtime import Runtime

RING = 1024  # copy events; a copy's event is reused RING copies later (waiting for it first, if it is not complete)
WAIT_PAIRS_COLLECTED = 4096  # timing events of waits kept before the completed ones are read


class RuntimeLink:
    """Copies on one dedicated CUDA stream issued by raw runtime calls, named by the scheduler's issue numbers."""

    def __init__(self, device: torch.device, delay_ms: float, runtime: Any = None):
        """``runtime``: the :class:`~psr_hf.offload.cuda_runtime.Runtime` to call (default: a new one on
        ``device``; the tests pass a stand-in that models one ordered stream)."""
        from .scheduler import _sleep_cycles

        self.device = device
        self.runtime = Runtime(device) if runtime is None else runtime
        self.stream = self.runtime.new_stream()
        self._stream = int(self.stream.cuda_stream)
        self._ring = [self.runtime.event() for _ in range(RING)]
        self._ring_seq = [-1] * RING  # issue number each ring event was last recorded after
        self._issued = 0
        self._complete = -1  # every copy with an issue number <= this is complete
        self._read_events: dict[int, Any] = {}  # layer -> its event after the latest computation on its slots
        self._read: dict[int, Any] = {}  # layers whose latest computation the next copy into them must wait for
        self._free_pairs: list[tuple[Any, Any]] = []
        self._waits: collections.deque[tuple[Any, Any]] = collections.deque()  # in record order on the compute stream
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
        """Issue copy ``seq`` (issue numbers increase; one may be missing where a copy failed to issue)."""
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

    def _pair(self) -> tuple[Any, Any]:
        """Timing events for one wait: the oldest recorded pair if it is complete (read and reused; creating an
        event costs about 10 us), else a free or a new one."""
        waits = self._waits
        if waits and self.runtime.query(waits[0][1]):
            self._read_wait(waits.popleft())
            return self._free_pairs.pop()
        if self._free_pairs:
            return self._free_pairs.pop()
        return self.runtime.event(timing=True), self.runtime.event(timing=True)

    def _read_wait(self, pair: tuple[Any, Any]) -> None:
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

    def take_failures(self) -> list:
        """The copies that failed since the last call (none: see :meth:`check`)."""
        return []
