"""The sequence a controller's routing state belongs to, and whether a forward may continue it:
:class:`RoutedSequence`.

A forward pass after ``past`` cached positions continues the current sequence, so its routing state must be the one
that routed those positions: the same KV cache object (when both are known) and as many positions as the state has
taken in. A forward that would route another sequence's cache with this state raises, naming what to do instead.
"""

from __future__ import annotations

import logging
import weakref

logger = logging.getLogger(__name__)


class RoutedSequence:
    """How many positions of which KV cache the routing state has taken in, and why the sequence's last forward
    pass stopped part-way (if it did): a controller's, one per model."""

    def __init__(self) -> None:
        self.positions: int | None = None  # positions the routing state has taken in (None: any KV cache may continue)
        self.interrupted: str | None = None  # why the last forward pass stopped part-way; None once a new one starts
        self._cache: weakref.ref | None = None  # weak reference to the KV cache its forward passes filled

    def start(self) -> None:
        """A new sequence: no position taken in yet, its KV cache not known yet."""
        self.positions, self._cache = 0, None

    @property
    def knows_cache(self) -> bool:
        """Whether the KV cache the sequence's forward passes fill is known (:meth:`remember_cache`)."""
        return self._cache is not None

    def remember_cache(self, cache: object) -> None:
        """The KV cache object the sequence's forward passes fill (a weak reference)."""
        if cache is None or not hasattr(cache, "get_seq_length"):
            return
        try:
            self._cache = weakref.ref(cache)
        except TypeError:  # not weakly referenceable: not checked
            self._cache = None

    def check_continuation(self, past: int, B: int, rows: int, cache: object = None, *, exact: bool,
                           restart: bool = False) -> bool:
        """Whether a forward of ``B`` rows after ``past`` cached positions (in the KV cache ``cache``, if given)
        starts afresh: it may continue this sequence of ``rows`` rows where it is the same cache object as the
        sequence's forward passes used (when both are known) and has as many cached positions as the routing state
        has seen (fewer, a cache cropped in place as assisted decoding does, only under ``exact`` routing, which no
        output depends on). Where it may not: a ``RuntimeError``, or with ``restart`` True (the routing state
        starts afresh for this forward, and this returns True)."""
        try:
            self._check_continuing(past, B, rows, cache, exact)
        except RuntimeError:
            if not restart:
                raise
            logger.debug("psr_hf: a forward continues another sequence's KV cache; fresh routing state (exact routing)")
            return True
        return False

    def _check_continuing(self, past: int, B: int, rows: int, cache: object, exact: bool) -> None:
        if past > 0 and self.interrupted is None:
            # a dead reference: the sequence's cache is gone, so this one (alive all along) is another
            other = cache is not None and self._cache is not None and cache is not self._cache()
            if other or (self.positions is not None and past > self.positions):
                owner = ("another KV cache (another forward pass started a new sequence in between)" if other
                         else f"a sequence of {self.positions} positions")
                raise RuntimeError(
                    f"psr_hf: this forward continues a KV cache of {past} positions, but the routing state belongs to "
                    f"{owner}: continuing would route this cache with another sequence's state. Start a new sequence "
                    "(generate() or a forward without past_key_values), or call psr_hf.controller(model).reset() to "
                    "continue this KV cache with fresh routing state"
                )
        if 0 < past < (self.positions or 0) and self.interrupted is None and not exact:
            raise RuntimeError(
                f"psr_hf: this forward continues a KV cache cropped to {past} positions, but the routing state has "
                f"taken in {self.positions}: the removed positions (rejected drafts of assisted decoding, "
                "a rolled-back turn) would still steer this sequence's routing. Start a new sequence (generate() or a "
                "forward without past_key_values), or call psr_hf.controller(model).reset() to continue this KV "
                "cache with fresh routing state"
            )
        if past > 0 and self.interrupted is not None:
            raise RuntimeError(
                f"psr_hf: the previous forward pass of this model stopped part-way ({self.interrupted}), so the "
                "sequence it belonged to is closed: its KV cache and routing state hold a partial step. Start a new "
                "sequence (generate() or a forward without past_key_values), or call psr_hf.controller(model)."
                "reset() to continue this KV cache with fresh routing state"
            )
        if past > 0 and B != rows:
            raise RuntimeError(
                f"psr_hf: a batch of {B} rows continues a cached sequence of {rows} rows; start a new "
                "sequence (empty cache) or reorder the rows with the KV cache"
            )
