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
