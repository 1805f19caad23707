"""psr_hf.engine.layers: the batch-1 decode building blocks against the transformers model they are built from
(CPU, float32).

Tolerances: decoded logits equal the full-sequence HF forward's at every position within 1e-5 of the position's
largest |logit| (measured: below 1e-6); router logits and pre-gates within 5e-6 of the largest |logit| (the same
matmul in another shape; measured: below 1e-6); the engine's scores equal the family's ``joint_scores`` bitwise
and the scores the controller records within 1e-5; the executed experts are the HF router's own top-K exactly.
"""

from __future__ import annotations

import types

import pytest
import torch

import psr_hf
from psr_hf.assets import OLMOE_ROUTING_NAME, load_shipped
from psr_hf.engine.families.deepseek_v3 import DeepseekV3Layers
from psr_hf.engine.families.olmoe import OlmoeLayers
from psr_hf.engine.families import build_layers
from psr_hf.engine.layers import DecodeLayers
from psr_hf.testing import tiny_model

LOGITS_TOL = 1e-5  # relative to the largest |logit| of the position
ROUTER_TOL = 5e-6  # relative to the largest |logit|; measured up to 7e-7 (another matmul shape than HF's)
TEXT = "The engine decodes one token at a time, and every step replays the same two graphs per layer."

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, mscale=0.8,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
VARIANTS = {
    "olmoe": ("olmoe", {}),
    "olmoe-gqa-clip": ("olmoe", dict(num_key_value_heads=2, clip_qkv=0.3)),
    "deepseek": ("deepseek_v3", {}),  # q_lora_rank None, rope_interleave True (the config default)
    "deepseek-plain-rope": ("deepseek_v3", dict(rope_interleave=False)),
    "deepseek-qlora": ("deepseek_v3", dict(q_lora_rank=24)),
    "deepseek-yarn": ("deepseek_v3", dict(rope_parameters=YARN, max_position_embeddings=32)),
}


@pytest.fixture(scope="module")
def shipped():
    return load_shipped(OLMOE_ROUTING_NAME)  # (model, tokenizer, calibration)


@pytest.fixture(scope="module")
def models(request):
    """``models(name)``: the model of a variant (built once per module); "shipped" is the trained OLMoE."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            if name == "shipped":
                cache[name] = request.getfixturevalue("shipped")[0]
            else:
                family, overrides = VARIANTS[name]
                cache[name] = tiny_model(family, **overrides)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def prompt(request):
    """``prompt(name)``: the token ids the tests decode with the model ``name``."""

    def get(name: str) -> list[int]:
        if name == "shipped":
            return request.getfixturevalue("shipped")[1](TEXT)["input_ids"]
        return list(TEXT.encode())[:14]  # the tiny models' byte vocabulary

    return get


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def _decode(eng: DecodeLayers, ids: list[int]) -> torch.Tensor:
    return torch.stack([eng.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])


# ---------------------------------------------------------------------------------------------------- logits
CASES = [("olmoe", True), ("olmoe-gqa-clip", True), ("deepseek", True), ("deepseek", False),
         ("deepseek-plain-rope", True), ("deepseek-qlora", True), ("deepseek-qlora", False), ("deepseek-yarn", True),
         ("shipped", True)]


@pytest.mark.parametrize("name, absorb", CASES, ids=[f"{n}-{'absorbed' if a else 'expanded'}" for n, a in CASES])
def test_decode_matches_full_sequence_forward(models, prompt, name, absorb):
    model = models(name)
    ids = prompt(name)
    ref = _hf_logits(model, ids)
    eng = build_layers(model, max_len=len(ids) + 4, absorb_mla=absorb)  # unused slots stay masked
    got = _decode(eng, ids)
    worst = max(_rel(got[p], ref[p]) for p in range(len(ids)))
    assert worst < LOGITS_TOL, f"{name}: max relative logit difference {worst:.2e}"


def test_a_new_sequence_reuses_the_cache_without_reset(models):
    model = models("deepseek")
    eng = build_layers(model, max_len=20)
    _decode(eng, list(b"a much longer first sequence")[:20])
    ids = list(b"short")
    got = _decode(eng, ids)  # the first sequence's later slots are still there, masked
    assert max(_rel(got[p], r) for p, r in enumerate(_hf_logits(model, ids))) < LOGITS_TOL


def test_variants_exercise_what_they_name(models, prompt):
    default, plain = models("deepseek"), models("deepseek-plain-rope")
    assert default.config.rope_interleave and not plain.config.rope_interleave
    ids = prompt("deepseek")
    # same seed and weights: only the RoPE layout differs, and it changes the outputs after position 0
    assert _rel(_hf_logits(default, ids)[1:], _hf_logits(plain, ids)[1:]) > 1e-3
    assert models("deepseek-qlora").model.layers[0].self_attn.q_proj is None
    yarn = build_layers(models("deepseek-yarn"), 8)
    attn = models("deepseek-yarn").model.layers[0].self_attn
    assert yarn.scaling == pytest.approx(attn.scaling) and yarn.scaling != pytest.approx(yarn.qk_dim ** -0.5)
    assert yarn.rope_scaling != 1.0  # yarn's cos/sin factor (mscale / mscale_all_dim)
    gqa = build_layers(models("olmoe-gqa-clip"), 8)
    assert (gqa.num_heads, gqa.num_kv_heads) == (4, 2) and gqa.kv.keys[0].shape == (8, 2, 16)


# ---------------------------------------------------------------------------------------------------- per block
def _router_inputs(model: torch.nn.Module, ids: list[int]) -> dict[int, tuple[torch.Tensor, tuple]]:
    """Per MoE decoder layer: HF's router input ``[S, H]`` and its output triple on the full sequence."""
    seen: dict[int, tuple] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            handles.append(gate.register_forward_hook(
                lambda mod, args, out, i=i: seen.__setitem__(i, (args[0].reshape(-1, args[0].shape[-1]).clone(),
                                                                 tuple(o.clone() for o in out)))))
    try:
        _hf_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("name", ["olmoe", "deepseek", "shipped"])
