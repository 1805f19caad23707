"""How far a routing configuration moves a model from exact routing: excess NLL on text windows, with copies.

For each window the model scores every next token twice: unpatched (exact routing: bitwise the model's own
routers) and patched with the configuration, in one teacher-forced forward pass, in which every position goes
through the logical cache in order. The **excess NLL** is the mean over the window's predicted tokens of
``NLL(config) - NLL(exact)`` in nats. On text sampled from the exact model it estimates the KL divergence from
exact routing (the paper's *selfgen* diagnostic, Section 6.1); on held-out text it is the same quantity under the
text's distribution. Reported per configuration: the mean over windows with a 95% t-interval (windows are the
unit), the excess perplexity ``exp(excess) - 1``, and the routing statistics over the same tokens (logical copies
per token, demand and prefetch, replaced router slots, displaced router mass).

The library logs; ``psr-hf kl`` prints.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch
from .._progress import tqdm

from ..hf.patching import controller, patch, unpatch
from ..policy.config import RoutingConfig
from ..policy.policies import POLICY_TABLE
from .grid import cache_prior, exact_lru, psr, routing_name
from .stats import mean_interval

if TYPE_CHECKING:
    from ..offload.config import OffloadConfig
    from ..policy.calibration import Calibration
    from ..prefetch.predictor import Predictor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DivergenceRow:
    """One configuration's distance from exact routing over the same windows."""

    name: str
    routing: dict[str, Any]
    capacity: int
    windows: int
    tokens: int
    nll: float  # mean NLL per predicted token under this configuration (nats)
    excess_nll: float  # mean over windows of the per-token NLL difference to exact routing (nats)
    excess_nll_ci95: tuple[float, float]
    excess_ppl_pct: float  # 100 * (exp(excess_nll) - 1)
    copies_per_token: float
    demand_per_token: float
    prefetch_per_token: float
    replaced_per_token: float
    displaced_mass: float
    window_excess: list[float] = field(default_factory=list)  # per window, in the windows' order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __repr__(self) -> str:
        lo, hi = self.excess_nll_ci95
        return (f"DivergenceRow({self.name!r}, C={self.capacity}, excess_nll={self.excess_nll:.4f} "
                f"[{lo:.4f}, {hi:.4f}], copies/tok={self.copies_per_token:.2f}, windows={self.windows}, "
                f"tokens={self.tokens})")


def paired_difference(a: DivergenceRow, b: DivergenceRow) -> tuple[float, tuple[float, float]]:
    """Mean over windows of ``a``'s excess NLL minus ``b``'s, with a 95% t-interval paired by window (both rows
    from one :func:`divergence` call, so over the same windows): negative means ``a`` is closer to exact."""
    if len(a.window_excess) != len(b.window_excess) or not a.window_excess:
        raise ValueError(f"{a.name} and {b.name} were not scored on the same windows (one divergence() call)")
    diff = np.asarray(a.window_excess) - np.asarray(b.window_excess)
    return float(diff.mean()), _ci95(diff)


def token_nll(model: torch.nn.Module, ids: torch.Tensor, bar: tqdm | None = None) -> np.ndarray:
    """``[T - 1]`` NLL (nats, float64) of tokens 1.. of ``ids`` ``[1, T]`` given the ones before."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].double()  # [T-1, V]
    logp = torch.log_softmax(logits, dim=-1)
    if bar is not None:
        bar.update(1)
    return (-logp.gather(1, ids[0, 1:, None].to(logp.device))[:, 0]).cpu().numpy()


def excess_ppl_percent(excess_nll: float) -> float:
    """The excess perplexity ``100 * (exp(excess) - 1)`` of a mean excess NLL (nats per token); on selfgen text
    the paper's ``sg%``."""
    return 100.0 * math.expm1(excess_nll)


def _ci95(values: np.ndarray) -> tuple[float, float]:
    """The 95% t-interval of the mean over windows (:func:`~psr_hf.eval.stats.mean_interval`) as a pair."""
    interval = mean_interval(values)
    return (interval.low, interval.high)


