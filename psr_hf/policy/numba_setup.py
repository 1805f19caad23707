"""Where numba caches psr_hf's compiled kernels: one function, :func:`use_user_cache_folder`, that every module
of psr_hf that jits with ``cache=True`` calls before its decorators (``policy._kernels``, ``policy._mass``,
``policy._block_kernels``, ``offload.slot_book``). numba only; importing this module changes nothing.
"""

from __future__ import annotations

import os

import numba


def user_cache_dir() -> str:
    """Where numba caches these kernels: ``NUMBA_CACHE_DIR`` when the user set it, else a per-user cache folder
    (``$XDG_CACHE_HOME/psr_hf/numba``, default ``~/.cache/psr_hf/numba``; ``~/Library/Caches/psr_hf/numba`` on
    macOS; ``%LOCALAPPDATA%\\psr_hf\\numba`` on Windows). Never beside the modules: ``cache=True`` alone writes
    ``__pycache__/*.nbi|.nbc`` into site-packages, which ``pip uninstall`` does not remove."""
    from .._paths import user_cache_dir as cache

    return os.environ.get("NUMBA_CACHE_DIR") or cache("numba")


def use_user_cache_folder() -> str:
    """Make the ``@njit(cache=True)`` decorators that run after this call cache in :func:`user_cache_dir`;
    returns that folder. Call it at the top of a module that jits, before its decorators.

    It sets one process-wide setting, ``numba.config.CACHE_DIR``, and only when it is empty (a ``NUMBA_CACHE_DIR``
    of the user's, or a folder another program chose, always wins). Why it must be process-wide: numba has no
    per-function cache folder; it reads ``numba.config.CACHE_DIR`` when each decorator runs and keeps the folder
    it found, and the decorators run after this call, in the caller's module, where no call could restore the
    setting once they are done. So it stays set: numba functions that other code defines later also cache there,
    each in a subfolder named after its source path, instead of beside their sources (numba finds them there
    again). Nothing else changes: not the environment, not numba's threads (the CLI's ``--threads`` sets those),
    not torch's.
    """
    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = user_cache_dir()
    return numba.config.CACHE_DIR
