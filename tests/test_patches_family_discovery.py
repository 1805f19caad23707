"""A new family is one file in psr_hf/patches and one per further layer it should support: the engine's decode
layers (psr_hf/engine/families) and grow's mapping (psr_hf/assets/grow_families). Each package finds its family
modules on its path and each module registers itself; nothing else lists them. Mixtral, written as those three
files into temporary folders on the three paths, is patched, decoded by the engine as transformers decodes it,
served behind generate(), and grown exactly, with no other change."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
import types
from pathlib import Path
from typing import Iterator

import pytest
import torch

import psr_hf
import psr_hf.assets.grow_families as grow_families
import psr_hf.engine.families as engine_families
import psr_hf.patches as patches
from psr_hf import RoutingConfig
from psr_hf._registry import FamilyRegistry
from psr_hf.assets.grow import PRESETS, default_target, grow, target_by_name
from psr_hf.assets.grow_families import grow_model_types
from psr_hf.engine.families import supported_model_types
from psr_hf.engine.families import build_layers
from psr_hf.testing import tiny_model
from test_patches_discovery import MIXTRAL_MODULE  # the patch module of the transformers path's own test

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

# psr_hf/engine/families/mixtral.py: Llama's attention (grouped-query, rotate-half RoPE, no q/k norms)
MIXTRAL_ENGINE = '''"""Mixtral's engine layers: grouped-query attention with rotate-half RoPE and no q/k norms."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import StaticKVCache, apply_rope, cos_sin, write_kv
from ..layers import DecodeLayers
from . import register_layers


@dataclass(frozen=True)
class MixtralStatic:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_scaling: float


