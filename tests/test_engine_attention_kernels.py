"""The attention kernels in the engine (the families' ``attention_kernels`` option: OLMoE's and Qwen3.5/3.6's q/k/v
projections as one Triton launch, and every family's attention over the filled slots only, DeepSeek-V3's absorbed
latent attention included; in triton's interpreter on the CPU, compiled on a GPU, marked cuda): the torch path's
greedy tokens with logits within float32 rounding, in the eager decoder, the graph decoder's bodies and the
compiled attention blocks (one op each, no graph break); the option refused with the reason where the kernels
cannot run, and off by default on the CPU."""

from __future__ import annotations

import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig, engine
from psr_hf.engine.families import build_layers
from psr_hf.engine.moe import triton_available
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")
TRITON_OK, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")
NEW = 5
FAMILIES = ["olmoe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next"]


def _ids(seed: int, length: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model, ids, decoder_class, kernels, **kwargs):
    psr_hf.controller(model).reset()
    decoder = decoder_class(model, 24, attention_kernels=kernels, **kwargs)
    sequence, logits = decoder.generate_greedy(ids, NEW, return_logits=True)
    return decoder.layers, sequence, logits


def _against_torch(model, decoder_class, kernels=True, **kwargs):
    ids = _ids(4, 7)
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
        torch_layers, want, want_logits = _greedy(model, ids, decoder_class, False, **kwargs)
        kernel_layers, got, got_logits = _greedy(model, ids, decoder_class, kernels, **kwargs)
    assert kernel_layers.attention_kernels is True and torch_layers.attention_kernels is False
    assert torch.equal(got, want)
    assert float(want_logits.abs().max()) > 0.1  # not vacuous
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoder, kwargs", [("Decoder", {}), ("GraphDecoder", {"graphs": False})],
                         ids=["decoder", "graph_decoder_bodies"])
def test_the_attention_kernels_decode_the_torch_paths_tokens(family, decoder, kwargs):
    _against_torch(tiny_model(family, seed=3, norm_noise=0.2), getattr(engine, decoder), **kwargs)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("family, graphs", [("olmoe", 1), ("deepseek_v3", 1), ("qwen3_5_moe_text", 2)])
def test_the_compiled_attention_block_calls_the_kernels_without_a_graph_break(family, graphs):
    """compile_blocks() (fullgraph) with the kernels: one graph per kind of layer, the same steps as eager (traced
    with aot_eager: the same ops, bitwise)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model(family, seed=5, norm_noise=0.2)
    ids = _ids(6, 5)
    eager = build_layers(model, max_len=len(ids), attention_kernels=True)
    want = torch.stack([eager.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    layers = build_layers(model, max_len=len(ids), attention_kernels=True)
    layers.compile_blocks(backend="aot_eager")
    counters.clear()
    got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert torch.equal(got, want)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_attach_passes_the_option_to_the_layers_and_generate_gives_the_torch_paths_tokens():
    model = tiny_model("olmoe", seed=3, norm_noise=0.2)
    ids = torch.tensor([_ids(4, 6)])
    outputs = {}
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
        for kernels in (False, True):
            psr_hf.controller(model).reset()
            engine.attach(model, max_len=16, attention_kernels=kernels)
            try:
                assert engine.attached(model).decoder.layers.attention_kernels is kernels
                outputs[kernels] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                                  min_new_tokens=4, do_sample=False, pad_token_id=0)
                assert engine.attached(model).served > 0  # the engine decoded, not the transformers path
            finally:
                engine.detach(model)
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_kernels_none_runs_torch_on_the_cpu(family, monkeypatch):
    model = tiny_model(family, seed=1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert build_layers(model, max_len=4).attention_kernels is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels only when asked for
    assert build_layers(model, max_len=4, attention_kernels=None).attention_kernels is False


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_kernels_true_is_refused_where_they_cannot_run(family, monkeypatch):
    import psr_hf.engine.decode_attention_kernel as attention_module

    model = tiny_model(family, seed=1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if TRITON_OK:  # CPU tensors outside triton's interpreter
        with pytest.raises(ValueError, match=r"attention_kernels=True: .*cpu: the kernel takes CUDA tensors, or CPU "
                                             r"tensors in triton's interpreter .*attention_kernels=None .* or False"):
            build_layers(model, max_len=4, attention_kernels=True)
    monkeypatch.setattr(attention_module, "triton", None)  # triton does not import
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"attention_kernels=True: .*needs triton, which does not import"):
        build_layers(model, max_len=4, attention_kernels=True)
    with pytest.raises(ValueError, match=r"attention_kernels must be None .*, True or False, got 'yes'"):
        build_layers(model, max_len=4, attention_kernels="yes")


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_deepseeks_expanded_attention_refuses_the_kernels():
    model = tiny_model("deepseek_v3", seed=1)
    with pytest.raises(ValueError, match=r"attention_kernels=True: .*absorbed attention only \(absorb_mla=True\)"):
        build_layers(model, max_len=4, absorb_mla=False, attention_kernels=True)
    assert build_layers(model, max_len=4, absorb_mla=False).attention_kernels is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_triton
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_attention_kernels_on_the_gpu_decode_the_torch_paths_tokens(family):
    """Compiled on CUDA, float32, the graph decoder with its CUDA graphs: the torch path's tokens, logits within
    float32 rounding. On by default for every family since this test passed on a lent H200."""
    model = tiny_model(family, seed=3, norm_noise=0.2).cuda()
    assert build_layers(model, max_len=8).attention_kernels is True
    _against_torch(model, engine.GraphDecoder, kernels=True)
