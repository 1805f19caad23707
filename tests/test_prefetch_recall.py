"""ExpertRecall@M (psr_hf.prefetch.recall): the metric against hand computation, its bounds, the baselines and
the recall table."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from psr_hf.prefetch.recall import (PreGate, PreviousToken, default_budgets, expert_recall, format_recall_table,
                                    native_scores, recall_table)
from psr_hf.prefetch.train import model_facts, moe_routers, record_router_inputs_with_positions, train_predictor
from psr_hf.testing import tiny_model


@pytest.fixture(scope="module")
def models():
    return {"olmoe": tiny_model("olmoe"), "deepseek_v3": tiny_model("deepseek_v3")}


def _windows(count: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=gen) for _ in range(count)]


@pytest.fixture(scope="module")
def recorded(models):
    return {name: record_router_inputs_with_positions(model, _windows(3, 20, seed=5))
            for name, model in models.items()}


class Oracle:
    """The native selection scores of layer l + 1 on its own input: what an ideal predictor would rank."""

    def __init__(self, model):
        self.family, self.layers = moe_routers(model)

    def scores(self, pair, router_inputs, positions):
        return native_scores(self.family, self.layers, router_inputs, pair + 1)


def _top(scores: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(scores, k).indices.tolist())


def test_pre_gate_matches_a_hand_computation(models, recorded):
    model = models["olmoe"]
    xs, positions = recorded["olmoe"]
    _, layers = moe_routers(model)
    K = model.config.num_experts_per_tok
    budgets = [2, K, K + 3]
    result = expert_recall(model, xs, PreGate(model), budgets, positions=positions)
    for m in budgets:
        per_pair = []
        for pair in range(len(layers) - 1):
            w = layers[pair + 1].router.weight.float()
            hits = [len(_top(w @ xs[pair + 1][i], K) & _top(w @ xs[pair][i], m)) / K
                    for i in range(len(positions)) if positions[i] > 0]
            per_pair.append(sum(hits) / len(hits))
        assert result["per_pair"][m] == pytest.approx(per_pair, abs=1e-6)
        assert result["recall"][m] == pytest.approx(sum(per_pair) / len(per_pair), abs=1e-6)
    assert result["tokens"] == 3 * 19  # the first token of every window is left out


def test_previous_token_matches_a_hand_computation(models, recorded):
    model = models["olmoe"]
    xs, positions = recorded["olmoe"]
    _, layers = moe_routers(model)
    K = model.config.num_experts_per_tok
    result = expert_recall(model, xs, PreviousToken(model), [K], positions=positions)
    per_pair = []
    for pair in range(len(layers) - 1):
        w = layers[pair + 1].router.weight.float()
        hits = [len(_top(w @ xs[pair + 1][i], K) & _top(w @ xs[pair + 1][i - 1], K)) / K
                for i in range(len(positions)) if positions[i] > 0]
        per_pair.append(sum(hits) / len(hits))
    assert result["per_pair"][K] == pytest.approx(per_pair, abs=1e-6)
    with pytest.raises(ValueError, match="positions"):
        expert_recall(model, xs, PreviousToken(model), [K])


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_recall_bounds_and_monotonicity(family, models, recorded):
    model = models[family]
    xs, positions = recorded[family]
    facts = model_facts(model)
    K, E = facts["top_k"], facts["num_experts"]
    budgets = list(range(1, E + 1))
    for method in (PreGate(model), PreviousToken(model), Oracle(model)):
        recall = expert_recall(model, xs, method, budgets, positions=positions)["recall"]
        values = [recall[m] for m in budgets]
        assert all(a <= b + 1e-9 for a, b in zip(values, values[1:]))
        assert recall[E] == pytest.approx(1.0)
        assert all(recall[m] <= min(1.0, m / K) + 1e-9 for m in budgets)
    oracle = expert_recall(model, xs, Oracle(model), [K // 2, K], positions=positions)["recall"]
    assert oracle[K] == pytest.approx(1.0) and oracle[K // 2] == pytest.approx(0.5)
    # the previous token is a worse guess than the token itself: below the oracle at M = K
    naive = expert_recall(model, xs, PreviousToken(model), [K], positions=positions)["recall"][K]
    assert naive < 1.0


def test_budgets_are_checked(models, recorded):
    model = models["olmoe"]
    xs, positions = recorded["olmoe"]
    E = model_facts(model)["num_experts"]
    for bad in ([0], [E + 1], []):
        with pytest.raises(ValueError, match="between 1 and the number of experts"):
            expert_recall(model, xs, PreGate(model), bad, positions=positions)
    assert default_budgets(8, 64) == [4, 8, 10] and default_budgets(6, 7) == [3, 6, 7]


def test_recall_table_trains_every_method_and_formats(models):
    model = models["deepseek_v3"]
    facts = model_facts(model)
    L, D, E, K = facts["num_layers"], facts["hidden_size"], facts["num_experts"], facts["top_k"]
    record = recall_table(model, _windows(4, 32, seed=6), _windows(2, 16, seed=7), rank=4, lr=1e-2,
                          batch_size=32, dtype=torch.float32)
    record = json.loads(json.dumps(record))  # JSON-ready
    assert record["budgets"] == [K // 2, K, K + 2]
    assert record["train_tokens"] == 4 * 32 and record["heldout_tokens"] == 2 * 16
    assert record["evaluated_tokens"] == 2 * 15
    rows = {r["name"].split(" (")[0]: r for r in record["methods"]}
    assert set(rows) == {"pre-gate", "naive", "single MLP", "ProMoE-style MLP", "SpecPrefetch"}
    assert rows["SpecPrefetch"]["parameters"] == (L - 1) * 4 * (D + E)
    assert rows["pre-gate"]["parameters"] == rows["naive"]["parameters"] == 0
    assert rows["ProMoE-style MLP"]["parameters"] == (L - 1) * (D * D + D + D * E + E)
    for row in record["methods"]:
        values = [row["recall"][str(m)] for m in record["budgets"]]
        assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values)
        assert len(row["per_pair"][str(K)]) == L - 1
    text = format_recall_table(record)
    assert f"R@{K // 2}†" in text and f"R@{K + 2}" in text
    assert f"{100 * rows['pre-gate']['recall'][str(K)]:.2f}" in text


def test_recall_table_checks_a_given_predictor(models):
    other = train_predictor(models["olmoe"], _windows(1, 16), rank=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="train one for this model"):
        recall_table(models["deepseek_v3"], _windows(1, 16), _windows(1, 16), rank=2, predictor=other)
