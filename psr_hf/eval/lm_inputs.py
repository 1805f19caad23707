"""What lm-eval's ``HFLM`` hands the model, as the routing must read it (docs/lm-eval.md).

Loglikelihood batches come right-padded with token 0 and without an attention mask: :class:`InputLengths` recovers
each row's real length from the requests, so that padding never reaches the routing state. Rolling loglikelihoods
tokenize whole documents that lm-eval windows itself: :func:`long_sequences_windowed` keeps the tokenizer from
warning about their length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' key for it


@contextlib.contextmanager
def long_sequences_windowed(tokenizer: PreTrainedTokenizerBase) -> Iterator[None]:
    """Inside the block, ``tokenizer`` does not warn that a sequence exceeds the model's maximum length (the caller
    windows it); after it, the tokenizer warns as it did before (once, as transformers does)."""
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(shown, dict):
        yield
        return
    before = shown.get(_LONG_SEQUENCE_WARNING)
    shown[_LONG_SEQUENCE_WARNING] = True  # transformers' own "already warned" mark
    try:
        yield
    finally:
        if before is None:
            shown.pop(_LONG_SEQUENCE_WARNING, None)
        else:
            shown[_LONG_SEQUENCE_WARNING] = before


def _key(tokens: Sequence[int]) -> tuple[int, int]:
    """A key of the tokens without trailing pad ids (HFLM right-pads loglikelihood inputs with 0): their length
    and hash (a collision can only add a candidate length, see :meth:`InputLengths.of`)."""
    end = len(tokens)
    while end and tokens[end - 1] == 0:
        end -= 1
    return end, hash(tuple(tokens[:end]))


class InputLengths:
    """The lengths of the current loglikelihood requests' inputs, by their tokens without trailing zeros. HFLM
    builds each row as ``(context + continuation)[-(max_length + 1):][:-1]``, right-pads the batch with 0 and
    passes no attention mask; with no requests (outside a loglikelihood call) no row counts as padded."""

    def __init__(self, requests: Iterable[tuple[Any, list[int], list[int]]] = (), max_length: int = 0):
        self._lengths: dict[tuple[int, int], set[int]] = {}
        for _, context, continuation in requests:
            inp = (context + continuation)[-(max_length + 1):][:-1]
            self._lengths.setdefault(_key(inp), set()).add(len(inp))

    def of(self, inps: torch.Tensor) -> list[int] | None:
        """Per row of a right-padded batch, its real length: the longest request input that the row's tokens
        match up to trailing zeros, or the whole row where no request matches; None when no row is padded. The
        row's own input is always a candidate, so a real token is never taken for padding (a real trailing 0
        stays real); at worst, where two inputs differ only in trailing zeros, a pad counts as real, which
        cannot change the row's decisions (they run in position order)."""
        if not self._lengths or inps.ndim != 2:
            return None
        width = int(inps.shape[1])
        result = []
        for row in inps.tolist():
            candidates = [n for n in self._lengths.get(_key(row), ()) if n <= width]
            result.append(max(candidates) if candidates else width)
        return None if min(result) == width else result
