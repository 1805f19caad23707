"""psr_hf.engine.GraphDecoder: the decode step split into graphs A_m / host / B_m per MoE layer and C.

CPU (``graphs=False``): the same functions in the same order on the same buffers as the eager Decoder, so tokens,
logits and recorded selections are bitwise equal (tiny OLMoE, tiny DeepSeek-V3, tiny Qwen3.5-MoE, the shipped OLMoE;
exact and psr; resident and offloaded to CPU slots). CUDA (marked ``cuda``, skipped without a GPU): the captured graphs against
the eager bodies in float32, a bf16 smoke run, timing independence of the offload's outputs, and a ms/token print.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.engine import Decoder, GraphDecoder
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

NEW = 5
MAX_LEN = 48
POLICIES = {
    "exact": dict(policy="exact", residency=0.5),
    "psr": dict(policy="psr", lam=0.2, budget=1, residency=0.5),
    "psr_distance2": dict(policy="psr", lam=0.2, budget=2, residency=0.5, prefetch_distance=2),
}


@pytest.fixture(scope="module")
def case(engine_case):
    """``case(name)``: (model, prompt ids [1, S], calibration, pad id), from conftest's ``engine_case``."""
    return engine_case


def _run(model, ids, decoder):
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    with ctl.record() as recorder:
        sequences, logits = decoder.generate_greedy(ids, NEW, return_logits=True)
    return sequences, logits, recorder.recordings, ctl.stats()


def _assert_bitwise(actual, expected) -> None:
    seq, logits, rec, stats = actual
    e_seq, e_logits, e_rec, e_stats = expected
    torch.testing.assert_close(seq, e_seq, rtol=0, atol=0)
    torch.testing.assert_close(logits, e_logits, rtol=0, atol=0)
    assert len(rec) == len(e_rec) == 1
    np.testing.assert_array_equal(rec[0].tokens, e_rec[0].tokens)
    np.testing.assert_array_equal(rec[0].selected, e_rec[0].selected)
    np.testing.assert_array_equal(rec[0].scores, e_rec[0].scores)
    for name in ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(e_stats, name), err_msg=name)


# ---------------------------------------------------------------------------------------------- CPU: bitwise
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("policy", ["exact", "psr", "psr_distance2"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text", "shipped"])
def test_eager_graph_structure_is_bitwise_the_decoder(case, name, policy, offloaded):
    model, ids, calibration, _ = case(name)
    offload = psr_hf.OffloadConfig(device="cpu", check_slots=True) if offloaded else None
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), calibration=calibration, offload=offload):
        expected = _run(model, ids, Decoder(model, MAX_LEN))
        decoder = GraphDecoder(model, MAX_LEN, graphs=False)
        actual = _run(model, ids, decoder)
        _assert_bitwise(actual, expected)
        # a second sequence on the same decoder (stale KV slots are masked) gives the same again
        _assert_bitwise(_run(model, ids, decoder), expected)
        if offloaded:
            assert all(p is None for p in psr_hf.controller(model).offload._pending)
    if policy.startswith("psr"):
        assert expected[3].total["replaced_per_token"] > 0  # the policy did route


def test_graph_bodies_and_order(case):
    model, _, _, _ = case("deepseek_v3")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        decoder = GraphDecoder(model, MAX_LEN, graphs=False)
        M = len(decoder.moe_layers)
        assert list(decoder._bodies) == [x for m in range(M) for x in (f"A{m}", f"B{m}")] + ["C"]
        # replayed as A_0, then B_m with A_{m+1} (B_{M-1} with C): one launch per MoE layer
        units = [decoder._unit_bodies(u) for u in range(M + 1)]
        assert units == [["A0"]] + [[f"B{m}", f"A{m + 1}"] for m in range(M - 1)] + [[f"B{M - 1}", "C"]]
        assert len(decoder._units) == M + 1
        assert decoder.moe_layers[0] > 0  # the dense first layers run inside graph A_0
        assert decoder.pool is None and not decoder._graphs


def test_construction_does_not_touch_the_controller(case):
    model, ids, _, _ = case("olmoe")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        ctl = psr_hf.controller(model)
        Decoder(model, MAX_LEN).prefill(ids)
        before = ctl.stats()
        GraphDecoder(model, MAX_LEN, graphs=False)
        after = ctl.stats()
        np.testing.assert_array_equal(after.tokens, before.tokens)
        np.testing.assert_array_equal(after.copies_per_token, before.copies_per_token)


