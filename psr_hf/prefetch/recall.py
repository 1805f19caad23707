"""ExpertRecall@M of next-layer expert predictors (docs/prefetch.md; the SpecPrefetch paper, Section 4
"Evaluation Metrics", Tables 1-3): the share of the next MoE layer's native top-K that a method's top-M
candidates hold, for every method the paper compares.

:func:`expert_recall` scores one method on recorded router inputs; :func:`recall_table` trains the learned methods
(:mod:`psr_hf.prefetch.train`) and scores them beside the untrained ones (:class:`PreGate`, :class:`PreviousToken`)
on the same held-out tokens; :func:`format_recall_table` writes the record as the paper's table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._text import text_table
from .train import (PairMLP, SingleMLP, fit, model_facts, moe_routers, record_router_inputs_with_positions,
                    router_targets, train_predictor)

logger = logging.getLogger(__name__)


class PreGate:
    """FATE's pre-gate: the next layer's router on the current router input, ``scores(router[l + 1], W[l + 1] x[l])``
    (the family's selection scores). No trainable parameters."""

    num_parameters = 0

    def __init__(self, model: nn.Module):
        self.family, self.layers = moe_routers(model)

    def logits(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        router = self.layers[pair + 1].router
        with torch.no_grad():
            return self.family.selection_scores(router, F.linear(x.float(), router.weight.detach().float()))


class PreviousToken:
    """Naive prefetch: the previous token's native layer-``l + 1`` selection scores (the experts it activated rank
    first). Needs the window positions; a window's first token has no candidates. No trainable parameters."""

    num_parameters = 0

    def __init__(self, model: nn.Module):
        self.family, self.layers = moe_routers(model)

    def scores(self, pair: int, router_inputs: Sequence[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        z = native_scores(self.family, self.layers, router_inputs, pair + 1)
        previous = torch.roll(z, 1, dims=0)  # row i - 1: the previous token of the same window when position > 0
        previous[positions == 0] = 0.0  # no previous token (these rows are never evaluated)
        return previous


def native_scores(family: Any, layers: Sequence[Any], router_inputs: Sequence[torch.Tensor],
                  layer: int) -> torch.Tensor:
    """``[N, E]`` the selection scores of MoE layer ``layer``'s router on its own recorded inputs."""
    router = layers[layer].router
    with torch.no_grad():
        return family.selection_scores(router, F.linear(router_inputs[layer].float(), router.weight.detach().float()))


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(scores, k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)


def check_budgets(budgets: Sequence[int], num_experts: int) -> list[int]:
    out = [int(m) for m in budgets]
    bad = [m for m in out if not 1 <= m <= num_experts]
    if not out or bad:
        raise ValueError(f"candidate budgets {out}: each M must be between 1 and the number of experts "
                         f"({num_experts}); e.g. K//2, K, K+2")
    return out


def default_budgets(top_k: int, num_experts: int) -> list[int]:
    """The paper's ``{K/2, K, K + 2}`` (limited, native, expanded), capped at the number of experts."""
    return sorted({max(1, top_k // 2), top_k, min(num_experts, top_k + 2)})


@torch.no_grad()
def expert_recall(model: nn.Module, router_inputs: Sequence[torch.Tensor], method: Any, budgets: Sequence[int], *,
                  positions: torch.Tensor | None = None, top_k: int | None = None) -> dict[str, Any]:
    """ExpertRecall@M of ``method`` for every ``M`` in ``budgets`` on recorded router inputs
    (:func:`psr_hf.prefetch.train.record_router_inputs`).

    ``method``: anything with ``logits(pair, x)`` (a :class:`~psr_hf.prefetch.predictor.Predictor`, a trained
    module, :class:`PreGate`) ranking layer ``pair + 1``'s experts from ``x[pair]``, or with
    ``scores(pair, router_inputs, positions)`` (:class:`PreviousToken`). ``positions`` ``[N]``: each token's
    position in its window; tokens at position 0 are not evaluated, for every method, because the previous-token
    method has no candidates there and all methods are scored on the same tokens (None: all tokens are, and a
    method that needs positions raises). ``top_k``: K (default: the model's).

    For each adjacent MoE-layer pair ``l`` (``0 .. L - 2``) and each evaluated token, ``T`` is the native top-``K``
    of layer ``l + 1`` (``topk`` of the family's selection scores -- softmax routers: the logits; DeepSeek-V3:
    sigmoid plus bias under the group mask -- of router ``l + 1`` on its own input ``x[l + 1]``) and ``C_M`` the
    top-``M`` candidates of the method, which saw only ``x[l]`` (batch-1 decoding: the token's own priorities).
    ``ExpertRecall@M = mean over tokens of |T & C_M| / K``, per pair and averaged over pairs.

    Returns ``{"recall": {M: mean over pairs}, "per_pair": {M: [recall of pair l]}, "tokens": evaluated tokens}``
    with recalls as fractions in [0, 1]."""
    family, layers = moe_routers(model)
    K = int(top_k or model_facts(model)["top_k"])
    E = layers[0].router.weight.shape[0]
    budgets = check_budgets(budgets, E)
    if len(router_inputs) != len(layers):
        raise ValueError(f"{len(router_inputs)} recorded router inputs for a model with {len(layers)} MoE layers")
    n = router_inputs[0].shape[0]
    if positions is None:
        if hasattr(method, "scores"):
            raise ValueError(f"{type(method).__name__} needs each token's position in its window; pass positions")
        keep = torch.ones(n, dtype=torch.bool)
    else:
        if positions.shape != (n,):
            raise ValueError(f"positions has shape {tuple(positions.shape)}; expected ({n},), one per token")
        keep = positions > 0
    if not keep.any():
        raise ValueError("no token to evaluate (every window has a single token); give longer windows")
    per_pair: dict[int, list[float]] = {m: [] for m in budgets}
    for pair in range(len(layers) - 1):
        native = _topk_mask(native_scores(family, layers, router_inputs, pair + 1), K)[keep]
        if hasattr(method, "scores"):
            scores = method.scores(pair, router_inputs, positions)
        else:
            scores = method.logits(pair, router_inputs[pair])
        scores = scores.float()[keep]
        for m in budgets:
            hits = (native & _topk_mask(scores, m)).sum(dim=-1).float() / K
            per_pair[m].append(float(hits.mean()))
    return {"recall": {m: sum(v) / len(v) for m, v in per_pair.items()}, "per_pair": per_pair,
            "tokens": int(keep.sum())}


def _json_recall(result: dict[str, Any]) -> dict[str, Any]:
    return {"recall": {str(m): v for m, v in result["recall"].items()},
            "per_pair": {str(m): v for m, v in result["per_pair"].items()}}


def recall_table(model: nn.Module, train_windows: Any, heldout_windows: Any, *, rank: int,
                 budgets: Sequence[int] | None = None, predictor: Any = None, epochs: int = 1, lr: float = 1e-4,
                 batch_size: int = 256, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 single_hidden: int | None = None, pair_hidden: int | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """The paper's Tables 1-3 for ``model``: ExpertRecall@M at matched budgets (default ``{K/2, K, K + 2}``) and
    trainable parameters of every method, on the held-out token windows.

    The learned methods train on ``train_windows`` with the same supervision and settings (:func:`fit`):
    SpecPrefetch at ``rank`` (or ``predictor``, a trained :class:`Predictor` or its path, checked against the
    model), the single MLP (``single_hidden``; default: SpecPrefetch's parameter count) and the ProMoE-style MLP
    per pair (``pair_hidden``; default: the hidden size). ``train_windows`` is needed even with a ``predictor``:
    the MLP baselines always train on it.

    Returns a JSON-ready record: ``model`` facts, ``budgets``, token counts, ``methods`` (name, parameters,
    ``recall`` / ``per_pair`` keyed by ``str(M)``, training facts) and ``chance`` (``M / E``, random ranking)."""
    from .predictor import Predictor

    facts = model_facts(model)
    L, E, D, K = facts["num_layers"], facts["num_experts"], facts["hidden_size"], facts["top_k"]
    budgets = check_budgets(budgets if budgets is not None else default_budgets(K, E), E)
    settings = {"epochs": epochs, "lr": lr, "batch_size": batch_size, "dtype": dtype, "seed": seed,
                "progress": progress}
    started = time.perf_counter()
    train_inputs, _ = record_router_inputs_with_positions(model, train_windows, progress=progress)
    held_inputs, positions = record_router_inputs_with_positions(model, heldout_windows, progress=progress)
    weights = router_targets(model, train_inputs)

    if predictor is not None:
        spec = Predictor.coerce(predictor)
        spec.check(num_layers=L, num_experts=E, hidden_size=D, model_type=facts["model_type"], top_k=K)
        spec_training = {k: v for k, v in spec.metadata.items()}
        spec_name = f"SpecPrefetch (rank {spec.rank}, loaded)"
    else:
        spec = train_predictor(model, rank=rank, router_inputs=train_inputs, epochs=epochs, lr=lr,
                               batch_size=batch_size, dtype=dtype, seed=seed, progress=progress)
        spec_training = dict(spec.metadata)
        spec_name = f"SpecPrefetch (rank {rank})"
    rank = spec.rank
    single = SingleMLP(L, D, E, single_hidden or SingleMLP.matched_hidden(L, D, E, rank), seed=seed)
    single_training = fit(single, weights, train_inputs, desc="single MLP", **settings)
    per_pair = PairMLP(L, D, E, pair_hidden or D, seed=seed)
    pair_training = fit(per_pair, weights, train_inputs, desc="ProMoE-style MLP", **settings)

    methods = [("pre-gate (FATE)", PreGate(model), 0, None),
               ("naive (previous token)", PreviousToken(model), 0, None),
               (f"single MLP (h={single.fc1.out_features})", single, single.num_parameters, single_training),
               (f"ProMoE-style MLP (h={per_pair.nets[0][0].out_features})", per_pair, per_pair.num_parameters,
                pair_training),
               (spec_name, spec, spec.num_parameters, spec_training)]
    rows = []
    for name, method, params, training in methods:
        result = expert_recall(model, held_inputs, method, budgets, positions=positions, top_k=K)
        rows.append({"name": name, "parameters": int(params), **_json_recall(result),
                     **({"training": _plain(training)} if training is not None else {})})
        evaluated = result["tokens"]
    return {"metric": "ExpertRecall@M", "model": facts, "budgets": budgets, "rank": rank,
            "train_tokens": int(train_inputs[0].shape[0]), "heldout_tokens": int(held_inputs[0].shape[0]),
            "evaluated_tokens": evaluated, "methods": rows, "predictor_loaded": predictor is not None, "chance": {str(m): m / E for m in budgets},
            "evaluation": "per token |native top-K of layer l+1 & top-M candidates| / K, mean over tokens (the "
                          "first token of each window left out for every method) and over pairs",
            "seconds": time.perf_counter() - started}


def _plain(facts: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in facts.items():
        out[k] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def _millions(n: int) -> str:
    return "0" if n == 0 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def format_recall_table(record: dict[str, Any]) -> str:
    """The record of :func:`recall_table` as a text table like the paper's Tables 1-3: one row per method,
    ExpertRecall@M in percent per budget (a dagger marks M < K, whose maximum is M/K) and the parameters."""
    K = int(record["model"]["top_k"])
    budgets = [int(m) for m in record["budgets"]]
    header = ["method"] + [f"R@{m}{'†' if m < K else ''}" for m in budgets] + ["parameters"]
    rows = [[row["name"]] + [f"{100 * row['recall'][str(m)]:.2f}" for m in budgets] + [_millions(row["parameters"])]
            for row in record["methods"]]
    rows.append(["chance (random ranking)"] + [f"{100 * record['chance'][str(m)]:.2f}" for m in budgets] + ["0"])
    notes = [f"R@M: ExpertRecall@M in % over {record['evaluated_tokens']} held-out tokens x "
             f"{record['model']['num_layers'] - 1} layer pairs (K={K}, E={record['model']['num_experts']}); "
             f"learned methods trained on {record['train_tokens']} tokens"
             + (f" (the loaded predictor on {record['methods'][-1].get('training', {}).get('tokens', '?')})."
                if record.get("predictor_loaded") else ".")]
    if any(m < K for m in budgets):
        notes.append("†: M < K, maximum M/K.")
    return text_table(rows, header) + "\n" + "\n".join(notes)
