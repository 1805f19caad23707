"""SpecPrefetch at run time: RoutingConfig(prefetch="predictor") with patch(..., predictor=...) replaces the
pre-gate ranking of prefetches by the predictor's priorities softmax(B A x) (docs/ALGORITHM.md, "Prefetch ranking
source"). Router-preserving with exact routing (outputs bitwise those of the model), the same decisions through
the transformers path, the CPU offload path and the engine, and replay() reproduces them from the recording."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.assets import load_shipped
from psr_hf.engine.graphs import GraphDecoder
from psr_hf.patches import get_patch
from psr_hf.prefetch import Predictor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "Prefetches follow a learned ranking while the router keeps deciding what runs, token after token."
SPEC = dict(policy="exact", eviction="score", budget=2, residency=0.5, prefetch="predictor")


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, calibration = load_shipped("tiny-moe")
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    return model, calibration, ids


def _predictor(model: torch.nn.Module, rank: int, seed: int, scale: float = 1.0) -> Predictor:
    """A rank-r predictor: a random one (seed) around a truncated SVD of each next router's weight."""
    family = get_patch(model.config.model_type)(model)
    routers = [m.router.weight.detach().float() for m in family.moe_layers()]
    g = torch.Generator().manual_seed(seed)
    A, B = [], []
    for w in routers[1:]:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        A.append(vh[:rank] + scale * torch.randn(rank, w.shape[1], generator=g) * vh.abs().mean())
        B.append(u[:, :rank] * s[:rank])
    return Predictor(A, B, {"model_type": model.config.model_type, "top_k": model.config.num_experts_per_tok})


def _generate(model, ids, new=10):
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    with torch.no_grad(), ctl.record() as rec:
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out, rec.recordings[0], ctl.stats()


def _engine_generate(model, ids, graphs=False, new=10):
    """(tokens, recording, stats) of the engine's greedy decoding of ``ids`` on the patched model."""
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    decoder = GraphDecoder(model, ids.shape[1] + 12, graphs=graphs)
    with ctl.record() as rec:
        seq = decoder.generate_greedy(ids, new)
    return seq, rec.recordings[0], ctl.stats()


