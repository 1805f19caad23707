"""psr_hf.assets.quantize and ``psr-hf quantize``: a bf16 model folder written as the official block-wise FP8
checkpoint of DeepSeek-V3 and Qwen3.6, for every family: the tensor names, dtypes and scale shapes of that format,
the kept tensors byte for byte, each weight within e4m3's rounding, and the model loaded back equal to the model
of the dequantized weights (through transformers' own CPU load where every dimension is whole blocks or one
block, through ``load_fp8_dequantized`` always); bad input refused with the fix, by the library and the CLI. The
block math they use, which the offload's FP8 store shares (psr_hf.assets.fp8_blocks): values on the e4m3 grid
come back exactly, partial tiles are scaled by their position, stacked weights as each matrix alone.

The tiny models are widened (hidden 192, experts of 160) so that matrices hold full 128x128 blocks and partial
ones; the reference dequantization here expands the scales with ``torch.kron``, independently of the library's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from psr_hf.assets import TINY_MOE
from psr_hf.assets.loading import byte_tokenizer
from psr_hf.assets.fp8_blocks import BLOCK, FP8_DTYPE, FP8_MAX, dequantize_blocks, quantize_blocks, scale_shape
from psr_hf.assets.quantize import kept_reason, load_fp8_dequantized, quantize_checkpoint, read_dequantized
from psr_hf.cli import main
from psr_hf.testing import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

# names the official releases quantize, and names they keep (checked here apart from the library's own rule)
QUANTIZED_NAMES = ("experts.", "shared_expert.", "q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa",
                   "kv_b_proj", "in_proj_qkv", "in_proj_z", "out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
KEPT_NAMES = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "in_proj_a.", "in_proj_b.",
              "in_proj_ba", "conv1d", "A_log", "dt_bias", "e_score_correction_bias", "visual.")


def _dims(family: str, hidden: int, inner: int, **extra) -> dict:
    """Overrides of a tiny config that set its hidden size and its experts' (and shared experts') width."""
    if family == "olmoe":
        return dict(hidden_size=hidden, intermediate_size=inner, **extra)
    fields = dict(hidden_size=hidden, moe_intermediate_size=inner, **extra)
    if family.startswith("qwen"):
        fields["shared_expert_intermediate_size"] = inner
    return fields


def _save_bf16(family: str, folder, **overrides):
    model = tiny_model(family, dtype=torch.bfloat16, norm_noise=0.1, **overrides)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("model*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _reference_dequantized(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = fp8.shape
    return fp8.float() * torch.kron(scale, torch.ones(BLOCK))[:rows, :cols]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """``family -> (bf16 model, source folder, FP8 folder, report)``, each built on first use."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            model = _save_bf16(family, root / "src", **_dims(family, 192, 160))
            cache[family] = (model, root / "src", root / "fp8", quantize_checkpoint(root / "src", root / "fp8"))
        return cache[family]

    return get