def test_blocks_in_graph_order_match_hf_layer_by_layer(models, prompt, name):
    """The functions as the graph engine calls them (separate output buffers): every MoE layer's router input,
    logits, pre-gate, scores, selected experts and weights against HF's on the same sequence."""
    model = models(name)
    ids = prompt(name)
    hf = _router_inputs(model, ids)
    eng = build_layers(model, max_len=len(ids))
    family = eng.family
    H, E, K = eng.hidden_size, eng.num_experts, eng.top_k
    hidden, hidden2, normed, mlp = (torch.zeros(1, H) for _ in range(4))
    logits = torch.zeros(1, model.config.vocab_size)
    ref = _hf_logits(model, ids)
    position = torch.zeros((), dtype=torch.int64)
    ids_buf, w_buf = torch.zeros(1, K, dtype=torch.int64), torch.zeros(1, K, dtype=eng.buffers.router_logits.dtype)
    for p, token in enumerate(ids):
        eng.check_position(p)
        position.fill_(p)
        eng.embed(torch.tensor([token]), hidden)
        for layer in range(eng.num_layers):
            eng.attention_block(layer, hidden, position, hidden2, normed)
            hidden.copy_(hidden2)
            if not eng.is_moe(layer):
                eng.dense_mlp(layer, normed, mlp)
                hidden.add_(mlp)
                continue
            x_hf, (logits_hf, weights_hf, index_hf) = hf[layer]
            assert _rel(normed[0], x_hf[p]) < LOGITS_TOL
            W = eng.router_width(layer)
            r_logits, r_scores = torch.zeros(1, W, dtype=w_buf.dtype), torch.zeros(1, W, dtype=w_buf.dtype)
            eng.router_logits(layer, normed, r_logits)
            eng.router_scores(layer, r_logits, r_scores)
            # on HF's own router input: this router's logits and the next one's (its pre-gate)
            x = x_hf[p : p + 1]
            on_hf = torch.zeros(1, W, dtype=w_buf.dtype)
            eng.router_logits(layer, x, on_hf)
            assert _rel(on_hf[0, :E], logits_hf[p]) < ROUTER_TOL
            moe = {m.decoder_index: m for m in family.moe_layers()}
            following = [m for m in family.moe_layers() if m.decoder_index > layer]
            if following:
                assert W == 2 * E
                assert _rel(on_hf[0, E:], following[0].router(x)[0][0]) < ROUTER_TOL
                _, joint = family.joint_scores(moe[layer].router, following[0].router, x,
                                               family.stacked_router_weight(moe[layer].router.weight,
                                                                            following[0].router.weight))
                on_hf_scores = torch.zeros_like(on_hf)
                eng.router_scores(layer, on_hf, on_hf_scores)
                assert torch.equal(on_hf_scores, joint)  # the controller's joint_scores, bitwise
            else:
                assert W == E
            eng.router_top_k(layer, r_scores, ids_buf)
            eng.execution_weights(layer, r_logits, ids_buf, w_buf)
            assert ids_buf[0].sort().values.tolist() == index_hf[p].sort().values.tolist()
            order_hf, order = index_hf[p].argsort(), ids_buf[0].argsort()
            assert torch.allclose(w_buf[0][order], weights_hf[p][order_hf].to(w_buf.dtype), rtol=1e-5, atol=1e-7)
            # graph B's work, here the reference MoE: routed experts against HF's experts module, shared, residual
            routed = eng.moe_reference(layer, normed, ids_buf, w_buf)
            experts = model.model.layers[layer].mlp.experts
            assert _rel(routed[0], experts(normed, ids_buf, w_buf)[0]) < 1e-5
            mlp.copy_(routed)
            if eng.has_shared_experts(layer):
                shared = torch.zeros(1, H)
                eng.shared_expert(layer, normed, shared)
                assert _rel(shared[0], model.model.layers[layer].mlp.shared_experts(normed)[0]) < 1e-6
                mlp.add_(shared)
            hidden.add_(mlp)
        eng.final(hidden, logits)
        assert _rel(logits[0], ref[p]) < LOGITS_TOL