def _router_inputs(model, ids):
    """[L] router inputs of every position of ``ids`` (one forward of the unpatched model)."""
    family = get_patch(model.config.model_type)(model)
    seen, handles = [], []
    for m in family.moe_layers():
        handles.append(m.router.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return [x.reshape(-1, x.shape[-1]) for x in seen]


def test_config_field_and_its_errors():
    config = RoutingConfig(**SPEC)
    assert config.prefetch == "predictor" and RoutingConfig.from_dict(config.to_dict()) == config
    assert RoutingConfig(policy="exact", residency=0.5).prefetch == "pregate"
    with pytest.raises(ValueError, match="prefetch='oracle' is not supported; allowed: pregate, predictor"):
        RoutingConfig(policy="psr", residency=0.5, prefetch="oracle")
    with pytest.raises(ValueError, match="never reads; give a prefetch budget"):
        RoutingConfig(policy="exact", residency=0.5, prefetch="predictor")  # budget 0: nothing would use it
    with pytest.raises(ValueError, match="never reads"):
        RoutingConfig(policy="cache_prior", residency=0.5, prefetch="predictor")


def test_patch_errors_name_the_problem(shipped):
    model, calibration, _ = shipped
    with pytest.raises(ValueError, match=r"needs the predictor: patch\(model, config, predictor="):
        psr_hf.patch(model, RoutingConfig(**SPEC), calibration=calibration)
    with pytest.raises(ValueError, match="set RoutingConfig\\(prefetch='predictor'"):
        psr_hf.patch(model, RoutingConfig(policy="psr", residency=0.5), predictor=_predictor(model, 2, 0))
    small = _predictor(model, 2, 0)
    wrong = Predictor(small.A[:-1], small.B[:-1], small.metadata)  # one MoE layer short
    with pytest.raises(ValueError, match="trained for .* MoE layers .* but the model has"):
        psr_hf.patch(model, RoutingConfig(**SPEC), predictor=wrong)
    with pytest.raises(ValueError, match="must be a psr_hf.prefetch.Predictor"):
        psr_hf.patch(model, RoutingConfig(**SPEC), predictor="predictor.safetensors")
    assert getattr(model, "_psr_hf_controller", None) is None  # nothing was left installed


def test_exact_routing_with_a_predictor_is_router_preserving(shipped):
    """Outputs bitwise those of the unpatched model; the prefetches follow the predictor (other copies than the
    pre-gate's), and the recorded pre-gate is the predictor's softmax on the previous layer's router input."""
    model, calibration, ids = shipped
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=10, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
    predictor = _predictor(model, 2, seed=1, scale=2.0)
    with psr_hf.patched(model, RoutingConfig(**SPEC), calibration=calibration, predictor=predictor):
        ours, rec, stats = _generate(model, ids)
    with psr_hf.patched(model, RoutingConfig(**{**SPEC, "prefetch": "pregate"}), calibration=calibration):
        pregate, pre_rec, pre_stats = _generate(model, ids)
    for out in (ours, pregate):
        assert torch.equal(out.sequences, plain.sequences)
        for a, b in zip(out.scores, plain.scores):
            assert torch.equal(a, b)
    np.testing.assert_array_equal(rec.selected, pre_rec.selected)  # the router decides what runs
    assert stats.total["prefetch_per_token"] > 0
    assert not np.array_equal(rec.pregate, pre_rec.pregate)
    # the prompt's recorded pre-gate of layer l + 1 = softmax(B[l] A[l] x[l]) on layer l's router input
    xs = _router_inputs(model, ids)
    T = ids.shape[1]
    for pair in range(predictor.num_pairs):
        want = predictor.priorities(pair, xs[pair]).numpy()
        np.testing.assert_allclose(rec.pregate[:T, pair + 1], want, rtol=1e-5, atol=1e-7)
    # replay from the recording reproduces the selections and the prefetch copies
    result = psr_hf.replay(RoutingConfig(**SPEC), rec, calibration=calibration)
    np.testing.assert_array_equal(result.selected, rec.selected)


def test_psr_with_a_predictor_steers_by_it_and_replays(shipped):
    model, calibration, ids = shipped
    config = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5, prefetch="predictor")
    predictor = _predictor(model, 3, seed=2)
    with psr_hf.patched(model, config, calibration=calibration, predictor=predictor):
        _, rec, stats = _generate(model, ids)
    result = psr_hf.replay(config, rec, calibration=calibration)
    np.testing.assert_array_equal(result.selected, rec.selected)
    assert stats.total["replaced_per_token"] > 0  # the bias changed selections


def test_reconfigure_keeps_or_drops_the_predictor(shipped):
    model, calibration, ids = shipped
    predictor = _predictor(model, 2, seed=3)
    with psr_hf.patched(model, RoutingConfig(**SPEC), calibration=calibration, predictor=predictor):
        ctl = psr_hf.controller(model)
        ctl.reconfigure(RoutingConfig(**{**SPEC, "residency": 0.25}), calibration=calibration)
        assert ctl.predictor is predictor
        ctl.reconfigure(RoutingConfig(policy="psr", residency=0.5), calibration=calibration)
        assert ctl.predictor is None
        with pytest.raises(ValueError, match="needs the predictor"):
            ctl.reconfigure(RoutingConfig(**SPEC), calibration=calibration)


def test_offload_and_engine_make_the_same_decisions(shipped):
    """The same predictor through the CPU offload path and the engine's step (eager, CPU): the same tokens,
    selections and copies as the transformers path."""
    model, calibration, ids = shipped
    predictor = _predictor(model, 2, seed=4, scale=2.0)
    config = RoutingConfig(**SPEC)
    with psr_hf.patched(model, config, calibration=calibration, predictor=predictor):
        hf, hf_rec, hf_stats = _generate(model, ids)
        seq, eng_rec, eng_stats = _engine_generate(model, ids)
    assert torch.equal(seq, hf.sequences)
    np.testing.assert_array_equal(eng_rec.selected, hf_rec.selected)
    for name in ("prefetch_per_token", "demand_per_token"):
        assert eng_stats.total[name] == hf_stats.total[name], name
    with psr_hf.patched(model, config, calibration=calibration, predictor=predictor,
                        offload=psr_hf.OffloadConfig(device="cpu")):
        off, off_rec, off_stats = _generate(model, ids)
    assert torch.equal(off.sequences, hf.sequences)
    np.testing.assert_array_equal(off_rec.selected, hf_rec.selected)
    assert off_stats.offload is not None and off_stats.total["prefetch_per_token"] == hf_stats.total[
        "prefetch_per_token"]


