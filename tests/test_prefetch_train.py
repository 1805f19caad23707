"""SpecPrefetch predictor training (psr_hf.prefetch.train): recording router inputs, the distillation objective,
the shared training loop and its baselines, and the train-predictor command."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from psr_hf.prefetch import Predictor
from psr_hf.prefetch.recall import expert_recall
from psr_hf.prefetch.train import (LowRankAdapters, PairMLP, SingleMLP, distillation_loss, fit, model_facts,
                                   record_router_inputs, record_router_inputs_with_positions, router_weights,
                                   train_module, train_predictor)
from psr_hf.testing import tiny_model


@pytest.fixture(scope="module")
def olmoe():
    return tiny_model("olmoe")


@pytest.fixture(scope="module")
def deepseek():
    return tiny_model("deepseek_v3")


def _windows(count: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=gen) for _ in range(count)]


def test_recorded_inputs_reproduce_the_routers_choices(olmoe):
    """The recorded x[l] is what router l ranks: its logits' top-K are the experts the model ran."""
    from psr_hf.prefetch.train import moe_routers

    _, layers = moe_routers(olmoe)
    chosen = []
    handles = [layer.router.register_forward_hook(lambda m, a, out: chosen.append(out[2].detach()))
               for layer in layers]
    window = _windows(1, 12)[0]
    try:
        with torch.no_grad():
            olmoe(input_ids=window[None])
    finally:
        for h in handles:
            h.remove()
    xs = record_router_inputs(olmoe, [window])
    K = model_facts(olmoe)["top_k"]
    assert len(xs) == len(layers) and xs[0].shape == (12, olmoe.config.hidden_size) and xs[0].dtype == torch.float32
    for x, layer, ran in zip(xs, layers, chosen):
        mine = torch.topk(F.linear(x, layer.router.weight.float()), K).indices
        assert torch.equal(mine.sort(-1).values, ran.reshape(-1, K).sort(-1).values)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_padded_positions_are_excluded(family, olmoe, deepseek):
    model = olmoe if family == "olmoe" else deepseek
    windows = [w[:n] for w, n in zip(_windows(3, 11, seed=1), (5, 11, 8))]
    batched, positions = record_router_inputs_with_positions(model, windows, batch_size=3)
    alone = [record_router_inputs(model, [w]) for w in windows]
    assert batched[0].shape[0] == 5 + 11 + 8
    assert positions.tolist() == list(range(5)) + list(range(11)) + list(range(8))
    for layer, x in enumerate(batched):
        torch.testing.assert_close(x, torch.cat([a[layer] for a in alone]), atol=1e-4, rtol=1e-4)


def test_bad_windows_and_settings_raise(olmoe):
    with pytest.raises(ValueError, match="no token windows"):
        record_router_inputs(olmoe, [])
    with pytest.raises(ValueError, match="token ids"):
        record_router_inputs(olmoe, [torch.zeros(3, 4, 5, dtype=torch.long)])
    with pytest.raises(ValueError, match="rank"):
        train_predictor(olmoe, _windows(1, 8), rank=10_000)
    with pytest.raises(ValueError, match="dtype"):
        train_predictor(olmoe, _windows(1, 8), rank=2, dtype=torch.float16)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_training_lowers_the_kl_and_records_its_facts(family, olmoe, deepseek):
    model = olmoe if family == "olmoe" else deepseek
    xs = record_router_inputs(model, _windows(8, 64))
    facts = model_facts(model)
    predictor = train_predictor(model, rank=8, router_inputs=xs, lr=3e-2, batch_size=32, epochs=8,
                                dtype=torch.float32, init="random")
    meta = predictor.metadata
    start = distillation_loss(model, xs, LowRankAdapters(router_weights(model), 8, init="random"))["loss"]
    end = distillation_loss(model, xs, predictor)
    assert float(meta["initial_loss"]) == pytest.approx(start, rel=1e-5)
    assert float(meta["final_loss"]) == pytest.approx(end["loss"], rel=1e-4)
    assert end["loss"] < 0.6 * start
    assert len(end["per_pair"]) == facts["num_layers"] - 1
    assert meta["model_type"] == family and int(meta["top_k"]) == facts["top_k"]
    assert int(meta["tokens"]) == 8 * 64 and int(meta["steps"]) == 8 * 16
    predictor.check(**facts)
    assert predictor.num_parameters == (facts["num_layers"] - 1) * 8 * (facts["hidden_size"] + facts["num_experts"])


