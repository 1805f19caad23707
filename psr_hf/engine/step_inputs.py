"""A decode step's token and position written to the device from pinned memory without a race:
:class:`StepInputs` (a copy the host enqueues before the step's graphs) and :class:`GraphStepInputs` (read by the
token graph's first kernel, so that nothing is enqueued before its launch).

The copy from pinned memory runs when the stream reaches it, so the host must not rewrite its source before then.
The host-routed graphs wait for every layer anyway, but the token graph (:mod:`psr_hf.engine.token_graph`) and a
prompt stepped token by token let the host run several steps ahead of the GPU. So each step writes the next of a
few pinned rows, and waits for that row's previous reader only when the host is that many steps ahead.

Why the token graph reads its inputs itself: a step then makes one runtime call (the launch) instead of three
(the copy, an event record, the launch). On the lent H100 a launch after a copy costs what a launch on an idle
stream does (``benchmarks/engine/graph_launch_probe.py``, "launched after"), so what this saves is the two calls'
own host time.
"""

from __future__ import annotations

import time

import torch

from psr_hf.offload.cuda_runtime import HostEvent, Runtime


class StepInputs:
    """Writes ``(token, position)`` into ``token`` and ``position`` (adjacent int64 device scalars: ``token``'s
    address + 8 is ``position``'s) with one raw copy per step on ``runtime``, from a ring of ``rows`` pinned rows."""

    def __init__(self, token: torch.Tensor, position: torch.Tensor, runtime: Runtime, rows: int = 8):
        if position.data_ptr() != token.data_ptr() + 8:
            raise ValueError("StepInputs: the position buffer must follow the token buffer (one 16-byte copy)")
        self._token, self._position = token.data_ptr(), position.data_ptr()
        self._runtime = runtime
        self._rows = torch.zeros(int(rows), 2, dtype=torch.int64, pin_memory=True)
        self._rows_np = self._rows.numpy()
        self._events = [HostEvent(token.device, runtime) for _ in range(int(rows))]
        self._used = [False] * int(rows)
        self._next = 0

    def write(self, token: int | None, position: int, stream: int) -> None:
        """Enqueue on ``stream`` (a raw handle) the copy of ``position`` and, unless ``token`` is None (the device
        wrote it), ``token``."""
        row = self._next
        self._next = (row + 1) % len(self._events)
        if self._used[row]:  # that row's copy, ``rows`` steps ago, has read its source
            self._events[row].synchronize()
        values = self._rows_np[row]
        values[1] = position
        source = self._rows.data_ptr() + 16 * row
        if token is None:
            self._runtime.copy_h2d(self._position, source + 8, 8, stream)
        else:
            values[0] = token
            self._runtime.copy_h2d(self._token, source, 16, stream)
        self._events[row].record(stream)
        self._used[row] = True


class GraphStepInputs:
    """``(token, position)`` read by a kernel captured first in the token graph (:meth:`read`) from a ring of
    ``rows`` pinned rows that :meth:`write` fills, one row per launch, into ``token`` and ``position`` (int64
    device scalars). A negative token or position keeps the buffer's value. The device counts the steps it has
    read and publishes the count to pinned memory, which the host checks before it reuses a row: no event, no
    copy and no other call on the launch's stream. Every :meth:`read` enqueued must have its :meth:`write` first
    (the two counts stay equal); :meth:`keep` writes a row that changes nothing (an eager run of the graph's body,
    such as the warm-up before a capture); :meth:`restart` starts both counts at 0 again."""

    def __init__(self, token: torch.Tensor, position: torch.Tensor, rows: int = 8):
        if token.numel() != 1 or position.numel() != 1 or token.dtype != torch.int64 or position.dtype != torch.int64:
            raise ValueError("GraphStepInputs: token and position must be one int64 element each")
        self._token, self._position = token.view(-1), position.view(-1)
        device = token.device
        pin = device.type == "cuda"
        self.rows = int(rows)
        self._ring = torch.full((self.rows, 2), -1, dtype=torch.int64, pin_memory=pin)
        self._ring_np = self._ring.numpy()
        self._done = torch.zeros(1, dtype=torch.int64, pin_memory=pin)  # steps the device has read
        self._done_np = self._done.numpy()
        self._counter = torch.zeros(1, dtype=torch.int64, device=device)  # the device's own count
        self._written = 0  # rows the host has written since restart

    @property
    def steps(self) -> torch.Tensor:
        """The device's count of the steps it has read (int64 ``[1]``, advanced by the token graph's first
        kernel): within a step, its number plus one."""
        return self._counter

    def restart(self) -> None:
        """Counts from 0 again on both sides (on the current stream, before the stretch's first launch)."""
        self._counter.zero_()
        self._done_np[0] = 0
        self._written = 0
        self._ring_np[:] = -1

    def keep(self) -> None:
        """The next read keeps the buffers as they are (the ring row it reads says so)."""
        self.write(None, -1)

    def write(self, token: int | None, position: int) -> None:
        """The next read's inputs (``token`` None: keep the buffer's token, which the device wrote; ``position``
        negative: keep the buffer's). Waits only while the device is ``rows`` reads behind the host."""
        row = self._written % self.rows
        while self._written - int(self._done_np[0]) >= self.rows:  # that row's reader has not run yet
            time.sleep(0)
        self._ring_np[row, 0] = -1 if token is None else int(token)
        self._ring_np[row, 1] = int(position)
        self._written += 1

    def read(self, interpret: bool = False) -> None:
        """Enqueue the kernel that reads the next row into the buffers (captured as the token graph's first node)."""
        from .device_decisions import triton_module

        kernel = triton_module("step_inputs_kernel.py", interpret).read_step_inputs_kernel
        kernel[(1,)](self._ring, self._counter, self._done, self._token, self._position, ROWS=self.rows,
                     num_warps=1)
