"""The FP8 expert store on the CPU path (``psr_hf/offload/fp8_experts.py`` and its checkpoint reader).

Tiny models are saved in bf16 and written as FP8 checkpoints by ``psr-hf quantize``'s writer
(``psr_hf.assets.quantize``), with dimensions that give whole 128x128 blocks and partial ones; loaded dequantized
(by that module's loader, right for every block, or by transformers' own CPU load) and patched with ``offload=``:
the host store and the slots then hold the checkpoint's e4m3 experts and scales, copies move FP8 bytes, and the
logits are bitwise those of the same model offloaded in bf16 (``expert_format="model"``) under the same routing.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import psr_hf
from psr_hf.engine.slot_moe import slot_moe
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.assets.fp8_blocks import FP8_DTYPE, quantize_blocks
from psr_hf.assets.quantize import load_fp8_dequantized, quantize_checkpoint, read_dequantized
from psr_hf.offload.experts import OffloadedExperts
from psr_hf.offload.fp8_experts import Fp8OffloadedExperts
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PAD = 0
BLOCK = (128, 128)
# hidden 192 and expert width 160: each projection has a whole 128x128 tile and partial ones
PARTIAL = {"olmoe": dict(hidden_size=192, intermediate_size=160),
           "deepseek_v3": dict(hidden_size=192, moe_intermediate_size=160),
           "qwen3_5_moe": dict(hidden_size=192, moe_intermediate_size=160)}  # loaded as its text model
WHOLE = dict(hidden_size=256, intermediate_size=128)  # olmoe with whole tiles only
POLICIES = {"psr": RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
            "exact": RoutingConfig(policy="exact", residency=0.5)}


# ---------------------------------------------------------------------------------------------- checkpoints
def _quantized(family: str, folder: Path, **dims) -> Path:
    """A tiny ``family`` model saved in bf16 under ``folder`` and written as an FP8 checkpoint by psr-hf quantize."""
    tiny_model(family, dtype=torch.bfloat16, **dims).save_pretrained(folder / "bf16")
    quantize_checkpoint(folder / "bf16", folder / "fp8")
    return folder / "fp8"


def _bf16_experts(folder: Path) -> Path:
    """An FP8 checkpoint (config.json says so) whose routed experts stayed bf16, as ``modules_to_not_convert``
    keeps them: only the attention output projections are quantized."""
    tiny_model("olmoe", dtype=torch.bfloat16, **PARTIAL["olmoe"]).save_pretrained(folder)
    out = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        out[name] = tensor
        if name.endswith("self_attn.o_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_blocks(tensor, BLOCK)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK), "modules_to_not_convert": ["mlp.experts"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name)``: the folder of an FP8 checkpoint (a family's, with partial tiles; "whole": OLMoE with
    whole tiles only; "bf16_experts"), written once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = (_bf16_experts(folder) if name == "bf16_experts" else
                          _quantized("olmoe", folder, **WHOLE) if name == "whole" else
                          _quantized(name, folder, **PARTIAL[name]))
        return made[name]

    return get


def _load(folder: Path) -> torch.nn.Module:
    """The checkpoint's model dequantized by psr_hf's loader (every block right), ``name_or_path`` the folder (so
    the default offload finds it; the tests name it all the same, :func:`_fp8`)."""
    return load_fp8_dequantized(folder, torch.bfloat16)


def _transformers_load(folder: Path) -> torch.nn.Module:
    """transformers' own CPU load: dequantized (partial blocks by the grid's size), ``name_or_path`` the folder."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def _fp8(folder: Path, **kwargs) -> OffloadConfig:
    return OffloadConfig(device="cpu", checkpoint=str(folder), **kwargs)


def _bf16(**kwargs) -> OffloadConfig:
    return OffloadConfig(device="cpu", expert_format="model", **kwargs)


def _experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith("mlp.experts")}


