"""psr_hf: cache-aware expert routing and offloading for HuggingFace MoE models.

Importing ``psr_hf`` is cheap and never imports torch: the policy layer (numpy + numba) loads on first use of
one of its names, and the torch integration (``patch``, ``controller``, ...) loads when it is first used.
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

from .policy.config import RoutingConfig  # noqa: E402  (torch- and numpy-free)

_LAZY = {
    "Calibration": "psr_hf.policy.calibration",
    "CalibrationBuilder": "psr_hf.policy.calibration",
    "LogicalCache": "psr_hf.policy.cache",
    "replay": "psr_hf.policy.replaying",
    "ReplayResult": "psr_hf.policy.replaying",
    "Recording": "psr_hf.policy.replaying",
    "patch": "psr_hf.hf.patching",
    "unpatch": "psr_hf.hf.patching",
    "patched": "psr_hf.hf.patching",
    "controller": "psr_hf.hf.patching",
    "calibrate": "psr_hf.hf.calibrate",
    "speculative_generate": "psr_hf.hf.speculative",
    "BlockConfig": "psr_hf.policy.blocks",
    "OffloadConfig": "psr_hf.offload.config",
    "OffloadStats": "psr_hf.offload.experts",
    "OffloadMemory": "psr_hf.offload.placement",
    "OffloadMemoryError": "psr_hf.offload.placement",
}

#: subpackages reachable as attributes (``psr_hf.engine.attach(model)`` after ``import psr_hf``), imported on use
_SUBPACKAGES = ("assets", "bench", "engine", "eval", "gates", "hf", "offload", "patches", "policy", "prefetch",
                "testing", "training")

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=["RoutingConfig", "__version__"],
                                             subpackages=_SUBPACKAGES)
