"""The routing policy: numpy + numba only (never torch).

- :data:`POLICY_TABLE`: what each policy is (one :class:`Policy` entry per policy; :mod:`.policies`).
- :class:`RoutingConfig`: which policy, cache size and parameters.
- :class:`Calibration`: bonus scale, warm set and token prior from held-out text.
- :class:`LogicalCache`: per-(row, layer) state and the compiled step (ALGORITHM.md parts 1 and 2).
- :func:`replay`: the policy over a recorded trace.
- :data:`MASS_SOFTMAX`, :data:`MASS_SIGMOID_BIAS`: how a family's router weighs an expert (``router_mass``).
- :mod:`psr_hf.policy.reference`: the slow pure-Python reference the kernels are tested against.

Names load on first use, so ``import psr_hf`` (which reaches RoutingConfig through here) stays free of numpy
and numba until a policy is actually run.
"""

from __future__ import annotations

from .._lazy import lazy_exports

from .config import DEFAULT_WINDOW, DELTA_MODES, EVICTIONS, POLICIES, RoutingConfig
from .policies import POLICY_TABLE, Policy

_LAZY = {
    "Calibration": ".calibration",
    "CalibrationBuilder": ".calibration",
    "CacheStats": ".cache",
    "LogicalCache": ".cache",
    "PlanLayout": ".cache",
    "StepPlan": ".cache",
    "ReplayResult": ".replaying",
    "replay": ".replaying",
    "Recording": ".replaying",
    # how a family's router weighs an expert (an ArchitecturePatch's router_mass), for the displaced mass
    "MASS_SOFTMAX": "._mass",
    "MASS_SIGMOID_BIAS": "._mass",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=["RoutingConfig", "POLICIES", "POLICY_TABLE", "Policy", "EVICTIONS",
                                                                   "DELTA_MODES", "DEFAULT_WINDOW"])
