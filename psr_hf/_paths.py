"""Where psr_hf keeps per-user files: compiled kernels and models built on the user's machine."""

from __future__ import annotations

import os
import sys


def user_cache_dir(*parts: str) -> str:
    """``<per-user cache folder>/psr_hf/<parts>``: ``$XDG_CACHE_HOME`` (default ``~/.cache``) on Linux,
    ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows. Never inside the installed package, which
    ``pip uninstall`` removes and which may be read-only."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.join(os.path.expanduser("~"), "AppData", "Local")
    elif sys.platform == "darwin":
        base = os.path.join(os.path.expanduser("~"), "Library", "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "psr_hf", *parts)