def test_a_trained_predictor_ranks_better_than_chance(olmoe):
    """From a zero B (uniform: no ranking at all) to recall well above random ranking's M/E on its training data."""
    xs, positions = record_router_inputs_with_positions(olmoe, _windows(8, 64, seed=2))
    facts = model_facts(olmoe)
    K, E = facts["top_k"], facts["num_experts"]
    predictor = train_predictor(olmoe, rank=8, router_inputs=xs, lr=3e-2, batch_size=32, epochs=8,
                                dtype=torch.float32, init="random")
    recall = expert_recall(olmoe, xs, predictor, [K], positions=positions)["recall"][K]
    assert recall > K / E + 0.25


def test_svd_initialisation_is_the_truncated_next_router(olmoe):
    weights = router_weights(olmoe)
    E, D = weights[0].shape
    full = LowRankAdapters(weights, min(E, D))
    for pair in range(len(weights) - 1):
        torch.testing.assert_close(full.B[pair] @ full.A[pair], weights[pair + 1], atol=1e-4, rtol=1e-4)
    low = LowRankAdapters(weights, 2).requires_grad_(False)
    err = torch.linalg.matrix_norm(low.B[0] @ low.A[0] - weights[1], ord=2)
    assert float(err) == pytest.approx(float(torch.linalg.svdvals(weights[1])[2]), rel=1e-3)


def test_the_bf16_default_trains(olmoe):
    xs = record_router_inputs(olmoe, _windows(4, 32, seed=3))
    predictor = train_predictor(olmoe, rank=4, router_inputs=xs, lr=1e-2, batch_size=16, init="random")
    assert "bf16" in predictor.metadata["precision"]
    assert float(predictor.metadata["final_loss"]) < float(predictor.metadata["initial_loss"])
    assert all(a.dtype == torch.float32 for a in predictor.A)


@pytest.mark.parametrize("kind", ["single", "pair"])
def test_baselines_train_through_the_same_loop(kind, olmoe):
    facts = model_facts(olmoe)
    L, D, E = facts["num_layers"], facts["hidden_size"], facts["num_experts"]
    h = 24
    module = SingleMLP(L, D, E, h) if kind == "single" else PairMLP(L, D, E, h)
    expected = D * h + h + (L - 1) * h + h * E + E if kind == "single" else (L - 1) * (D * h + h + h * E + E)
    assert module.num_parameters == expected
    out = train_module(olmoe, module, _windows(6, 48, seed=4), lr=1e-2, batch_size=32, epochs=2,
                       dtype=torch.float32)
    assert out["final_loss"] < out["initial_loss"]
    assert module.logits(L - 2, torch.randn(3, D)).shape == (3, E)


def test_fit_rejects_inputs_of_another_model(olmoe, deepseek):
    xs = record_router_inputs(deepseek, _windows(1, 8))
    with pytest.raises(ValueError, match="MoE layers"):
        fit(LowRankAdapters(router_weights(olmoe), 2), router_weights(olmoe), xs[:1])


