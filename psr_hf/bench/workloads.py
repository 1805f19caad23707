"""Workloads of the benchmarks: the models they build or load and the text they decode.

- models: :func:`olmoe_1b_7b_config` and :func:`build_random_model` (seeded random OLMoE-1B-7B-shaped or
  :data:`TINY_SHAPE` models with peaked routers), :func:`load_model` (what ``--model`` names: those, the shipped
  ``tiny-moe`` or a model directory);
- tokens: :func:`byte_tokenizer` (for the random models), :func:`prompt_ids` (seeded random prompts);
- text: :func:`module_sources` (standard-library sources, offline and deterministic) and :func:`text_windows`
  (fixed token windows cut from texts); :data:`WINDOW_MODULES` and :data:`CALIBRATION_MODULES` never overlap.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RANDOM_OLMOE = "random-olmoe-1b-7b"
TINY = "tiny"
TINY_MOE = "tiny-moe"  # the trained tiny OLMoE shipped in psr_hf.assets (psr_hf.assets.TINY_MOE_NAME)
# the shipped small trained models grown exactly to a real model's dimensions (psr_hf.assets.grow) when loaded:
# trained routing, real-size experts; name -> (shipped model, grow preset)
GROWN: dict[str, tuple[str, str]] = {
    "grown-olmoe-routing": ("olmoe-routing", "olmoe-1b-7b"),
    "grown-moonlight-routing": ("moonlight-routing", "moonlight-16b-a3b"),
}
GROWN_OLMOE = "grown-olmoe-routing"  # the GPU benchmarks' default model
BUILT_MODELS = (RANDOM_OLMOE, TINY, *GROWN)  # built here; every other name goes to resolve_model

# allenai/OLMoE-1B-7B-0924's shape; no end-of-sequence or pad token, so generation never stops early
OLMOE_1B_7B: dict[str, Any] = dict(
    vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None,
)
# a shape that decodes in milliseconds per token on a CPU (tests, --tiny, --model tiny)
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
)

# Default text: sources of standard-library modules (offline, deterministic for a given Python). The windows and
# the calibration never share a module, so the warm set and the token prior are not fitted on the timed tokens.
WINDOW_MODULES = ("textwrap", "argparse", "json.decoder", "collections")
CALIBRATION_MODULES = ("functools", "heapq", "string", "contextlib", "dataclasses", "enum")


# ---------------------------------------------------------------------------------------------------- tokens
def byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` over exactly 256 ids (one per byte, no merges), so it fits the tiny
    models' vocabulary; eos/pad/bos are the tiny configs' ids 1/0/2 (bytes that never occur in text)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([""], vocab_size=256, show_progress=False, special_tokens=[])
    # left padding: batched generate() needs it (psr_hf refuses right-padded generation)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, padding_side="left")
    vocab = tokenizer.convert_ids_to_tokens([0, 1, 2])
    tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token = vocab[0], vocab[1], vocab[2]
    return tokenizer


def prompt_ids(vocab_size: int, prompt_tokens: int, seed: int) -> torch.Tensor:
    """``[1, prompt_tokens]`` token ids drawn uniformly from ``[0, vocab_size)`` by a CPU generator seeded ``seed``."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be >= 1")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, prompt_tokens), generator=generator)


# ---------------------------------------------------------------------------------------------------- models
def olmoe_1b_7b_config(**overrides: Any) -> Any:
    """An ``OlmoeConfig`` with OLMoE-1B-7B's shape (see :data:`OLMOE_1B_7B`); ``overrides`` replace fields.

    ``rope_theta=`` is accepted as an override and stored in ``rope_parameters`` (transformers 5 keeps it there).
    """
    from transformers import OlmoeConfig

    fields = {**OLMOE_1B_7B, **overrides}
    if "rope_theta" in fields:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(fields.pop("rope_theta"))}
    return OlmoeConfig(**fields)


def router_weight_std(hidden_size: int) -> float:
    """Std of the random router weights: the logit scale that std 0.5 gives at hidden size 64 (tiny.py).

    Logits are sums over ``hidden_size`` unit-RMS inputs, so the std scales as ``1/sqrt(hidden_size)``; the
    default init (0.02) would make routing nearly uniform, unlike trained routers.
    """
    return 0.5 * math.sqrt(64.0 / hidden_size)


