"""Silent wrong results a review found in the routed forward (issue 47): exact routing at the router's own ties in
every dtype, displaced mass under a gate, gradient checkpointing with several forwards before one backward, rows
stopped by a stopping criterion, assisted decoding under a cache-aware policy, and exact routing inside a graph
compiled with ``fullgraph=True``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import psr_hf
from psr_hf.hf.inputs import cache_keyword
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_next")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tied_routers(model: torch.nn.Module) -> torch.nn.Module:
    """Every odd expert's router row (and DeepSeek-V3's score bias) equal to the even one before it: the two score
    exactly alike in every dtype, so the router's own top-K often ends inside a tied pair and its pick decides."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and param.ndim == 2 and param.shape[0] > 1:
                param[1::2] = param[0::2]
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer[1::2] = buffer[0::2]
    return model


def _executed(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """The experts each MoE layer's experts module ran, in call order, while ``run()`` runs."""
    calls: list[torch.Tensor] = []
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [b.register_forward_pre_hook(lambda module, args: calls.append(args[1].detach().clone())) for b in blocks]
    try:
        out = run()
    finally:
        for hook in hooks:
            hook.remove()
    return out, calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_routing_runs_the_routers_own_pick_at_ties(family, dtype):
    model = _tied_routers(tiny_model(family, dtype=dtype, seed=1))
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, own = _executed(model, lambda: model(input_ids=ids).logits)
        tokens = model.generate(ids[:1], max_new_tokens=24, do_sample=False)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)), torch.no_grad():
        patched_logits, ran = _executed(model, lambda: model(input_ids=ids).logits)
        patched_tokens = model.generate(ids[:1], max_new_tokens=24, do_sample=False)
    assert len(ran) == len(own)
    for mine, theirs in zip(ran, own):
        assert torch.equal(mine, theirs)  # the same experts in the same order, ties included
    assert torch.equal(patched_logits, logits)
    assert torch.equal(patched_tokens, tokens)


def test_the_tie_test_has_ties_the_lower_index_rule_breaks_otherwise():
    """The models above do tie at the top-K boundary: the policy's own rule (ties to the lower index) picks other
    experts than the router at some positions, so the test above shows the router's pick is followed."""
    model = _tied_routers(tiny_model("olmoe", dtype=torch.bfloat16, seed=1))
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    router = model.model.layers[0].mlp.gate
    hidden = model.model.embed_tokens(ids).reshape(-1, router.weight.shape[1])
    with torch.no_grad():
        _, _, indices = router(hidden)
        scores = torch.nn.functional.linear(hidden, router.weight).float().numpy()
    ranking = np.argsort(-scores, axis=1, kind="stable")[:, : router.top_k]  # ties to the lower index
    assert (np.sort(ranking, 1) != np.sort(indices.numpy(), 1)).any()


def test_displaced_mass_comes_from_the_routers_own_scores_under_a_gate():
    from psr_hf.assets import load_shipped
    from psr_hf.gates import MarginHead

    model, tokenizer, calibration = load_shipped("olmoe-routing")
    config = psr_hf.RoutingConfig(policy="cache_prior", lam=0.3, eviction="lru", residency=0.375)
    ids = tokenizer("The committee met on Tuesday to discuss the budget, and after a long debate it decided",
                    return_tensors="pt")["input_ids"]
    untrained = MarginHead.uniform(config.lam * calibration.delta, int(model.config.hidden_size))
    runs = []
    for gate in (None, untrained):  # the untrained head makes Cache-Prior's decisions
        with psr_hf.patched(model, config, calibration=calibration, gate=gate), torch.no_grad():
            ctl = psr_hf.controller(model)
            with ctl.record() as recorder:
                model.generate(ids, max_new_tokens=12, do_sample=False)
            runs.append((recorder.recordings[0].selected, ctl.stats().total))
    (plain_selected, plain), (gated_selected, gated) = runs
    np.testing.assert_array_equal(gated_selected, plain_selected)
    assert plain["displaced_mass"] > 0
    assert gated["displaced_mass"] == plain["displaced_mass"]


def _two_forward_gradients(model: torch.nn.Module, checkpointing: bool | str) -> dict[str, torch.Tensor]:
    """Gradients of the sum of two forward passes' losses (different inputs) with one backward."""
    from test_hf_training import train_with_checkpointing

    train_with_checkpointing(model, checkpointing)
    losses = []
    for seed in (0, 1):
        ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(seed))
        losses.append(model(input_ids=ids, labels=ids, use_cache=False).loss)
    (losses[0] + losses[1]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [True, "reentrant"])
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_two_forwards_before_one_backward_recompute_each_forwards_routing(family, checkpointing):
    model = tiny_model(family, seed=0)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, residency=0.5))
    plain = _two_forward_gradients(model, checkpointing=False)
    checkpointed = _two_forward_gradients(model, checkpointing=checkpointing)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0, msg=name)
    assert psr_hf.controller(model).stats().total["replaced_per_token"] > 0


class _StopRowZeroAfter(StoppingCriteria):
    """Row 0 is done once it has ``n`` new tokens; the other rows run on."""

    def __init__(self, prompt: int, n: int):
        self.prompt, self.n = prompt, n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[0] = input_ids.shape[1] - self.prompt >= self.n
        return done


