"""RuntimeLink's bookkeeping (the raw CUDA copy link) on the CPU, against a stand-in runtime that models CUDA's
ordered streams: events mark a stream position, work completes in order when the test says so. The real calls
run on the GPU in ``tests/test_offload_cuda.py`` (marked cuda); this checks what the link decides from them: when
a copy is done, when a ring event must be waited for before it is reused, that waits' timing events are reused,
and that a copy into a layer waits for the layer's latest computation."""

from __future__ import annotations

import pytest
import torch

from psr_hf.offload import links
from psr_hf.offload.links import RuntimeLink

COMPUTE, COPY = 7, 9


class _Stream:
    cuda_stream = COPY


class _OrderedStreams:
    """Two streams, each completing its work in order up to ``completed[stream]``."""

    def __init__(self):
        self.enqueued = {COMPUTE: 0, COPY: 0}
        self.completed = {COMPUTE: 0, COPY: 0}
        self.created = 0
        self.calls: list[tuple] = []

    def new_stream(self):
        return _Stream()

    def current_stream(self):
        return COMPUTE

    def event(self, timing=False):
        self.created += 1
        return {"stream": None, "position": 0}

    def copy_h2d(self, dst, src, nbytes, stream):
        self.enqueued[stream] += 1
        self.calls.append(("copy", dst, src, nbytes, stream))

    def record(self, event, stream):
        event["stream"], event["position"] = stream, self.enqueued[stream]

    def wait(self, stream, event):
        self.calls.append(("wait", stream, event["stream"], event["position"]))

    def query(self, event):
        return event["stream"] is None or self.completed[event["stream"]] >= event["position"]

    def synchronize(self, event):
        if event["stream"] is not None:
            stream = event["stream"]
            self.completed[stream] = max(self.completed[stream], event["position"])
            self.calls.append(("sync", stream, event["position"]))

    def synchronize_stream(self, stream):
        self.completed[stream] = self.enqueued[stream]

    def elapsed_ms(self, start, end):
        return 1.0

    def close(self):
        pass


def _link():
    streams = _OrderedStreams()
    return RuntimeLink(torch.device("cpu"), 0.0, runtime=streams), streams


def _copy(link, layer=0, slot=0, expert=0):
    """Issue the next copy (the scheduler's issue numbers: 0, 1, ...); returns its number."""
    seq = link._issued
    link.copy(seq, layer, slot, expert, (1000 + slot, 2000 + slot), ((3000 + expert, 64), (4000 + expert, 32)))
    return seq


def test_a_copy_is_done_when_its_stream_position_is_and_so_are_the_earlier_ones():
    link, streams = _link()
    jobs = [_copy(link, slot=s, expert=s) for s in range(4)]
    assert [c[1:4] for c in streams.calls if c[0] == "copy"][:2] == [(1000, 3000, 64), (2000, 4000, 32)]
    assert not any(link.done(job) for job in jobs)
    streams.completed[COPY] = 4  # the first two copies (two buffers each) complete
    assert link.done(jobs[1]) and not link.done(jobs[2])
    streams.completed[COPY] = 0  # what is known complete stays complete, without asking the device again
    assert link.done(jobs[0]) and link.done(jobs[1])
    assert link.complete() == 1
    streams.completed[COPY] = 6  # three copies: the latest known complete is found from the oldest in flight
    assert link.complete() == 2
    streams.completed[COPY] = 8
    assert link.complete() == 3


def test_a_ring_event_is_waited_for_before_it_marks_a_later_copy(monkeypatch):
    monkeypatch.setattr(links, "RING", 2)
    link, streams = _link()
    first, second = _copy(link, slot=0), _copy(link, slot=1)
    assert not [c for c in streams.calls if c[0] == "sync"]
    third = _copy(link, slot=2)  # reuses the first copy's event, still in flight: the host waits for it first
    assert [c for c in streams.calls if c[0] == "sync"] == [("sync", COPY, 2)]
    assert link.done(first) and not link.done(second) and not link.done(third)
    streams.completed[COPY] = streams.enqueued[COPY]
    assert link.done(third) and link.done(second)


def test_waits_reuse_their_timing_events_and_count_the_waited_time():
    link, streams = _link()
    job = _copy(link)
    before = streams.created
    for _ in range(5):
        link.wait(job)  # the compute stream's earlier waits are complete: their events are read and reused
    assert streams.created - before == 2  # one pair of timing events for all five waits
    assert ("wait", COMPUTE, COPY, 2) in streams.calls
    link.synchronize()
    assert link.wait_s == pytest.approx(5 * 1e-3)


def test_a_copy_into_a_layer_waits_for_the_layers_latest_computation():
    link, streams = _link()
    streams.enqueued[COMPUTE] = 3
    link.read_done(layer=1)
    _copy(link, layer=0)
    assert not [c for c in streams.calls if c[0] == "wait"]  # layer 0 was not read
    _copy(link, layer=1, slot=1)
    assert ("wait", COPY, COMPUTE, 3) in streams.calls
    _copy(link, layer=1, slot=2)  # once per computation
    assert [c for c in streams.calls if c[0] == "wait"] == [("wait", COPY, COMPUTE, 3)]


def test_close_is_idempotent_and_completes_everything():
    link, streams = _link()
    job = _copy(link)
    link.close()
    link.close()
    assert link.done(job)
