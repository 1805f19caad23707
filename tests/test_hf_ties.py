"""Tied router scores (common in bf16): the experts that run are always the ones the logical cache selected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.testing import tiny_model


@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_executed_experts_equal_the_recorded_selection_even_with_ties(policy):
    model = tiny_model("olmoe", dtype=torch.bfloat16, seed=0)  # ties at the top-K boundary under both policies
    config = psr_hf.RoutingConfig(policy=policy, residency=0.5)
    with psr_hf.patched(model, config):
        ctl = psr_hf.controller(model)
        executed: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in ctl.layers}
        hooks = [layer.block.experts.register_forward_pre_hook(
            lambda module, args, i=layer.index: executed[i].append(args[1].clone())) for layer in ctl.layers]
        try:
            ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0))
            with torch.no_grad(), ctl.record() as rec:
                model.generate(ids, max_new_tokens=64, do_sample=False)
        finally:
            for hook in hooks:
                hook.remove()
    (recording,) = rec.recordings
    z = recording.scores.astype(np.float64)
    ordered = -np.sort(-z, axis=-1)
    ties = ordered[..., ctl.top_k - 1] == ordered[..., ctl.top_k]  # [T, L]
    if policy == "psr":  # exact routing's recorded scores break each tie the router's way (router_choice)
        assert ties.any(), "the test needs tied router scores at the top-K boundary; pick another seed"
    for layer, calls in executed.items():
        ran = np.sort(torch.cat(calls).numpy(), axis=-1)  # [T, K]
        np.testing.assert_array_equal(ran, recording.selected[:, layer])
    # the replayed policy agrees too (ties go to the lower index in both)
    np.testing.assert_array_equal(psr_hf.replay(config, recording).selected, recording.selected)