@pytest.mark.parametrize("name", ["deepseek", "shipped"])
def test_scores_are_what_the_controller_records(models, prompt, request, name, quiet_psr_hf):
    """The controller's recorded z and pre-gate g (exact routing with logical prefetch: the pre-gate is computed)
    equal the engine's router scores decoded token by token, and its executed experts the engine's top-K."""
    model = models(name)
    ids = prompt(name)
    calibration = request.getfixturevalue("shipped")[2] if name == "shipped" else None
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", budget=1, residency=0.5), calibration) as pm:
        with psr_hf.controller(pm).record() as rec, torch.no_grad():
            pm(torch.tensor([ids]))
    recording = rec.recordings[0]
    eng = build_layers(model, max_len=len(ids))
    trace: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    router_scores, router_top_k = eng.router_scores, eng.router_top_k

    def scores_spy(layer, logits, out):
        router_scores(layer, logits, out)
        trace[layer] = (out.clone(), None)

    def top_k_spy(layer, scores, out):
        router_top_k(layer, scores, out)
        trace[layer] = (trace[layer][0], out.clone())

    eng.router_scores, eng.router_top_k = scores_spy, top_k_spy
    E = eng.num_experts
    for p, token in enumerate(ids):
        eng.decode_step_reference(token, p)
        for layer, (scores, chosen) in trace.items():
            n = eng.moe_index(layer)
            z = torch.from_numpy(recording.scores[p, n])
            torch.testing.assert_close(scores[0, :E], z, rtol=0, atol=1e-5 * float(z[z.isfinite()].abs().max()))
            if scores.shape[1] == 2 * E:
                g = torch.from_numpy(recording.pregate[p, n + 1])
                torch.testing.assert_close(scores[0, E:], g, rtol=0, atol=1e-5 * float(g[g.isfinite()].abs().max()))
            assert chosen[0].sort().values.tolist() == recording.selected[p, n].tolist()


