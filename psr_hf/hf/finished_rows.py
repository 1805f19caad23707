"""The rows of a running ``generate()`` that finished: :class:`FinishedRows`.

generate() feeds a row's end-of-sequence token back once, then pad tokens, and keeps feeding a row that a stopping
criterion ended (a stop string, lm-eval's ``until``, any custom criterion). From that position on the row's outputs
are discarded, so what it is fed must not touch its routing state or statistics, as a row decoded alone would have
stopped there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch


class FinishedRows:
    """Which rows of the running ``generate()`` have finished (a controller's, one per model). Outside
    :meth:`generating` no row finishes."""

    def __init__(self) -> None:
        self.finished = np.zeros(1, dtype=bool)  # [R]
        self._stop_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self._stop_set: frozenset[int] = frozenset()  # the same ids, for the one-token check
        self._prompt_length = 0  # the running generate() call's input ids (cached part included)
        self._per_row = False  # the running generate() reports stopped rows (stopped)
        self._depth = 0  # generate() calls running in this model (nested: a composite model's own)

    def reset(self, rows: int) -> None:
        """A new sequence of ``rows`` rows, none finished."""
        self.finished = np.zeros(rows, dtype=bool)

    def reorder(self, index: np.ndarray) -> None:
        """New row ``i`` continues old row ``index[i]`` (beam search)."""
        self.finished = self.finished[index]

    @contextlib.contextmanager
    def generating(self, stop_ids: np.ndarray, prompt_length: int, per_row: bool) -> Iterator[None]:
        """A ``generate()`` call runs inside this block, with these stop token ids and ``prompt_length`` input ids;
        ``per_row``: its stopping criteria are asked once per step for every row (greedy and sampled decoding; beam
        search asks them for candidate beams, which are not rows)."""
        previous = self._stop_ids, self._stop_set, self._prompt_length, self._per_row
        self._stop_ids, self._stop_set = stop_ids, frozenset(int(t) for t in stop_ids.tolist())
        self._prompt_length, self._per_row = prompt_length, per_row
        # a call that continues a cached sequence gives every row new input: rows that finished before run again
        self.finished[:] = False
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._stop_ids, self._stop_set, self._prompt_length, self._per_row = previous

    def stopped(self, done: torch.Tensor) -> None:
        """generate()'s stopping criteria ended the rows where ``done`` ``[B]`` is true: from the next forward pass
        on, what generate() feeds those rows never touches their state."""
        if not (self._depth and self._per_row) or done.ndim != 1 or done.shape[0] != self.finished.shape[0]:
            return
        self.finished |= done.detach().to("cpu").numpy().astype(bool)

    def mark(self, tokens: np.ndarray, valid: np.ndarray | None, past: int) -> np.ndarray | None:
        """The real positions ``valid`` (None: all) of a forward of ``tokens`` ``[B, S]`` after ``past`` cached
        positions, less those of rows that finished before them or at an end-of-sequence token among them. Only
        generated tokens count: the prompt's positions in this block (a chat turn continuing a cached sequence holds
        eos ids) do not end a row."""
        if not (self._depth and past > 0 and (self._stop_ids.size or self.finished.any())):
            return valid
        prompt = self._prompt_length - past
        if tokens.size == 1 and not self.finished.any():  # batch-1 decoding: no array set operation per token
            if int(tokens[0, 0]) not in self._stop_set or prompt > 0:
                return valid
        hit = np.isin(tokens, self._stop_ids)  # [B, S]
        hit[:, : max(prompt, 0)] = False
        if not hit.any() and not self.finished.any():
            return valid
        done = np.logical_or.accumulate(hit, axis=1) | self.finished[:, None]
        self.finished |= done[:, -1]
        keep = ~done if valid is None else (valid != 0) & ~done
        return None if keep.all() else keep.astype(np.uint8)
