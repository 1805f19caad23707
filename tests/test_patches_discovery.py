"""An architecture is one file: psr_hf.patches finds its family modules, each declares its model types with
@register_patch and carries its tiny test config; nothing else lists them."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

import psr_hf
import psr_hf.patches as patches
from psr_hf import RoutingConfig
from psr_hf.patches import get_patch, register_patch, supported_model_types
from psr_hf.patches.base import ArchitecturePatch
from psr_hf.testing import FAMILIES, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

# A whole new family, as it would be written in psr_hf/patches/mixtral.py: Mixtral's router is a softmax top-K
# that always renormalises its K weights; the tiny config is the family's own.
MIXTRAL_MODULE = '''"""Mixtral (``MixtralForCausalLM``): softmax router, top-K renormalised."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("mixtral")
class MixtralPatch(ArchitecturePatch):
    default_window = 2
    normalize = True  # MixtralTopKRouter renormalises its top-K weights
    tiny = dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=4,
    )
'''
MODULE_NAME = "mixtral_in_one_file"


@contextlib.contextmanager
def _family_folder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``folder`` on ``psr_hf.patches.__path__`` for the block; afterwards the registry, the path and the imported
    modules are as before."""
    registry = dict(patches.REGISTRY._entries)
    monkeypatch.setattr(patches, "__path__", [*patches.__path__, str(folder)])
    importlib.invalidate_caches()  # the folder's file was written after the import system last listed it
    try:
        yield
    finally:
        monkeypatch.undo()  # the path
        patches.REGISTRY._entries.clear()
        patches.REGISTRY._entries.update(registry)
        sys.modules.pop(f"psr_hf.patches.{MODULE_NAME}", None)
        if hasattr(patches, MODULE_NAME):
            delattr(patches, MODULE_NAME)


def test_a_new_family_is_one_file(tmp_path, monkeypatch):
    """A module dropped into the patches folder is found, registered, has a tiny model and patches it: no list,
    no other file changes."""
    (tmp_path / f"{MODULE_NAME}.py").write_text(MIXTRAL_MODULE)
    assert "mixtral" not in supported_model_types()
    with _family_folder(tmp_path, monkeypatch):
        assert "mixtral" in supported_model_types()
        patch_class = get_patch("mixtral")
        assert patch_class.__name__ == "MixtralPatch" and patch_class.__module__ == f"psr_hf.patches.{MODULE_NAME}"
        assert tiny_config("mixtral").num_local_experts == 16
        model = tiny_model("mixtral")
        ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = model(ids).logits
            with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
                ctl = psr_hf.controller(model)
                assert (ctl.num_layers, ctl.num_experts, ctl.top_k, ctl.default_window) == (3, 16, 4, 2)
                assert torch.equal(model(ids).logits, expected)  # exact routing: bitwise the model's own
            with psr_hf.patched(model, RoutingConfig(policy="psr", residency=0.5)):
                with psr_hf.controller(model).record() as recorder:
                    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    (recording,) = recorder.recordings
    assert recording.num_tokens == 6 + 3  # the prompt and every generated token but the last
    # cleaned up: unsupported again, and the error still says how to add it
    assert "mixtral" not in supported_model_types()
    with pytest.raises(ValueError, match="'mixtral' is not supported by psr_hf; supported: deepseek_v3, olmoe.*"
                                         "one module in psr_hf/patches"):
        get_patch("mixtral")


def test_families_come_from_the_registry_with_their_own_tiny_configs():
    assert FAMILIES == tuple(supported_model_types())
    assert {"olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"} <= set(FAMILIES)
    for family in FAMILIES:
        config = get_patch(family).tiny_config(family)  # the family module's own
        assert config.model_type == family
        assert tiny_config(family).to_dict() == config.to_dict()
    assert type(tiny_model("qwen3_5_moe")).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert type(tiny_model("qwen3_5_moe_text")).__name__ == "Qwen3_5MoeForCausalLM"
    assert tiny_config("qwen3_5_moe", num_hidden_layers=2).text_config.num_hidden_layers == 2


def test_the_model_types_are_declared_once_by_the_decorator():
    assert not hasattr(ArchitecturePatch, "model_types")
    assert get_patch("qwen3_5_moe") is get_patch("qwen3_5_moe_text")


def test_a_model_type_registered_twice_raises():
    with pytest.raises(ValueError, match="model_type 'olmoe' is already registered by .*OlmoePatch"):
        register_patch("olmoe")(type("Other", (ArchitecturePatch,), {}))
    with pytest.raises(ValueError, match="needs at least one model_type"):
        register_patch()


def test_a_family_without_a_tiny_config_says_so():
    class Bare(ArchitecturePatch):
        pass

    with pytest.raises(ValueError, match=r"Bare \('bare'\) has no tiny test config"):
        Bare.tiny_config("bare")


def test_importing_the_patches_package_imports_neither_torch_nor_a_family():
    code = ("import sys, psr_hf.patches; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "assert not [m for m in sys.modules if m.startswith('psr_hf.patches.')], 'a family module'")
    subprocess.run([sys.executable, "-c", code], check=True)
