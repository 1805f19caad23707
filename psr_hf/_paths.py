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


def _nearest_existing(path: str) -> str:
    """The path itself or its nearest ancestor that exists (a dangling symlink counts as existing)."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def check_output(option: str, path: str, *, directory: bool = False) -> None:
    """``ValueError`` naming ``option`` unless ``path`` can be written (a file; with ``directory``, a folder
    created new or empty), checked before the work whose result it would hold: its folder must exist and be
    writable, and the path must not be a folder (a file) or a file or dangling link (a folder)."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{option} {path}: a symbolic link to nothing; remove it or choose another path")
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{option} {path}: exists and is not a folder; choose a new or empty folder")
        base = _nearest_existing(path)
        if not os.path.isdir(base):
            raise ValueError(f"{option} {path}: {base} is a file, so no folder can be made there")
    else:
        if os.path.isdir(path):
            raise ValueError(f"{option} {path}: is a folder; give the file to write")
        base = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(base):
            raise ValueError(f"{option} {path}: the folder {base} does not exist; create it first")
    if not os.access(base, os.W_OK):
        raise ValueError(f"{option} {path}: {base} is not writable")