def build_random_model(config: Any, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0, experts_implementation: str = "grouped_mm") -> torch.nn.Module:
    """A seeded random ``AutoModelForCausalLM`` of ``config``, built directly on ``device`` in ``dtype``, eval mode.

    The router weights get :func:`router_weight_std` so routing is peaked; everything else keeps transformers'
    init. ``experts_implementation`` (``grouped_mm``, ``batched_mm`` or ``eager``) is passed to ``from_config``;
    note that ``generate()`` on a GPU switches ``grouped_mm`` to ``batched_mm`` for its decode steps.
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' (with the tiny shape)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    rng_devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     experts_implementation=experts_implementation)
        std = router_weight_std(int(config.hidden_size))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight") and param.ndim == 2:
                    param.normal_(mean=0.0, std=std)
    return model.eval()


def load_model(model: str, device: str, *, seed: int = 0) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """``(model, tokenizer, description)`` for ``--model``: ``random-olmoe-1b-7b`` (OLMoE-1B-7B shape, random
    weights, bf16, built on ``device``), ``tiny`` (:data:`TINY_SHAPE`, float32) or a model directory
    (``AutoModelForCausalLM``, its own tokenizer; ``description["calibration_file"]`` is the path of a
    ``calibration.safetensors`` beside it and ``description["calibration"]`` its name for records; any name that
    :func:`psr_hf.assets.resolve_model` resolves, hub ids included), ``tiny-moe``
    being the trained one shipped in :mod:`psr_hf.assets` (float32). The random models use
    :func:`byte_tokenizer` on real text. Every experts implementation is ``grouped_mm``."""
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but torch sees no CUDA device; use --device cpu (a small model: "
                         "tiny, tiny-moe, olmoe-routing)")
    if model in GROWN:
        return _load_grown(model, target)
    if model in (RANDOM_OLMOE, TINY):
        tiny = model == TINY
        dtype = torch.float32 if tiny else torch.bfloat16
        built = build_random_model(olmoe_1b_7b_config(**(TINY_SHAPE if tiny else {})), target, dtype, seed=seed)
        # the record's text names the tokenizer where users meet it (psr_hf.testing re-exports it)
        return built, byte_tokenizer(), {
            "name": model, "weights": f"random, seed {seed} (build_random_model: routers at router_weight_std)",
            "tokenizer": "byte-level, 256 ids (psr_hf.testing.byte_tokenizer)"}
    from ..assets import calibration_beside, resolve_model

    source = resolve_model(model, also=BUILT_MODELS)  # a clear error for a typo or a non-MoE model, before loading
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.location, **source.from_pretrained_kwargs)
    # the shipped models are small: float32 (their bf16 weights upcast), the precision a CPU runs best
    dtype = torch.float32 if source.kind in ("shipped", "built") else "auto"
    loaded = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, experts_implementation="grouped_mm",
                                                  **source.from_pretrained_kwargs)
    path = source.directory
    info = {"name": str(path) if source.kind == "directory" else model, "weights": "pretrained",
            "tokenizer": type(tokenizer).__name__}
    beside = calibration_beside(path) if path is not None else None
    if beside is not None:  # a calibration saved beside the model is its default
        info["calibration_file"] = str(beside)
        # how records name it: the shipped one by its place in the package, never by this machine's path
        info["calibration"] = (f"psr_hf/assets/{path.name}/calibration.safetensors" if source.kind == "shipped"
                               else f"{model}/calibration.safetensors (built)" if source.kind == "built"
                               else info["calibration_file"])
    return loaded.to(target).eval(), tokenizer, info


def _load_grown(model: str, target: torch.device) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """A shipped small trained model grown to its real model's dimensions on ``target`` (bf16 on a GPU, float32
    on a CPU), with the small model's tokenizer and calibration (routing is unchanged by growing)."""
    from ..assets import shipped_dir
    from ..assets.grow import grow, target_by_name

    small_name, preset = GROWN[model]
    small, tokenizer, info = load_model(small_name, "cpu")
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    grown = grow(small, target_by_name(preset), device=target, dtype=dtype).eval()
    info.update(name=model, weights=f"{small_name} (trained; {shipped_dir(small_name).name}) grown "
                                    f"exactly to {preset}'s dimensions by psr_hf.assets.grow")
    return grown, tokenizer, info