@pytest.mark.parametrize("policy", ["psr", "exact"])
def test_a_row_stopped_by_a_stopping_criterion_counts_and_records_as_alone(policy):
    model = tiny_model("olmoe", seed=0)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=1)
    results = []
    config = psr_hf.RoutingConfig(policy=policy, residency=0.5, **({"lam": 0.3} if policy == "psr" else {}))
    with psr_hf.patched(model, config), torch.no_grad():
        ctl = psr_hf.controller(model)
        for batch in (ids[:1], ids):
            ctl.reset_stats()
            with ctl.record() as recorder:
                model.generate(batch, stopping_criteria=StoppingCriteriaList([_StopRowZeroAfter(8, 3)]), **kwargs)
            stats = ctl.stats()
            results.append((int(stats.tokens[0]), recorder.recordings[0]))
    (alone_tokens, alone), (batch_tokens, batched) = results
    assert batch_tokens == alone_tokens == 8 + 3 - 1  # the prompt and the tokens fed before the stop
    assert len(batched.tokens) == len(alone.tokens)
    np.testing.assert_array_equal(batched.selected, alone.selected)


@pytest.mark.parametrize("assist", ["prompt_lookup", "assistant_model"])
def test_assisted_decoding_is_refused_under_a_cache_aware_policy(assist):
    model = tiny_model("olmoe", seed=0)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([ids, ids], dim=1)  # prompt lookup finds n-grams to propose
    extra = ({"prompt_lookup_num_tokens": 4} if assist == "prompt_lookup"
             else {"assistant_model": tiny_model("olmoe", seed=5)})
    kwargs = dict(input_ids=ids, max_new_tokens=12, do_sample=False, **extra)
    with torch.no_grad():
        greedy = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)), torch.no_grad():
        assert torch.equal(model.generate(**kwargs), greedy)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, residency=0.5)), torch.no_grad():
        with pytest.raises(ValueError, match="assisted decoding"):
            model.generate(**kwargs)
        assert psr_hf.controller(model).forward_pass is None
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # the model still works


def test_a_forward_over_a_cropped_cache_is_refused_under_a_cache_aware_policy():
    from transformers import DynamicCache

    model = tiny_model("olmoe", seed=0)
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(4))
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, residency=0.5)), torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
        cache.crop(-3)  # three positions the routing state has seen are gone from the KV cache
        with pytest.raises(RuntimeError, match="cropped"):
            model(input_ids=ids[:, 7:8], use_cache=True, **{cache_keyword(model): cache})


def _compile_config():
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    config._compile_all_devices = True  # transformers compiles on a GPU only unless told
    return config


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_routing_compiles_with_fullgraph_and_generates_as_unpatched(family):
    """As transformers' test_generate_compile_model_forward_fullgraph runs it: two batches of the same shape, a
    static cache, the forward compiled with fullgraph=True, no recompilation for the second batch."""
    torch.compiler.reset()
    model = tiny_model(family, seed=0)
    batches = [torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(seed)) for seed in (2, 3)]
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        eager = [model.generate(ids, **kwargs) for ids in batches]
    config = _compile_config()
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)), torch.no_grad():
        compiled = [model.generate(batches[0], cache_implementation="static", compile_config=config, **kwargs)]
        assert hasattr(model, "_compiled_call") or hasattr(psr_hf.controller(model).family.decoder(),
                                                            "_compiled_call")
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled.append(model.generate(batches[1], cache_implementation="static", compile_config=config,
                                           **kwargs))
    for mine, theirs in zip(compiled, eager):
        assert torch.equal(mine.sequences, theirs.sequences)
        for a, b in zip(mine.scores, theirs.scores):
            torch.testing.assert_close(a, b)


def test_a_forward_compiled_with_fullgraph_is_the_unpatched_forward_under_exact_routing():
    torch.compiler.reset()
    model = tiny_model("olmoe", seed=0)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        assert torch.equal(compiled(input_ids=ids).logits, expected)


def test_a_cache_aware_policy_inside_a_compiled_graph_is_refused_with_the_reason():
    torch.compiler.reset()
    model = tiny_model("olmoe", seed=0)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="decides the routing on the host"):
            compiled(input_ids=ids)


def test_following_the_routers_picks_changes_only_the_positions_that_disagree_and_only_their_picks():
    from psr_hf.hf.router_choice import follow_router_choice

    scores = np.array([[3.0, 2.0, 2.0, 1.0],    # a tie at the boundary: the router took expert 2
                       [4.0, 3.0, 1.0, 0.0],    # agrees with the policy's top-2
                       [-np.inf, 1.0, 5.0, 1.0]], dtype=np.float32)  # the router took a masked expert
    picks = np.array([[0, 2], [1, 0], [0, 2]])
    out = follow_router_choice(scores, picks)
    assert out is not scores and out.dtype == np.float32
    top = np.argsort(-out, axis=1, kind="stable")[:, :2]  # the policy's ranking: ties to the lower index
    np.testing.assert_array_equal(np.sort(top, 1), np.sort(picks, 1))
    np.testing.assert_array_equal(out[1], scores[1])  # an agreeing position is untouched
    assert out[0, 2] == np.nextafter(np.float32(2.0), np.float32(np.inf)) and out[0, 1] == 2.0
    assert out[2, 0] == np.nextafter(np.float32(1.0), np.float32(np.inf)) and out[2, 2] == 5.0
    agreeing = scores[1:2]
    assert follow_router_choice(agreeing, picks[1:2]) is agreeing  # nothing to change: no copy