def test_divergence_pairs_psr_with_a_predictor_against_the_pre_gate(shipped):
    from psr_hf.eval.divergence import divergence, predictor_pairs, sweep_configs

    model, calibration, ids = shipped
    configs = sweep_configs((0.5,), (0.3,), budget=1, predictor=True)
    assert list(configs) == ["exact_lru_res50", "cp_lam0.3_res50", "psr_lam0.3_n1_res50", "psr_lam0.3_n1_pred_res50"]
    with pytest.raises(ValueError, match="pass predictor="):
        divergence(model, [ids], configs, calibration=calibration)
    windows = [ids[:, :20], ids[:, 5:]]
    rows = divergence(model, windows, configs, calibration=calibration, predictor=_predictor(model, 2, 5, 2.0))
    (pair,) = predictor_pairs(rows)
    by = {r.name: r for r in rows}
    assert pair["predictor"] == "psr_lam0.3_n1_pred_res50" and pair["pregate"] == "psr_lam0.3_n1_res50"
    want = np.mean(np.subtract(by[pair["predictor"]].window_excess, by[pair["pregate"]].window_excess))
    assert pair["excess_nll_diff"] == pytest.approx(want)
    lo, hi = pair["excess_nll_diff_ci95"]
    assert lo <= pair["excess_nll_diff"] <= hi
    assert by["psr_lam0.3_n1_pred_res50"].routing["prefetch"] == "predictor"
    assert (by["psr_lam0.3_n1_pred_res50"].window_excess != by["psr_lam0.3_n1_res50"].window_excess)


def test_previous_token_prefetch_is_naive_prefetch(shipped):
    """prefetch="previous": the ranking of layer l at token t is z[t - 1, l] (the calibration's expert counts at
    the first token); router-preserving with exact routing; replay, the engine and a left-padded batch agree."""
    model, calibration, ids = shipped
    config = RoutingConfig(**{**SPEC, "prefetch": "previous", "window": 16})  # beyond its own top-8
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    with psr_hf.patched(model, config, calibration=calibration):
        out, rec, stats = _generate(model, ids)
        ctl = psr_hf.controller(model)
        ctl.reset()
        decoder = GraphDecoder(model, ids.shape[1] + 12, graphs=False)
        with ctl.record() as erec:
            seq = decoder.generate_greedy(ids, 10)
        # a batch of two rows, the second left-padded: each row decides as it does alone
        pad = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids[:, :-3]], dim=1)
        mask = torch.cat([torch.zeros(1, 3), torch.ones(1, ids.shape[1] - 3)], dim=1).long()
        ctl.reset()
        with torch.no_grad(), ctl.record() as brec:
            model(torch.cat([ids, pad]), attention_mask=torch.cat([torch.ones_like(ids), mask]))
        ctl.reset()
        with torch.no_grad(), ctl.record() as srec:
            model(ids[:, :-3])
    assert torch.equal(out.sequences, plain)
    L = rec.scores.shape[1]
    np.testing.assert_array_equal(rec.pregate[1:, 1:], rec.scores[:-1, 1:])  # z of the previous token
    counts = np.asarray(calibration.expert_counts, dtype=np.float32)
    np.testing.assert_array_equal(rec.pregate[0, 1:], counts[1:L])
    assert stats.total["prefetch_per_token"] > 0
    np.testing.assert_array_equal(psr_hf.replay(config, rec, calibration=calibration).selected, rec.selected)
    assert torch.equal(seq, out.sequences)
    np.testing.assert_array_equal(erec.recordings[0].selected, rec.selected)
    # (the engine runs the prompt one token at a time: its scores equal the block forward's to rounding)
    np.testing.assert_allclose(erec.recordings[0].pregate, rec.pregate, rtol=1e-5, atol=1e-5)
    padded = next(r for r in brec.recordings if r.row == 1)
    np.testing.assert_allclose(padded.pregate, srec.recordings[0].pregate, rtol=1e-5, atol=1e-5)  # batch rounding
    np.testing.assert_array_equal(padded.selected, srec.recordings[0].selected)


