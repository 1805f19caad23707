"""The engine over FP8 experts (CPU, float32, eager): a model loaded from an FP8 checkpoint and offloaded with its
e4m3 experts and block scales is decoded by the engine's slot MoE in FP8 (:mod:`psr_hf.engine.slot_moe`, the
kernel's reference form here), with the tokens, logits and routing of the transformers path on the same store,
and of the engine on the same weights offloaded in float32; the token graph takes the FP8 store (its device copies
move the four tensors of an FP8 expert) and, on a GPU, decides and computes as the host path does, bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig, engine
from psr_hf.assets.quantize import load_fp8_dequantized, quantize_checkpoint
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

NEW = 8
PSR = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
EXACT = RoutingConfig(policy="exact", residency=0.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny OLMoE written as an FP8 checkpoint (hidden 192, expert width 160: whole and partial blocks)."""
    root = tmp_path_factory.mktemp("fp8_engine")
    tiny_model("olmoe", dtype=torch.bfloat16, hidden_size=192, intermediate_size=160).save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root / "fp8"


def _generate(model, ids, with_engine: bool):
    """Greedy tokens, step scores and the routing recording of ``model`` (patched), with or without the engine."""
    if with_engine:
        engine.attach(model)
    try:
        ctl = psr_hf.controller(model)
        ctl.reset()
        ctl.reset_stats()
        with torch.no_grad(), ctl.record() as recorder:
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        served = engine.attached(model).served if with_engine else None
        return out, recorder.recordings[0], ctl.stats(), served
    finally:
        engine.detach(model)


def _run(folder, routing, expert_format, with_engine):
    model = load_fp8_dequantized(folder, torch.float32)
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23]])
    offload = OffloadConfig(device="cpu", expert_format=expert_format)  # "fp8": found by the model's name_or_path
    with psr_hf.patched(model, routing, calibration=False, offload=offload):
        assert psr_hf.controller(model).expert_store.weight_format == ("fp8" if expert_format == "fp8" else "model")
        return _generate(model, ids, with_engine)


@pytest.mark.parametrize("routing", [PSR, EXACT], ids=["psr", "exact"])
def test_the_engine_in_fp8_decodes_what_the_transformers_path_and_the_dequantized_engine_decode(folder, routing):
    hf = _run(folder, routing, "fp8", with_engine=False)
    fp8 = _run(folder, routing, "fp8", with_engine=True)
    dense = _run(folder, routing, "model", with_engine=True)
    assert fp8[3] == NEW  # every step served by the engine
    for other in (hf, dense):
        assert torch.equal(fp8[0].sequences, other[0].sequences)
        np.testing.assert_array_equal(fp8[1].selected, other[1].selected)
        assert fp8[2].total["copies_per_token"] == other[2].total["copies_per_token"]
    # the engine's FP8 kernel dequantizes the slots it reads exactly as the dequantized weights were made
    for a, b in zip(fp8[0].scores, dense[0].scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(fp8[0].scores, hf[0].scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fp8[2].offload.bytes < dense[2].offload.bytes * 0.6  # the copies moved FP8 bytes


def test_the_token_graph_takes_the_fp8_store_and_copies_its_four_tensors(folder):
    from psr_hf.engine.slot_moe import filled_slots
    from psr_hf.engine.token_graph import device_routing_unsupported

    model = load_fp8_dequantized(folder, torch.float32)
    offload = OffloadConfig(device="cpu")
    with psr_hf.patched(model, PSR, calibration=False, offload=offload):
        ctl = psr_hf.controller(model)
        assert ctl.expert_store.weight_format == "fp8"
        assert device_routing_unsupported(ctl) is None
        slots = filled_slots(ctl.expert_store, 0)
        assert set(slots) == set(ctl.expert_store.expert_weights(0))  # what the device copies move, by name
        assert {t.dtype for t in slots.values()} == {torch.float8_e4m3fn, torch.float32}


# ------------------------------------------------------------------------------------- CUDA
def _graph_run(model, ids, graphs: bool):
    """Greedy tokens, step logits and selections of a GraphDecoder on ``model`` (patched)."""
    from psr_hf.engine.graphs import GraphDecoder

    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    with ctl.record() as recorder:
        sequences, logits = GraphDecoder(model, 48, graphs=graphs).generate_greedy(ids, NEW, return_logits=True)
    return sequences, logits, recorder.recordings[0].selected, ctl.stats()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_fp8_graphs_are_bitwise_eager_and_independent_of_copy_timing(folder):
    """On the GPU the FP8 slot MoE runs its Triton kernels inside the CUDA graphs: graphs against the same step
    eagerly, and several copy timings, give bitwise the same tokens, logits and selections; the copies move FP8."""
    model = load_fp8_dequantized(folder, torch.bfloat16).to("cuda")
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23]])
    runs = []
    for graphs, setting in ((False, dict()), (True, dict(max_in_flight=1)), (True, dict(max_in_flight=4)),
                            (True, dict(max_in_flight=2, copy_delay_ms=1.0))):
        with psr_hf.patched(model, PSR, calibration=False, offload=OffloadConfig(device="cuda", **setting)):
            store = psr_hf.controller(model).expert_store
            assert store.weight_format == "fp8"
            per_expert = store.memory().bytes_per_expert
            runs.append(_graph_run(model, ids, graphs))
    for run in runs[1:]:
        torch.testing.assert_close(run[0], runs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(run[1], runs[0][1], rtol=0, atol=0)
        np.testing.assert_array_equal(run[2], runs[0][2])
    bf16_per_expert = 3 * 160 * 192 * 2
    assert per_expert < 0.6 * bf16_per_expert
    stats = runs[1][3].offload
    assert stats.bytes > 0 and stats.bytes % per_expert == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_the_token_graph_on_fp8_experts_equals_the_host_path_bitwise(folder):
    from psr_hf.engine.graphs import GraphDecoder
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = load_fp8_dequantized(folder, torch.bfloat16).to("cuda")
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23]])
    with psr_hf.patched(model, PSR, calibration=False, offload=OffloadConfig(device="cuda")):
        ctl = psr_hf.controller(model)
        runs = []
        for decoder in (GraphDecoder(model, 48), TokenGraphDecoder(model, 48)):
            ctl.reset()
            ctl.reset_stats()
            runs.append((*decoder.generate_greedy(ids, NEW, return_logits=True), ctl.stats()))
    (host_ids, host_logits, host_stats), (dev_ids, dev_logits, dev_stats) = runs
    torch.testing.assert_close(dev_ids, host_ids, rtol=0, atol=0)
    torch.testing.assert_close(dev_logits, host_logits, rtol=0, atol=0)
    assert dev_stats.offload.bytes == host_stats.offload.bytes > 0
    np.testing.assert_array_equal(dev_stats.copies_per_token, host_stats.copies_per_token)