def test_errors(case):
    model, ids, _, _ = case("olmoe")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"])):
        with pytest.raises(ValueError, match="CUDA"):
            GraphDecoder(model, MAX_LEN, graphs=True)
        decoder = GraphDecoder(model, MAX_LEN, graphs=False)
        with pytest.raises(ValueError, match="batch 1"):
            decoder.generate_greedy(torch.cat([ids, ids]), 2)
        with pytest.raises(ValueError, match="batch 1"):
            decoder.step(torch.tensor([1, 2]))
        with pytest.raises(ValueError, match="max_len"):
            GraphDecoder(model, 2, graphs=False).prefill([1, 2, 3])
        with pytest.raises(ValueError, match="at least one token"):
            decoder.prefill([])


def test_slots_reallocated_by_the_store_are_refused(case):
    """The graphs read the slot buffers of construction: once the expert store reallocates them (a reconfigure to
    another capacity), the decoder refuses to step instead of reading the old ones."""
    model, ids, _, _ = case("olmoe")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cpu")):
        decoder = GraphDecoder(model, MAX_LEN, graphs=False)
        decoder.prefill(ids)
        psr_hf.controller(model).reconfigure(RoutingConfig(**{**POLICIES["psr"], "residency": 0.25}))
        with pytest.raises(RuntimeError, match="reallocated"):
            decoder.prefill(ids)


def test_a_decoder_built_for_one_prefetch_distance_refuses_another(case):
    """The router stacks hold router m + D under router m: after a reconfigure to another prefetch distance the
    decoder refuses to step (its pre-gates would rank the wrong layer), and a new decoder decodes."""
    model, ids, _, _ = case("olmoe")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        decoder = GraphDecoder(model, MAX_LEN, graphs=False)
        decoder.prefill(ids)
        psr_hf.controller(model).reconfigure(RoutingConfig(**POLICIES["psr_distance2"]))
        with pytest.raises(RuntimeError, match="prefetch_distance"):
            decoder.prefill(ids)
        assert GraphDecoder(model, MAX_LEN, graphs=False).layers.distance == 2