def _with_checkpoint_experts(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """``model`` (an OLMoE) with its routed experts set to the checkpoint's, dequantized by psr-hf quantize's
    reader (by block position), in transformers' fused layout (gate rows, then up rows)."""
    stored = read_dequantized(folder, torch.bfloat16)
    with torch.no_grad():
        for name, module in _experts_modules(model).items():
            E = module.gate_up_proj.shape[0]
            proj = {p: torch.stack([stored[f"{name}.{e}.{p}.weight"] for e in range(E)])
                    for p in ("gate_proj", "up_proj", "down_proj")}
            module.gate_up_proj.copy_(torch.cat([proj["gate_proj"], proj["up_proj"]], dim=1))
            module.down_proj.copy_(proj["down_proj"])
    return model


# ---------------------------------------------------------------------------------------------- running
def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _run(model, config, offload, new=6):
    """Greedy tokens and step logits of one row, a teacher-forced forward of a left-padded batch of two, the
    offload statistics and memory, of ``model`` freshly patched (unpatched afterwards)."""
    psr_hf.patch(model, config, calibration=False, offload=offload)
    try:
        ctl = psr_hf.controller(model)
        batch = _ids(1, 2, 12)
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        batch[1, :3] = PAD
        with torch.no_grad():
            out = model.generate(_ids(0, 1, 7), max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                                 output_logits=True, return_dict_in_generate=True)
            forced = model(batch, attention_mask=mask).logits
        result = dict(tokens=out.sequences, steps=torch.stack(out.logits), forced=forced,
                      stats=ctl.stats().offload, memory=ctl.memory(), store=ctl.expert_store)
    finally:
        psr_hf.unpatch(model)
    return result


# ---------------------------------------------------------------------------------------------- the store
@pytest.mark.parametrize("family, policy, threads", [
    ("olmoe", "psr", 1), ("olmoe", "exact", 1), ("olmoe", "psr", 2), ("deepseek_v3", "psr", 1),
    ("qwen3_5_moe", "exact", 1)])
def test_fp8_offload_is_bitwise_the_dequantized_model_offloaded(checkpoints, family, policy, threads):
    folder = checkpoints(family)
    config = POLICIES[policy]
    torch.set_num_threads(threads)  # two: a block computes slot by slot (docs/offloading.md)
    try:
        fp8 = _run(_load(folder), config, _fp8(folder, check_slots=True))
        bf16 = _run(_load(folder), config, _bf16(check_slots=True))
    finally:
        torch.set_num_threads(1)
    assert isinstance(fp8["store"], Fp8OffloadedExperts) and type(bf16["store"]) is OffloadedExperts
    assert torch.equal(fp8["tokens"], bf16["tokens"])
    assert torch.equal(fp8["steps"], bf16["steps"])
    assert torch.equal(fp8["forced"], bf16["forced"])
    a, b = fp8["stats"], bf16["stats"]
    assert (a.demand, a.prefetch, a.dropped, a.warm) == (b.demand, b.prefetch, b.dropped, b.warm)


def test_a_model_transformers_loaded_is_offloaded_in_fp8_by_default(checkpoints, caplog):
    """transformers' CPU load drops quantization_config from the model's config; its folder's config.json still
    says FP8, so the default offload reads the checkpoint: the checkpoint's experts (block by position), with the
    rest of the model as transformers loaded it, and a warning that transformers' partial blocks differ."""
    folder = checkpoints("olmoe")
    model = _transformers_load(folder)
    assert getattr(model.config, "quantization_config", None) is None
    caplog.set_level(logging.WARNING, logger="psr_hf.offload")
    fp8 = _run(model, POLICIES["psr"], OffloadConfig(device="cpu", check_slots=True))
    assert any("partial 128x128 tiles" in r.getMessage() for r in caplog.records)
    bf16 = _run(_with_checkpoint_experts(_transformers_load(folder), folder), POLICIES["psr"], _bf16())
    assert isinstance(fp8["store"], Fp8OffloadedExperts)
    for key in ("tokens", "steps", "forced"):
        assert torch.equal(fp8[key], bf16[key]), key


def _decode_through_the_store(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each token-layer's MoE output of four decode steps with seeded router scores, computed as the engine's
    decoders do: the slots :meth:`decode_slots` gives, through the layer's :func:`~psr_hf.engine.slot_moe.slot_moe`
    (the FP8 kernel's reference form on an FP8 store, the model-weights one otherwise)."""
    ctl = psr_hf.controller(model)
    handle, store = ctl.decode_handle(), ctl.expert_store
    rng = np.random.default_rng(0)
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    outputs = []
    for position, token in enumerate((5, 9, 11, 5)):
        with handle.step(token, position):
            for layer in range(ctl.num_layers):
                last = layer + 1 == ctl.num_layers
                scores, pregate = rng.standard_normal((2, ctl.num_experts)).astype(np.float32)
                selection = handle.select(layer, scores, None if last else pregate)
                if not last:
                    handle.prefetch(layer + 1)
                slots = torch.from_numpy(store.decode_slots(layer, selection.experts.reshape(-1)))
                weights = torch.linspace(0.1, 0.9, slots.numel(), dtype=hidden.dtype)
                moe = slot_moe(store, layer, hidden.device)
                assert moe.fp8 == (store.weight_format == "fp8")
                outputs.append(moe(hidden, slots, weights, torch.empty_like(hidden), backend="torch"))
                store.decode_done(layer)
    return outputs


def test_the_engines_slot_moe_on_the_fp8_store_is_bitwise_the_dequantized_experts(checkpoints):
    folder = checkpoints("olmoe")
    runs = []
    for offload in (_fp8(folder), _bf16()):
        model = _load(folder)
        psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=offload)
        try:
            runs.append(_decode_through_the_store(model))
        finally:
            psr_hf.unpatch(model)
    assert len(runs[0]) == 12 and all(torch.equal(a, b) for a, b in zip(*runs))


def test_copy_timing_never_changes_fp8_outputs(checkpoints):
    folder = checkpoints("olmoe")
    runs = [_run(_load(folder), POLICIES["psr"], _fp8(folder, **kw))
            for kw in (dict(max_in_flight=4), dict(max_in_flight=1, copy_delay_ms=1.0))]
    for key in ("tokens", "steps", "forced"):
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_the_store_holds_fp8_experts_and_copies_fp8_bytes(checkpoints):
    folder = checkpoints("olmoe")
    model = _load(folder)
    first = next(iter(_experts_modules(model).values()))
    bf16_per_expert = first.gate_up_proj[0].nbytes + first.down_proj[0].nbytes
    psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=_fp8(folder))
    try:
        ctl = psr_hf.controller(model)
        store = ctl.expert_store
        host, slots = store.expert_weights(0), store.fp8_slot_weights(0)
        with torch.no_grad():
            model.generate(_ids(2, 1, 5), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
        stats, memory = ctl.stats().offload, ctl.memory()
    finally:
        psr_hf.unpatch(model)
    I, H = 160, 192
    assert {n: (t.dtype, tuple(t.shape)) for n, t in host.items()} == {
        "gate_up_proj": (FP8_DTYPE, (16, 2 * I, H)), "gate_up_proj_scale_inv": (torch.float32, (16, 4, 2)),
        "down_proj": (FP8_DTYPE, (16, H, I)), "down_proj_scale_inv": (torch.float32, (16, 2, 2))}
    assert {n: (t.dtype, t.shape[0]) for n, t in slots.items()} == {n: (t.dtype, 8) for n, t in host.items()}
    stored = load_file(folder / "model.safetensors")
    up = "model.layers.0.mlp.experts.5.up_proj.weight"
    assert torch.equal(host["gate_up_proj"][5, I:].view(torch.uint8), stored[up].view(torch.uint8))
    assert torch.equal(host["gate_up_proj_scale_inv"][5, 2:], stored[up + "_scale_inv"])  # up's block rows
    per_expert = 3 * I * H + 3 * 4 * 4  # e4m3 bytes and three 2x2 float32 scale grids
    assert memory.bytes_per_expert == per_expert and 0.5 < per_expert / bf16_per_expert < 0.501
    assert memory.expert_bytes_full == 3 * 16 * per_expert and memory.expert_bytes_device == 3 * 8 * per_expert
    assert memory.host_store_bytes >= memory.expert_bytes_full
    copies = stats.demand + stats.prefetch - stats.dropped + stats.warm
    assert copies > 0 and stats.bytes == copies * per_expert


def test_offloaded_expert_parameters_hold_no_memory_and_unpatch_restores_them_dequantized(checkpoints):
    folder = checkpoints("olmoe")
    model, reference = _load(folder), _load(folder)
    expected = dict(reference.named_parameters())
    originals = {name: (m.gate_up_proj, m.down_proj) for name, m in _experts_modules(model).items()}
    psr_hf.patch(model, POLICIES["exact"], calibration=False, offload=_fp8(folder))
    for name, module in _experts_modules(model).items():
        for weight, original in zip(("gate_up_proj", "down_proj"), originals[name]):
            held = getattr(module, weight)
            assert held.is_meta and held.shape == expected[f"{name}.{weight}"].shape
            assert original.numel() == 0  # the bf16 values are not kept beside the FP8 store
    psr_hf.unpatch(model)
    for name, module in _experts_modules(model).items():
        for weight, original in zip(("gate_up_proj", "down_proj"), originals[name]):
            assert getattr(module, weight) is original and original.device.type == "cpu"
            assert torch.equal(original, expected[f"{name}.{weight}"])
    assert model.config._experts_implementation == reference.config._experts_implementation
    with torch.no_grad():
        assert torch.equal(model(_ids(5, 1, 9)).logits, reference(_ids(5, 1, 9)).logits)


def test_a_checkpoint_of_whole_tiles_offloads_as_transformers_loaded_it(checkpoints):
    """Where every tile is whole, transformers' dequantized weights are the checkpoint's: the FP8 store computes
    the loaded model (bitwise against it offloaded in bf16), and unpatch gives it back unchanged."""
    folder = checkpoints("whole")
    model = _transformers_load(folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bf16 = _run(_transformers_load(folder), POLICIES["psr"], _bf16())
    fp8 = _run(model, POLICIES["psr"], OffloadConfig(device="cpu", expert_format="fp8"))
    assert isinstance(fp8["store"], Fp8OffloadedExperts)
    for key in ("tokens", "steps", "forced"):
        assert torch.equal(fp8[key], bf16[key]), key
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_model_psr_hf_loaded_dequantized_is_offloaded_in_fp8_by_default(checkpoints):
    """load_fp8_dequantized names the folder as from_pretrained does, so ``expert_format="auto"`` (the default)
    finds the FP8 checkpoint: the host store holds its e4m3 experts, not the loaded model's bf16 ones."""
    folder = checkpoints("olmoe")
    model = _load(folder)
    assert model.name_or_path == model.config._name_or_path == str(folder)
    psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))
    try:
        store = psr_hf.controller(model).expert_store
        host = store.expert_weights(0)
    finally:
        psr_hf.unpatch(model)
    assert isinstance(store, Fp8OffloadedExperts)
    assert host["gate_up_proj"].dtype == FP8_DTYPE and host["down_proj"].dtype == FP8_DTYPE


def test_a_model_loaded_without_its_folder_offloads_in_fp8_once_the_checkpoint_is_named(checkpoints):
    folder = checkpoints("olmoe")
    model = _load(folder)
    model.name_or_path = model.config.name_or_path = ""  # as if loaded some other way: its config names no folder
    assert type(_run(model, POLICIES["exact"], OffloadConfig(device="cpu"))["store"]) is OffloadedExperts
    with pytest.raises(ValueError, match="not loaded from an FP8 checkpoint.*OffloadConfig\\(checkpoint="):
        psr_hf.patch(model, POLICIES["exact"], calibration=False,
                     offload=OffloadConfig(device="cpu", expert_format="fp8"))
    assert isinstance(_run(model, POLICIES["exact"], _fp8(folder))["store"], Fp8OffloadedExperts)


def test_a_model_whose_experts_differ_from_the_checkpoint_is_refused(checkpoints):
    model = _transformers_load(checkpoints("whole"))
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[1, 0, 0] += 1.0  # expert 1 % 16 of layer 1: the one checked
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="MoE layer 1: expert 1's down_proj in the model differs from the FP8"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))
    with pytest.raises(ValueError, match="not patched"):
        psr_hf.controller(model)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())  # all or nothing: given back as it was


