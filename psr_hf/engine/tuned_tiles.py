"""The kernels' tiles chosen by measurement on a GPU model, shipped as a table (``tuned_tiles.json``).

A tile fixes the order of a kernel's float32 sums, so it is chosen once, by a benchmark on the lent GPU, and read
from this table, never by timing at run time (outputs would then depend on timing). Entries are keyed by kernel,
the GPU's name (``torch.cuda.get_device_name``) and the shape; where the table has none, the kernel keeps its
default tiles. Each entry keeps what chose it: the benchmark, its record and the times it measured.
``benchmarks/engine/moe_tiles_bench.py --table`` and ``benchmarks/engine/gemv_bench.py --table`` write entries.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: the shipped table
TABLE = Path(__file__).with_name("tuned_tiles.json")


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str | None:
    """The GPU's name the table is keyed by (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {}
    return json.loads(p.read_text())


def lookup(kernel: str, device: torch.device, shape: str, path: Path = TABLE) -> dict[str, Any] | None:
    """The tiles measured best for ``kernel`` at ``shape`` on this GPU model, or None (the kernel's defaults)."""
    name = device_name(device)
    if name is None:
        return None
    entry = _load(str(path)).get(kernel, {}).get(name, {}).get(shape)
    return None if entry is None else dict(entry["tiles"])


def record(kernel: str, device: torch.device, shape: str, tiles: dict[str, Any], evidence: dict[str, Any],
           path: Path = TABLE) -> None:
    """Write ``tiles`` for ``kernel`` at ``shape`` on this GPU model into the table at ``path``, with ``evidence``
    (what measured them); later lookups in this process see it."""
    name = device_name(device)
    if name is None:
        raise ValueError(f"tuned tiles are recorded for a CUDA device; got {device}")
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(kernel, {}).setdefault(name, {})[shape] = {"tiles": tiles, "evidence": evidence}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
    logger.info("tuned tiles for %s at %s on %s: %s", kernel, shape, name, tiles)