def divergence(model: torch.nn.Module, windows: Sequence[torch.Tensor], configs: Mapping[str, RoutingConfig],
               calibration: Calibration | str | Path | None = None,
               offload: OffloadConfig | Mapping[str, object] | str | None = None, progress: bool = False,
               predictor: Predictor | None = None) -> list[DivergenceRow]:
    """Excess NLL over exact routing and routing statistics of each configuration on ``windows``.

    Args:
        model: an unpatched transformers MoE model of a supported family.
        windows: token ids ``[1, T]`` (or ``[T]``) each, T >= 2; one new sequence per window.
        configs: name -> :class:`RoutingConfig`; each is patched in turn (and unpatched after).
        calibration: passed to :func:`psr_hf.patch`.
        offload: passed to :func:`psr_hf.patch` (outputs do not depend on it).
        predictor: a :class:`psr_hf.prefetch.Predictor`, given to :func:`psr_hf.patch` for the configurations with
            ``prefetch="predictor"`` (SpecPrefetch's learned ranking as the pre-gate).
        progress: show a tqdm bar (stderr) over the forward passes (the exact one and each configuration's).
    Returns one :class:`DivergenceRow` per configuration, in ``configs`` order.
    """
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("divergence() needs the unpatched model (its own routers are the exact reference)")
    if not windows:
        raise ValueError("no windows to score")
    wanting = [name for name, config in configs.items() if config.prefetch == "predictor"]
    if wanting and predictor is None:
        raise ValueError(f"configurations {', '.join(wanting)} rank prefetches by a predictor (prefetch='predictor'); "
                         "pass predictor= (psr_hf.prefetch.Predictor.load(path))")
    device = next(model.parameters()).device
    ids = []
    for w in windows:
        w = torch.as_tensor(w)
        w = w[None] if w.ndim == 1 else w
        if w.ndim != 2 or w.shape[0] != 1 or w.shape[1] < 2:
            raise ValueError(f"each window must be token ids [1, T] with T >= 2, got shape {tuple(w.shape)}")
        ids.append(w.to(device))
    model.eval()
    bar = tqdm(total=(len(configs) + 1) * len(ids), unit="window", desc="excess NLL", disable=not progress)
    try:
        bar.set_postfix_str("exact")
        exact = [token_nll(model, w, bar) for w in ids]
        rows = []
        for name, config in configs.items():
            bar.set_postfix_str(name)
            patch(model, config, calibration=calibration, offload=offload,
                  predictor=predictor if config.prefetch == "predictor" else None)
            try:
                ctl = controller(model)
                nll = [token_nll(model, w, bar) for w in ids]
                stats = ctl.stats().total
                capacity = ctl.capacity
            finally:
                unpatch(model)
            rows.append(_row(name, config, capacity, nll, exact, stats))
    finally:
        bar.close()
    return rows


def _row(name: str, config: RoutingConfig, capacity: int, nll: list[np.ndarray], exact: list[np.ndarray],
         stats: Mapping[str, float]) -> DivergenceRow:
    """One configuration's row from its per-window NLLs and the exact ones (same windows, same order)."""
    excess = np.array([float((a - b).mean()) for a, b in zip(nll, exact)])
    mean_excess = float(excess.mean())
    logger.info("divergence %s: excess NLL %.4f nats/token, %.2f copies/token", name, mean_excess,
                stats["copies_per_token"])
    return DivergenceRow(
        name=name, routing=config.to_dict(), capacity=capacity, windows=len(nll), tokens=int(sum(a.size for a in nll)),
        nll=float(np.concatenate(nll).mean()), excess_nll=mean_excess, excess_nll_ci95=_ci95(excess),
        excess_ppl_pct=excess_ppl_percent(mean_excess), copies_per_token=stats["copies_per_token"],
        demand_per_token=stats["demand_per_token"], prefetch_per_token=stats["prefetch_per_token"],
        replaced_per_token=stats["replaced_per_token"], displaced_mass=stats["displaced_mass"],
        window_excess=excess.tolist(),
    )


def sweep_configs(residencies: Sequence[float] = (0.5, 0.25), lams: Sequence[float] = (0.1, 0.2, 0.3),
                  budget: int = 1, predictor: bool = False) -> dict[str, RoutingConfig]:
    """The issue's grid (:mod:`psr_hf.eval.grid`): exact+LRU, and cache_prior and psr (``budget``) for each lam, at
    each residency (named ``..._res{percent}``); with ``predictor`` also each psr row with ``prefetch="predictor"``
    (named ``psr_lam..._n..._pred_res...``)."""
    out: dict[str, RoutingConfig] = {}
    for r in residencies:
        entries = [exact_lru()]
        for lam in lams:
            entries += [cache_prior(lam), psr(lam, budget)]
            if predictor:
                entries.append(psr(lam, budget, predictor=True))
        for fields in entries:
            config = RoutingConfig(residency=r, **fields)
            out[f"{routing_name(config)}_res{100 * r:g}"] = config
    return out