def test_weights_replaced_after_offloading_are_refused_at_the_next_forward(checkpoints):
    folder = checkpoints("olmoe")
    model = _load(folder)
    psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=_fp8(folder))
    try:
        experts = model.model.layers[0].mlp.experts
        experts.down_proj = torch.nn.Parameter(torch.zeros(experts.down_proj.shape, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="replaced, converted or written after offloading"):
            with torch.no_grad():
                model(_ids(0, 1, 4))
    finally:
        psr_hf.unpatch(model)
    assert not model.model.layers[0].mlp.experts.down_proj.any()  # the user's parameter stays


def test_unquantized_experts_offload_the_models_own_weights(checkpoints):
    folder = checkpoints("bf16_experts")
    model = _transformers_load(folder)
    assert type(_run(model, POLICIES["psr"], OffloadConfig(device="cpu"))["store"]) is OffloadedExperts
    with pytest.raises(ValueError, match="keeps the routed experts unquantized"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False,
                     offload=OffloadConfig(device="cpu", expert_format="fp8"))


# ---------------------------------------------------------------------------------------------- refusals
def test_an_fp8_model_without_its_files_gets_the_fix(checkpoints, tmp_path):
    model = _load(checkpoints("olmoe"))
    written = json.loads((checkpoints("olmoe") / "config.json").read_text())["quantization_config"]
    model.config.quantization_config = written  # as transformers keeps it where it loads FP8 modules (a GPU)
    model.config._name_or_path = "no/such-model"
    with pytest.raises(ValueError, match=r"finds no checkpoint files.*OffloadConfig\(checkpoint="):
        psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))
    with pytest.raises(ValueError, match="no such folder"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False,
                     offload=OffloadConfig(device="cpu", checkpoint=str(tmp_path / "missing")))
    empty = tmp_path / "config_only"
    empty.mkdir()
    shutil.copy(checkpoints("olmoe") / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False,
                     offload=OffloadConfig(device="cpu", checkpoint=str(empty)))
    with pytest.raises(ValueError, match="not patched"):
        psr_hf.controller(model)
    assert not model.model.layers[0].mlp.experts.gate_up_proj.is_meta