# ------------------------------------------------------------------------------------- CUDA (written, not yet run)
def _cuda_model(name: str, dtype: torch.dtype = torch.float32):
    return tiny_model(name, dtype=dtype).to("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
@pytest.mark.parametrize("policy", ["exact", "psr", "psr_distance2"])
def test_cuda_graphs_match_eager_float32(name, policy, offloaded):
    model = _cuda_model(name)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), offload=offload):
        eager = _run(model, ids, GraphDecoder(model, MAX_LEN, graphs=False))
        graphed = _run(model, ids, GraphDecoder(model, MAX_LEN, graphs=True))
    torch.testing.assert_close(graphed[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(graphed[1], eager[1], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(graphed[2][0].selected, eager[2][0].selected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_cuda_bf16_smoke(name):
    model = _cuda_model(name, torch.bfloat16)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        seq, logits, rec, _ = _run(model, ids, GraphDecoder(model, MAX_LEN, graphs=True))
    assert seq.shape == (1, ids.shape[1] + NEW)
    assert torch.isfinite(logits).all()
    assert rec[0].selected.shape[0] == ids.shape[1] + NEW - 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_cuda_timing_never_changes_outputs(name):
    model = _cuda_model(name)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    results = []
    settings = [dict(max_in_flight=1), dict(max_in_flight=2), dict(max_in_flight=4),
                dict(max_in_flight=2, copy_delay_ms=2.0), dict(max_in_flight=2, copy_api="torch"),
                dict(max_in_flight=1, copy_delay_ms=1.0, copy_api="torch")]
    for setting in settings:
        with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]),
                            offload=psr_hf.OffloadConfig(device="cuda", **setting)):
            results.append(_run(model, ids, GraphDecoder(model, MAX_LEN, graphs=True)))
    for setting, result in zip(settings[1:], results[1:]):
        torch.testing.assert_close(result[0], results[0][0], rtol=0, atol=0, msg=str(setting))
        torch.testing.assert_close(result[1], results[0][1], rtol=0, atol=0, msg=str(setting))
        np.testing.assert_array_equal(result[2][0].selected, results[0][2][0].selected, err_msg=str(setting))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_cuda_one_graph_per_layer_equals_one_graph_per_body(name, offloaded):
    """B_m and A_{m+1} captured as one graph (the default: one launch per MoE layer) against one graph per body:
    the same kernels in the same order, so tokens, logits and selections are bitwise equal."""
    model = _cuda_model(name)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=offload):
        merged = GraphDecoder(model, MAX_LEN, graphs=True)
        split = GraphDecoder(model, MAX_LEN, graphs=True, merge=False)
        assert merged.merged and not split.merged
        assert len(merged._graphs) == len(merged.moe_layers) + 1 and len(split._graphs) == 2 * len(split.moe_layers) + 1
        one, per_body = _run(model, ids, merged), _run(model, ids, split)
    _assert_bitwise(one, per_body)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_cuda_ms_per_token(offloaded, capsys):
    model = _cuda_model("olmoe", torch.bfloat16)
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    tokens = list(range(3, 3 + 32))
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=offload):
        times = {}
        for graphs in (False, True):
            decoder = GraphDecoder(model, MAX_LEN, graphs=graphs)
            decoder.prefill([1, 2])
            decoder.time_steps(tokens[:4])  # warm
            decoder.reset()
            decoder.prefill([1])
            times[graphs] = decoder.time_steps(tokens)
        eager = Decoder(model, MAX_LEN)
        eager.prefill([1])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in tokens:
            eager.step(t)
        torch.cuda.synchronize()
        times["Decoder"] = (time.perf_counter() - t0) * 1e3 / len(tokens)
    with capsys.disabled():
        print(f"\nGraphDecoder ms/token ({'offloaded' if offloaded else 'resident'}, tiny olmoe bf16): "
              f"graphs {times[True]:.3f}, eager bodies {times[False]:.3f}, Decoder {times['Decoder']:.3f}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_cuda_compiled_blocks_match_uncompiled_float32(name):
    """torch.compile'd attention blocks (the default on CUDA) against the same graphs without compile: logits
    within 1e-4 of the largest, the same selections."""
    model = _cuda_model(name)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        plain = _run(model, ids, GraphDecoder(model, MAX_LEN, graphs=True, compile=False))
        decoder = GraphDecoder(model, MAX_LEN, graphs=True)
        assert decoder.compiled
        fused = _run(model, ids, decoder)
        assert decoder.blocked_s > 0  # the host waited on graph A's events
    assert float((fused[1] - plain[1]).abs().max() / plain[1].abs().max()) < 1e-4
    np.testing.assert_array_equal(fused[2][0].selected, plain[2][0].selected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("policy", ["psr", "spec", "psr_distance2"])
def test_cuda_offloaded_graph_recordings_replay_to_their_selections(case, policy):
    """The captured graphs, offloaded to the GPU (raw copy calls and graph launches where cuda-python imports):
    replay() of the recording gives the selections the engine executed, and the copies the cache counted."""
    from psr_hf.assets import OLMOE_ROUTING_NAME, load_shipped

    model, tokenizer, calibration = load_shipped(OLMOE_ROUTING_NAME)
    ids = case("shipped")[1]
    model = model.to("cuda")
    fields = {"psr": dict(lam=0.2, budget=1), "psr_distance2": dict(lam=0.2, budget=1, prefetch_distance=2)}
    config = RoutingConfig(policy=policy.partition("_")[0], residency=0.25, **fields.get(policy, {}))
    with psr_hf.patched(model, config, calibration=calibration, offload=psr_hf.OffloadConfig(device="cuda")):
        _, _, recordings, _ = _run(model, ids, GraphDecoder(model, MAX_LEN, graphs=True))
        counts = psr_hf.controller(model).cache.stats()
    (recording,) = recordings
    result = psr_hf.replay(config, recording, calibration=calibration)
    np.testing.assert_array_equal(result.selected, recording.selected)
    assert result.demand_copies.sum() == counts.demand[:, 0].sum() > 0
    assert result.prefetch_copies.sum() == counts.prefetch[:, 0].sum()
