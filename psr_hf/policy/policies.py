"""What a routing policy is: one :class:`Policy` entry per policy in :data:`POLICY_TABLE`.

Every place that behaves differently per policy reads its entry here instead of testing the policy's name:
:class:`~psr_hf.policy.RoutingConfig` takes its defaults and validation rules from it, and
:class:`~psr_hf.policy.LogicalCache` hands the entry's code and behaviour flags to the kernels, which branch on
the flags (part 1 on or off, biased or pre-gate selection), never on a name. A policy that combines behaviours
the kernels already have is therefore one new entry here (plus its independent check in ``reference.py``).

numpy-free and torch-free on purpose, like ``config.py``, which imports it at interpreter start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# When part 1 (pre-gate insertion, ALGORITHM.md step 2) runs
PART1_NEVER = "never"
PART1_WITH_BUDGET = "budget > 0"  # only when the configured budget is positive (budget 0 = a budget sweep's origin)
PART1_ALWAYS = "always"
PART1_MODES = (PART1_NEVER, PART1_WITH_BUDGET, PART1_ALWAYS)

# The optional RoutingConfig parameters a policy may read; a parameter it does not read must stay at its neutral
# value (lam 0, budget 0, window unset, top_j 0, delta_mode 'fixed'), so that no setting silently does nothing.
OPTIONS = ("lam", "budget", "window", "top_j", "delta_mode")

# The RoutingConfig fields whose unset value (None) takes the policy's default
DEFAULTED_FIELDS = ("lam", "budget", "eviction")


@dataclass(frozen=True)
class PaperName:
    """How the paper names a policy: ``label`` starts its curves' names in the figures and tables (``Cache-Prior``,
    ``PSR n=1``) and ``stem`` its configurations' names in the routing grid (``cp_lam0.2``, ``psr_lam0.3_n1``)."""

    label: str
    stem: str


@dataclass(frozen=True)
class Policy:
    """One routing policy (a row of ALGORITHM.md's "Policies" table).

    Attributes:
        name: the ``RoutingConfig.policy`` value.
        code: the policy's code in the kernels' config array (distinct per policy).
        description: one line for tables and help texts.
        lam, budget, eviction: defaults of the fields left unset (``budget=None``: K, see ``top_k_window``).
        part1: when part 1 inserts the pre-gate's predicted experts: :data:`PART1_NEVER`,
            :data:`PART1_WITH_BUDGET` or :data:`PART1_ALWAYS`.
        top_k_window: part 1 runs with budget = window = K (an explicit budget or window must equal K).
        biased: selection is the biased top-K of ``z + lam * d * m`` (ALGORITHM.md step 4).
        executes_pregate: selection at layers >= 1 is the pre-gate's top-K (speculative execution).
        options: which of :data:`OPTIONS` the policy reads.
        paper: how the paper's figures, tables and routing grid name it; None for a policy the paper does not
            have (the frontier labels it by its name, the grid has no name for it).
    """

    name: str
    code: int
    description: str
    lam: float
    budget: int | None
    eviction: str
    part1: str
    biased: bool = False
    executes_pregate: bool = False
    top_k_window: bool = False
    options: frozenset[str] = frozenset()
    paper: PaperName | None = None

    def __post_init__(self) -> None:
        # the table is code: a contradictory entry fails at import, naming the entry and the rule it breaks
        def require(ok: bool, rule: str) -> None:
            if not ok:
                raise ValueError(f"policy table entry {self.name!r}: {rule}")

        require(self.part1 in PART1_MODES, f"part1={self.part1!r}; allowed: {', '.join(PART1_MODES)}")
        require(set(self.options) <= set(OPTIONS), f"options {sorted(self.options)}; allowed: {', '.join(OPTIONS)}")
        require(not (self.biased and self.executes_pregate), "selection is either biased or the pre-gate's top-K")
        require(("lam" in self.options) == self.biased, "lam is an option exactly of biased policies")
        can_insert = self.part1 != PART1_NEVER
        require(("budget" in self.options) == can_insert, "budget is an option exactly when part 1 can run")
        require(("window" in self.options) == can_insert, "window is an option exactly when part 1 can run")
        require(self.top_k_window == (self.budget is None), "budget default None (= K) exactly with top_k_window")
        require(not self.top_k_window or self.part1 == PART1_ALWAYS, "top_k_window needs part1='always'")
        require("lam" in self.options or self.lam == 0.0, "an unused lam defaults to 0")
        require("budget" in self.options or self.budget == 0, "an unused budget defaults to 0")

    @property
    def defaults(self) -> dict[str, object]:
        """The values of :data:`DEFAULTED_FIELDS` for this policy."""
        return {name: getattr(self, name) for name in DEFAULTED_FIELDS}

    @property
    def follows_router(self) -> bool:
        """Whether selection is the router's own top-K (exact routing: outputs are the unpatched model's)."""
        return not (self.biased or self.executes_pregate)

    @property
    def takes_gate(self) -> bool:
        """Whether a margin head (a learned bonus per token) can set this policy's bonus: biased policies."""
        return self.biased

    @property
    def can_prefetch(self) -> bool:
        """Whether part 1 can insert the pre-gate's candidates at all (with some budget): what separates PSR from
        Cache-Prior among the biased policies."""
        return self.part1 != PART1_NEVER

    @property
    def reads_pregate(self) -> bool:
        """Whether the policy can read the pre-gate at all (part 1, or pre-gate selection)."""
        return self.part1 != PART1_NEVER or self.executes_pregate

    def inserts(self, budget: int | None) -> bool:
        """Whether part 1 runs with this ``budget``."""
        return self.part1 == PART1_ALWAYS or (self.part1 == PART1_WITH_BUDGET and budget is not None and budget > 0)


