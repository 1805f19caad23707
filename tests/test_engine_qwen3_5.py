"""The engine on the hybrid decoders of Qwen3.5/3.6-MoE (psr_hf/engine/families/qwen3_5_moe.py) and Qwen3-Next
(qwen3_next.py: fused Gated DeltaNet projections, a dense MLP layer in the tiny config), CPU, float32: generate()
through the engine gives the patched transformers path's tokens, scores within 1e-4 and routing decisions, for the
causal LMs and the image-text model on text, exact and PSR routing, resident and offloaded; the Gated DeltaNet
state starts every sequence from zero; the layers' step equals the model's own forward position by position. The
Gated DeltaNet kernel in the engine (the family's ``gated_delta_kernel`` option; in triton's interpreter on the CPU,
compiled on a GPU, marked cuda): the torch step's greedy tokens, logits within 1e-4 and states within float32
rounding, also inside the compiled attention blocks; the option refused with the reason where the kernel cannot run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig, engine
from psr_hf.engine.families import build_layers
from psr_hf.engine.moe import triton_available
from psr_hf.testing import tiny_model
from test_engine_generate import _generate as _fresh_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

POLICIES = {"exact": dict(policy="exact", residency=0.5), "psr": dict(policy="psr", lam=0.2, budget=1, residency=0.5)}
NEW = 8


def _model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with non-trivial norms (the zero-centred norms start at zero, the gated norm at one)."""
    return tiny_model(model_type, seed=seed, norm_noise=0.2)


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, seed=None, **kwargs):
    """generate() from a fresh routing state: (output, its one recording, stats)."""
    out, (recording,), stats = _fresh_generate(model, ids, seed, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                                               output_scores=True, return_dict_in_generate=True, **kwargs)
    return out, recording, stats


def _both(model, ids, policy, offload=None, seed=None, **kwargs):
    """The same generate() on the transformers path and through the engine, in one patch."""
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), offload=offload):
        hf = _generate(model, ids, seed, **kwargs)
        engine.attach(model, max_len=64)
        try:
            ours = _generate(model, ids, seed, **kwargs)
            state = engine.attached(model)
            served, fallbacks, loops = state.served, state.fallbacks, state.loop_calls
        finally:
            engine.detach(model)
    return hf, ours, (served, fallbacks, loops)


def _same(hf, ours) -> None:
    assert torch.equal(ours[0].sequences, hf[0].sequences)
    for a, b in zip(ours[0].scores, hf[0].scores):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        assert float((a[finite] - b[finite]).abs().max()) < 1e-4
    np.testing.assert_array_equal(ours[1].selected, hf[1].selected)
    for name in ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token"):
        assert ours[2].total[name] == hf[2].total[name], name


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"],
                         ids=["causal_lm", "image_text", "qwen3_next"])
@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_generate_through_the_engine_equals_the_transformers_path(model_type, policy):
    model = _model(model_type)
    hf, ours, (served, fallbacks, loops) = _both(model, _ids(1, 9), policy, do_sample=False)
    assert (served, fallbacks, loops) == (NEW, 0, 1)  # the prompt and every step, in the engine's own loop
    _same(hf, ours)
    if policy == "psr":
        assert ours[2].total["replaced_per_token"] > 0  # the policy steered somewhere


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_sampling_and_offload_equal_the_transformers_path(model_type):
    model = _model(model_type, seed=3)
    offload = psr_hf.OffloadConfig(device="cpu", check_slots=True)
    hf, ours, (served, fallbacks, _) = _both(model, _ids(2, 7), "psr", offload=offload, seed=5, do_sample=True,
                                             top_k=20)
    assert served == NEW and fallbacks == 0
    _same(hf, ours)
    assert ours[2].total["copies_per_token"] > 0  # offloaded: the slots were refilled


def test_every_sequence_starts_from_a_cleared_recurrent_state():
    """Two generate() calls in a row through the engine: the second equals a fresh transformers run (the Gated
    DeltaNet's convolution window and recurrent state of the first sequence are gone)."""
    model = _model("qwen3_5_moe_text", seed=4)
    first, second = _ids(3, 8), _ids(4, 5)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"])):
        want = _generate(model, second)
        engine.attach(model, max_len=64)
        try:
            _generate(model, first)
            layers = engine.attached(model).decoder.layers
            assert any(float(t.abs().sum()) > 0 for t in layers.kv.recurrent if t is not None)
            got = _generate(model, second)
        finally:
            engine.detach(model)
    _same(want, got)


