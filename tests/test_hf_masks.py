"""Every attention mask transformers hands a patched model marks padding for the routing state: 2D masks, the 4D
masks of a static cache and of packed sequences, and the per-layer-type dicts of hybrid models. Under exact routing
a static cache generates the unpatched model's tokens; under psr it makes the dynamic cache's routing decisions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.hf.masks import valid_positions
from psr_hf.testing import tiny_model

FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_next")


def _causal_4d(mask2d: torch.Tensor, past: int, S: int, keys: int, kind: str) -> torch.Tensor:
    """The 4D mask transformers builds: query i (absolute position past + i) attends real keys up to its own."""
    B = mask2d.shape[0]
    pos = torch.arange(past, past + S).view(1, S, 1)
    key = torch.arange(keys).view(1, 1, keys)
    real = torch.zeros(B, keys, dtype=torch.bool)
    real[:, : mask2d.shape[1]] = mask2d.bool()
    attend = (key <= pos) & real[:, None, :]  # [B, S, K]
    attend = attend[:, None]
    if kind == "bool":
        return attend
    if kind == "int":
        return attend.long()
    return torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["bool", "int", "float"])
def test_a_4d_mask_marks_the_positions_its_2d_mask_marks(kind):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    expected = valid_positions(mask, 3, 5, 0)
    assert expected.tolist() == [[0, 0, 1, 1, 1], [1] * 5, [0, 1, 1, 1, 1]]
    for keys in (5, 12):  # a dynamic cache's keys, a static cache's (unfilled slots masked)
        assert np.array_equal(valid_positions(_causal_4d(mask, 0, 5, keys, kind), 3, 5, 0), expected)
    decode = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), dim=1)  # one more position, after 5 cached
    assert valid_positions(_causal_4d(decode, 5, 1, 12, kind), 3, 1, 5) is None
    assert valid_positions(_causal_4d(decode, 5, 1, 12, kind), 3, 1, 5, positions=torch.tensor([5])) is None


def test_a_padded_row_that_a_backend_unmasked_is_still_padding():
    mask = _causal_4d(torch.tensor([[0, 0, 1, 1]]), 0, 4, 4, "bool")
    mask[0, 0, :2] = True  # fully masked rows made to attend everything, as some attention backends do
    assert valid_positions(mask, 1, 4, 0).tolist() == [[0, 0, 1, 1]]


def test_a_dict_of_masks_per_layer_type_is_read_from_its_2d_or_4d_entry():
    mask = torch.tensor([[0, 1, 1]])
    four = _causal_4d(mask, 0, 3, 3, "bool")
    assert valid_positions({"full_attention": four, "linear_attention": mask}, 1, 3, 0).tolist() == [[0, 1, 1]]
    assert valid_positions({"full_attention": four, "linear_attention": None}, 1, 3, 0).tolist() == [[0, 1, 1]]
    assert valid_positions({"full_attention": None}, 1, 3, 0) is None


@pytest.mark.parametrize("bad", [torch.ones(2, 3, 4), torch.ones(3, 1, 4, 4), "mask", torch.ones(2, 1, 5, 4)])
def test_a_mask_it_cannot_read_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="attention_mask"):
        valid_positions(bad, 2, 4, 0)


def _ids_and_mask(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_a_static_cache_generates_the_unpatched_tokens_and_the_dynamic_caches_decisions(family, quiet_psr_hf):
    torch.manual_seed(0)
    model = tiny_model(family).eval()
    ids, mask = _ids_and_mask()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    unpatched = model.generate(**kwargs, cache_implementation="static")
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=1.0)):
        exact = model.generate(**kwargs, cache_implementation="static")
    assert torch.equal(exact.sequences, unpatched.sequences)
    assert all(torch.equal(a, b) for a, b in zip(exact.scores, unpatched.scores))
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)):
        with psr_hf.controller(model).record() as static:
            on_static = model.generate(**kwargs, cache_implementation="static")
        with psr_hf.controller(model).record() as dynamic:
            on_dynamic = model.generate(**kwargs)
    assert torch.equal(on_static.sequences, on_dynamic.sequences)
    assert len(static.recordings) == len(dynamic.recordings) == 2
    for a, b in zip(static.recordings, dynamic.recordings):
        assert np.array_equal(a.selected, b.selected) and np.array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_custom_4d_mask_routes_as_its_2d_mask_does(kind, quiet_psr_hf):
    """A forward with a prepared 4D mask (packed sequences, custom masks): under exact routing the unpatched
    logits; under psr the decisions of the same forward with the 2D mask."""
    torch.manual_seed(0)
    model = tiny_model("olmoe").eval()
    ids, mask = _ids_and_mask(1)
    four = _causal_4d(mask, 0, ids.shape[1], ids.shape[1], kind)
    unpatched = model(input_ids=ids, attention_mask=four).logits
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=1.0)):
        assert torch.equal(model(input_ids=ids, attention_mask=four).logits, unpatched)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)):
        runs = []
        for m in (mask, four):
            with psr_hf.controller(model).record() as rec:
                model(input_ids=ids, attention_mask=m)
            runs.append(rec.recordings)
    assert [r.selected.shape for r in runs[0]] == [r.selected.shape for r in runs[1]]
    assert runs[0][0].selected.shape[0] == 4  # row 0 recorded its 4 real positions only
    assert all(np.array_equal(a.selected, b.selected) for a, b in zip(*runs))


def test_a_compiled_forward_breaks_its_graph_at_the_routing_and_routes_as_the_eager_one(quiet_psr_hf):
    """torch.compile without fullgraph (the routing decisions run on the host between the layers): the logits
    and the decisions of the eager patched forward."""
    torch.manual_seed(0)
    model = tiny_model("olmoe").eval()
    ids, mask = _ids_and_mask(5)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)):
        with psr_hf.controller(model).record() as eager:
            expected = model(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(model, backend="eager")
        with psr_hf.controller(model).record() as traced:
            logits = compiled(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)
    assert all(np.array_equal(a.selected, b.selected) for a, b in zip(eager.recordings, traced.recordings))