def test_cli_round_trip_and_shape_mismatch(tmp_path, capsys, olmoe):
    from psr_hf.cli import main

    out = tmp_path / "predictor.safetensors"
    assert main(["train-predictor", "--model", "tiny-moe", "--tokens", "600", "--window", "200", "--rank", "4",
                 "--dtype", "fp32", "--batch-size", "100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    loaded = Predictor.load(out)
    assert loaded.rank == 4 and loaded.num_layers == 4 and loaded.model_type == "olmoe"
    assert int(loaded.metadata["tokens"]) == 600 and int(loaded.metadata["steps"]) == 6
    assert f"{loaded.num_parameters:,} parameters" in printed and "3 layer pairs" in printed
    assert f"-> {float(loaded.metadata['final_loss']):.4f} (final loss)" in printed
    # the recall command evaluates the loaded predictor instead of training one
    record = tmp_path / "recall.json"
    assert main(["recall", "--model", "tiny-moe", "--predictor", str(out), "--train-tokens", "300",
                 "--heldout-tokens", "300", "--batch-size", "100", "--dtype", "fp32", "--json", str(record)]) == 0
    rows = {r["name"]: r for r in json.loads(record.read_text())["methods"]}
    assert rows["SpecPrefetch (rank 4, loaded)"]["parameters"] == loaded.num_parameters
    # a predictor of another model's shape: the check names the mismatch
    facts = model_facts(olmoe)
    with pytest.raises(ValueError, match="MoE layers"):
        loaded.check(**facts)
    assert main(["recall", "--model", "tiny", "--predictor", str(out), "--train-tokens", "300",
                 "--heldout-tokens", "300"]) == 2
    assert "train one for this model" in capsys.readouterr().err


def test_cli_default_rank_is_the_papers_capped(tmp_path, capsys):
    from psr_hf.cli import main

    out = tmp_path / "p.safetensors"
    assert main(["train-predictor", "--model", "tiny-moe", "--tokens", "200", "--out", str(out)]) == 0
    loaded = Predictor.load(out)
    assert loaded.rank == min(64, loaded.num_experts, loaded.hidden_size)
    assert "bf16" in loaded.metadata["precision"]
    assert main(["train-predictor", "--model", "tiny-moe", "--tokens", "200", "--rank", "999",
                 "--out", str(out)]) == 2
    assert "give a rank in that range" in capsys.readouterr().err
    assert main(["train-predictor", "--model", "tiny-moe", "--text", str(tmp_path / "missing.txt"),
                 "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "qwen3_next", "qwen3_5_moe"])
def test_every_family_trains_a_predictor_the_runtime_accepts(family, quiet_psr_hf):
    import psr_hf
    from psr_hf.policy.config import RoutingConfig

    model = tiny_model(family)
    predictor = train_predictor(model, _windows(2, 12, seed=8), rank=4, dtype=torch.float32)
    facts = model_facts(model)
    assert predictor.num_layers == facts["num_layers"] and predictor.num_experts == facts["num_experts"]
    with psr_hf.patched(model, RoutingConfig(residency=0.5, prefetch="predictor"), predictor=predictor):
        with torch.no_grad():
            model(input_ids=_windows(1, 6, seed=9)[0][None])
    # recording needs the native routers: a patched model is refused with the fix named
    psr_hf.patch(model, RoutingConfig(residency=0.5, prefetch="predictor"), predictor=predictor)
    try:
        with pytest.raises(ValueError, match="unpatched"):
            record_router_inputs(model, _windows(1, 6))
    finally:
        psr_hf.unpatch(model)


def test_targets_follow_the_routers_selection(olmoe, deepseek):
    """Softmax routers: the target is log_softmax(W x). DeepSeek-V3 (sigmoid + e_score_correction_bias): the
    target ranks the experts as the router selects them, bias included, with the spread of the logits; training
    and the loss use it."""
    from psr_hf.prefetch.train import RouterTargets, moe_routers, router_targets

    xs = record_router_inputs(olmoe, _windows(2, 16))
    plain = router_targets(olmoe, xs)
    assert plain.scores is None
    torch.testing.assert_close(plain.log_probs(1, xs[1]), F.log_softmax(F.linear(xs[1], router_weights(olmoe)[1]), -1))

    family, layers = moe_routers(deepseek)
    biases = [layer.router.e_score_correction_bias for layer in layers]
    saved = [b.clone() for b in biases]
    try:
        gen = torch.Generator().manual_seed(0)
        for b in biases:  # a bias that reorders the experts (a trained DeepSeek-V3's is learned by balancing)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        xs = record_router_inputs(deepseek, _windows(2, 16, seed=1))
        targets = router_targets(deepseek, xs)
        assert targets.scores is not None and all(t > 0 for t in targets.scales)
        W = router_weights(deepseek)
        for layer, x in enumerate(xs):
            logp = targets.log_probs(layer, x)
            selection = family.selection_scores(layers[layer].router, F.linear(x, W[layer]))
            assert torch.equal(torch.argsort(logp, dim=-1, descending=True, stable=True),
                               torch.argsort(selection, dim=-1, descending=True, stable=True))
            assert not torch.equal(logp.argmax(-1), F.linear(x, W[layer]).argmax(-1))  # the bias matters here
            kept = torch.isfinite(selection)  # a group-limited router's masked experts: -1e4, never selected
            assert (logp[~kept] < -1e3).all() and (logp[kept] > -1e3).all()
            spread = logp[kept].std()
            assert 0.5 < float(spread / F.linear(x, W[layer]).std()) < 2.0
        predictor = train_predictor(deepseek, rank=4, router_inputs=xs, lr=1e-2, batch_size=8, dtype=torch.float32)
        assert "sigmoid + bias" in predictor.metadata["objective"]
        loss = distillation_loss(deepseek, xs, predictor)["loss"]
        assert loss == pytest.approx(distillation_loss(targets, xs, predictor)["loss"])
    finally:
        for b, s in zip(biases, saved):
            b.copy_(s)
    with pytest.raises(ValueError, match="both scores and scales"):
        RouterTargets(W, scores=lambda layer, z: z)