def default_texts(model: str) -> list[tuple[str, str]] | None:
    """``(name, text)`` of the held-out text for a trained model that psr_hf ships (or grows): Volume I of
    *Persuasion*, which none of them saw; None for other models (the caller's own default)."""
    from ..assets import HELD_OUT_TEXT, NAMED_MODELS

    if model in NAMED_MODELS or model in GROWN:
        return [(f"held-out: {HELD_OUT_TEXT.name}", HELD_OUT_TEXT.read_text(encoding="utf-8"))]
    return None


# ---------------------------------------------------------------------------------------------------- text
def module_sources(modules: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, text)`` of each standard-library module's source file (``inspect.getsourcefile``); the label is
    ``stdlib:<module>`` (records name the module, not a path on the machine)."""
    out = []
    for name in modules:
        path = inspect.getsourcefile(importlib.import_module(name))
        if path is None:
            raise ValueError(f"module {name!r} has no source file to read")
        out.append((f"stdlib:{name}", Path(path).read_text(encoding="utf-8")))
    return out


def text_windows(texts: Sequence[str], tokenizer: Any, *, windows: int, tokens: int) -> list[torch.Tensor]:
    """``windows`` token windows ``[1, tokens + 1]`` (position 0 starts the sequence, ``tokens`` are timed).

    Window ``i`` is cut from text ``i % len(texts)`` at token offset ``(i // len(texts)) * (tokens + 1)`` (texts
    tokenised without special tokens); a text too short for its window raises ``ValueError``."""
    if windows < 1 or tokens < 1:
        raise ValueError(f"windows={windows} and tokens={tokens} must be >= 1")
    if not texts:
        raise ValueError("no texts to cut windows from")
    # verbose=False: long texts are cut into windows here, beyond the tokenizer's model_max_length
    encoded = [tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] for text in texts]
    out = []
    for i in range(windows):
        source = encoded[i % len(texts)]
        start = (i // len(texts)) * (tokens + 1)
        window = source[start : start + tokens + 1]
        if len(window) < tokens + 1:
            raise ValueError(f"text {i % len(texts)} has {len(source)} tokens; window {i} needs tokens "
                             f"[{start}, {start + tokens + 1}): give fewer --windows or --tokens, or longer --text")
        out.append(torch.tensor([window], dtype=torch.long))
    return out


def model_calibration(model: torch.nn.Module, tokenizer: Any, *, tokens: int, calibration: str | Path | None = None,
                      beside: str | Path | None = None, beside_name: str | None = None,
                      progress: Callable[[str], None] | None = None, bar: bool = False) -> tuple[Any, dict[str, Any]]:
    """``(calibration, how)`` of the routed rows of a benchmark: the file ``calibration`` when given, else the one
    saved ``beside`` the model (named ``beside_name`` in records), else :func:`psr_hf.calibrate` on ``tokens``
    tokens of :data:`CALIBRATION_MODULES` (never the windows' text). ``how`` is the record's description:
    ``{"file": ...}`` or ``{"modules", "tokens", "how"}``; ``bar`` shows calibrate's progress bar."""
    from ..policy.calibration import Calibration

    if calibration is not None:
        return Calibration.load(calibration), {"file": str(calibration)}
    if beside is not None:
        return Calibration.load(beside), {"file": beside_name or str(beside)}
    from ..hf.calibrate import calibrate

    if progress is not None:
        progress(f"calibrating on {tokens} tokens of {', '.join(CALIBRATION_MODULES)}")
    calib = calibrate(model, [text for _, text in module_sources(CALIBRATION_MODULES)], tokenizer=tokenizer,
                      max_length=512, batch_size=4, max_tokens=tokens, progress=bar)
    return calib, {"modules": list(CALIBRATION_MODULES), "tokens": tokens,
                   "how": "psr_hf.calibrate (exact routing), windows of 512 tokens"}
