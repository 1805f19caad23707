"""Files shipped with the package: the small trained OLMoE (``tiny_moe/``), its tokenizer, calibration and card,
and the held-out text ``persuasion_vol1.txt``.

``tiny_moe/`` is a transformers model directory (``AutoModelForCausalLM.from_pretrained(TINY_MOE)`` works offline):
OLMoE's routing shape (64 experts, top-8, softmax, ``norm_topk_prob=False``), 4 MoE layers, 8.7 M parameters,
trained on offline text (``examples/train_tiny_moe/``); ``README.md`` in it is the model card.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_MOE = Path(__file__).resolve().parent / "tiny_moe"
TINY_MOE_NAME = "tiny-moe"  # its name wherever a model is named: psr-hf --model, lm-eval pretrained=
# Volume I of Jane Austen's *Persuasion* (public domain): the held-out text of the demo, psr-hf kl and the
# psr_heldout_ppl task; the tiny MoE never saw any of it (eval_configs/data/extract_persuasion.py rebuilds it)
HELD_OUT_TEXT = Path(__file__).resolve().parent / "persuasion_vol1.txt"
CALIBRATION = "calibration.safetensors"


def tiny_moe_dir() -> Path:
    """The shipped model's directory; a clear error where the installation lacks its files."""
    weights = sorted(TINY_MOE.glob("*.safetensors"))
    if not (TINY_MOE / "config.json").is_file() or not any(p.name != CALIBRATION for p in weights):
        raise FileNotFoundError(
            f"the shipped tiny MoE is not installed at {TINY_MOE} (config.json and weights missing); reinstall "
            "psr_hf from a complete checkout or wheel (its package data includes psr_hf/assets/tiny_moe)")
    return TINY_MOE


def model_dir(name_or_path: str | Path) -> Path:
    """The directory of a model named on a command line: ``tiny-moe`` is the shipped one, anything else a path."""
    return tiny_moe_dir() if str(name_or_path) == TINY_MOE_NAME else Path(name_or_path)


def calibration_beside(directory: str | Path) -> Path | None:
    """``DIR/calibration.safetensors`` where a model directory has one (its default calibration), else None."""
    path = Path(directory) / CALIBRATION
    return path if path.is_file() else None


def load_tiny_moe(dtype: Any = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, calibration)`` of the shipped trained tiny OLMoE, in eval mode (``dtype``: default
    float32; the weights are stored in bfloat16). The calibration was computed on the training corpus's
    calibration split."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..policy.calibration import Calibration

    path = tiny_moe_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, Calibration.load(path / CALIBRATION)
