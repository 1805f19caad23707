"""The engine's dense projections in block-wise FP8 (:mod:`psr_hf.engine.dense_fp8`): OLMoE's q/k/v and output
projections, DeepSeek-V3's latent attention projections (all but the absorbed ``kv_b_proj``), Qwen3.5/3.6's and
Qwen3-Next's attention and Gated DeltaNet projections, and the dense and shared MLPs, read from the FP8
checkpoint whose experts the offload holds, computed by the fused GEMV's FP8 form (Triton's interpreter here). On a model loaded from that checkpoint dequantized in float32 the FP8 form multiplies
the same float32 products in the same order as the GEMV over the dequantized weights, so the engine decodes the same
tokens and logits bitwise; the option's rule, and the refusals with their fixes."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig, engine
from psr_hf.assets.quantize import load_fp8_dequantized, quantize_checkpoint
from psr_hf.engine.families import build_layers
from psr_hf.engine.moe import triton_available
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")
TRITON_OK, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")

PSR = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
NEW = 2


FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next")


def _write(root, family: str):
    """A tiny ``family`` model written as an FP8 checkpoint (hidden 192: a whole and a partial scale block per
    row); its folder."""
    inner = (dict(intermediate_size=160) if family == "olmoe" else dict(moe_intermediate_size=160)
             if family == "deepseek_v3" else dict(moe_intermediate_size=160, shared_expert_intermediate_size=160))
    tiny_model(family, dtype=torch.bfloat16, hidden_size=192, seed=2, norm_noise=0.2,
               **inner).save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root / "fp8"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``family -> FP8 checkpoint folder``, each written on first use."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _write(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def folder(folders):
    return folders("olmoe")


def _generate(folder, **options):
    """Greedy tokens and step scores of the engine (attention kernels on, the given options) on the model loaded
    from ``folder`` in float32 and offloaded with its FP8 experts, and the engine's layers."""
    model = load_fp8_dequantized(folder, torch.float32)
    ids = torch.tensor([[3, 17, 42]])
    with psr_hf.patched(model, PSR, calibration=False, offload=OffloadConfig(device="cpu")):
        engine.attach(model, max_len=16, attention_kernels=True, **options)
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            attached = engine.attached(model)
            assert attached.served == NEW  # every step decoded by the engine
            return out, attached.decoder.layers
        finally:
            engine.detach(model)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_projections_decode_the_dequantized_weights_tokens_and_logits_bitwise(folders, family, monkeypatch):
    from psr_hf.engine import gemv_kernel

    monkeypatch.setattr(gemv_kernel, "PROGRAMS_PER_SM", 0)  # 16 rows per program: fewer interpreted programs
    folder = folders(family)
    fp8, fp8_layers = _generate(folder)  # None: FP8 where it can, and here it can
    plain, plain_layers = _generate(folder, dense_fp8=False)
    assert fp8_layers.dense_fp8 is True and plain_layers.dense_fp8 is False
    assert torch.equal(fp8.sequences, plain.sequences)
    assert float(plain.scores[0].abs().max()) > 0.1  # not vacuous
    for a, b in zip(fp8.scores, plain.scores):
        assert torch.equal(a, b)
    # the engine's own tensors are the checkpoint's bytes, not a quantization of the model's weights
    owned = fp8_layers.owned_tensors()
    files = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            files.update({k: f.get_tensor(k) for k in f.keys() if k.endswith((".weight", "weight_scale_inv"))})
    read = sorted(name[:-len(".fp8")] for name in owned if name.endswith(".fp8"))
    in_fp8 = sorted(k[len("model."):-len(".weight_scale_inv")] for k in files
                    if k.endswith("_scale_inv") and ".experts." not in k  # the routed experts are the store's
                    and ".kv_b_proj." not in k)  # DeepSeek's, absorbed into the query and output: the model's
    names = {k: k.replace(".self_attn", "").replace(".linear_attn", "").replace(".mlp.shared_experts", ".shared")
             .replace(".mlp.shared_expert", ".shared") for k in in_fp8}
    assert read == sorted(names.values())  # every one of them
    in_fp8 = sorted(in_fp8, key=names.get)
    for name, key in zip(read, in_fp8):
        weight, scale = owned[f"{name}.fp8"], owned[f"{name}.fp8_scale"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert torch.equal(weight.view(torch.uint8), files[f"model.{key}.weight"].view(torch.uint8))
        assert torch.equal(scale, files[f"model.{key}.weight_scale_inv"])
    assert not any(name.endswith(".fp8") for name in plain_layers.owned_tensors())


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_option_falls_back_or_refuses_with_the_reason(folder):
    plain = tiny_model("olmoe", seed=1)
    assert build_layers(plain, max_len=4, attention_kernels=True).dense_fp8 is False  # not patched: no checkpoint
    with pytest.raises(ValueError, match="dense_fp8=True: the model's experts are not offloaded from a fine-grained"):
        build_layers(plain, max_len=4, attention_kernels=True, dense_fp8=True)
    with pytest.raises(ValueError, match="dense_fp8 must be None"):
        build_layers(plain, max_len=4, dense_fp8="yes")
    model = load_fp8_dequantized(folder, torch.float32)
    with psr_hf.patched(model, PSR, calibration=False, offload=OffloadConfig(device="cpu")):
        assert build_layers(model, max_len=4, attention_kernels=False).dense_fp8 is False
        with pytest.raises(ValueError, match="dense_fp8=True: the attention kernels do not run"):
            build_layers(model, max_len=4, attention_kernels=False, dense_fp8=True)
        assert build_layers(model, max_len=4, attention_kernels=True, dense_fp8=True).dense_fp8 is True
        with torch.no_grad():
            model.model.layers[0].self_attn.o_proj.weight.mul_(1.5)  # no longer the checkpoint's
        with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj's weight differs from the FP8 checkpoint"):
            build_layers(model, max_len=4, attention_kernels=True)
        assert build_layers(model, max_len=4, attention_kernels=True, dense_fp8=False).dense_fp8 is False
    bf16_store = load_fp8_dequantized(folder, torch.float32)
    with psr_hf.patched(bf16_store, PSR, calibration=False,
                        offload=OffloadConfig(device="cpu", expert_format="model")):
        assert build_layers(bf16_store, max_len=4, attention_kernels=True).dense_fp8 is False


def _graph_logits(folder, device: str, **options):
    """The step logits of the GraphDecoder (CUDA graphs) on the model loaded from ``folder`` in float32 and
    offloaded with its FP8 experts on ``device``, decoding a fixed token sequence, and its layers."""
    model = load_fp8_dequantized(folder, torch.float32).to(device)
    tokens = [3, 17, 42, 8, 99, 5]
    with psr_hf.patched(model, PSR, calibration=False, offload=OffloadConfig(device=device)):
        decoder = engine.GraphDecoder(model, max_len=16, **options)
        decoder.reset()
        logits = torch.stack([decoder.step(t).clone() for t in tokens])
        return logits, decoder.layers


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.usefixtures("compiled")
def test_cuda_fp8_projections_in_graphs_equal_the_dequantized_weights_within_float32_rounding(folder):
    """Compiled for the GPU the FP8 form is not bitwise the GEMV over the dequantized float32 weights (on the H100
    the logits differed in their last bits): within float32 rounding, the same greedy tokens."""
    fp8, fp8_layers = _graph_logits(folder, "cuda")
    plain, plain_layers = _graph_logits(folder, "cuda", dense_fp8=False)
    assert fp8_layers.attention_kernels and fp8_layers.dense_fp8 is True and plain_layers.dense_fp8 is False
    assert float(plain.abs().max()) > 0.1
    print(f"FP8 form against the dequantized weights: max |logit difference| {float((fp8 - plain).abs().max()):.3g}")
    torch.testing.assert_close(fp8, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(fp8.argmax(-1), plain.argmax(-1))
