"""The demo behind ``psr-hf demo`` / ``make demo``: generate under exact and cache-aware routing, count copies.

The default model is the small trained OLMoE shipped with the package (:mod:`psr_hf.assets`: OLMoE-1B-7B's
routing shape, 64 experts, top-8, softmax, ``norm_topk_prob=False``, 4 MoE layers, trained on offline English
prose, technical text and Python) with its calibration, computed on its corpus's calibration split. Prompts are
the openings of paragraphs of the held-out text (*Persuasion*, which the model never saw in training). ``model=
"random"`` runs a seeded random tiny OLMoE over a byte vocabulary instead (noise continuations; routing only), and
a path runs a saved model with its tokenizer.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ._progress import tqdm

from .policy.config import RoutingConfig
from .hf.calibrate import calibrate
from .hf.patching import controller, patch, unpatch
from .testing import tiny_model

DEMO_SHAPE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    pad_token_id=0, eos_token_id=None, bos_token_id=None,
)

UNPRINTABLE = [i for i in range(256) if not (32 <= i < 127 or i == 10)]

DEMO_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("exact + LRU", dict(policy="exact", eviction="lru")),
    ("cache_prior lam 0.2", dict(policy="cache_prior", lam=0.2)),
    ("psr lam 0.2 n=1", dict(policy="psr", lam=0.2, budget=1)),
)


@dataclass
class DemoRun:
    name: str
    residency: float
    capacity: int
    texts: list[str]
    tokens: np.ndarray  # [P, new_tokens] generated ids
    stats: dict[str, float] = field(default_factory=dict)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Any) -> str:
    raw = bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() or c in "\n" else "\N{REPLACEMENT CHARACTER}" for c in raw)


def calibration_text() -> str:
    """Held-out text for the demo's calibration: sources of a few standard-library modules (always offline)."""
    return "\n".join(inspect.getsource(module) for module in (textwrap, json.decoder, json.encoder))


def build_demo_model(seed: int = 0) -> torch.nn.Module:
    return tiny_model("olmoe", seed=seed, **DEMO_SHAPE)


