"""The attached engine when the model changes under it and at its length limit: router weights changed after the
engine was built are routed with (or, where the engine cannot follow, refused naming what to do), a dtype conversion
fails naming the engine, and a generate() past ``max_len`` counts and records its sequence once."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import psr_hf
import psr_hf.engine
from psr_hf import RoutingConfig
from psr_hf.testing import tiny_model
from test_offload import _ids
from test_offload_faults import _generate as _generate_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

_generate = functools.partial(_generate_tokens, new=6)  # (tokens, step logits) of six new tokens unless told


def _engine_case(offload=None):
    import psr_hf.engine as engine

    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5), offload=offload)
    engine.attach(model, max_len=32)
    return model


@pytest.mark.parametrize("layer", [0, -1])  # a stacked router (with the next layer's) and the last one
@pytest.mark.parametrize("how", ["copy_", "load_state_dict", "replace", "data"])
def test_a_compiled_generate_routes_with_router_weights_changed_after_compile(layer, how):
    model = _engine_case()
    ids = _ids(2, 1, 5)
    router = psr_hf.controller(model).layers[layer].router
    new = router.weight.detach() * -1.5 + 0.01
    if how == "copy_":
        with torch.no_grad():
            router.weight.copy_(new)
    elif how == "load_state_dict":
        router.load_state_dict({"weight": new}, strict=False)
    elif how == "data":  # the same Parameter over new memory: no version change, another address
        router.weight.data = new.clone()
    else:
        router.weight = torch.nn.Parameter(new.clone())
    if how in ("replace", "data") and layer == -1:  # the last router is read where it lives: refused, with what to do
        with pytest.raises(RuntimeError, match="attach the engine again"):
            _generate(model, ids)
        return
    got = _generate(model, ids)
    psr_hf.engine.detach(model)
    want = _generate(model, ids)  # the transformers path, on the same weights
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_the_step_checks_each_router_weight_once_and_a_change_seen_by_one_stack_only_still_restacks_the_other():
    from psr_hf.engine.layers import _unchanged

    model = _engine_case()
    layers = psr_hf.engine.attached(model).decoder.layers
    routers = [r.router.weight for r in layers._routers.values()]
    assert len(layers._router_entries) == len(routers)  # each router also its predecessor's pre-gate: read once
    assert [entry[1] for entry in layers._router_entries] == routers
    handle = psr_hf.engine.attached(model).decoder.decode_handle
    with torch.no_grad():
        routers[1].mul_(-1.0)  # router 1: stacked with router 0 (its pre-gate) and with router 2
    layers.sync_routers(handle, moe_layers=(0,))  # layer 0 restacked only: router 1's own stack still stale
    assert not _unchanged(layers._router_entries)
    assert sum(entry[1] is routers[1] for entry in layers._router_entries) == 2  # read at both versions
    layers.sync_routers(handle)
    assert _unchanged(layers._router_entries) and len(layers._router_entries) == len(routers)


def test_a_compiled_model_converted_to_another_dtype_fails_naming_the_engine():
    model = _engine_case()
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"engine was built on it .*attach the engine again"):
        _generate(model, _ids(3, 1, 4))


def test_a_compiled_generate_past_max_len_counts_and_records_the_sequence_once():
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    ids = _ids(8, 1, 5)
    ctl = psr_hf.controller(model)
    with ctl.record() as want_rec:
        want = _generate(model, ids, new=20)
    want_stats = ctl.stats().total
    ctl.reset_stats()
    psr_hf.engine.attach(model, max_len=16)  # 5 + 20 positions: the engine hands over to transformers midway
    with ctl.record() as got_rec:
        got = _generate(model, ids, new=20)
    got_stats = ctl.stats().total
    assert psr_hf.engine.attached(model).fallbacks > 0
    assert torch.equal(got[0], want[0])
    assert got_stats["tokens"] == want_stats["tokens"] == 24  # each routed position once
    assert got_stats["demand_per_token"] == pytest.approx(want_stats["demand_per_token"])
    assert len(got_rec.recordings) == len(want_rec.recordings) == 1
    np.testing.assert_array_equal(got_rec.recordings[0].selected, want_rec.recordings[0].selected)
