"""OLMoE's attention kernels in the engine (the family's ``attention_kernels`` option: the q/k/v projections as one
Triton launch and the attention over the filled slots only; in triton's interpreter on the CPU, compiled on a GPU,
marked cuda): the torch path's greedy tokens with logits within float32 rounding, in the eager decoder, the graph
decoder's bodies and the compiled attention blocks (one op each, no graph break); the option refused with the
reason where the kernels cannot run, and off by default on the CPU."""

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


def _ids(seed: int, length: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model, ids, decoder_class, kernels, **kwargs):
    psr_hf.controller(model).reset()
    decoder = decoder_class(model, 24, attention_kernels=kernels, **kwargs)
    sequence, logits = decoder.generate_greedy(ids, NEW, return_logits=True)
    return decoder.layers, sequence, logits


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("decoder, kwargs", [("Decoder", {}), ("GraphDecoder", {"graphs": False})],
                         ids=["decoder", "graph_decoder_bodies"])
def test_the_attention_kernels_decode_the_torch_paths_tokens(decoder, kwargs):
    model = tiny_model("olmoe", seed=3, norm_noise=0.2)
    ids = _ids(4, 7)
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
        torch_layers, want, want_logits = _greedy(model, ids, getattr(engine, decoder), False, **kwargs)
        kernel_layers, got, got_logits = _greedy(model, ids, getattr(engine, decoder), True, **kwargs)
    assert kernel_layers.attention_kernels is True and torch_layers.attention_kernels is False
    assert torch.equal(got, want)
    assert float(want_logits.abs().max()) > 0.1  # not vacuous
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_compiled_attention_block_calls_the_kernels_without_a_graph_break():
    """compile_blocks() (fullgraph) with the kernels: one graph for every layer, the same steps as eager (traced
    with aot_eager: the same ops, bitwise)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model("olmoe", seed=5, norm_noise=0.2)
    ids = _ids(6, 5)
    eager = build_layers(model, max_len=len(ids), attention_kernels=True)
    want = torch.stack([eager.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    layers = build_layers(model, max_len=len(ids), attention_kernels=True)
    layers.compile_blocks(backend="aot_eager")
    counters.clear()
    got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert torch.equal(got, want)


def test_attention_kernels_none_runs_torch_on_the_cpu(monkeypatch):
    model = tiny_model("olmoe", seed=1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert build_layers(model, max_len=4).attention_kernels is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels only when asked for
    assert build_layers(model, max_len=4, attention_kernels=None).attention_kernels is False


def test_attention_kernels_true_is_refused_where_they_cannot_run(monkeypatch):
    import psr_hf.engine.gemv_kernel as gemv_module

    model = tiny_model("olmoe", seed=1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if TRITON_OK:  # CPU tensors outside triton's interpreter
        with pytest.raises(ValueError, match=r"attention_kernels=True: .*cpu: the kernel takes CUDA tensors, or CPU "
                                             r"tensors in triton's interpreter .*attention_kernels=None .* or False"):
            build_layers(model, max_len=4, attention_kernels=True)
    monkeypatch.setattr(gemv_module, "triton", None)  # triton does not import
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"attention_kernels=True: .*needs triton, which does not import"):
        build_layers(model, max_len=4, attention_kernels=True)
    with pytest.raises(ValueError, match=r"attention_kernels must be None .*, True or False, got 'yes'"):
        build_layers(model, max_len=4, attention_kernels="yes")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_triton
@pytest.mark.usefixtures("compiled")
def test_the_attention_kernels_on_the_gpu_decode_the_torch_paths_tokens():
    """Compiled on CUDA, float32, the graph decoder with its CUDA graphs: the torch path's tokens, logits within
    float32 rounding; on by default there."""
    model = tiny_model("olmoe", seed=3, norm_noise=0.2).cuda()
    ids = _ids(4, 7)
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
        torch_layers, want, want_logits = _greedy(model, ids, engine.GraphDecoder, False)
        kernel_layers, got, got_logits = _greedy(model, ids, engine.GraphDecoder, None)
    assert kernel_layers.attention_kernels is True and torch_layers.attention_kernels is False
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