def mixtral_attention(s, a, x, position, keys, values, slots):
    nH, nKV, D = s.num_heads, s.num_kv_heads, s.head_dim
    cos, sin = cos_sin(position, a["inv_freq"], s.rope_scaling, x.dtype, False)
    q = apply_rope(F.linear(x, a["q_proj"]).view(nH, D), cos, sin, False)
    write_kv(keys, position, apply_rope(F.linear(x, a["k_proj"]).view(nKV, D), cos, sin, False))
    write_kv(values, position, F.linear(x, a["v_proj"]).view(nKV, D))
    scores = torch.matmul(q.view(nKV, nH // nKV, D), keys.permute(1, 2, 0)) * D ** -0.5  # [nKV, G, T]
    probs = torch.softmax(scores.masked_fill(slots > position, float("-inf")), dim=-1, dtype=torch.float32)
    return F.linear(torch.matmul(probs.to(q.dtype), values.transpose(0, 1)).reshape(1, nH * D), a["o_proj"])


@register_layers("mixtral")
class MixtralLayers(DecodeLayers):
    def _build_attention(self):
        c = self.config
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self._attn = [{"inv_freq": self.inv_freq, **{p: self._ref(f"layers.{i}.{p}", getattr(layer.self_attn, p).weight)
                                                     for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}
                      for i, layer in enumerate(self.layers)]
        self._attention_fn = mixtral_attention
        self._static = MixtralStatic(self.num_heads, self.num_kv_heads, self.head_dim, self.rope_scaling)

    def _build_kv_cache(self):
        return StaticKVCache(self.num_layers, self.max_len, self.num_kv_heads, self.head_dim, self.head_dim,
                             dtype=self.dtype, device=self.device)

    def _cache(self, layer):
        return self.kv.keys[layer], self.kv.values[layer], self.kv.slots
'''

# psr_hf/assets/grow_families/mixtral.py: heads and rotary pairs placed as for OLMoE, no norms inside attention
MIXTRAL_GROW = '''"""Mixtral's grow mapping and a small preset."""

from __future__ import annotations

import math

import torch

from . import register_grow
from .base import Dims, GrowFamily, GrowTarget, head_positions, rope_map


@register_grow("mixtral")
class MixtralGrow(GrowFamily, model_name="Mixtral-x4"):
    def check_target(self, target, fail):
        if target.head_dim is None or target.head_dim % 2:
            fail("a Mixtral target needs an even head_dim")

    def dims(self, config):
        return Dims(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                    config.intermediate_size, head_dim=config.head_dim or config.hidden_size // config.num_attention_heads)

    def attention(self, fill, big, small, s, b, config):
        inner = rope_map(s.head_dim, b.head_dim, interleaved=False)
        q_pos = head_positions(s.heads, s.head_dim, b.head_dim, inner)
        d = (s.heads // s.kv_heads) // (b.heads // b.kv_heads)  # repetitions of each small key/value head
        kv_from = (torch.repeat_interleave(torch.arange(s.kv_heads), d).view(-1, 1) * s.head_dim
                   + torch.arange(s.head_dim).view(1, -1)).reshape(-1)
        kv_to = head_positions(s.kv_heads * d, s.head_dim, b.head_dim, inner)
        fill.linear(big.q_proj, small.q_proj, q_pos, None, math.sqrt(b.head_dim / s.head_dim))  # the attention scale
        fill.linear(big.k_proj, small.k_proj, (kv_from, kv_to), None)
        fill.linear(big.v_proj, small.v_proj, (kv_from, kv_to), None)
        fill.linear(big.o_proj, small.o_proj, None, q_pos)

    def update_config(self, data, s, b):
        data.update(intermediate_size=b.expert, head_dim=b.head_dim)


MixtralGrow.preset = GrowTarget(name="mixtral-x4", family="mixtral", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=8, head_dim=32, expert_intermediate_size=48)
'''

MODULE = "mixtral_family"
FILES = {"psr_hf.patches": MIXTRAL_MODULE, "psr_hf.engine.families": MIXTRAL_ENGINE,
         "psr_hf.assets.grow_families": MIXTRAL_GROW}
REGISTRIES = (patches.REGISTRY._entries, engine_families.REGISTRY._entries, grow_families.REGISTRY._entries)


@contextlib.contextmanager
def _family_files(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each of :data:`FILES` written into its own folder on its package's ``__path__`` for the block; afterwards the
    registries, the paths and the imported modules are as before."""
    saved = [dict(registry) for registry in REGISTRIES]
    for package_name, text in FILES.items():
        (folder / package_name).mkdir()
        (folder / package_name / f"{MODULE}.py").write_text(text)
        package = importlib.import_module(package_name)
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder / package_name)])
    importlib.invalidate_caches()  # the files were written after the import system last listed the folders
    try:
        yield
    finally:
        monkeypatch.undo()
        for registry, before in zip(REGISTRIES, saved):
            registry.clear()
            registry.update(before)
        for package_name in FILES:
            sys.modules.pop(f"{package_name}.{MODULE}", None)
            if hasattr(sys.modules[package_name], MODULE):
                delattr(sys.modules[package_name], MODULE)


def test_a_new_family_is_one_file_per_layer(tmp_path, monkeypatch):
    assert len(FILES) == 3  # the transformers path, the engine, grow: what full support of a family touches
    assert "mixtral" not in supported_model_types() and "mixtral" not in grow_model_types()
    engine_families, grow_families = supported_model_types(), grow_model_types()
    assert engine_families[:2] == grow_families[:2] == ["olmoe", "deepseek_v3"]
    with _family_files(tmp_path, monkeypatch):
        assert supported_model_types() == [*engine_families, "mixtral"]  # listed after the project's own
        assert grow_model_types() == [*grow_families, "mixtral"]
        model = tiny_model("mixtral")
        ids = list(range(3, 17))
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0]
        layers = build_layers(model, max_len=len(ids) + 2)
        assert type(layers).__name__ == "MixtralLayers"
        got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5

        prompt = torch.tensor([ids[:6]])
        with psr_hf.patched(model, RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5)), torch.no_grad():
            hf = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            psr_hf.engine.attach(model, max_len=16)
            try:
                ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
                assert psr_hf.engine.attached(model).served == 6 and psr_hf.engine.attached(model).fallbacks == 0
            finally:
                psr_hf.engine.detach(model)
        assert torch.equal(ours, hf)

        small = tiny_model("mixtral", seed=3)
        assert default_target(small.config) is target_by_name("mixtral-x4") and "mixtral-x4" in PRESETS
        big = grow(small)
        assert big.config.hidden_size == 256 and big.config.head_dim == 32
        probe = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            small_logits, big_logits = small(probe).logits, big(probe).logits
        assert float((small_logits - big_logits).abs().max()) <= 1e-5 * float(small_logits.abs().max())
    # cleaned up: unsupported again
    assert "mixtral" not in supported_model_types() and "mixtral" not in grow_model_types()
    assert "mixtral-x4" not in PRESETS
    with pytest.raises(ValueError, match=f"does not support model_type 'mixtral'; supported: "
                                         f"{', '.join(engine_families)}$"):
        build_layers(types.SimpleNamespace(config=model.config), 8)


def test_the_shipped_families_are_found_on_the_paths():
    assert supported_model_types() == ["olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"]
    assert grow_model_types() == ["olmoe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next"]
    assert list(PRESETS) == ["olmoe-1b-7b", "moonlight-16b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"]
    assert type(build_layers(tiny_model("deepseek_v3"), 4)).__module__ == "psr_hf.engine.families.deepseek_v3"
    assert type(build_layers(tiny_model("qwen3_5_moe"), 4)).__module__ == "psr_hf.engine.families.qwen3_5_moe"
    assert type(build_layers(tiny_model("qwen3_next"), 4)).__module__ == "psr_hf.engine.families.qwen3_next"


def test_a_model_type_registered_twice_raises():
    registry = FamilyRegistry(engine_families.__name__, "engine layers")
    registry.register("x")(int)
    with pytest.raises(ValueError, match=r"model_type 'x' is already registered by <class 'int'> \(engine layers\)"):
        registry.register("x")(float)
    with pytest.raises(ValueError, match="registering engine layers needs at least one model_type"):
        registry.register()


def test_importing_the_family_packages_imports_neither_torch_nor_a_family():
    code = ("import sys, psr_hf.engine.families, psr_hf.assets.grow_families; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "assert not [m for m in sys.modules if m.startswith(('psr_hf.engine.families.', "
            "'psr_hf.assets.grow_families.'))], 'a family module'")
    subprocess.run([sys.executable, "-c", code], check=True)
