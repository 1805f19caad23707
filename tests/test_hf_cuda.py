"""The patched path on a GPU (marked cuda: skipped on CI, run on the lent GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.testing import tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_exact_is_bitwise_unpatched_and_psr_replays_on_cuda(family):
    model = tiny_model(family).cuda()
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        ref_logits = model(ids, attention_mask=mask).logits
        with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5, budget=1, eviction="score")):
            assert torch.equal(model(ids, attention_mask=mask).logits, ref_logits)
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), reference)
        config = psr_hf.RoutingConfig(policy="psr", residency=0.25)
        with psr_hf.patched(model, config):
            with psr_hf.controller(model).record() as rec:
                model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            assert psr_hf.controller(model).stats().total["replaced_per_token"] > 0
    for recording in rec.recordings:
        np.testing.assert_array_equal(psr_hf.replay(config, recording).selected, recording.selected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_next"])
def test_exact_routing_runs_the_routers_own_pick_at_ties_on_cuda(family, dtype):
    """torch's top-k on the GPU breaks ties its own way too: the experts that ran are the unpatched model's."""
    from test_faults_routing import _executed, _tied_routers

    model = _tied_routers(tiny_model(family, dtype=dtype, seed=1)).cuda()
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits, own = _executed(model, lambda: model(input_ids=ids).logits)
        tokens = model.generate(ids[:1], max_new_tokens=24, do_sample=False)
        with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)):
            patched_logits, ran = _executed(model, lambda: model(input_ids=ids).logits)
            patched_tokens = model.generate(ids[:1], max_new_tokens=24, do_sample=False)
    assert len(ran) == len(own) and all(torch.equal(a, b) for a, b in zip(ran, own))
    assert torch.equal(patched_logits, logits)
    assert torch.equal(patched_tokens, tokens)