@pytest.mark.parametrize("model_type, layers_class", [("qwen3_5_moe_text", "Qwen35MoeLayers"),
                                                       ("qwen3_next", "Qwen3NextLayers")])
def test_the_layers_step_equals_the_models_forward_position_by_position(model_type, layers_class):
    model = _model(model_type, seed=6)
    ids = _ids(5, 12)[0].tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    layers = build_layers(model, max_len=len(ids) + 1)
    assert type(layers).__name__ == layers_class
    kinds = model.config.layer_types
    assert [layers.kv.conv[i] is not None for i in range(len(kinds))] == [k == "linear_attention" for k in kinds]
    got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    again = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert torch.equal(again, got)  # position 0 cleared the recurrent state


def test_a_layer_pattern_without_full_attention_is_refused():
    model = tiny_model("qwen3_5_moe_text", layer_types=["linear_attention"] * 4)
    with pytest.raises(ValueError, match="expect both linear-attention and full-attention layers"):
        build_layers(model, max_len=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_cuda_graphs_equal_the_transformers_path_float32(policy, offloaded):
    """On the GPU (CUDA graphs, compiled attention blocks, the Triton slot MoE) in float32: the transformers path's
    greedy tokens, its scores within 1e-4, its routing decisions."""
    model = _model("qwen3_5_moe_text", seed=7).to("cuda")
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    hf, ours, (served, fallbacks, loops) = _both(model, _ids(6, 9).to("cuda"), policy, offload=offload,
                                                 do_sample=False)
    assert (served, fallbacks, loops) == (NEW, 0, 1)
    _same(hf, ours)


# ------------------------------------------------------------------ the Gated DeltaNet kernel in the engine
TRITON_OK, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")
KERNEL_NEW = 6


def _greedy(model, ids, decoder_class, **kwargs):
    """Greedy tokens and logits of a fresh decoder of ``decoder_class``, and its Gated DeltaNet states after them."""
    psr_hf.controller(model).reset()
    decoder = decoder_class(model, 32, **kwargs)
    sequence, logits = decoder.generate_greedy(ids, KERNEL_NEW, return_logits=True)
    states = [t.clone() for t in decoder.layers.kv.conv + decoder.layers.kv.recurrent if t is not None]
    return decoder.layers, sequence, logits, states


def _kernel_against_torch(model, ids, decoder_class, kernel=True, **kwargs):
    """The same greedy decoding with the kernel (option ``kernel``) and with the torch step: the same tokens, logits
    within 1e-4 and Gated DeltaNet states within float32 rounding: the kernel wrote the engine's own state buffers
    (had it written elsewhere, they would have stayed where the prompt left them while the torch step's moved on)."""
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"])):
        torch_layers, want, want_logits, want_states = _greedy(model, ids, decoder_class, gated_delta_kernel=False,
                                                               **kwargs)
        kernel_layers, got, got_logits, got_states = _greedy(model, ids, decoder_class, gated_delta_kernel=kernel,
                                                             **kwargs)
    assert kernel_layers.gated_delta_kernel is True and torch_layers.gated_delta_kernel is False
    assert torch.equal(got, want)
    assert float((got_logits - want_logits).abs().max()) < 1e-4
    for a, b in zip(got_states, want_states):
        assert float(b.abs().max()) > 0  # not vacuous
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("model_type, decoder", [("qwen3_5_moe_text", "Decoder"), ("qwen3_next", "GraphDecoder")],
                         ids=["qwen3_5_decoder", "qwen3_next_eager_graph_bodies"])
def test_the_gated_delta_kernel_in_the_engine_decodes_the_torch_steps_tokens(model_type, decoder):
    """In triton's interpreter on the CPU, float32: the eager Decoder and GraphDecoder's bodies (graphs=False) with
    the kernel give the torch step's greedy tokens, logits within 1e-4 and states within float32 rounding."""
    kwargs = {"graphs": False} if decoder == "GraphDecoder" else {}
    model = _model(model_type, seed=8)
    _kernel_against_torch(model, _ids(7, 6)[0].tolist(), getattr(engine, decoder), **kwargs)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_compiled_attention_blocks_call_the_kernel_as_one_op_without_a_graph_break():
    """compile_blocks() (fullgraph) with the kernel: one graph per kind of layer, and the kernel, an opaque custom op
    there, updates the engine's state as the eager kernel does (traced with aot_eager: the same ops, bitwise)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model("qwen3_5_moe_text", seed=9)
    ids = _ids(8, 5)[0].tolist()
    eager = build_layers(model, max_len=len(ids), gated_delta_kernel=True)
    want = torch.stack([eager.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    layers = build_layers(model, max_len=len(ids), gated_delta_kernel=True)
    layers.compile_blocks(backend="aot_eager")
    counters.clear()
    got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # Gated DeltaNet and full attention
    assert torch.equal(got, want)
    for a, b in zip(layers.kv.recurrent, eager.kv.recurrent):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_gated_delta_kernel_none_runs_the_torch_step_on_the_cpu(monkeypatch):
    model = _model("qwen3_5_moe_text", seed=10)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert build_layers(model, max_len=4).gated_delta_kernel is False
    assert build_layers(model, max_len=4)._linear.kernel is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernel only when asked for
    assert build_layers(model, max_len=4, gated_delta_kernel=None).gated_delta_kernel is False


def test_gated_delta_kernel_true_is_refused_where_the_kernel_cannot_run(monkeypatch):
    import psr_hf.engine.gated_delta_kernel as kernel_module

    model = _model("qwen3_5_moe_text", seed=10)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if TRITON_OK:  # CPU tensors outside triton's interpreter
        with pytest.raises(ValueError, match=r"gated_delta_kernel=True: .*cpu: the kernel takes CUDA tensors, or CPU "
                                             r"tensors in triton's interpreter .*gated_delta_kernel=None .* or False"):
            build_layers(model, max_len=4, gated_delta_kernel=True)
    monkeypatch.setattr(kernel_module, "triton", None)  # triton does not import
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"gated_delta_kernel=True: .*needs triton, which does not import"):
        build_layers(model, max_len=4, gated_delta_kernel=True)
    with pytest.raises(ValueError, match="gated_delta_kernel must be None"):
        build_layers(model, max_len=4, gated_delta_kernel="yes")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"])):  # the decoders and attach pass it on
        with pytest.raises(ValueError, match="needs triton"):
            engine.Decoder(model, 4, gated_delta_kernel=True)
        with pytest.raises(ValueError, match="needs triton"):
            engine.attach(model, max_len=4, gated_delta_kernel=True)
        assert engine.attached(model) is None
    olmoe = tiny_model("olmoe")
    assert not hasattr(build_layers(olmoe, max_len=4, gated_delta_kernel=None), "gated_delta_kernel")
    with pytest.raises(ValueError, match="take no option 'gated_delta_kernel'"):
        build_layers(olmoe, max_len=4, gated_delta_kernel=True)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_engine_a_b_benchmark_runs_on_the_cpu_and_writes_its_record(tmp_path):
    from module_files import ROOT, load_module

    bench = load_module("gated_delta_engine_ab", ROOT / "benchmarks" / "qwen36" / "gated_delta_engine_ab.py")
    path = tmp_path / "record.json"
    record = bench.main(["--model", "tiny-qwen3_5", "--prompt", "2", "--tokens", "2", "--check-tokens", "3",
                         "--rounds", "2", "--hbm-gbps", "100", "--json", str(path)])
    assert json.loads(path.read_text())["greedy"]["equal"] is True
    assert record["greedy"]["tokens"] == 3 and record["greedy"]["max_abs_logit_diff"] < 1e-4
    assert all(len(record["ms_per_token"][name]["rounds"]) == 2 for name in ("torch", "kernel"))
    assert len(record["torch_over_kernel"]["rounds"]) == 2 and record["hbm_bound_ms"] > 0
    assert record["gated_delta_layers"] == 3 and record["graphs"] is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_triton
@pytest.mark.usefixtures("compiled")
def test_cuda_graphs_with_the_gated_delta_kernel_decode_the_torch_steps_tokens_float32():
    """On the GPU (CUDA graphs, compiled attention blocks, the kernel compiled in the warm-up before capture) in
    float32: the default (None) picks the kernel, and it gives the torch step's greedy tokens, logits within 1e-4
    and states within float32 rounding."""
    model = _model("qwen3_5_moe_text", seed=11).to("cuda")
    _kernel_against_torch(model, _ids(9, 9)[0].tolist(), engine.GraphDecoder, kernel=None)
