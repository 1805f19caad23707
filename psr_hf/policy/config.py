"""RoutingConfig: which policy runs, with which cache size and parameters.

numpy-free and torch-free on purpose: it is imported by `psr_hf` at interpreter start (lm-eval registration)
and by the policy kernels.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

POLICIES = ("exact", "cache_prior", "psr", "spec")
EVICTIONS = ("score", "lru")
DELTA_MODES = ("fixed", "running")

# The paper's operating points (Sections 6.1 and 6.6, Appendix B). `None` for window means "the architecture's
# default" (8 where there is none); spec's budget and window are fixed to K by ALGORITHM.md.
_POLICY_DEFAULTS: dict[str, dict[str, Any]] = {
    "exact": {"lam": 0.0, "budget": 0, "eviction": "lru"},
    "cache_prior": {"lam": 0.2, "budget": 0, "eviction": "lru"},
    "psr": {"lam": 0.2, "budget": 1, "eviction": "score"},
    "spec": {"lam": 0.0, "budget": None, "eviction": "score"},
}

DEFAULT_WINDOW = 8


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RoutingConfig:
    """How one model routes: policy, logical cache size and the policy's parameters.

    Give exactly one of ``capacity`` (expert slots per MoE layer) and ``residency`` (fraction of the layer's
    experts; the capacity is ``round(residency * E)``). Fields left at ``None`` take the policy's default:

    ============  =====  ======  ========  ==========================================
    policy        lam    budget  eviction  notes
    ============  =====  ======  ========  ==========================================
    exact         0      0       lru       the model's own top-K; budget > 0 adds logical prefetch
    cache_prior   0.2    0       lru       no insertion (budget must be 0)
    psr           0.2    1       score     window None = the architecture's default (8 if none)
    spec          0      K       score     executes the pre-gate's top-K; budget = window = K (explicit
                                           values must equal K)
    ============  =====  ======  ========  ==========================================

    Invalid values or combinations raise ``ValueError`` naming the field and what is allowed.
    """

    policy: str = "psr"
    capacity: int | None = None
    residency: float | None = None
    lam: float | None = None
    budget: int | None = None
    window: int | None = None
    eviction: str | None = None
    top_j: int = 0
    delta_mode: str = "fixed"
    decay_fast: float = 0.5
    decay_slow: float = 0.98

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not supported; allowed: {', '.join(POLICIES)}")
        defaults = _POLICY_DEFAULTS[self.policy]
        for name in ("lam", "budget", "eviction"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[name])
        if _is_int(self.lam):
            object.__setattr__(self, "lam", float(self.lam))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        policy = self.policy
        if (self.capacity is None) == (self.residency is None):
            raise ValueError(
                "give exactly one of capacity= (expert slots per MoE layer, an int >= top_k) "
                "and residency= (fraction of each layer's experts in (0, 1])"
            )
        if self.capacity is not None and (not _is_int(self.capacity) or self.capacity < 1):
            raise ValueError(f"capacity={self.capacity!r} must be an int >= 1 (expert slots per MoE layer)")
        if self.residency is not None and (
            not _is_real(self.residency) or not (0.0 < float(self.residency) <= 1.0)
        ):
            raise ValueError(f"residency={self.residency!r} must be a number in (0, 1] (fraction of experts resident)")
        if not _is_real(self.lam) or not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam={self.lam!r} must be a finite number >= 0")
        if policy in ("exact", "spec") and self.lam != 0.0:
            raise ValueError(
                f"lam={self.lam} has no effect with policy={policy!r}; the routing bonus is used only by "
                "policy='cache_prior' or 'psr' (leave lam unset for this policy)"
            )
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction={self.eviction!r} is not supported; allowed: {', '.join(EVICTIONS)}")
        if policy == "spec":
            # spec's budget and window are K; an explicit value is checked against K once K is known
            if self.budget is not None and (not _is_int(self.budget) or self.budget < 1):
                raise ValueError(f"budget={self.budget!r}: policy='spec' uses budget = K (leave it unset)")
        else:
            if not _is_int(self.budget) or self.budget < 0:
                raise ValueError(f"budget={self.budget!r} must be an int >= 0 (prefetch insertions per layer and token)")
        if policy == "cache_prior" and self.budget != 0:
            raise ValueError(
                f"budget={self.budget} is not allowed with policy='cache_prior', which never inserts predicted "
                "experts; use policy='psr' for a prefetch budget, or budget=0"
            )
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise ValueError(f"window={self.window!r} must be an int >= 1 (pre-gate candidates) or None (architecture default)")
        if self.window is not None and policy == "cache_prior":
            raise ValueError(
                f"window={self.window} has no effect with policy='cache_prior', which never reads the pre-gate; "
                "only psr, spec and exact with budget > 0 use the window"
            )
        # (psr / exact with budget 0 keep their window: inert until a budget is set, as in a budget sweep)
        if not _is_int(self.top_j) or self.top_j < 0:
            raise ValueError(f"top_j={self.top_j!r} must be an int >= 0")
        if self.top_j > 0 and policy not in ("cache_prior", "psr"):
            raise ValueError(f"top_j={self.top_j} is used only by policy='cache_prior' or 'psr', not {policy!r}")
        if self.delta_mode not in DELTA_MODES:
            raise ValueError(f"delta_mode={self.delta_mode!r} is not supported; allowed: {', '.join(DELTA_MODES)}")
        if self.delta_mode != "fixed" and policy not in ("cache_prior", "psr"):
            raise ValueError(
                f"delta_mode={self.delta_mode!r} is used only by policy='cache_prior' or 'psr', not {policy!r}"
            )
        for name in ("decay_fast", "decay_slow"):
            value = getattr(self, name)
            if not _is_real(value) or not (0.0 <= float(value) < 1.0):
                raise ValueError(f"{name}={value!r} must be a number in [0, 1)")

    # ------------------------------------------------------------------ derived values
    @property
    def inserts(self) -> bool:
        """Whether part 1 (pre-gate insertion into the logical cache) runs."""
        # ALGORITHM.md: with budget 0 nothing is inserted and no candidate is protected, so psr with LRU,
        # budget 0 and top_j 0 is Cache-Prior decision for decision (the paper's unit-tested equivalence).
        if self.policy == "spec":
            return True
        if self.policy in ("psr", "exact"):
            return self.budget > 0
        return False

    @property
    def biased(self) -> bool:
        """Whether selection adds the routing bonus (cache_prior, psr)."""
        return self.policy in ("cache_prior", "psr")

    def capacity_for(self, num_experts: int, top_k: int) -> int:
        """Slots per layer for a layer of ``num_experts`` experts with top-``top_k`` routing (``top_k <= C <= E``)."""
        if self.capacity is not None:
            capacity = self.capacity
            source = f"capacity={capacity}"
        else:
            capacity = int(math.floor(self.residency * num_experts + 0.5))
            source = f"residency={self.residency} (round({self.residency} * {num_experts}) = {capacity} slots)"
        if capacity < top_k:
            raise ValueError(
                f"{source} is below the model's top-k ({top_k}): every token executes {top_k} experts per layer, "
                f"so the cache needs at least {top_k} slots (residency >= {top_k / num_experts:.4g})"
            )
        if capacity > num_experts:
            raise ValueError(f"{source} exceeds the number of experts per layer ({num_experts})")
        return capacity

    def window_for(self, top_k: int, default: int = DEFAULT_WINDOW) -> int:
        """Pre-gate candidates per step: K for spec, else ``window`` or the architecture's ``default``."""
        if self.policy == "spec":
            self._check_spec("window", self.window, top_k)
            return top_k
        return self.window if self.window is not None else default

    def budget_for(self, top_k: int) -> int:
        """Prefetch insertions allowed per step: K for spec, else ``budget``."""
        if self.policy == "spec":
            self._check_spec("budget", self.budget, top_k)
            return top_k
        return int(self.budget)

    @staticmethod
    def _check_spec(name: str, value: Any, top_k: int) -> None:
        if value is not None and value != top_k:
            raise ValueError(
                f"{name}={value} with policy='spec': speculative execution inserts the pre-gate's top-K with "
                f"budget = window = K = {top_k} (ALGORITHM.md); leave {name} unset or set it to {top_k}"
            )

    # ------------------------------------------------------------------ serialisation
    @classmethod
    def coerce(cls, config: Any) -> "RoutingConfig":
        """``config`` as a RoutingConfig: a RoutingConfig as it is, a dict of its fields, or a path to its YAML."""
        if isinstance(config, RoutingConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)) and str(config).endswith((".yaml", ".yml")):
            return cls.load_yaml(config)
        raise ValueError(
            "config must be a psr_hf.RoutingConfig (e.g. RoutingConfig(policy='psr', residency=0.5)), a dict of its "
            f"fields or a path to its YAML file; got {type(config).__name__}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (every field, resolved defaults included)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RoutingConfig":
        """Build from a mapping; unknown keys raise ``ValueError`` with the allowed names."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"unknown RoutingConfig field(s) {unknown}; allowed: {', '.join(allowed)}")
        data = dict(values)
        # A saved config carries the policy's resolved defaults; spec's budget/window are implied by K.
        return cls(**data)

    def save_yaml(self, path: str | Path) -> None:
        """Write the config as YAML (every field, so the file documents the run)."""
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load_yaml(cls, path: str | Path) -> "RoutingConfig":
        """Read a YAML file written by :meth:`save_yaml` or by hand (a mapping of field names)."""
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a YAML mapping of RoutingConfig fields, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "RoutingConfig":
        """A copy with ``changes`` applied; policy defaults are re-resolved when the policy changes."""
        data = self.to_dict()
        if "policy" in changes and changes["policy"] != self.policy:
            for name in ("lam", "budget", "eviction"):
                data[name] = None
        if ("capacity" in changes) and changes["capacity"] is not None:
            data["residency"] = None
        if ("residency" in changes) and changes["residency"] is not None:
            data["capacity"] = None
        data.update(changes)
        return RoutingConfig(**data)
