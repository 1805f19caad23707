"""The routing policy: numpy + numba only (never torch).

- :class:`RoutingConfig`: which policy, cache size and parameters.
- :class:`Calibration`: bonus scale, warm set and token prior from held-out text.
- :class:`LogicalCache`: per-(row, layer) state and the compiled step (ALGORITHM.md parts 1 and 2).
- :func:`replay`: the policy over a recorded trace.
- :mod:`psr_hf.policy.reference`: the slow pure-Python reference the kernels are tested against.
"""

from .calibration import Calibration, CalibrationBuilder
from .cache import CacheStats, LogicalCache, StepPlan
from .config import DEFAULT_WINDOW, DELTA_MODES, EVICTIONS, POLICIES, RoutingConfig
from .replay import ReplayResult, replay

__all__ = [
    "Calibration",
    "CalibrationBuilder",
    "CacheStats",
    "LogicalCache",
    "StepPlan",
    "RoutingConfig",
    "POLICIES",
    "EVICTIONS",
    "DELTA_MODES",
    "DEFAULT_WINDOW",
    "ReplayResult",
    "replay",
]