def test_moe_reference_reads_transposed_experts():
    model = tiny_model("olmoe")
    eng = build_layers(model, 4)
    normed = torch.randn(1, eng.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.tensor([[3, 0, 11, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    expected = [eng.moe_reference(layer, normed, ids, weights) for layer in range(eng.num_layers)]
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().transpose(1, 2).contiguous())
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous())
        experts.is_transposed = True
    transposed = build_layers(model, 4)
    for layer in range(eng.num_layers):
        torch.testing.assert_close(transposed.moe_reference(layer, normed, ids, weights), expected[layer],
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_bfloat16_models_keep_the_routers_dtype(prompt, family):
    """A smoke test of the dtype plumbing: the buffers take the model's dtype and the router's (DeepSeek-V3's
    router computes in float32 even where its weights were cast to bfloat16), every MoE layer's logits equal the
    HF router's on the same input, and decoding stays within bfloat16 noise of HF's forward (bound 0.1 of the
    largest logit: bfloat16 rounding happens in another order than in HF's fused attention)."""
    model = tiny_model(family, dtype=torch.bfloat16)
    ids = prompt(family)[:8]
    eng = build_layers(model, max_len=8)
    router_dtype = torch.float32 if family == "deepseek_v3" else torch.bfloat16
    assert eng.buffers.hidden.dtype == torch.bfloat16 and eng.buffers.router_logits.dtype == router_dtype
    hf = _router_inputs(model, ids)
    for layer, (x, (logits_hf, _, _)) in hf.items():
        out = torch.zeros(len(ids), eng.router_width(layer), dtype=router_dtype)
        for p in range(len(ids)):
            eng.router_logits(layer, x[p : p + 1], out[p : p + 1])
        assert logits_hf.dtype == router_dtype
        assert _rel(out[:, : eng.num_experts].float(), logits_hf.float()) < (1e-6 if family == "deepseek_v3" else 1e-2)
    ref = _hf_logits(model, ids).float()
    got = _decode(eng, ids).float()
    assert max(_rel(got[p], ref[p]) for p in range(len(ids))) < 0.1


# ---------------------------------------------------------------------------------------------------- memory
def _storages(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


@pytest.mark.parametrize("name", ["olmoe-gqa-clip", "deepseek-qlora", "shipped"])
def test_weights_are_shared_and_nothing_parameter_sized_is_allocated(models, name):
    model = models(name)
    max_len = 16
    eng = build_layers(model, max_len)
    model_storages = _storages(model)
    refs = eng.referenced_tensors()
    assert refs and all(t.untyped_storage().data_ptr() in model_storages for t in refs.values())
    decoder, layer0, last = model.model, model.model.layers[0], model.model.layers[-1]
    assert eng.embed_weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
    assert eng.lm_head_weight.data_ptr() == model.lm_head.weight.data_ptr()
    moe_layer = max(i for i in range(eng.num_layers) if eng.is_moe(i))
    assert eng.router_width(moe_layer) == eng.num_experts  # the last MoE layer: its own router weight, in place
    assert refs[f"layers.{moe_layer}.router"].data_ptr() == last.mlp.gate.weight.data_ptr()
    assert refs[f"layers.{moe_layer}.experts.gate_up"].data_ptr() == last.mlp.experts.gate_up_proj.data_ptr()
    assert refs[f"layers.{moe_layer}.experts.down"].data_ptr() == last.mlp.experts.down_proj.data_ptr()
    if isinstance(eng, OlmoeLayers):
        assert refs["layers.0.q_proj"].data_ptr() == layer0.self_attn.q_proj.weight.data_ptr()
        assert refs["layers.0.k_norm"].data_ptr() == layer0.self_attn.k_norm.weight.data_ptr()
    else:
        assert refs["layers.0.kv_b_proj"].data_ptr() == layer0.self_attn.kv_b_proj.weight.data_ptr()
        assert refs["layers.0.q_b_proj"].data_ptr() == layer0.self_attn.q_b_proj.weight.data_ptr()
        assert refs["layers.0.mlp.gate_proj"].data_ptr() == layer0.mlp.gate_proj.weight.data_ptr()  # dense MLP
        shared = last.mlp.shared_experts.down_proj.weight
        assert refs[f"layers.{moe_layer}.shared.down_proj"].data_ptr() == shared.data_ptr()

    owned = eng.owned_tensors()
    assert not any(t.untyped_storage().data_ptr() in model_storages for t in owned.values())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    kv = [t for k, t in owned.items() if k.startswith(("kv.keys", "kv.values"))]
    stacked = [t for k, t in owned.items() if k.endswith("stacked_router")]
    rest = {k: t for k, t in owned.items() if not k.startswith(("kv.keys", "kv.values")) and
            not k.endswith("stacked_router")}
    c, L, elem = eng.config, eng.num_layers, eng.dtype.itemsize
    if isinstance(eng, OlmoeLayers):
        assert nbytes(kv) == 2 * L * max_len * eng.num_kv_heads * eng.head_dim * elem
    else:  # the latent and the roped k_pe, one tensor per layer
        assert nbytes(kv) == L * max_len * (c.kv_lora_rank + c.qk_rope_head_dim) * elem
    moe_layers = sum(eng.is_moe(i) for i in range(L))
    assert nbytes(stacked) == (moe_layers - 1) * 2 * eng.num_experts * eng.hidden_size * stacked[0].element_size()
    row = max(c.vocab_size, max_len, 2 * eng.num_experts, eng.hidden_size)
    assert all(t.numel() <= row for t in rest.values()), {k: t.shape for k, t in rest.items() if t.numel() > row}
    params = nbytes(list(model.parameters()))
    assert nbytes(rest.values()) < 0.01 * params


# ---------------------------------------------------------------------------------------------------- capture rules
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _forbid_host_syncs(monkeypatch):
    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"host synchronisation in a decode step: Tensor.{name}")
        return method

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


@pytest.mark.parametrize("name", ["olmoe-gqa-clip", "deepseek-qlora"])
@pytest.mark.parametrize("absorb", [True, False])
def test_a_decode_step_never_synchronises_with_the_host(models, prompt, name, absorb, monkeypatch):
    model = models(name)
    ids = prompt(name)[:5]
    option = {"absorb_mla": absorb} if name.startswith("deepseek") else {}  # DeepSeek-V3's option alone
    eng = build_layers(model, max_len=8, **option)
    tokens = [torch.tensor([t]) for t in ids]
    positions = [torch.tensor(p) for p in range(len(ids))]
    expected = _decode(eng, ids)
    got = []
    with monkeypatch.context() as m:
        _forbid_host_syncs(m)
        for p in range(len(ids)):
            # device tensors (as a graph gets them), and host ints (checked on the host, written with fill_)
            out = eng.decode_step_reference(tokens[p], positions[p]) if p % 2 else eng.decode_step_reference(ids[p], p)
            got.append(out[0].clone())
    assert torch.equal(torch.stack(got), expected)


def _identity(eng: DecodeLayers) -> dict[str, tuple[int, int, tuple]]:
    return {k: (id(t), t.data_ptr(), tuple(t.shape)) for k, t in eng.owned_tensors().items()}


@pytest.mark.parametrize("name", ["olmoe", "deepseek"])
def test_a_decode_step_allocates_no_new_state(models, prompt, name):
    eng = build_layers(models(name), max_len=6)
    before = _identity(eng)
    outputs = [eng.decode_step_reference(t, p) for p, t in enumerate(prompt(name)[:4])]
    assert _identity(eng) == before  # same tensors, same memory, same shapes after every step
    assert all(out is eng.buffers.logits for out in outputs)


def test_out_hidden_may_alias_hidden(models):
    eng = build_layers(models("olmoe"), max_len=4)
    position = torch.tensor(0)
    hidden = torch.randn(1, eng.hidden_size, generator=torch.Generator().manual_seed(1))
    separate, normed_a, normed_b = torch.zeros_like(hidden), torch.zeros_like(hidden), torch.zeros_like(hidden)
    eng.attention_block(0, hidden, position, separate, normed_a)
    same = hidden.clone()
    eng.attention_block(0, same, position, same, normed_b)
    assert torch.equal(same, separate) and torch.equal(normed_a, normed_b)


# ---------------------------------------------------------------------------------------------------- errors
def test_other_model_types_are_refused():
    from transformers import AutoConfig

    stub = types.SimpleNamespace(config=AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4))
    with pytest.raises(ValueError, match="does not support model_type 'llama'; supported: olmoe, deepseek_v3"):
        build_layers(stub, 8)


def test_a_family_option_goes_to_the_family_that_takes_it_and_no_other(models):
    """absorb_mla is DeepSeek-V3's option: passed on to it; another family refuses it unless it is given at
    DeepSeek-V3's default (what the decoders pass for every model), and an option no family takes is refused."""

    assert DecodeLayers.family_options() == {} and DeepseekV3Layers.family_options() == {
        "absorb_mla": True, "attention_kernels": None, "dense_fp8": None}
    assert build_layers(models("deepseek"), 4, absorb_mla=False).absorb_mla is False
    assert build_layers(models("deepseek"), 4).absorb_mla is True
    olmoe = build_layers(models("olmoe"), 4, absorb_mla=True)  # DeepSeek-V3's default asks nothing of OLMoE
    assert not hasattr(olmoe, "absorb_mla")
    with pytest.raises(ValueError, match="OlmoeLayers engine layers take no option 'absorb_mla'; their options: "
                                         "attention_kernels, dense_fp8"):
        build_layers(models("olmoe"), 4, absorb_mla=False)
    with pytest.raises(ValueError, match="take no option 'absorb'; their options: absorb_mla"):
        build_layers(models("deepseek"), 4, absorb=True)


@pytest.mark.parametrize("name", ["olmoe", "deepseek", "qwen3_5_moe_text", "qwen3_next"])
def test_every_registered_family_provides_what_the_engine_family_protocol_names(models, name):
    from psr_hf.engine.families import EngineFamily, layers_class

    model = models(name) if name in ("olmoe", "deepseek") else tiny_model(name)
    layers = build_layers(model, 4)
    assert isinstance(layers, EngineFamily) and isinstance(layers, DecodeLayers)
    assert layers_class(model.config.model_type) is type(layers)
    attention, static, tensors = layers._layer_attention(0)  # set by the family's _build_attention
    assert callable(attention) and static is not None and tensors
    for hook in ("_build_attention", "_build_kv_cache", "_cache"):  # the family's own, not the base's abstract ones
        assert getattr(type(layers), hook) is not getattr(DecodeLayers, hook)


def test_rope_depending_on_the_sequence_length_is_refused():
    model = tiny_model("olmoe", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="rope type 'dynamic'.*supported: default, linear, llama3, yarn"):
        build_layers(model, 8)


def test_batch_position_and_shape_errors(models):
    eng = build_layers(models("deepseek"), max_len=4)
    H = eng.hidden_size
    with pytest.raises(ValueError, match="batch 1"):
        eng.embed(torch.tensor([5, 6]), torch.zeros(2, H))
    with pytest.raises(ValueError, match="batch 1"):
        eng.attention_block(1, torch.zeros(2, H), torch.tensor(0), torch.zeros(2, H), torch.zeros(2, H))
    for bad in (4, 17, -1):
        with pytest.raises(ValueError, match="outside the static KV cache"):
            eng.check_position(bad)
    with pytest.raises(ValueError, match="outside the static KV cache"):
        eng.decode_step_reference(5, 4)
    with pytest.raises(ValueError, match="0-d int64 tensor"):
        eng.attention_block(1, torch.zeros(1, H), torch.tensor([0]), torch.zeros(1, H), torch.zeros(1, H))
    with pytest.raises(ValueError, match=r"must be \[1, 32\]"):
        eng.router_logits(1, torch.zeros(1, H), torch.zeros(1, 16))
    with pytest.raises(ValueError, match="dense MLP layer"):
        eng.router_logits(0, torch.zeros(1, H), torch.zeros(1, 32))
    with pytest.raises(ValueError, match="routed MoE layer"):
        eng.dense_mlp(1, torch.zeros(1, H), torch.zeros(1, H))
    olmoe = build_layers(models("olmoe"), max_len=4)
    with pytest.raises(ValueError, match="no shared experts"):
        olmoe.shared_expert(0, torch.zeros(1, H), torch.zeros(1, H))
    assert isinstance(eng, DeepseekV3Layers)


@pytest.mark.parametrize("name, absorb", [("olmoe-gqa-clip", True), ("deepseek-qlora", True),
                                          ("deepseek-yarn", False)])
def test_compiled_attention_block_is_one_graph_compiled_once_and_exact(models, prompt, name, absorb):
    """compile_blocks(): the attention block traces as one graph (fullgraph) and compiles once for every layer
    (each layer's weights and cache are arguments); traced with the aot_eager backend (the same ops, no code
    generation, which needs no C compiler on a CPU) the decoded logits equal the eager block's bitwise."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, ids = models(name), prompt(name)
    eager = _decode(build_layers(model, max_len=len(ids), absorb_mla=absorb), ids)
    eng = build_layers(model, max_len=len(ids), absorb_mla=absorb)
    eng.compile_blocks(backend="aot_eager")
    counters.clear()
    got = _decode(eng, ids)
    assert torch.equal(got, eager)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one compile for every layer & step
    assert eng.num_layers > 1 and len(ids) > 1
    eng.compile_blocks(False)
    assert torch.equal(_decode(eng, ids), eager)


def test_engines_of_many_shapes_in_one_process_stay_within_dynamo_s_recompile_limit():
    """dynamo compiles a code object at most 8 times (then fullgraph raises): nine engines of different
    ``max_len`` each compile and run, two equal engines share one compiled block, and the copy computes what the
    block function does."""
    from psr_hf.engine.attention import attention_block
    from psr_hf.engine.layers import own_code_copy

    copy = own_code_copy(attention_block)
    assert copy.__code__ is not attention_block.__code__ and copy.__code__ == attention_block.__code__
    assert copy.__defaults__ == attention_block.__defaults__ and copy.__name__ == attention_block.__name__
    torch._dynamo.reset()
    model = tiny_model("olmoe")
    ids = [3, 4]
    eager = _decode(build_layers(model, max_len=4), ids)
    blocks = []
    for max_len in range(4, 13):
        eng = build_layers(model, max_len=max_len)
        eng.compile_blocks(backend="aot_eager")
        assert torch.equal(_decode(eng, ids), eager)
        blocks.append(eng._block)
    assert len({id(b) for b in blocks}) == 9
    twin = build_layers(model, max_len=12)
    twin.compile_blocks(backend="aot_eager")
    assert twin._block is blocks[-1]


@pytest.mark.parametrize("normalize", [False, True])
def test_compiled_softmax_execution_weights_are_the_familys_in_one_graph(models, normalize):
    """compile_routing(): a softmax router's execution weights trace as one graph for every layer (traced with
    aot_eager: the same ops) and equal the family's own ``execution_weights`` bitwise; DeepSeek-V3's sigmoid
    router keeps its own."""
    from torch._dynamo.utils import counters

    from psr_hf.engine.layers import softmax_execution_weights
    from psr_hf.patches.base import ArchitecturePatch

    torch._dynamo.reset()
    eng = build_layers(models("olmoe"), max_len=4)
    eng.family.normalize = normalize
    eng.compile_routing(backend="aot_eager")
    counters.clear()
    g = torch.Generator().manual_seed(int(normalize))
    E, K = eng.num_experts, eng.top_k
    for layer in [d for d in range(eng.num_layers) if eng.is_moe(d)]:
        logits = torch.randn(1, 2 * E, generator=g)
        ids = torch.randperm(E, generator=g)[:K].reshape(1, K)
        got = torch.empty(1, K)
        eng.execution_weights(layer, logits, ids, got)
        want = ArchitecturePatch.execution_weights(eng.family, eng._moe(layer).router, logits[:, :E], ids)
        assert torch.equal(got, want)
        if normalize:
            assert float(got.sum()) == pytest.approx(1.0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert eng._weights_fn is not softmax_execution_weights
    eng.compile_routing(False)
    assert eng._weights_fn is softmax_execution_weights
    assert build_layers(models("deepseek"), max_len=4)._softmax_weights is False
