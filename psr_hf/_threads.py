"""psr_hf's one thread decision: a small model on the CPU runs with one torch intra-op thread.

Its matrix products take microseconds, so more threads gain nothing on an idle machine, and on a busy one every
parallel region waits for an OpenMP worker the OS has descheduled (the shipped tiny-moe generating 32 tokens on
a loaded 2-core machine: 0.17-0.35 s with one thread, 0.86-1.19 s with torch's default two;
benchmarks/threads/record.txt). Torch's thread count is process-wide, so only the command line applies the
decision; the library (``patch()``, ``load_shipped()``) leaves it to the caller, who calls
``torch.set_num_threads(1)`` for a small model (as the README's quickstart and the notebook do). The CLI's
commands take ``PSR_HF_THREADS=N`` (or ``OMP_NUM_THREADS``, or ``--threads``) to choose otherwise.

:func:`keep_torch_threads` keeps that decision around numba's parallel kernels (the policy's replay).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Iterator

logger = logging.getLogger(__name__)

SMALL_HIDDEN = 512  # hidden size up to which a model counts as small
ENV = "PSR_HF_THREADS"  # the user's thread count for psr_hf's decision (an int >= 1)


def _user_threads() -> int | None:
    value = os.environ.get(ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: give a number of threads >= 1 (or leave it unset for psr_hf's choice)")
    return int(value)


def decide(hidden_size: int | None, device: Any = "cpu") -> int:
    """Apply the decision for a model of ``hidden_size`` on ``device``; returns torch's intra-op thread count."""
    import torch

    chosen = _user_threads()
    if chosen is not None:
        torch.set_num_threads(chosen)
    elif (not os.environ.get("OMP_NUM_THREADS") and torch.get_num_threads() > 1 and torch.device(device).type == "cpu"
          and hidden_size is not None and hidden_size <= SMALL_HIDDEN):
        torch.set_num_threads(1)
        logger.info("psr_hf: one torch thread for this small model on the CPU (hidden size %d; %s=N or "
                    "OMP_NUM_THREADS to choose)", hidden_size, ENV)
    return torch.get_num_threads()


def decide_for(model: Any) -> int:
    """:func:`decide` for a loaded model (its text config's hidden size, the device of its first parameter)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    try:
        device = next(model.parameters()).device
    except (StopIteration, AttributeError):
        device = "cpu"
    return decide(hidden if isinstance(hidden, int) else None, device)


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Around a parallel numba kernel: numba's OpenMP layer sets the process's OpenMP thread count, which torch
    reads as its own intra-op count (a caller that chose one torch thread for a small model would run its next
    forward on every core). Restores the caller's torch count after the call where torch is loaded (this never
    imports it: the policy room that calls it never uses torch); numba's own count is the caller's too, never set
    here."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
