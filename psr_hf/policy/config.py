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

from .policies import DEFAULTED_FIELDS, PART1_ALWAYS, POLICY_TABLE, Policy, describe, users_of

POLICIES = tuple(POLICY_TABLE)  # the policy names, from the table in policies.py
EVICTIONS = ("score", "lru")
DELTA_MODES = ("fixed", "running")
#: where the pre-gate ranking g comes from (ALGORITHM.md, "Prefetch ranking source"): the next layer's router on
#: this layer's router input, a learned predictor (psr_hf.prefetch.Predictor, given to patch(predictor=...)), or
#: the previous token's scores at the same layer (SpecPrefetch's Naive Prefetch baseline)
PREFETCH_SOURCES = ("pregate", "predictor", "previous")

# `None` for window means "the architecture's default" (8 where there is none)
DEFAULT_WINDOW = 8

# The largest value of a field that sizes a buffer (capacity, budget, window, top_j): no layer has more experts
# than this (a calibration stores expert ids as uint16), and each of these counts experts of one layer. Checked
# when the config is made; against the layer's own number of experts when the cache is built (capacity_for).
MAX_EXPERTS = 65536
YAML_SUFFIXES = (".yaml", ".yml")


def _listing(items: list[str], last: str) -> str:
    """``a, b <last> c`` for messages."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} " + items[-1]


def _policy_names(names: tuple[str, ...]) -> str:
    """``policy='a', 'b' or 'c'`` for messages."""
    return "policy=" + _listing([repr(name) for name in names], "or")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RoutingConfig:
    """How one model routes: policy, logical cache size and the policy's parameters.

    Give exactly one of ``capacity`` (expert slots per MoE layer) and ``residency`` (fraction of the layer's
    experts; the capacity is ``round(residency * E)``). Fields left at ``None`` take the policy's default from
    :data:`psr_hf.policy.policies.POLICY_TABLE` (``window=None``: the architecture's default, 8 if none); a
    parameter the policy does not read must be left at its neutral value:

    {policies}

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
    prefetch: str = "pregate"
    prefetch_distance: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICY_TABLE:
            import difflib

            close = difflib.get_close_matches(str(self.policy), POLICIES, n=1) if isinstance(self.policy, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else " (a policy name, as a string)"
            raise ValueError(f"policy={self.policy!r} is not supported; allowed: {', '.join(POLICIES)}{hint}")
        for name, default in self.definition.defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if _is_int(self.lam):
            object.__setattr__(self, "lam", float(self.lam))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        policy = self.policy
        entry = self.definition
        if (self.capacity is None) == (self.residency is None):
            raise ValueError(
                "give exactly one of capacity= (expert slots per MoE layer, an int >= top_k) "
                "and residency= (fraction of each layer's experts in (0, 1])"
            )
        if self.capacity is not None and (not _is_int(self.capacity) or not 1 <= self.capacity <= MAX_EXPERTS):
            raise ValueError(
                f"capacity={self.capacity!r} must be an int >= 1 and <= {MAX_EXPERTS} (expert slots per MoE "
                "layer, at most the layer's experts)"
            )
        if self.residency is not None and (
            not _is_real(self.residency) or not (0.0 < float(self.residency) <= 1.0)
        ):
            raise ValueError(f"residency={self.residency!r} must be a number in (0, 1] (fraction of experts resident)")
        if not _is_real(self.lam) or not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam={self.lam!r} must be a finite number >= 0")
        if "lam" not in entry.options and self.lam != 0.0:
            raise ValueError(
                f"lam={self.lam} has no effect with policy={policy!r}; the routing bonus is used only by "
                f"{_policy_names(users_of('lam'))} (leave lam unset for this policy)"
            )
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction={self.eviction!r} is not supported; allowed: {', '.join(EVICTIONS)}")
        if entry.top_k_window:
            # budget and window are K; an explicit value is checked against K once K is known
            if self.budget is not None and (not _is_int(self.budget) or self.budget < 1):
                raise ValueError(f"budget={self.budget!r}: policy={policy!r} uses budget = K (leave it unset)")
        else:
            if not _is_int(self.budget) or not 0 <= self.budget <= MAX_EXPERTS:
                raise ValueError(
                    f"budget={self.budget!r} must be an int >= 0 and <= {MAX_EXPERTS} (prefetch insertions per layer "
                    "and token, at most the layer's experts)"
                )
        if "budget" not in entry.options and self.budget != 0:
            # suggest the policies that select the same way but do insert (cache_prior -> psr)
            inserting = users_of("budget")
            alike = tuple(name for name in inserting if POLICY_TABLE[name].biased == entry.biased) or inserting
            raise ValueError(
                f"budget={self.budget} is not allowed with policy={policy!r}, which never inserts predicted "
                f"experts; use {_policy_names(alike)} for a prefetch budget, or budget=0"
            )
        if self.window is not None and (not _is_int(self.window) or not 1 <= self.window <= MAX_EXPERTS):
            raise ValueError(
                f"window={self.window!r} must be an int >= 1 and <= {MAX_EXPERTS} (pre-gate candidates, at most "
                "the layer's experts) or None (architecture default)"
            )
        if self.window is not None and "window" not in entry.options:
            readers = _listing([
                name + (" with budget > 0" if POLICY_TABLE[name].part1 != PART1_ALWAYS else "")
                for name in users_of("window")
            ], "and")
            raise ValueError(
                f"window={self.window} has no effect with policy={policy!r}, which never reads the pre-gate; "
                f"only {readers} use the window"
            )
        # (psr / exact with budget 0 keep their window: inert until a budget is set, as in a budget sweep)
        if not _is_int(self.top_j) or not 0 <= self.top_j <= MAX_EXPERTS:
            raise ValueError(
                f"top_j={self.top_j!r} must be an int >= 0 and <= {MAX_EXPERTS} (at most the layer's experts)"
            )
        if self.top_j > 0 and "top_j" not in entry.options:
            raise ValueError(f"top_j={self.top_j} is used only by {_policy_names(users_of('top_j'))}, not {policy!r}")
        if self.delta_mode not in DELTA_MODES:
            raise ValueError(f"delta_mode={self.delta_mode!r} is not supported; allowed: {', '.join(DELTA_MODES)}")
        if self.delta_mode != "fixed" and "delta_mode" not in entry.options:
            raise ValueError(
                f"delta_mode={self.delta_mode!r} is used only by {_policy_names(users_of('delta_mode'))}, "
                f"not {policy!r}"
            )
        for name in ("decay_fast", "decay_slow"):
            value = getattr(self, name)
            if not _is_real(value) or not (0.0 <= float(value) < 1.0):
                raise ValueError(f"{name}={value!r} must be a number in [0, 1)")
        if self.prefetch not in PREFETCH_SOURCES:
            raise ValueError(f"prefetch={self.prefetch!r} is not supported; allowed: {', '.join(PREFETCH_SOURCES)} "
                             "(where the pre-gate ranking comes from)")
        if self.prefetch != "pregate" and not self.needs_pregate:
            raise ValueError(
                f"prefetch={self.prefetch!r} replaces the pre-gate ranking, which policy={policy!r} with "
                f"budget={self.budget} never reads; give a prefetch budget (e.g. policy='exact', eviction='score', "
                "budget=2: SpecPrefetch's router-preserving prefetch) or use policy='psr' / 'spec'"
            )

        self._validate_distance()

    def _validate_distance(self) -> None:
        """``prefetch_distance`` D: the pre-gate of layer ``l`` is router ``l`` on the router input of layer
        ``l - D`` (docs/ALGORITHM.md, "Prefetch distance"); only the pre-gate ranks that far ahead, and only part 1
        reads it."""
        D = self.prefetch_distance
        if not _is_int(D) or D < 1:
            raise ValueError(f"prefetch_distance={D!r} must be an int >= 1 (MoE layers between the layer whose router "
                             "input ranks a prefetch and the layer it fills)")
        if D == 1:
            return
        if not self.inserts:
            raise ValueError(f"prefetch_distance={D} has no effect with policy={self.policy!r} and budget={self.budget}, "
                             "which insert no prefetches; give a prefetch budget (psr, or exact with budget > 0) or "
                             "leave prefetch_distance at 1")
        if self.executes_pregate:
            raise ValueError(f"prefetch_distance={D}: policy={self.policy!r} executes the pre-gate of the next layer, "
                             "so its distance is 1; leave prefetch_distance at 1")
        if self.prefetch != "pregate":
            raise ValueError(f"prefetch_distance={D} needs prefetch='pregate' (a later router on this layer's input); "
                             f"prefetch={self.prefetch!r} ranks the next layer only; leave prefetch_distance at 1")

    # ------------------------------------------------------------------ derived values
    @property
    def definition(self) -> Policy:
        """The policy's entry in :data:`~psr_hf.policy.policies.POLICY_TABLE` (what the policy does)."""
        return POLICY_TABLE[self.policy]

    @property
    def inserts(self) -> bool:
        """Whether part 1 (pre-gate insertion into the logical cache) runs."""
        # ALGORITHM.md: with budget 0 nothing is inserted and no candidate is protected, so psr with LRU,
        # budget 0 and top_j 0 is Cache-Prior decision for decision (the paper's unit-tested equivalence).
        return self.definition.inserts(self.budget)

    @property
    def biased(self) -> bool:
        """Whether selection adds the routing bonus (cache_prior, psr)."""
        return self.definition.biased

    @property
    def executes_pregate(self) -> bool:
        """Whether selection at layers >= 1 is the pre-gate's top-K (spec)."""
        return self.definition.executes_pregate

    @property
    def follows_router(self) -> bool:
        """Whether selection is the router's own top-K (exact routing, with or without logical prefetch)."""
        return self.definition.follows_router

    @property
    def takes_gate(self) -> bool:
        """Whether a margin head can set the bonus: a biased policy with a fixed bonus scale."""
        return self.definition.takes_gate and self.delta_mode == "fixed"

    @property
    def needs_pregate(self) -> bool:
        """Whether steps at layers >= 1 need the pre-gate scores (part 1 runs, or selection executes them)."""
        return self.inserts or self.executes_pregate

    def capacity_for(self, num_experts: int, top_k: int) -> int:
        """Slots per layer for a layer of ``num_experts`` experts with top-``top_k`` routing (``top_k <= C <= E``).
        Also checks the other fields that size a buffer against the layer (:meth:`check_experts`)."""
        self.check_experts(num_experts)
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

    def check_experts(self, num_experts: int) -> None:
        """Raise ``ValueError`` when ``budget`` or ``top_j`` exceeds ``num_experts``, the experts of one layer: no
        step inserts or protects more experts than the layer has, and both size the cache's buffers (the capacity is
        checked by :meth:`capacity_for`; a window above E ranks all E experts, as the kernels clamp it)."""
        for name in ("budget", "top_j"):
            value = getattr(self, name)
            if value is not None and value > num_experts:
                raise ValueError(
                    f"{name}={value} exceeds the model's {num_experts} experts per MoE layer: no step can use more "
                    f"experts than the layer has; set {name} to at most {num_experts}"
                )

    def window_for(self, top_k: int, default: int = DEFAULT_WINDOW) -> int:
        """Pre-gate candidates per step: K for spec, else ``window`` or the architecture's ``default``."""
        if self.definition.top_k_window:
            self._check_spec("window", self.window, top_k)
            return top_k
        return self.window if self.window is not None else default

    def budget_for(self, top_k: int) -> int:
        """Prefetch insertions allowed per step: K for spec, else ``budget``."""
        if self.definition.top_k_window:
            self._check_spec("budget", self.budget, top_k)
            return top_k
        return int(self.budget)

    def _check_spec(self, name: str, value: Any, top_k: int) -> None:
        if value is not None and value != top_k:
            raise ValueError(
                f"{name}={value} with policy={self.policy!r}: this policy inserts the pre-gate's top-K with "
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
        if isinstance(config, (str, Path)):
            if Path(config).suffix.lower() in YAML_SUFFIXES:
                return cls.load_yaml(config)
            raise ValueError(
                "config must be a psr_hf.RoutingConfig (e.g. RoutingConfig(policy='psr', residency=0.5)), a dict of "
                f"its fields or a path to its YAML file, whose name ends in {' or '.join(YAML_SUFFIXES)} (any case); "
                f"got {type(config).__name__} {str(config)!r}, which does not"
            )
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
        """Read a YAML file written by :meth:`save_yaml` or by hand (a mapping of field names, each at most once:
        a key given twice raises ``ValueError`` instead of the last one silently winning)."""
        import yaml

        try:
            data = yaml.load(Path(path).read_text(), Loader=_unique_key_loader())  # a SafeLoader subclass
        except _DuplicateKey as error:
            raise ValueError(f"{path}: {error}") from None
        except yaml.constructor.ConstructorError as error:  # a !!python/... tag: SafeLoader builds no objects
            raise ValueError(f"{path}: YAML tags that build objects are refused ({error.problem}); a routing config "
                             "is a plain mapping of field names to numbers and strings") from None
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML ({type(error).__name__}: {error})") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a YAML mapping of RoutingConfig fields, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "RoutingConfig":
        """A copy with ``changes`` applied; policy defaults are re-resolved when the policy changes."""
        data = self.to_dict()
        if "policy" in changes and changes["policy"] != self.policy:
            for name in DEFAULTED_FIELDS:
                data[name] = None
        if ("capacity" in changes) and changes["capacity"] is not None:
            data["residency"] = None
        if ("residency" in changes) and changes["residency"] is not None:
            data["capacity"] = None
        data.update(changes)
        return RoutingConfig(**data)


class _DuplicateKey(Exception):
    pass


_LOADER: Any = None


def _unique_key_loader() -> Any:
    """``yaml.SafeLoader`` that raises on a mapping key given twice (PyYAML keeps the last one silently)."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class UniqueKeySafeLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                seen: set = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # "<<: *base" merges: explicit keys override merged ones by design
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        duplicate = key in seen
                        seen.add(key)
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
                    if duplicate:
                        raise _DuplicateKey(
                            f"key {key!r} appears more than once (line {key_node.start_mark.line + 1}); give each "
                            "RoutingConfig field once"
                        )
                return super().construct_mapping(node, deep=deep)

        _LOADER = UniqueKeySafeLoader
    return _LOADER


# the policy table in the docstring, written from the table itself (None under python -OO)
if RoutingConfig.__doc__:
    RoutingConfig.__doc__ = RoutingConfig.__doc__.replace("{policies}", describe().replace("\n", "\n    "))