def test_cli_kl_and_bench_take_a_predictor(tmp_path, capsys, shipped):
    import json

    from psr_hf.cli import main

    model, _, _ = shipped
    path = _predictor(model, 2, 6, 2.0).save(tmp_path / "p.safetensors")
    record = tmp_path / "kl.json"
    assert main(["excess-nll", "--model", "tiny-moe", "--windows", "2", "--tokens", "24", "--residencies", "0.5", "--lams",
                 "0.3", "--predictor", str(path), "--json", str(record)]) == 0
    text = capsys.readouterr().out
    assert "psr_lam0.3_n1_pred_res50 - psr_lam0.3_n1_res50: excess NLL" in text
    data = json.loads(record.read_text())
    assert data["predictor"] == str(path) and len(data["predictor_pairs"]) == 1
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--predictor", str(path)]) == 2
    assert "give --prefetch-budgets too" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--prefetch-budgets", "2,0.5"]) == 2
    assert "expected comma-separated integers >= 1" in capsys.readouterr().err


def test_batch_priorities_sum_the_valid_tokens_softmaxes():
    g = torch.Generator().manual_seed(0)
    p = Predictor([torch.randn(3, 8, generator=g)], [torch.randn(5, 3, generator=g)])
    x = torch.randn(2, 4, 8, generator=g)
    valid = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    s = p.batch_priorities(0, x, valid)
    want = sum(torch.softmax(p.weight(0) @ x[b, t], dim=0) for b in range(2) for t in range(4) if valid[b, t])
    torch.testing.assert_close(s, want, rtol=1e-5, atol=1e-6)
    assert float(s.sum()) == pytest.approx(7.0, rel=1e-5)  # one unit of mass per valid token
    assert torch.allclose(p.batch_priorities(0, x), p.priorities(0, x.reshape(-1, 8)).sum(0))
    with pytest.raises(ValueError, match="valid has 3 entries for 8 tokens"):
        p.batch_priorities(0, x, torch.ones(3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_engine_graphs_with_a_predictor_are_router_preserving(shipped):
    """On the GPU, offloaded to CUDA slots with captured graphs (float32): exact routing with the predictor's
    prefetches gives the tokens of exact routing with the pre-gate's, the same selections as the eager step, and
    the same prefetch and demand counts as the eager step (decisions do not depend on the graphs)."""
    cpu_model, calibration, ids = shipped
    predictor = _predictor(cpu_model, 2, seed=4, scale=2.0)  # on the CPU: the controller moves it
    model = cpu_model.to("cuda")
    ids = ids.to("cuda")
    results = {}
    try:
        for name, config, pred in (("pregate", dict(SPEC, prefetch="pregate"), None), ("spec", SPEC, predictor)):
            with psr_hf.patched(model, RoutingConfig(**config), calibration=calibration, predictor=pred,
                                offload=psr_hf.OffloadConfig(device="cuda")):
                for graphs in (False, True):
                    seq, recording, stats = _engine_generate(model, ids, graphs=graphs)
                    results[name, graphs] = seq.cpu(), recording, stats
    finally:
        cpu_model.to("cpu")
    for graphs in (False, True):
        assert torch.equal(results["spec", graphs][0], results["pregate", graphs][0])
        np.testing.assert_array_equal(results["spec", graphs][1].selected, results["pregate", graphs][1].selected)
    np.testing.assert_array_equal(results["spec", True][1].selected, results["spec", False][1].selected)
    for name in ("prefetch_per_token", "demand_per_token"):
        assert results["spec", True][2].total[name] == results["spec", False][2].total[name], name
    # the prefetch ranking is the predictor's, not the pre-gate's
    assert not np.array_equal(results["spec", True][1].pregate, results["pregate", True][1].pregate)
