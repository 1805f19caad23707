"""The offload on a GPU (marked cuda: skipped on CI, run on the lent GPU).

Copies go through a CUDA stream from pinned host memory; how many are in flight and how long each takes change
latency, never tokens: greedy outputs are identical for max_in_flight 1, 2 and 4 and with an artificial delay
injected into every copy.
"""

from __future__ import annotations

import pytest
import torch

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.testing import tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
              pytest.mark.usefixtures("quiet_psr_hf")]

CONFIG = RoutingConfig(policy="psr", lam=0.3, budget=2, residency=0.25)


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, mask=None, new=24):
    device = next(model.parameters()).device if not hasattr(model, "device") else model.device
    kwargs = {} if mask is None else {"attention_mask": mask.to(device)}
    with torch.no_grad():
        out = model.generate(ids.to(device), max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences.cpu(), torch.stack(out.logits).float().cpu()


@pytest.mark.parametrize("family", ["olmoe", "qwen3_5_moe_text", "deepseek_v3"])
def test_greedy_tokens_do_not_depend_on_copy_timing(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    prompts = [(_ids(1, 1, 1), None), (_ids(2, 1, 9), None)]
    ids = _ids(3, 2, 8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    prompts.append((ids, mask))
    runs = []
    for max_in_flight, delay in ((1, 0.0), (2, 0.0), (4, 0.0), (2, 1.0), (1, 2.0)):
        psr_hf.patch(model, CONFIG, offload=OffloadConfig(device="cuda:0", max_in_flight=max_in_flight,
                                                          copy_delay_ms=delay))
        try:
            assert next(model.lm_head.parameters()).is_cuda
            outputs = [_generate(model, p, m) for p, m in prompts]
            stats = psr_hf.controller(model).stats()
        finally:
            psr_hf.unpatch(model)
        runs.append((outputs, stats))
    first = runs[0]
    for outputs, stats in runs[1:]:
        for (tokens, logits), (ref_tokens, ref_logits) in zip(outputs, first[0]):
            assert torch.equal(tokens, ref_tokens)
            assert torch.equal(logits, ref_logits)
        assert stats.total == first[1].total
    # the delayed runs waited longer for their copies than the undelayed ones
    assert runs[4][1].offload.wait_ms > runs[0][1].offload.wait_ms
    # against the non-offloaded patched model on the GPU: decoding from a one-token prompt gives the same tokens;
    # prompts whose experts exceed the slots run in groups of experts, whose sum rounds differently in bf16 (so only
    # the first step's logits are compared, to bf16 precision)
    model.cuda()
    with psr_hf.patched(model, CONFIG):
        resident = [_generate(model, p, m) for p, m in prompts]
    model.cpu()
    assert torch.equal(first[0][0][0], resident[0][0])
    for (_, logits), (_, ref_logits) in zip(first[0], resident):
        torch.testing.assert_close(logits[0], ref_logits[0], rtol=0.05, atol=0.05)


def _cuda_python_missing() -> str:
    from psr_hf.offload import cuda_runtime

    ok, why = cuda_runtime.available()
    return "" if ok else why


@pytest.mark.skipif(bool(_cuda_python_missing()), reason="raw copy calls need cuda-python: the cuda extra")
def test_raw_copy_calls_equal_torch_calls():
    """Copies issued by cuda-python (the default when it imports) and by torch's calls: the same tokens, logits,
    routing statistics and copy counts; with 3 events in the link's ring (reused every 3 copies, waited for when
    still in flight) and every slot checked against the host store."""
    from psr_hf.offload import links

    model = tiny_model("olmoe", dtype=torch.bfloat16)
    prompts = [(_ids(1, 1, 1), None), (_ids(2, 1, 9), None)]
    runs = {}
    for api, ring in (("torch", None), ("cuda-python", None), ("cuda-python", 3)):
        previous = links.RING
        if ring is not None:
            links.RING = ring
        try:
            with psr_hf.patched(model, CONFIG, offload=OffloadConfig(device="cuda:0", copy_api=api,
                                                                       check_slots=ring is not None)):
                link = psr_hf.controller(model).offload.link
                assert isinstance(link, links.RuntimeLink) == (api == "cuda-python")
                outputs = [_generate(model, p, m) for p, m in prompts]
                stats = psr_hf.controller(model).stats()
        finally:
            links.RING = previous
        runs[(api, ring)] = (outputs, stats)
    (ref_out, ref_stats) = runs[("torch", None)]
    for key, (outputs, stats) in runs.items():
        for (tokens, logits), (ref_tokens, ref_logits) in zip(outputs, ref_out):
            assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits), key
        assert stats.total == ref_stats.total, key
        for field in ("demand", "prefetch", "dropped", "warm", "bytes"):
            assert getattr(stats.offload, field) == getattr(ref_stats.offload, field), (key, field)
        assert stats.offload.demand + stats.offload.prefetch > 0


def test_copy_api_cuda_python_without_it_is_a_clear_error(monkeypatch):
    from psr_hf.offload import cuda_runtime

    monkeypatch.setattr(cuda_runtime, "available", lambda: (False, "cuda-python is not importable (test)"))
    model = tiny_model("olmoe", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="copy_api='cuda-python'.*not importable"):
        psr_hf.patch(model, CONFIG, offload=OffloadConfig(device="cuda:0", copy_api="cuda-python"))
    with pytest.raises(ValueError, match="not patched"):  # the failed install left nothing on the model
        psr_hf.controller(model)


def test_slots_hold_the_executed_experts_on_cuda():
    model = tiny_model("olmoe", dtype=torch.bfloat16)
    psr_hf.patch(model, CONFIG, offload=OffloadConfig(device="cuda:0", check_slots=True, max_in_flight=1))
    try:
        ids = _ids(4, 2, 7)
        _generate(model, ids, torch.ones_like(ids), new=16)
        _generate(model, _ids(5, 1, 1), new=16)
    finally:
        psr_hf.unpatch(model)


def test_device_memory_holds_only_the_slots_and_unpatch_restores():
    model = tiny_model("olmoe", dtype=torch.bfloat16, num_experts=64, num_experts_per_tok=8, intermediate_size=256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    psr_hf.patch(model, RoutingConfig(policy="psr", residency=0.25), offload="cuda:0")
    try:
        mem = psr_hf.controller(model).memory()
        used = torch.cuda.memory_allocated() - start
        engine = psr_hf.controller(model).offload
        assert all(buffer.is_pinned() for buffer in engine.placement.buffers)
        assert mem.pinned and mem.capacity == 16 and mem.expert_bytes_device * 4 == mem.expert_bytes_full
        # slots plus the non-expert weights, and nothing like the full experts
        assert mem.expert_bytes_device <= used < mem.expert_bytes_device + mem.non_expert_bytes_device + 2**20
        _generate(model, _ids(6, 1, 4), new=8)
    finally:
        psr_hf.unpatch(model)
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, before[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shipped_trained_model_decodes_the_same_tokens_offloaded_on_cuda(dtype):
    """tiny-moe (trained routers, real text) offloaded to cuda:0: copy timing never changes tokens or logits
    (bitwise across max_in_flight and copy delays). Against the same patched model resident on the GPU, decode
    steps are the same computation but the prompt is a block whose experts run in groups of at most C, equal to
    rounding: in float32 the greedy tokens are the same and the logits equal to 1e-4."""
    from psr_hf.assets import load_tiny_moe

    model, tokenizer, calibration = load_tiny_moe(dtype=dtype)
    tokenizer.padding_side = "left"
    batch = tokenizer(["Sir Walter Elliot, of Kellynch Hall,", "def main():\n    parser ="], return_tensors="pt",
                      padding=True, add_special_tokens=False)
    config = RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.25)
    model.to("cuda:0")
    with psr_hf.patched(model, config, calibration=calibration):
        resident = _generate(model, batch["input_ids"], batch["attention_mask"])
    model.to("cpu")
    runs = []
    for max_in_flight, delay in ((2, 0.0), (1, 1.0), (4, 0.0)):
        with psr_hf.patched(model, config, calibration=calibration,
                            offload=OffloadConfig(device="cuda:0", max_in_flight=max_in_flight, copy_delay_ms=delay)):
            runs.append(_generate(model, batch["input_ids"], batch["attention_mask"]))
            stats = psr_hf.controller(model).stats().offload
        assert stats.demand + stats.prefetch > 0
    for tokens, logits in runs[1:]:
        assert torch.equal(tokens, runs[0][0]) and torch.equal(logits, runs[0][1])
    tokens, logits = runs[0]
    if dtype == torch.float32:
        assert torch.equal(tokens, resident[0])
        torch.testing.assert_close(logits, resident[1], rtol=1e-4, atol=1e-4)
    # bf16: no comparison with the resident model. Measured on the H200: its logits (up to 20, where bf16's spacing
    # is 0.125) differ by up to 1.0 at the first step even under exact routing, and psr's greedy tokens part after
    # a few steps
