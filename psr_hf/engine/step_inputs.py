"""A decode step's token and position written to the device from pinned memory without a race:
:class:`StepInputs`.

The copy from pinned memory runs when the stream reaches it, so the host must not rewrite its source before then.
The host-routed graphs wait for every layer anyway, but the token graph (:mod:`psr_hf.engine.token_graph`) and a
prompt stepped token by token let the host run several steps ahead of the GPU. So each step writes the next of a
few pinned rows, and waits for that row's previous copy only when the host is that many steps ahead.
"""

from __future__ import annotations

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