def predictor_pairs(rows: Sequence[DivergenceRow]) -> list[dict[str, Any]]:
    """For every psr row with a predictor and its plain twin (the same routing with the pre-gate): the paired
    difference of excess NLL over windows (predictor minus pre-gate, with its 95% t-interval; negative: the learned
    ranking costs less quality) and the demand and total copies per token of both."""
    out = []
    for r in rows:
        if r.routing.get("prefetch") != "predictor":
            continue
        twin = next((t for t in rows if t.routing == {**r.routing, "prefetch": "pregate"}), None)
        if twin is None:
            continue
        diff = np.asarray(r.window_excess) - np.asarray(twin.window_excess)
        out.append({"predictor": r.name, "pregate": twin.name, "excess_nll_diff": float(diff.mean()),
                    "excess_nll_diff_ci95": list(_ci95(diff)), "demand_per_token": [r.demand_per_token,
                                                                                      twin.demand_per_token],
                    "copies_per_token": [r.copies_per_token, twin.copies_per_token]})
    return out


def format_rows(rows: Sequence[DivergenceRow]) -> str:
    """A text table of :func:`divergence` rows."""
    from .._text import text_table

    header = ["configuration", "C", "excess NLL [95% CI]", "excess ppl %", "copies/tok", "demand", "prefetch",
              "replaced", "displaced mass"]
    body = [[r.name, str(r.capacity), f"{r.excess_nll:.4f} [{r.excess_nll_ci95[0]:.4f}, {r.excess_nll_ci95[1]:.4f}]",
             f"{r.excess_ppl_pct:.2f}", f"{r.copies_per_token:.2f}", f"{r.demand_per_token:.2f}",
             f"{r.prefetch_per_token:.2f}", f"{r.replaced_per_token:.2f}", f"{r.displaced_mass:.4f}"] for r in rows]
    return text_table(body, header)


_MARKERS = ("o", "s", "^", "D", "v", "P")


def _follows_router(routing: Mapping[str, Any]) -> bool:
    """Whether a row's routing (``RoutingConfig.to_dict()``) is exact: its lam, if any, steers nothing."""
    entry = POLICY_TABLE.get(routing.get("policy"))
    return entry is not None and entry.follows_router


def plot_divergence(rows: Sequence[DivergenceRow | Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Write a PNG to ``path`` (returned): excess NLL over exact routing against copies per token, one panel per
    residency, one colour and line per policy (its points ordered by copies, labelled by lam), bars: the 95%
    interval over windows where there is one. ``rows``: :func:`divergence` rows or their ``to_dict()`` form
    (a ``psr-hf kl --json`` record's ``rows``). matplotlib is imported here, so scoring runs without it."""
    points = [r.to_dict() if isinstance(r, DivergenceRow) else dict(r) for r in rows]
    if not points:
        raise ValueError("no divergence rows to plot: give the rows of divergence() (or of a psr-hf kl --json record)")
    for p in points:
        missing = [k for k in ("routing", "excess_nll", "copies_per_token") if k not in p]
        if missing or "policy" not in p["routing"] or "residency" not in p["routing"]:
            raise ValueError(f"row {p.get('name', '?')!r} is not a divergence row: it needs excess_nll, "
                             f"copies_per_token and routing (policy, residency)")
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure state (PNG: Agg)
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'psr_hf[eval]' (or matplotlib)") from None
    residencies = sorted({float(p["routing"]["residency"]) for p in points}, reverse=True)
    policies = list(dict.fromkeys(p["routing"]["policy"] for p in points))
    colours = {policy: f"C{i % 10}" for i, policy in enumerate(policies)}
    fig = Figure(figsize=(5.2 * len(residencies) + 0.6, 4.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(residencies), sharey=True, squeeze=False)[0])
    for ax, residency in zip(axes, residencies):
        for index, policy in enumerate(policies):
            mine = sorted((p for p in points if p["routing"]["policy"] == policy
                           and float(p["routing"]["residency"]) == residency), key=lambda p: p["copies_per_token"])
            if not mine:
                continue
            x = np.array([p["copies_per_token"] for p in mine], dtype=float)
            y = np.array([p["excess_nll"] for p in mine], dtype=float)
            ci = [p.get("excess_nll_ci95") for p in mine]
            err = None
            if all(c is not None and all(map(math.isfinite, c)) for c in ci):
                err = np.array([[yi - c[0] for yi, c in zip(y, ci)], [c[1] - yi for yi, c in zip(y, ci)]])
            ax.errorbar(x, y, yerr=err, color=colours[policy], marker=_MARKERS[index % len(_MARKERS)],
                        capsize=3, linewidth=1, label=policy)
            for p, xi, yi in zip(mine, x, y):
                lam = p["routing"].get("lam")
                if lam is not None and not _follows_router(p["routing"]):
                    ax.annotate(f"lam {lam:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(f"{residency:.0%} of experts resident")
        ax.set_xlabel("expert copies per token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("excess NLL over exact routing (nats/token)")
    fig.suptitle(title or "excess NLL vs copies per token (bars: 95% interval over windows)")
    path = Path(path)
    fig.savefig(path, dpi=110, format="png")
    return path
