"""A pids cgroup that caps how many tasks the sandbox may run: the kernel enforces it for root too, where
RLIMIT_NPROC is not enforced (the kernel exempts root's user from it, in every user namespace mapped to root)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

_COUNTER = itertools.count()


def _mounts() -> list[tuple[str, str, list[str]]]:
    """``(mount point, fstype, options)`` of the cgroup file systems, from /proc/self/mountinfo."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4].encode().decode("unicode_escape"), tail[0], tail[2].split(",")))
    return found


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in the hierarchy of ``controller`` (None: the cgroup2 one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    raise OSError(f"no {controller or 'cgroup2'} entry in /proc/self/cgroup")


def create(max_tasks: int) -> tuple[Path | None, str]:
    """A new pids cgroup below this process's, limited to ``max_tasks``: ``(its folder, "")``, or ``(None, why
    not)``. Needs write access to the cgroup file system (root, outside a container that mounts it read-only)."""
    reasons = []
    for point, fstype, options in _mounts():
        try:
            if fstype == "cgroup" and "pids" in options:
                parent = Path(point) / _own_path("pids").lstrip("/")
            elif fstype == "cgroup2":
                parent = Path(point) / _own_path(None).lstrip("/")
                if "pids" not in (parent / "cgroup.subtree_control").read_text().split():
                    reasons.append(f"{point}: the pids controller is not enabled for child cgroups")
                    continue
            else:
                continue
            folder = parent / f"psr_sandbox_{os.getpid()}_{next(_COUNTER)}"
            folder.mkdir()
            try:
                (folder / "pids.max").write_text(str(max_tasks))
            except OSError:
                folder.rmdir()
                raise
            return folder, ""
        except OSError as exc:
            reasons.append(f"{point}: {exc.strerror or exc}")
    return None, "; ".join(reasons) or "no cgroup file system with the pids controller is mounted"


def remove(folder: Path) -> None:
    """Remove the cgroup (its tasks are dead by now; a folder still busy is left for the system)."""
    try:
        folder.rmdir()
    except OSError:
        pass