def left_padded(prompts: tuple[str, ...] | list[str], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[P, S]`` of byte-encoded prompts, left-padded."""
    encoded = [encode(p) for p in prompts]
    S = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), S), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), S), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, S - len(e):] = torch.tensor(e)
        mask[row, S - len(e):] = 1
    return ids, mask


def held_out_text() -> str:
    """The held-out text shipped in the package (:data:`psr_hf.assets.HELD_OUT_TEXT`, *Persuasion* vol. I)."""
    from .assets import HELD_OUT_TEXT

    return HELD_OUT_TEXT.read_text(encoding="utf-8")


def held_out_prompts(text: str, count: int = 3, words: int = 12) -> tuple[str, ...]:
    """The first ``words`` words of the first ``count`` paragraphs of at least 40 words (after the chapter titles)."""
    paragraphs = [p.split() for p in text.split("\n\n") if len(p.split()) >= 40]
    return tuple(" ".join(p[:words]) for p in paragraphs[:count])


def _kl_windows(ids: list[int], count: int, length: int) -> list[torch.Tensor]:
    if len(ids) < count * length:
        count = max(len(ids) // length, 1)
    return [torch.tensor([ids[i * length : (i + 1) * length]], dtype=torch.long) for i in range(count)]


RANDOM = "random"


def _field(config: Any, *names: str) -> Any:
    """The first of ``names`` that ``config`` (or its text config) has, for the description; '?' if none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in names:
        for c in (config, text):
            if getattr(c, name, None) is not None:
                return getattr(c, name)
    return "?"


@torch.no_grad()
def run_demo(*, new_tokens: int = 32, residencies: tuple[float, ...] = (0.5, 0.25), seed: int = 0,
             prompts: tuple[str, ...] | None = None, model: str | Path = "tiny-moe",
             kl_windows: int = 4, kl_tokens: int = 128, progress: bool = False) -> dict[str, Any]:
    """Generate from ``prompts`` (one left-padded batch) under each demo configuration and residency, and measure
    each configuration's excess NLL over exact routing on held-out windows (:mod:`psr_hf.eval.divergence`).

    ``model``: ``"tiny-moe"`` (the shipped trained model with its calibration), ``"random"`` (the seeded random
    tiny OLMoE with a byte vocabulary, calibrated on standard-library source) or a saved model directory with its
    tokenizer (and ``calibration.safetensors`` beside them, else it is calibrated on standard-library source), or any
    name :func:`psr_hf.assets.resolve_model` resolves (``ValueError`` naming what was looked for otherwise).
    Prompts default to the openings of held-out paragraphs. ``progress``: tqdm bars (stderr) over the generation
    runs and the scoring passes.

    Returns a dict: ``model`` (a description), ``prompts``, ``new_tokens``, ``calibration_tokens``, ``kl`` (what
    was scored), ``runs`` (one :class:`DemoRun` per configuration and residency) and ``divergence`` (the
    :class:`~psr_hf.eval.divergence.DivergenceRow` of each run, in the same order)."""
    from .eval.divergence import divergence

    text = held_out_text()
    if prompts is None:
        prompts = held_out_prompts(text)
    if model == RANDOM:
        net = build_demo_model(seed)
        tokenizer, description = None, ("tiny OLMoE, random weights (seeded), 4 MoE layers x 64 experts, top-8, byte "
                                        "vocabulary")
        calibration = calibrate(net, [encode(calibration_text())], max_length=256, batch_size=8,
                                progress=progress)
        ids, mask = left_padded(prompts)
        suppress: list[int] | None = UNPRINTABLE  # printable continuations; routing is unaffected
        held_ids = encode(text)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .assets import TINY_MOE_NAME, calibration_beside, resolve_model
        from .policy.calibration import Calibration

        source = resolve_model(model, also=(RANDOM,))  # a typo or a non-MoE model fails here, before loading
        net = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32,
                                                   **source.from_pretrained_kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(source.location, **source.from_pretrained_kwargs)
        tokenizer.padding_side = "left"
        file = calibration_beside(source.directory) if source.directory is not None else None
        if file is not None:
            calibration = Calibration.load(file)
        else:
            calibration = calibrate(net, [calibration_text()], tokenizer=tokenizer, max_length=256, progress=progress)
        batch = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        suppress = None
        name = ("the shipped trained tiny MoE (psr_hf.assets)" if model == TINY_MOE_NAME else
                source.directory.name if source.kind == "directory" else str(model))
        description = f"{name}: {type(net).__name__}, {getattr(net.config, 'num_hidden_layers', '?')} " \
                      f"layers x {_field(net.config, 'num_experts', 'n_routed_experts', 'num_local_experts')} experts, " \
                      f"top-{_field(net.config, 'num_experts_per_tok')}"
        held_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # cut into windows below
    runs: list[DemoRun] = []
    configs: dict[str, RoutingConfig] = {}
    bar = tqdm(total=len(residencies) * len(DEMO_CONFIGS), unit="run", desc="generating", disable=not progress)
    for residency in residencies:
        for name, fields in DEMO_CONFIGS:
            bar.set_postfix_str(f"{name} @ {residency:.0%}")
            config = configs[f"{name}@{residency}"] = RoutingConfig(residency=residency, **fields)
            patch(net, config, calibration=calibration)
            try:
                kwargs = {"suppress_tokens": suppress} if suppress else {}
                pad = tokenizer.pad_token_id if tokenizer is not None else 0
                out = net.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=pad, **kwargs)
                stats = controller(net).stats().total
                capacity = controller(net).capacity
            finally:
                unpatch(net)
            generated = out[:, ids.shape[1]:].numpy()
            texts = ([decode(g) for g in generated] if tokenizer is None else
                     tokenizer.batch_decode(generated, skip_special_tokens=True))
            runs.append(DemoRun(name, residency, capacity, texts, generated, stats))
            bar.update(1)
    bar.close()
    exact = {run.residency: run.tokens for run in runs if configs[f"{run.name}@{run.residency}"].follows_router}
    for run in runs:
        run.stats["same_tokens_as_exact"] = float(np.mean(run.tokens == exact[run.residency]))
    windows = _kl_windows(held_ids, kl_windows, kl_tokens)
    rows = divergence(net, windows, configs, calibration=calibration, progress=progress)
    for run, row in zip(runs, rows):
        run.stats["excess_nll"] = row.excess_nll
    return {
        "model": description,
        "prompts": list(prompts),
        "new_tokens": new_tokens,
        "calibration_tokens": int(calibration.expert_counts[0].sum() // net.config.num_experts_per_tok),
        "kl": f"{len(windows)} held-out windows of {windows[0].shape[1]} tokens",
        "runs": runs,
        "divergence": rows,
    }
