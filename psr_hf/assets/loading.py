"""Loading the model a ``--model`` name gives (docs/models.md): a name :func:`psr_hf.assets.resolve_model`
resolves, a shipped model grown to real size (:data:`GROWN`), or a seeded random OLMoE (:data:`RANDOM_OLMOE`,
:data:`TINY`) with peaked routers and the byte-level tokenizer. :func:`load_model` returns the model, its
tokenizer and the description a record keeps of it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import ModelSource, calibration_beside, resolve_model, shipped_dir

if TYPE_CHECKING:
    import torch

RANDOM_OLMOE = "random-olmoe-1b-7b"
TINY = "tiny"
TINY_MOE = "tiny-moe"  # the trained tiny OLMoE shipped in psr_hf.assets (psr_hf.assets.TINY_MOE_NAME)
# the shipped small trained models grown exactly to a real model's dimensions (psr_hf.assets.grow) when loaded:
# trained routing, real-size experts; name -> (shipped model, grow preset)
GROWN: dict[str, tuple[str, str]] = {
    "grown-olmoe-routing": ("olmoe-routing", "olmoe-1b-7b"),
    "grown-moonlight-routing": ("moonlight-routing", "moonlight-16b-a3b"),
    "grown-qwen36-routing": ("qwen36-routing", "qwen3.6-35b-a3b"),
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
#: the hidden size of every model of :data:`BUILT_MODELS`, known before it is built
BUILT_HIDDEN_SIZES: dict[str, int] = {RANDOM_OLMOE: OLMOE_1B_7B["hidden_size"], TINY: TINY_SHAPE["hidden_size"],
                                      **{name: OLMOE_1B_7B["hidden_size"] for name in GROWN}}


def model_hidden_size(model: str, built: Mapping[str, int] = BUILT_HIDDEN_SIZES) -> int | None:
    """The hidden size of the model ``model`` names, without loading it: ``built`` gives it for the names the
    caller builds itself; any other name goes through :func:`resolve_model`, which reads its config (so a typo or
    a model psr_hf cannot patch fails here, before anything loads)."""
    return built[model] if model in built else _resolve(model, tuple(built)).hidden_size


def _resolve(model: str, also: tuple[str, ...]) -> ModelSource:
    """:func:`resolve_model` for a name this module loads (``also``: the names the caller builds), refusing first
    a grow preset's name (``olmoe-1b-7b``: the target ``psr-hf grow`` grows to, not a model) with the name of the
    model grown to it, where the caller builds that one."""
    grown = [name for name, (_, preset) in GROWN.items() if preset == str(model).strip().lower() and name in also]
    if grown:
        small, preset = GROWN[grown[0]]
        raise ValueError(f"model {model!r} is a grow target (the dimensions psr-hf grow --target grows to), not a "
                         f"model; the shipped {small} grown to it is named {grown[0]}: use that name")
    return resolve_model(model, also=also)


# ---------------------------------------------------------------------------------------------------- random models
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


def build_random_model(config: Any, device: str | torch.device = "cuda", dtype: torch.dtype | None = None,
                       seed: int = 0, experts_implementation: str = "grouped_mm") -> torch.nn.Module:
    """A seeded random ``AutoModelForCausalLM`` of ``config``, built directly on ``device`` in ``dtype`` (default
    bfloat16), eval mode.

    The router weights get :func:`router_weight_std` so routing is peaked; everything else keeps transformers'
    init. ``experts_implementation`` (``grouped_mm``, ``batched_mm`` or ``eager``) is passed to ``from_config``;
    note that ``generate()`` on a GPU switches ``grouped_mm`` to ``batched_mm`` for its decode steps.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype
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


# ---------------------------------------------------------------------------------------------------- loading
def load_pretrained(source: ModelSource, device: Any, dtype: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a resolved model, its weights in ``dtype`` on ``device``, eval mode; ``kwargs``
    go to ``AutoModelForCausalLM.from_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantize import is_fp8_checkpoint, load_fp8_dequantized

    tokenizer = AutoTokenizer.from_pretrained(source.location, **source.from_pretrained_kwargs)
    if source.directory is not None and is_fp8_checkpoint(source.directory):
        # every weight dequantized with the checkpoint's block size (on a GPU transformers' FP8 layers would fetch
        # a kernel from the hub); an offload still reads the experts in FP8 from the folder (docs/quantized.md)
        model = load_fp8_dequantized(source.directory, torch.bfloat16 if dtype == "auto" else dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **kwargs,
                                                     **source.from_pretrained_kwargs)
    return model.to(device).eval(), tokenizer


def load_model(model: str, device: str, *, seed: int = 0) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """``(model, tokenizer, description)`` for ``--model``: ``random-olmoe-1b-7b`` (OLMoE-1B-7B shape, random
    weights, bf16, built on ``device``), ``tiny`` (:data:`TINY_SHAPE`, float32), a :data:`GROWN` name, or any name
    that :func:`psr_hf.assets.resolve_model` resolves (float32 for the shipped and built models; its own
    tokenizer; ``description["calibration_file"]`` is the path of a ``calibration.safetensors`` beside it and
    ``description["calibration"]`` its name for records). The random models use :func:`byte_tokenizer` on real
    text. Every experts implementation is ``grouped_mm``."""
    import torch

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
    source = _resolve(model, BUILT_MODELS)  # a clear error for a typo or a non-MoE model, before loading
    # the shipped models are small: float32 (their bf16 weights upcast), the precision a CPU runs best
    dtype = torch.float32 if source.kind in ("shipped", "built") else "auto"
    loaded, tokenizer = load_pretrained(source, target, dtype, experts_implementation="grouped_mm")
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
    return loaded, tokenizer, info


def _load_grown(model: str, target: torch.device) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """A shipped small trained model grown to its real model's dimensions on ``target`` (bf16 on a GPU, float32
    on a CPU), with the small model's tokenizer and calibration (routing is unchanged by growing)."""
    import torch

    from .grow import grow, target_by_name

    small_name, preset = GROWN[model]
    small, tokenizer, info = load_model(small_name, "cpu")
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    grown = grow(small, target_by_name(preset), device=target, dtype=dtype).eval()
    info.update(name=model, weights=f"{small_name} (trained; {shipped_dir(small_name).name}) grown "
                                    f"exactly to {preset}'s dimensions by psr_hf.assets.grow")
    return grown, tokenizer, info
