"""Raw CUDA runtime calls for the decode path, through NVIDIA's cuda-python (``cuda.bindings.runtime``).

Why: on the lent H200 one torch ``copy_(pinned, non_blocking=True)`` of an expert costs 20.7 us of host time to
issue, the same ``cudaMemcpyAsync`` 2.2 us; a torch event record 5.2 us, ``cudaEventRecord`` 0.5 us; ``with
torch.cuda.stream(s)`` 8.8 us and ``torch.cuda.current_stream()`` about 29 us (the current figures:
``benchmarks/engine/h200/host_path/host_calls.json``). The copy path of the engine calls these per copy and per
layer, so it calls them raw: fixed addresses, events from a pool, the stream's raw handle.

Optional: ``cuda-python`` is a GPU extra (``pip install psr-hf[cuda]``). :func:`available` says whether it imports
and why not; every caller falls back to torch's calls without it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # cuda-python is optional: its types only name what these calls take and return
    from cuda.bindings.runtime import cudaError_t, cudaEvent_t, cudaGraphExec_t


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """``(True, "cuda-bindings X.Y")`` when ``cuda.bindings.runtime`` imports and torch sees a CUDA device, else
    ``(False, why)`` (cached)."""
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        from cuda.bindings import runtime  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return False, (f"cuda-python is not importable ({type(exc).__name__}: {exc}); install the GPU extra: "
                       "pip install 'psr-hf[cuda]'")
    try:
        from cuda import bindings
        version = getattr(bindings, "__version__", "?")
    except Exception:  # the version is informative only
        version = "?"
    return True, f"cuda-bindings {version}"


def _rt() -> ModuleType:
    from cuda.bindings import runtime

    return runtime


def raw_current_stream(device: torch.device) -> int:
    """The raw handle of torch's current stream on ``device`` (about 1 us, against about 29 us for
    ``torch.cuda.current_stream(device).cuda_stream``, most of it in resolving the device)."""
    return int(torch._C._cuda_getCurrentRawStream(device.index))


class Runtime:
    """The few runtime calls the copy path makes, each checked: a failure raises ``RuntimeError`` naming the call
    and CUDA's error. Events are created on ``device`` and kept for the object's life."""

    def __init__(self, device: torch.device):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"psr_hf offload: raw CUDA calls are unavailable: {why}")
        rt = self.rt = _rt()
        self.device = device
        self._success = rt.cudaError_t.cudaSuccess
        self._not_ready = rt.cudaError_t.cudaErrorNotReady
        self._h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._memcpy = rt.cudaMemcpyAsync
        self._record = rt.cudaEventRecord
        self._wait = rt.cudaStreamWaitEvent
        self._query = rt.cudaEventQuery
        self._event_sync = rt.cudaEventSynchronize
        self._launch = rt.cudaGraphLaunch
        self._events: list[cudaEvent_t] = []

    def _fail(self, call: str, err: cudaError_t) -> None:
        name = getattr(err, "name", str(err))
        raise RuntimeError(f"psr_hf offload: {call} failed on {self.device} ({name})")

    def event(self, timing: bool = False) -> cudaEvent_t:
        """A new event (blocking-sync off; timing only when asked: a timing event costs more to record)."""
        rt = self.rt
        flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
        with torch.cuda.device(self.device):
            err, event = rt.cudaEventCreateWithFlags(flags)
        if err != self._success:
            self._fail("cudaEventCreateWithFlags", err)
        self._events.append(event)
        return event

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err, = self._memcpy(dst, src, nbytes, self._h2d, stream)
        if err != self._success:
            self._fail("cudaMemcpyAsync", err)

    def record(self, event: cudaEvent_t, stream: int) -> None:
        err, = self._record(event, stream)
        if err != self._success:
            self._fail("cudaEventRecord", err)

    def wait(self, stream: int, event: cudaEvent_t) -> None:
        """``stream`` waits (on the device) for ``event``."""
        err, = self._wait(stream, event, 0)
        if err != self._success:
            self._fail("cudaStreamWaitEvent", err)

    def query(self, event: cudaEvent_t) -> bool:
        """Whether the work before ``event``'s latest record is complete."""
        err, = self._query(event)
        if err == self._success:
            return True
        if err == self._not_ready:
            return False
        self._fail("cudaEventQuery", err)
        return False

    def synchronize(self, event: cudaEvent_t) -> None:
        """The host waits for ``event``."""
        err, = self._event_sync(event)
        if err != self._success:
            self._fail("cudaEventSynchronize", err)

    def graph_exec(self, handle: int) -> cudaGraphExec_t:
        """A ``cudaGraphExec_t`` for the address torch's ``CUDAGraph.raw_cuda_graph_exec()`` returns."""
        return self.rt.cudaGraphExec_t(int(handle))

    def launch(self, graph_exec: cudaGraphExec_t, stream: int) -> None:
        """``cudaGraphLaunch``: torch's ``CUDAGraph.replay()`` without its per-replay work in Python and C++ (the
        memory pool's liveness check, the RNG generators' offsets, which graphs without random numbers never
        read)."""
        err, = self._launch(graph_exec, stream)
        if err != self._success:
            self._fail("cudaGraphLaunch", err)

    def new_stream(self) -> torch.cuda.Stream:
        """A new torch CUDA stream on the device (its raw handle: ``int(stream.cuda_stream)``)."""
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> int:
        """The raw handle of torch's current stream on the device."""
        return raw_current_stream(self.device)

    def synchronize_stream(self, stream: int) -> None:
        """The host waits for everything enqueued on ``stream``."""
        err, = self.rt.cudaStreamSynchronize(stream)
        if err != self._success:
            self._fail("cudaStreamSynchronize", err)

    def elapsed_ms(self, start: cudaEvent_t, end: cudaEvent_t) -> float:
        err, ms = self.rt.cudaEventElapsedTime(start, end)
        if err != self._success:
            self._fail("cudaEventElapsedTime", err)
        return float(ms)

    def close(self) -> None:
        """Destroy the events (after the work that records them is complete)."""
        events, self._events = self._events, []
        for event in events:
            self.rt.cudaEventDestroy(event)


class HostEvent:
    """An event the host waits on after work it enqueued: a raw CUDA event where cuda-python imports (about 2 us
    to record, against 9 for torch's), torch's otherwise, nothing on a CPU (the work is done when it returns).
    ``runtime``: the caller's :class:`Runtime`, or None to make one where possible."""

    def __init__(self, device: torch.device, runtime: Runtime | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if runtime is None and cuda and available()[0]:
            runtime = Runtime(self.device)
        self._runtime = runtime if cuda else None
        self._event: cudaEvent_t | torch.cuda.Event | None = (self._runtime.event() if self._runtime is not None
                            else torch.cuda.Event() if cuda else None)

    def record(self, stream: int | None = None) -> None:
        """Mark the work enqueued so far on the current stream (``stream``: its raw handle, if known)."""
        if self._runtime is not None:
            self._runtime.record(self._event, raw_current_stream(self.device) if stream is None else stream)
        elif self._event is not None:
            self._event.record()

    def synchronize(self) -> None:
        """The host waits for the work before the latest :meth:`record`."""
        if self._runtime is not None:
            self._runtime.synchronize(self._event)
        elif self._event is not None:
            self._event.synchronize()