# ---------------------------------------------------------------------------------------------------- the format
@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoint_has_the_official_names_dtypes_and_scale_shapes(family, quantized):
    _, src, dst, report = quantized(family)
    before, after = _tensors(src), _tensors(dst)
    scales = {n for n in after if n.endswith(".weight_scale_inv")}
    assert set(after) == set(before) | scales
    assert {n.removesuffix("_scale_inv") for n in scales} <= set(before)
    for name, tensor in before.items():
        if f"{name}_scale_inv" in after:
            assert any(k in name for k in QUANTIZED_NAMES) and not any(k in f"{name}." for k in KEPT_NAMES), name
            rows, cols = tensor.shape
            assert after[name].dtype == torch.float8_e4m3fn and after[name].shape == tensor.shape
            scale = after[f"{name}_scale_inv"]
            assert scale.dtype == torch.float32 and scale.shape == (math.ceil(rows / 128), math.ceil(cols / 128))
        else:
            assert any(k in f"{name}." for k in KEPT_NAMES) or tensor.ndim != 2, name
            assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    expert = next(n for n in before if ".experts.0.gate_proj.weight" in n)
    assert after[f"{expert}_scale_inv"].shape == (2, 2)  # [160, 192]: one full block and three partial ones
    assert report.quantized == len(scales) and sum(report.kept.values()) == len(before) - len(scales)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_gains_the_fp8_quantization_config_and_keeps_its_dtype(family, quantized):
    _, src, dst, report = quantized(family)
    config, source = (json.loads((d / "config.json").read_text()) for d in (dst, src))
    quant = config.pop("quantization_config")
    assert config == source and config["dtype"] == "bfloat16"
    assert {k: quant[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    skipped = quant["modules_to_not_convert"]
    assert tuple(skipped) == report.modules_to_not_convert and "lm_head" in skipped
    after = _tensors(dst)
    kept_linear = {n.removesuffix(".weight") for n, t in after.items()
                   if n.endswith(".weight") and t.ndim == 2 and f"{n}_scale_inv" not in after and "visual." not in n}
    assert kept_linear <= set(skipped)
    assert not any(f"{m}.weight_scale_inv" in after for m in skipped)
    assert ("model.visual" in skipped) == (family == "qwen3_5_moe")
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_the_kept_rule_names_each_reason():
    assert kept_reason("model.layers.3.mlp.experts.7.down_proj.weight", 2) is None
    assert kept_reason("model.layers.3.mlp.gate_proj.weight", 2) is None
    assert kept_reason("model.layers.3.mlp.gate.weight", 2) == "routers and shared-expert gates"
    assert kept_reason("model.layers.3.mlp.gate.e_score_correction_bias", 1) == "routers and shared-expert gates"
    assert kept_reason("model.layers.0.linear_attn.in_proj_ba.weight", 2).startswith("Gated DeltaNet")
    assert kept_reason("model.layers.0.self_attn.q_proj.bias", 1).startswith("biases")
    assert kept_reason("model.layers.0.self_attn.kv_a_layernorm.weight", 1) == "norms"


# ---------------------------------------------------------------------------------------------------- the values
@pytest.mark.parametrize("family", FAMILIES)
def test_each_weight_comes_back_within_e4m3_rounding_of_its_block_scale(family, quantized):
    """e4m3 keeps 3 mantissa bits: a normal value comes back within 2^-4 of its magnitude, a subnormal one (below
    2^-6 times its block's scale) within 2^-10 times the scale; each scale is its block's largest magnitude over
    448 (1 for an all-zero block)."""
    _, src, dst, _ = quantized(family)
    before, after = _tensors(src), _tensors(dst)
    for name, tensor in before.items():
        if f"{name}_scale_inv" not in after:
            continue
        weight, scale = tensor.float(), after[f"{name}_scale_inv"]
        back = _reference_dequantized(after[name], scale)
        spread = torch.kron(scale, torch.ones(BLOCK))[: weight.shape[0], : weight.shape[1]]
        bound = weight.abs() * 2**-4 + spread * 2**-10
        assert ((back - weight).abs() <= bound).all(), name
        rows, cols = weight.shape
        padded = torch.zeros(scale.shape[0] * 128, scale.shape[1] * 128)
        padded[:rows, :cols] = weight
        amax = padded.view(scale.shape[0], 128, scale.shape[1], 128).abs().amax(dim=(1, 3))
        assert torch.equal(scale, torch.where(amax > 0, amax / FP8_MAX, 1.0)), name
        assert torch.equal(dequantize_blocks(after[name], scale), back), name


def test_zero_blocks_and_values_on_the_fp8_grid_come_back_exactly():
    """A 200 x 300 weight: an all-zero block gets scale 1 and zeros; blocks (partial ones too) whose values are
    e4m3 values times 2^k with a largest magnitude of 448 * 2^k get the scale 2^k and return bit for bit."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    weight = grid[torch.randint(len(grid), (200, 300), generator=torch.Generator().manual_seed(0))] * 2.0**-9
    for row, col in ((0, 128), (0, 256), (128, 0), (129, 200), (130, 256)):  # each block's largest magnitude
        weight[row, col] = -FP8_MAX * 2.0**-9
    weight[:128, :128] = 0
    fp8, scale = quantize_blocks(weight)
    assert scale.shape == (2, 3) and scale[0, 0] == 1 and (scale.flatten()[1:] == 2.0**-9).all()
    assert torch.equal(dequantize_blocks(fp8, scale), weight)
    assert torch.equal(fp8[:128, :128].float(), torch.zeros(128, 128))


def test_a_scale_grid_of_another_block_size_is_refused():
    fp8, scale = quantize_blocks(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"needs scales of shape \(4, 5\), not \(2, 3\)"):
        dequantize_blocks(fp8, scale, block=(64, 64))


def _representable(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random e4m3 values, each 128x128 tile times its own power of two, with 448 in every tile (so its scale is
    that power of two and every value comes back exactly)."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=g) * 40).to(FP8_DTYPE).float()
    rows, cols = shape[-2:]
    values[..., ::BLOCK[0], ::BLOCK[1]] = FP8_MAX
    powers = torch.randint(-6, 4, scale_shape(shape, BLOCK), generator=g).float().exp2()
    tile = powers.repeat_interleave(BLOCK[0], -2)[..., :rows, :].repeat_interleave(BLOCK[1], -1)[..., :cols]
    return values * tile


@pytest.mark.parametrize("shape", [(128, 128), (192, 160), (3, 300, 129), (2, 64, 32)])
def test_exactly_representable_tiles_come_back_exactly(shape):
    w = _representable(shape, seed=len(shape))
    fp8, scale_inv = quantize_blocks(w, BLOCK)
    assert fp8.dtype == FP8_DTYPE and fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == scale_shape(shape, BLOCK)
    assert torch.equal(dequantize_blocks(fp8, scale_inv, BLOCK, torch.float32), w)


def test_partial_tiles_are_scaled_by_their_position():
    w = torch.randn(2, 300, 200, generator=torch.Generator().manual_seed(3))
    fp8, scale_inv = quantize_blocks(w, BLOCK)
    got = dequantize_blocks(fp8, scale_inv, BLOCK, torch.float32)
    rows = torch.arange(300) // 128
    cols = torch.arange(200) // 128
    expected = fp8.float() * scale_inv[:, rows][:, :, cols]  # element (r, c) takes tile (r // 128, c // 128)'s scale
    assert torch.equal(got, expected)
    assert torch.equal(dequantize_blocks(fp8[1], scale_inv[1], BLOCK, torch.float32), got[1])  # stacked = 2-D
    assert (got - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_dequantizing_writes_into_a_view_of_a_larger_buffer():
    w = torch.randn(160, 192, generator=torch.Generator().manual_seed(4))
    fp8, scale_inv = quantize_blocks(w, BLOCK)
    buffer = torch.zeros(2, 320, 192, dtype=torch.bfloat16)
    dequantize_blocks(fp8, scale_inv, BLOCK, torch.bfloat16, out=buffer[1, 160:])
    assert torch.equal(buffer[1, 160:], dequantize_blocks(fp8, scale_inv, BLOCK, torch.bfloat16))
    assert not buffer[0].any() and not buffer[1, :160].any()


def test_block_math_refuses_bad_input_naming_the_fix():
    fp8, scale_inv = quantize_blocks(torch.randn(160, 192), BLOCK)
    with pytest.raises(ValueError, match="weight_block_size"):
        dequantize_blocks(fp8, scale_inv, (64, 64))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_blocks(fp8.float(), scale_inv)
    with pytest.raises(ValueError, match="block="):
        quantize_blocks(torch.randn(4, 4), (0, 128))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        quantize_blocks(torch.randn(4), BLOCK)


# ---------------------------------------------------------------------------------------------------- loading back
def _reference_model(src, dst, tmp_path):
    """The source model with every quantized weight replaced by its reference dequantization (float32), saved
    as a plain checkpoint and loaded by transformers."""
    from transformers import AutoModelForCausalLM

    after = _tensors(dst)
    weights = {n: _reference_dequantized(t, after[f"{n}_scale_inv"]) if f"{n}_scale_inv" in after else t
               for n, t in after.items() if not n.endswith("_scale_inv")}
    folder = tmp_path / "dequantized"
    folder.mkdir()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((src / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logits(model, vocab: int = 256) -> torch.Tensor:
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loader_gives_the_model_of_the_dequantized_weights(family, quantized, tmp_path):
    model, src, dst, _ = quantized(family)
    reference = _reference_model(src, dst, tmp_path)
    loaded = load_fp8_dequantized(dst, torch.float32)
    assert type(loaded) is type(reference)
    want, got = reference.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(_logits(loaded), _logits(reference))
    # FP8's rounding moves the logits only a little from the bf16 model's: cosine 0.997-0.998 measured, 0.955 for
    # the tiny DeepSeek-V3, whose grouped router flips choices on small changes (2% noise on its weights: 0.970)
    fp8, bf16 = _logits(loaded), _logits(model.float())
    assert torch.nn.functional.cosine_similarity(fp8.flatten(), bf16.flatten(), dim=0) > 0.9


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kept_tensors_load_bit_for_bit(family, quantized):
    _, src, dst, _ = quantized(family)
    loaded = load_fp8_dequantized(dst, torch.bfloat16).state_dict()
    before, after = _tensors(src), _tensors(dst)
    in_memory = {n: n.replace("model.language_model.", "model.") for n in before}  # the text model of a composite
    kept = [n for n in before if f"{n}_scale_inv" not in after and in_memory[n] in loaded]
    assert any("mlp.gate.weight" in n for n in kept) and any("embed_tokens" in n for n in kept)
    assert all(torch.equal(loaded[in_memory[n]], before[n]) for n in kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_on_the_cpu_loads_the_same_model_when_every_dimension_is_whole_blocks(family, tmp_path):
    """transformers 5 dequantizes an FP8 checkpoint on a machine without a GPU; with every quantized dimension
    at most 128 or a multiple of it, its model is the loader's, bit for bit."""
    from transformers import AutoModelForCausalLM

    extra = dict(linear_key_head_dim=32) if family == "qwen3_next" else {}  # in_proj_qkvz: 256 rows, not 192
    _save_bf16(family, tmp_path / "src", **_dims(family, 256, 128, **extra))
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    ours = load_fp8_dequantized(tmp_path / "fp8", torch.float32)
    assert type(theirs) is type(ours)
    want, got = ours.state_dict(), theirs.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(_logits(theirs), _logits(ours))


def test_transformers_cpu_load_misplaces_the_scales_of_partial_blocks_and_the_loader_does_not(quantized):
    """transformers 5.25 takes a block to be rows // scale rows (80 for 160 rows), not 128: its CPU load of a
    matrix with a partial block multiplies by the wrong scales. When this fails, transformers has fixed it:
    update docs/quantized.md and psr_hf/assets/quantize.py's docstring."""
    from transformers import AutoModelForCausalLM

    _, _, dst, _ = quantized("olmoe")
    theirs = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).model.layers[0].mlp.experts
    ours = load_fp8_dequantized(dst, torch.float32).model.layers[0].mlp.experts
    assert not torch.equal(theirs.down_proj, ours.down_proj)
    on_disk = read_dequantized(dst)["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert torch.equal(ours.down_proj[0], on_disk)


def test_transformers_cpu_load_refuses_a_dimension_its_scale_rows_do_not_divide_and_the_loader_loads_it(tmp_path):
    """147 rows in 2 scale rows (DeepSeek-V3's kv_a_proj_with_mqa: 576 in 5): transformers 5.25 stops the load."""
    from transformers import AutoModelForCausalLM

    _save_bf16("deepseek_v3", tmp_path / "src", hidden_size=192, kv_lora_rank=139)
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8")
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    loaded = load_fp8_dequantized(tmp_path / "fp8", torch.float32).model.layers[0].self_attn.kv_a_proj_with_mqa
    on_disk = read_dequantized(tmp_path / "fp8")["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert loaded.weight.shape == (147, 192) and torch.equal(loaded.weight, on_disk)


def _fp8_layers(dst) -> tuple[dict[str, str], set[str]]:
    """What transformers does first when it loads the checkpoint where FP8 runs (a GPU), here on the meta device:
    ``(module name -> class name after its FP8 conversion, the modules whose weights were quantized)``."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    config = AutoConfig.from_pretrained(dst)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    if cls.config_class is config.sub_configs.get("text_config"):
        config = config.get_text_config()  # AutoModelForCausalLM's text model of a composite model
    with torch.device("meta"):
        model = cls(config)
    quantizer.preprocess_model(model)
    after = _tensors(dst)
    quantized_modules = {n.removesuffix(".weight").replace("model.language_model.", "model.")
                         for n in after if f"{n}_scale_inv" in after}
    return {n: type(m).__name__ for n, m in model.named_modules()}, quantized_modules


@pytest.mark.parametrize("family", FAMILIES)
def test_on_a_gpu_transformers_would_make_fp8_layers_of_exactly_the_quantized_weights(family, quantized):
    """With the config's modules_to_not_convert, each linear layer whose weight was quantized becomes an FP8 layer
    and each MoE block's experts FP8 experts, while the kept ones (shared-expert gates, Gated DeltaNet's a/b
    projections, lm_head) stay plain linear layers."""
    kinds, quantized_modules = _fp8_layers(quantized(family)[2])
    assert {n for n, k in kinds.items() if k == "FP8Linear"} == {m for m in quantized_modules if ".experts." not in m}
    assert {n for n, k in kinds.items() if k == "FP8Experts"} == {m.split(".experts.")[0] + ".experts"
                                                                   for m in quantized_modules if ".experts." in m}
    plain = {n for n, k in kinds.items() if k == "Linear"}
    assert "lm_head" in plain and not plain & quantized_modules


def test_a_tied_output_head_stays_a_plain_linear_layer(tmp_path):
    """A tied lm_head is no tensor of the checkpoint, but a linear layer transformers would convert to FP8."""
    _save_bf16("olmoe", tmp_path / "src", tie_word_embeddings=True)
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8")
    assert "lm_head.weight" not in _tensors(tmp_path / "fp8")
    assert _fp8_layers(tmp_path / "fp8")[0]["lm_head"] == "Linear"


# ---------------------------------------------------------------------------------------------------- bad input
def test_bad_sources_are_refused_before_anything_is_written(quantized, tmp_path):
    model, src, dst, _ = quantized("olmoe")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="already quantized.*give the bfloat16 or float32 model it was made from"):
        quantize_checkpoint(dst, out)
    empty = tmp_path / "no_weights"
    empty.mkdir()
    (empty / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no safetensors weights .*save it with save_pretrained\(\)"):
        quantize_checkpoint(empty, out)
    save_file({"model.layers.0.mlp.gate.weight": torch.zeros(4, 4, dtype=torch.float64)},
              empty / "model.safetensors")
    with pytest.raises(ValueError, match="tensor model.layers.0.mlp.gate.weight is F64; quantize reads bfloat16"):
        quantize_checkpoint(empty, out)
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}  # transformers' in-memory names: fused
    save_file(fused, empty / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj holds every expert fused .*one 2-D matrix per"):
        quantize_checkpoint(empty, out)
    assert not out.exists()
    (empty / "model.safetensors").unlink()
    broken = _tensors(src)  # in two shards, the NaN in the second: the first is written before it is found
    broken["model.layers.2.mlp.experts.5.up_proj.weight"][3, 4] = float("nan")
    shards = {name: "b.safetensors" if name.startswith("model.layers.2.") else "a.safetensors" for name in broken}
    for shard in ("a.safetensors", "b.safetensors"):
        save_file({n: t for n, t in broken.items() if shards[n] == shard}, empty / shard, metadata={"format": "pt"})
    (empty / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    with pytest.raises(ValueError, match="experts.5.up_proj.weight holds inf or NaN"):
        quantize_checkpoint(empty, out)
    assert not out.exists()  # the partly written folder is removed
    (out / "x").mkdir(parents=True)
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        quantize_checkpoint(src, out)
    with pytest.raises(ValueError, match="give two positive integers"):
        quantize_checkpoint(src, tmp_path / "other", block=(128, 0))


def test_the_cli_quantizes_the_shipped_model_into_its_shards_and_says_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "tiny-moe-fp8"
    assert main(["quantize", "tiny-moe", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"quantized tiny-moe to {out} (FP8 e4m3, 128x128 blocks): ")
    assert "weights quantized" in printed and "17 norms" in printed and "MB -> " in printed
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = json.loads((TINY_MOE / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(source["weight_map"].values())
    on_disk = _tensors(out)
    assert set(index["weight_map"]) == set(on_disk)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in on_disk.values())
    assert (out / "calibration.safetensors").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("case", ["already quantized", "no such model", "destination is a file"])
def test_the_cli_prints_bad_input_as_one_line_without_a_traceback(case, quantized, capsys):
    _, _, dst, _ = quantized("olmoe")
    argv, message = {
        "already quantized": ([str(dst), str(dst.parent / "again")], f"{dst} is already quantized"),
        "no such model": ([str(dst.parent / "nothing"), str(dst.parent / "out")], "no such local directory"),
        "destination is a file": (["tiny-moe", str(dst / "config.json")], "exists and is not a folder"),
    }[case]
    capsys.readouterr()  # the fixture's own progress bars
    assert main(["quantize", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psr-hf quantize: error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