@pytest.mark.parametrize("change, message", [
    (dict(weight_block_size=[64, 64]), "psr_hf expects .* 64x64 tiles, as config.json says"),
    (dict(weight_block_size=None), "weight_block_size=None; psr_hf reads block-wise scales"),
    (dict(scale_fmt="ue8m0"), "scale_fmt='ue8m0'; psr_hf reads e4m3 weights with float32 scales"),
    (dict(fmt="e5m2"), "fmt='e5m2'"),
])
def test_an_fp8_variant_psr_hf_does_not_read_is_refused_with_the_fix(checkpoints, tmp_path, change, message):
    folder = shutil.copytree(checkpoints("olmoe"), tmp_path / "variant")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    model = _load(checkpoints("olmoe"))
    with pytest.raises(ValueError, match=message) as error:
        psr_hf.patch(model, POLICIES["psr"], calibration=False,
                     offload=OffloadConfig(device="cpu", checkpoint=str(folder)))
    assert "expert_format='model'" in str(error.value)
    assert not model.model.layers[0].mlp.experts.gate_up_proj.is_meta


def test_fp8_required_of_a_bf16_model_names_psr_hf_quantize():
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match="not loaded from an FP8 checkpoint.*psr-hf quantize"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False,
                     offload=OffloadConfig(device="cpu", expert_format="fp8"))


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_other_quantization_methods_are_refused_at_patch(method, tmp_path):
    model = tiny_model("olmoe")
    model.config.quantization_config = {"quant_method": method, "bits": 4}
    with pytest.raises(ValueError, match=f"quantized with '{method}'.*bf16/float32 experts and fine-grained FP8"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))
    del model.config.quantization_config
    model.save_pretrained(tmp_path)  # the same said by the checkpoint's config.json only
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model.config._name_or_path = str(tmp_path)
    with pytest.raises(ValueError, match=f"checkpoint {tmp_path} is quantized with '{method}'"):
        psr_hf.patch(model, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(expert_format="int4"), "expert_format='int4' must be one of 'auto', 'fp8', 'model'"),
    (dict(checkpoint=""), "checkpoint='' must be None or the path"),
    (dict(expert_format="model", checkpoint="/x"), "expert_format='model' reads none"),
])
def test_bad_expert_formats_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OffloadConfig(device="cpu", **kwargs)