# The paper's operating points (Sections 6.1 and 6.6, Appendix B); spec's budget and window are fixed to K by
# ALGORITHM.md. Codes are the kernels' policy ids (any distinct ints).
_ENTRIES = (
    Policy(
        name="exact", code=0, description="the router's own top-K; budget > 0 adds logical prefetch",
        lam=0.0, budget=0, eviction="lru", part1=PART1_WITH_BUDGET, options=frozenset({"budget", "window"}),
        paper=PaperName(label="exact", stem="exact"),
    ),
    Policy(
        name="cache_prior", code=1, description="biased top-K favouring resident experts; never inserts",
        lam=0.2, budget=0, eviction="lru", part1=PART1_NEVER, biased=True,
        options=frozenset({"lam", "top_j", "delta_mode"}), paper=PaperName(label="Cache-Prior", stem="cp"),
    ),
    Policy(
        name="psr", code=2, description="biased top-K plus pre-gate prefetch insertion within the budget",
        lam=0.2, budget=1, eviction="score", part1=PART1_WITH_BUDGET, biased=True,
        options=frozenset({"lam", "budget", "window", "top_j", "delta_mode"}),
        paper=PaperName(label="PSR", stem="psr"),
    ),
    Policy(
        name="spec", code=3, description="executes the pre-gate's top-K; budget = window = K",
        lam=0.0, budget=None, eviction="score", part1=PART1_ALWAYS, executes_pregate=True, top_k_window=True,
        options=frozenset({"budget", "window"}), paper=PaperName(label="spec", stem="spec"),
    ),
)


def _table(entries: Iterable[Policy]) -> dict[str, Policy]:
    table: dict[str, Policy] = {}
    codes: set[int] = set()
    labels: set[str] = set()
    stems: set[str] = set()
    for entry in entries:
        if entry.name in table or entry.code in codes:
            raise ValueError(f"policy table entry {entry.name!r}: name or code {entry.code} is taken")
        if entry.paper is not None:
            # a label or a stem names one policy: the grid reads its names back
            if entry.paper.label in labels or entry.paper.stem in stems:
                raise ValueError(f"policy table entry {entry.name!r}: paper label {entry.paper.label!r} or stem "
                                 f"{entry.paper.stem!r} is taken")
            labels.add(entry.paper.label)
            stems.add(entry.paper.stem)
        table[entry.name] = entry
        codes.add(entry.code)
    return table


POLICY_TABLE: dict[str, Policy] = _table(_ENTRIES)
"""Every policy by name, in the order of ALGORITHM.md."""


def users_of(option: str) -> tuple[str, ...]:
    """Names of the policies that read ``option`` (one of :data:`OPTIONS`), in table order."""
    return tuple(name for name, entry in POLICY_TABLE.items() if option in entry.options)


def describe() -> str:
    """The table as reStructuredText (for docstrings and help texts)."""
    rows = [
        (p.name, f"{p.lam:g}", "K" if p.budget is None else str(p.budget), p.eviction, p.description)
        for p in POLICY_TABLE.values()
    ]
    header = ("policy", "lam", "budget", "eviction", "what it does")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, fmt(header), rule, *(fmt(r) for r in rows), rule])