def test_the_bench_loads_an_fp8_folder_dequantized_and_drops_its_fp8_copies_without_dequantizing(checkpoints):
    """``--model <FP8 folder>``: every weight dequantized with the checkpoint's block size and the folder as its
    name, so an offload reads the experts in FP8; a bench copy offloaded in FP8 and thrown away gets the source's
    tensors back (nothing dequantized, no second copy of the experts), and the source is unchanged."""
    from psr_hf.assets.loading import load_model
    from psr_hf.bench.runners import drop_offloaded_copy, weight_sharing_copy

    folder = checkpoints("olmoe")
    source, _, info = load_model(str(folder), "cpu")
    assert source.name_or_path == str(folder)
    expected = _load(folder)  # bf16, the checkpoint's dtype, as "auto" loads a folder
    for (name, p), (_, q) in zip(source.named_parameters(), expected.named_parameters()):
        assert p.dtype == q.dtype == torch.bfloat16 and torch.equal(p, q), name
    before = {name: (p, p.data_ptr()) for name, p in source.named_parameters()}
    copied = weight_sharing_copy(source)
    psr_hf.patch(copied, POLICIES["psr"], calibration=False, offload=OffloadConfig(device="cpu"))
    assert isinstance(psr_hf.controller(copied).offload, Fp8OffloadedExperts)
    drop_offloaded_copy(copied, source)
    for name, p in copied.named_parameters():
        assert p.data_ptr() == before[name][1], name
    for name, p in source.named_parameters():
        assert p is before[name][0] and p.data_ptr() == before[name][1], name
