"""Grow a small trained MoE model to real-size dimensions, exactly: an upcycle that computes the same function.

Latency benchmarks need a model with trained routing *and* real-size experts (the bytes and FLOPs of OLMoE-1B-7B
or Moonlight-16B-A3B). :func:`grow` takes a small trained model (e.g. the shipped ``tiny-moe``, hidden size 128)
and builds a model of the target's dimensions whose every real dimension computes exactly what it computed
before: padded rows and columns are zero, and every norm, scale and rotary frequency is mapped. The number of
layers, experts, the top-k, the router's options and the vocabulary are the small model's. Because the grown
model computes the small model's function, its router scores are the small model's and its routing decisions
are identical (up to floating-point rounding: sums over more, zero-padded terms).

The rules (checked against ``transformers`` 5.17 to 5.2x, ``models/{olmoe,deepseek_v3}/modeling_*.py``):

* **Linear weights, embeddings, lm_head, router:** the small block at the mapped rows/columns, zeros elsewhere.
  The router keeps its experts and gets zero columns for the padded hidden dimensions; DeepSeek-V3's
  ``e_score_correction_bias`` is copied. Fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``):
  gate rows ``i -> i``, up rows ``I + i -> I' + i``; padded gate/up rows and down columns are zero, so a padded
  intermediate unit contributes ``act(0) * 0 = 0``. Dense MLPs and shared experts likewise.
* **RMSNorm** over a zero-padded vector: ``n`` real of ``n' = r n`` entries, so the mean of squares is ``ms / r``.
  With the norm's input scaled by ``c`` (through the rows of the linear layer that produces it) and its epsilon
  ``eps'``: ``c x / sqrt(c^2 ms / r + eps') = sqrt(r) x / sqrt(ms + r eps' / c^2)``. So ``c^2 = r eps' / eps``
  and weight ``w' = w / sqrt(r)`` on the real entries (zero on the padded ones, whose inputs are zero) give the
  small norm's output exactly. The hidden-size norms read their input from the residual stream, which is not
  scaled (``c = 1``): the grown config's ``rms_norm_eps`` is ``eps / r_hidden``. Every other norm gets its ``c``
  from its own ratio and epsilon (OLMoE's ``q_norm``/``k_norm`` over all heads, DeepSeek-V3's
  ``kv_a_layernorm``/``q_a_layernorm``, whose epsilon transformers fixes at 1e-6 rather than the config's), so
  every norm is exact, not only up to epsilon. With ``r`` a power of 4, ``sqrt(r)`` is a power of two and the
  scaling is exact in bfloat16 too.
* **Heads:** extra query heads have zero q rows and zero o_proj columns (no contribution). Grouped-query
  attention: the small ``g = H / K`` query heads per key/value head must be a multiple of the grown model's; each
  small key/value head is repeated ``g / g'`` times (for OLMoE's ``k_norm`` the repetition enters ``r``).
* **Head dimension with RoPE** (``rotate_half``: dim ``i`` pairs with ``i + d/2``, frequency
  ``theta^(-2i/d)``): small dim ``i`` goes to ``f i`` with ``f = d'/d`` (an integer), which keeps the pairs and
  the frequencies (``theta^(-2fi/(fd))``); DeepSeek-V3's interleaved layout (``rope_interleave``: pairs
  ``(2j, 2j+1)``, frequency ``j``) maps ``2j + e -> 2fj + e``. Only the ``default`` and ``linear`` RoPE types
  (frequencies independent of the head dimension's size) are mapped; anything else is refused. The attention
  scale ``1/sqrt(head_dim)`` shrinks: queries are multiplied by ``sqrt(d'/d)`` (OLMoE: in ``q_norm``'s weight;
  DeepSeek-V3: in the query projection, with ``qk_nope + qk_rope`` as head dimension; its YaRN ``mscale`` does
  not depend on the dimensions). OLMoE with ``clip_qkv``: q, k and v each get ``(d'/d)^(1/4)``, o_proj the
  inverse and the clip bound the same factor, so the clamps stay exact.
* **Multi-head latent attention (DeepSeek-V3):** nope, rope, v and latent (``kv_lora_rank``, ``q_lora_rank``)
  dimensions keep their positions within each head; the rope part follows the RoPE rule above. A model without
  a query LoRA cannot gain one exactly (the norm inside it is not linear), and the other way round.

Anything else that cannot be mapped exactly raises ``ValueError`` naming it.

Precision: in float32 the grown model reproduces the small one up to rounding (tiny-moe grown to OLMoE-1B-7B's
dimensions on an H200: logits within 1.2e-5 of logits up to 20, every selected expert the same). In bfloat16 the
two models round their activations differently (other matrix shapes), so they are equally close to the float32
function but not to each other bit for bit: there about 3% of token-layer selections differed between the small
and the grown bfloat16 models, as many as between the small model in bfloat16 and in float32. Compare routing
decisions of a grown model with its small model's in float32.

Library: logs with ``logging`` (parameter counts, the size of one expert), never prints.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

#: the families grow() maps (``config.model_type``)
GROW_FAMILIES = ("olmoe", "deepseek_v3")
# RoPE types whose frequencies do not depend on the size of the head dimension (see the module docstring)
_ROPE_TYPES = ("default", "linear")
# files beside a model's weights that grow_pretrained copies (the tokenizer's, and a calibration: the grown model
# routes exactly as the small one, so the small model's calibration is the grown model's)
_COPIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
           "tokenizer.model", "spiece.model", "chat_template*", "tokenization_*.py", "calibration.safetensors")


# ---------------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class GrowTarget:
    """The dimensions to grow a model of one family to (presets :data:`OLMOE_1B_7B`, :data:`MOONLIGHT_16B_A3B`).

    Layers, experts, top-k, groups, scaling, scoring and vocabulary are not here: they are the small model's.
    Build a smaller target of the same code path (for tests) with ``dataclasses.replace(OLMOE_1B_7B, name=...,
    hidden_size=512, ...)`` or ``GrowTarget(...)``; every field is validated (``ValueError`` naming it).

    Attributes:
        name: a label (the presets' names are accepted by :func:`target_by_name`).
        family: the ``config.model_type`` it applies to: ``olmoe`` or ``deepseek_v3``.
        hidden_size, num_attention_heads, num_key_value_heads: the config fields of those names.
        expert_intermediate_size: one routed expert's intermediate size (OLMoE ``intermediate_size``,
            DeepSeek-V3 ``moe_intermediate_size``; DeepSeek-V3's shared experts get ``n_shared_experts`` times it).
        head_dim: OLMoE's head dimension (``hidden_size / num_attention_heads``: its ``q_norm`` spans the hidden
            size); None for DeepSeek-V3.
        dense_intermediate_size: DeepSeek-V3's ``intermediate_size`` (the dense first layers' MLP); None for OLMoE.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: DeepSeek-V3's multi-head latent
            attention (``q_lora_rank`` None: no query LoRA); None for OLMoE.
    """

    name: str
    family: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    expert_intermediate_size: int
    head_dim: int | None = None
    dense_intermediate_size: int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    _MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    def __post_init__(self) -> None:
        def fail(why: str) -> None:
            raise ValueError(f"grow target {self.name!r}: {why}")

        if self.family not in GROW_FAMILIES:
            fail(f"family={self.family!r}; grow supports {', '.join(GROW_FAMILIES)}")
        for field in dataclasses.fields(self):
            if field.name in ("name", "family"):
                continue
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                fail(f"{field.name}={value!r} must be an int >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.family == "olmoe":
            extra = [f for f in ("dense_intermediate_size", "q_lora_rank", *self._MLA) if getattr(self, f) is not None]
            if extra:
                fail(f"{', '.join(extra)} are DeepSeek-V3 fields; leave them None for an OLMoE target")
            if self.head_dim is None:
                fail("head_dim is required for an OLMoE target")
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                fail(f"head_dim={self.head_dim} x num_attention_heads={self.num_attention_heads} must equal "
                     f"hidden_size={self.hidden_size} (OLMoE's q_norm spans the hidden size)")
            if self.head_dim % 2:
                fail(f"head_dim={self.head_dim} must be even (rotary pairs)")
        else:
            missing = [f for f in ("dense_intermediate_size", *self._MLA) if getattr(self, f) is None]
            if missing:
                fail(f"{', '.join(missing)} required for a DeepSeek-V3 target")
            if self.head_dim is not None:
                fail("head_dim is OLMoE's; a DeepSeek-V3 target has qk_nope_head_dim, qk_rope_head_dim and "
                     "v_head_dim instead (leave head_dim None)")
            if self.num_key_value_heads != self.num_attention_heads:
                fail(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                     f"{self.num_attention_heads} (multi-head latent attention expands keys per query head)")
            if self.qk_rope_head_dim % 2:
                fail(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")

    def dims(self) -> dict[str, Any]:
        """The fields as a dict (for records)."""
        return dataclasses.asdict(self)

    def with_dims(self, **changes: Any) -> "GrowTarget":
        """This target with some dimensions replaced (ints, digit strings, or None / ``"none"``), named after
        this one and the changes (e.g. a reduced target of the same code path for tests:
        ``OLMOE_1B_7B.with_dims(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64)``).
        ``ValueError`` naming an unknown field or a value that is not a whole number."""
        fields = [f.name for f in dataclasses.fields(self) if f.name not in ("name", "family")]
        values = {}
        for key, value in changes.items():
            if key not in fields:
                raise ValueError(f"grow target has no dimension {key!r}; its dimensions: {', '.join(fields)}")
            if isinstance(value, str):
                text = value.strip().lower()
                if text == "none":
                    value = None
                elif text.isdigit():
                    value = int(text)
                else:
                    raise ValueError(f"{key}={value!r}: give a whole number (or none)")
            values[key] = value
        if not values:
            return self
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        return dataclasses.replace(self, name=f"{self.name} with {label}", **values)


#: allenai/OLMoE-1B-7B's dimensions
OLMOE_1B_7B = GrowTarget(
    name="olmoe-1b-7b", family="olmoe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
    head_dim=128, expert_intermediate_size=1024,
)
#: moonshotai/Moonlight-16B-A3B's dimensions (no query LoRA)
MOONLIGHT_16B_A3B = GrowTarget(
    name="moonlight-16b-a3b", family="deepseek_v3", hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=16, expert_intermediate_size=1408, dense_intermediate_size=11264, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
#: the presets by name
PRESETS: dict[str, GrowTarget] = {t.name: t for t in (OLMOE_1B_7B, MOONLIGHT_16B_A3B)}
_DEFAULT_BY_FAMILY = {"olmoe": OLMOE_1B_7B, "deepseek_v3": MOONLIGHT_16B_A3B}


def target_by_name(name: str) -> GrowTarget:
    """The preset called ``name`` (``olmoe-1b-7b``, ``moonlight-16b-a3b``; case-insensitive); ``ValueError``
    listing the known names otherwise."""
    key = str(name).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ValueError(f"no grow target {name!r}; known targets: {', '.join(PRESETS)}{hint}")


def default_target(config: Any) -> GrowTarget:
    """The preset of a model's family: ``olmoe`` -> :data:`OLMOE_1B_7B`, ``deepseek_v3`` ->
    :data:`MOONLIGHT_16B_A3B`. ``config``: a transformers config, a ``config.json`` dict or a model type."""
    model_type = config if isinstance(config, str) else (
        config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None))
    if model_type not in _DEFAULT_BY_FAMILY:
        raise ValueError(f"grow has no target for model type {model_type!r}; it grows "
                         + ", ".join(f"{f} (to {t.name})" for f, t in _DEFAULT_BY_FAMILY.items()))
    return _DEFAULT_BY_FAMILY[model_type]


# ---------------------------------------------------------------------------------------------------- the model's dims
@dataclass(frozen=True)
class _Dims:
    """One model's dimensions, read from its config (the small model's) or a target (the grown model's)."""

    hidden: int
    heads: int
    kv_heads: int
    expert: int
    head_dim: int | None = None  # OLMoE
    dense: int | None = None  # DeepSeek-V3 from here
    kv_lora: int | None = None
    q_lora: int | None = None
    nope: int | None = None
    rope: int | None = None
    v: int | None = None

    @classmethod
    def of_config(cls, config: Any) -> "_Dims":
        if config.model_type == "olmoe":
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                       config.intermediate_size, head_dim=head_dim)
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                   config.moe_intermediate_size, dense=config.intermediate_size, kv_lora=config.kv_lora_rank,
                   q_lora=config.q_lora_rank, nope=config.qk_nope_head_dim, rope=config.qk_rope_head_dim,
                   v=config.v_head_dim)

    @classmethod
    def of_target(cls, t: GrowTarget) -> "_Dims":
        return cls(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.expert_intermediate_size,
                   head_dim=t.head_dim, dense=t.dense_intermediate_size, kv_lora=t.kv_lora_rank,
                   q_lora=t.q_lora_rank, nope=t.qk_nope_head_dim, rope=t.qk_rope_head_dim, v=t.v_head_dim)


# which target field each dimension comes from (for messages)
_FIELD = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
          "expert": "expert_intermediate_size", "head_dim": "head_dim", "dense": "dense_intermediate_size",
          "kv_lora": "kv_lora_rank", "q_lora": "q_lora_rank", "nope": "qk_nope_head_dim", "rope": "qk_rope_head_dim",
          "v": "v_head_dim"}


def _check_model(model: Any) -> str:
    """The model's family; ``ValueError`` for a model grow cannot grow."""
    from . import check_supported

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"grow needs a transformers model (with .config); got {type(model).__name__}")
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    check_supported(name, config.to_dict())  # names a non-MoE model as such
    if config.model_type not in GROW_FAMILIES:
        raise ValueError(f"grow cannot grow model type {config.model_type!r} ({type(model).__name__}); it maps "
                         f"{', '.join(GROW_FAMILIES)} exactly (OLMoE-1B-7B and Moonlight-16B-A3B shapes)")
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm")
    if getattr(model, "lm_head", None) is None or not all(hasattr(inner, a) for a in parts):
        raise ValueError(f"grow needs the causal LM class of {config.model_type} (with .model and .lm_head); got "
                         f"{type(model).__name__}: load it with AutoModelForCausalLM")
    return config.model_type


def _check_rope(config: Any) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, Mapping) else None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (config.rope_parameters={params!r}): its frequencies depend on the "
                         f"head dimension's size, so a grown head cannot keep them exactly; grow maps "
                         f"{', '.join(_ROPE_TYPES)} RoPE only")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={factor}: grow maps RoPE over the whole head dimension only")


def _check_target(family: str, small: _Dims, big: _Dims, target: GrowTarget, config: Any) -> None:
    if target.family != family:
        raise ValueError(f"grow target {target.name!r} is for {target.family} models; this model is {family} "
                         f"(its preset is {default_target(family).name})")
    smaller = [f"{_FIELD[k]}={getattr(big, k)} < the model's {getattr(small, k)}"
               for k in _FIELD if getattr(small, k) is not None and getattr(big, k) is not None
               and getattr(big, k) < getattr(small, k)]
    if smaller:
        raise ValueError(f"grow target {target.name!r} is smaller than the model: {'; '.join(smaller)}; a target "
                         "must be at least as large as the model in every dimension")
    if (small.q_lora is None) != (big.q_lora is None):
        raise ValueError(f"grow target {target.name!r} has q_lora_rank={big.q_lora}, the model {small.q_lora}: a "
                         "query LoRA cannot be added or removed exactly (the RMSNorm inside it is not linear); use "
                         f"q_lora_rank={'None' if small.q_lora is None else '>= ' + str(small.q_lora)}")
    rotary, what = (small.head_dim, big.head_dim), "head_dim"
    if family == "deepseek_v3":
        rotary, what = (small.rope, big.rope), "qk_rope_head_dim"
        if small.kv_heads != small.heads:
            raise ValueError(f"the model has num_key_value_heads={small.kv_heads} != num_attention_heads="
                             f"{small.heads}, which DeepSeek-V3's attention does not support")
    if rotary[1] % rotary[0]:
        raise ValueError(f"grow target {target.name!r}: {what}={rotary[1]} must be a multiple of the model's "
                         f"{rotary[0]} (each rotary pair moves to a pair of the same frequency)")
    g_small, g_big = small.heads // small.kv_heads, big.heads // big.kv_heads
    if g_small % g_big:
        raise ValueError(f"grow target {target.name!r}: {g_big} query heads per key/value head, the model {g_small}; "
                         "the model's must be a multiple of the target's (key/value heads can be repeated, not merged)")
    if family == "olmoe" and small.head_dim * small.heads != small.hidden:
        raise ValueError(f"the model's head_dim {small.head_dim} x {small.heads} heads != hidden_size {small.hidden} "
                         "(OLMoE's q_norm spans the hidden size)")
    _check_rope(config)


# ---------------------------------------------------------------------------------------------------- filling
def _snap(x: float) -> float:
    """``x`` as the integer or integer reciprocal it equals up to rounding (1, 16, 1/4, ...), else ``x``."""
    for value, invert in ((x, False), (1.0 / x, True)):
        nearest = round(value)
        if nearest >= 1 and abs(value - nearest) <= 1e-9 * value:
            return 1.0 / nearest if invert else float(nearest)
    return x


class _Filler:
    """Writes the grown model's tensors from the small one's and remembers which it wrote."""

    def __init__(self) -> None:
        self.filled: set[int] = set()

    @torch.no_grad()
    def put(self, dst: torch.Tensor, src: torch.Tensor, maps: Sequence[Any], scale: Any = 1.0) -> None:
        """``dst`` = zeros with ``src * scale`` at the mapped positions. ``maps``: per axis None (the first
        ``src.shape[axis]`` positions), a tensor of destination positions (one per source position), or a pair
        ``(source positions, destination positions)`` (to repeat source entries). ``scale``: a number or a tensor
        broadcastable to ``src``. Computed in float32, cast to ``dst``'s dtype."""
        if src.ndim != dst.ndim or len(maps) != src.ndim:
            raise ValueError(f"grow: a {tuple(src.shape)} tensor cannot fill a {tuple(dst.shape)} one")
        value = src.detach().to(device=dst.device, dtype=torch.float32)
        if isinstance(scale, torch.Tensor):
            value = value * scale.to(device=dst.device, dtype=torch.float32)
        elif scale != 1.0:
            value = value * float(scale)
        index = []
        for axis, m in enumerate(maps):
            if isinstance(m, tuple):
                value = value.index_select(axis, m[0].to(dst.device))
                m = m[1]
            n = value.shape[axis]
            m = torch.arange(n) if m is None else m
            if m.numel() != n or (n and int(m.max()) >= dst.shape[axis]):
                raise ValueError(f"grow: axis {axis} of a {tuple(src.shape)} tensor does not map into "
                                 f"{tuple(dst.shape)}")
            shape = [1] * value.ndim
            shape[axis] = n
            index.append(m.to(device=dst.device, dtype=torch.long).view(shape))
        dst.zero_()
        dst[tuple(index)] = value.to(dst.dtype)
        self.filled.add(id(dst))

    def linear(self, big: Any, small: Any, rows: Any, cols: Any, row_scale: Any = 1.0, col_scale: Any = 1.0) -> None:
        """A ``nn.Linear`` (weight ``[out, in]``, optional bias ``[out]``)."""
        rs = row_scale.reshape(-1, 1) if isinstance(row_scale, torch.Tensor) else row_scale
        cs = col_scale.reshape(1, -1) if isinstance(col_scale, torch.Tensor) else col_scale
        self.put(big.weight, small.weight, (rows, cols), rs * cs)
        if (big.bias is None) != (small.bias is None):
            raise ValueError("grow: a linear layer gained or lost its bias")
        if small.bias is not None:
            self.put(big.bias, small.bias, (rows,), row_scale)

    def norm(self, big: Any, small: Any, where: Any, r: float, scale: float = 1.0) -> float:
        """An RMSNorm over a vector that grows ``r`` times (real entries at ``where``); returns the factor ``c``
        that its input must be scaled by (module docstring)."""
        eps_small = getattr(small, "variance_epsilon", None)
        eps_big = getattr(big, "variance_epsilon", None)
        if eps_small is None or eps_big is None or eps_small <= 0:
            raise ValueError(f"grow: {type(small).__name__} is not an RMSNorm with a positive variance_epsilon")
        self.put(big.weight, small.weight, (where,), scale / math.sqrt(r))
        return math.sqrt(_snap(r * eps_big / eps_small))


def _head_positions(heads: int, dim_small: int, dim_big: int, inner: torch.Tensor | None = None) -> torch.Tensor:
    """Destination positions of ``heads`` heads of ``dim_small`` entries each: small entry ``h * dim_small + i``
    goes to ``h * dim_big + inner[i]`` (``inner``: default the identity)."""
    inner = torch.arange(dim_small) if inner is None else inner
    return (torch.arange(heads).view(-1, 1) * dim_big + inner.view(1, -1)).reshape(-1)


def _rope_map(small: int, big: int, interleaved: bool) -> torch.Tensor:
    """Where each of ``small`` rotary dimensions goes among ``big`` (module docstring)."""
    f = big // small
    i = torch.arange(small)
    return 2 * f * (i // 2) + i % 2 if interleaved else f * i


def _mlp(fill: _Filler, big: Any, small: Any, hid: Any) -> None:
    """A gate/up/down MLP (dense layer or shared experts): padded intermediate units are zero."""
    fill.linear(big.gate_proj, small.gate_proj, None, hid)
    fill.linear(big.up_proj, small.up_proj, None, hid)
    fill.linear(big.down_proj, small.down_proj, hid, None)


def _experts(fill: _Filler, big: Any, small: Any, I_small: int, I_big: int, hid: Any) -> None:
    """Fused experts ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]`` (stored
    transposed where the experts class says ``is_transposed``)."""
    if getattr(small, "has_gate", True) is False:
        raise ValueError(f"grow: {type(small).__name__} has no gate projection; grow maps gated experts only")
    transposed = bool(getattr(small, "is_transposed", False))
    gate_up = torch.cat((torch.arange(I_small), I_big + torch.arange(I_small)))
    rows_cols = lambda rows, cols: (None, cols, rows) if transposed else (None, rows, cols)  # noqa: E731
    fill.put(big.gate_up_proj, small.gate_up_proj, rows_cols(gate_up, hid))
    fill.put(big.down_proj, small.down_proj, rows_cols(hid, None))
    for name, rows in (("gate_up_proj_bias", gate_up), ("down_proj_bias", hid)):
        if getattr(small, name, None) is not None:
            fill.put(getattr(big, name), getattr(small, name), (None, rows))


def _olmoe_attention(fill: _Filler, big: Any, small: Any, s: _Dims, b: _Dims, clip: bool) -> None:
    f = b.head_dim // s.head_dim
    inner = _rope_map(s.head_dim, b.head_dim, interleaved=False)
    q_pos = _head_positions(s.heads, s.head_dim, b.head_dim, inner)
    # key/value heads: big kv head j holds small kv head j // d (d = repetitions), for j < K_small * d
    d = (s.heads // s.kv_heads) // (b.heads // b.kv_heads)
    kv_src = torch.repeat_interleave(torch.arange(s.kv_heads), d)
    kv_from = (kv_src.view(-1, 1) * s.head_dim + torch.arange(s.head_dim).view(1, -1)).reshape(-1)
    kv_to = _head_positions(s.kv_heads * d, s.head_dim, b.head_dim, inner)
    # the attention scale 1/sqrt(head_dim) shrinks by sqrt(f): queries get sqrt(f); with clip_qkv, q, k and v each
    # get f^(1/4) (and o_proj the inverse) so that the clamps, scaled by the same factor, stay exact
    q_scale, kv_scale = (f ** 0.25, f ** 0.25) if clip else (math.sqrt(f), 1.0)
    n_small, n_big = s.heads * s.head_dim, b.heads * b.head_dim
    c_q = fill.norm(big.q_norm, small.q_norm, q_pos, n_big / n_small, q_scale)
    c_k = fill.norm(big.k_norm, small.k_norm, (kv_from, kv_to),
                    (b.kv_heads * b.head_dim) / (d * s.kv_heads * s.head_dim), kv_scale)
    fill.linear(big.q_proj, small.q_proj, q_pos, None, c_q)
    fill.linear(big.k_proj, small.k_proj, (kv_from, kv_to), None, c_k)
    fill.linear(big.v_proj, small.v_proj, (kv_from, kv_to), None, kv_scale)
    fill.linear(big.o_proj, small.o_proj, None, q_pos, col_scale=1.0 / kv_scale)


def _mla_attention(fill: _Filler, big: Any, small: Any, s: _Dims, b: _Dims, interleaved: bool) -> None:
    rope = _rope_map(s.rope, b.rope, interleaved)
    qk_small, qk_big = s.nope + s.rope, b.nope + b.rope
    # query rows per head: nope dims keep their place, rope dims follow the rotary map; the attention scale
    # qk_head_dim^-0.5 (times YaRN's mscale^2, which does not depend on the dims) shrinks by sqrt(qk_big/qk_small)
    q_rows = torch.cat((torch.arange(s.nope), b.nope + rope))
    q_rows = _head_positions(s.heads, qk_small, qk_big, q_rows)
    q_scale = math.sqrt(qk_big / qk_small)
    if s.q_lora is None:
        fill.linear(big.q_proj, small.q_proj, q_rows, None, q_scale)
    else:
        c = fill.norm(big.q_a_layernorm, small.q_a_layernorm, None, b.q_lora / s.q_lora)
        fill.linear(big.q_a_proj, small.q_a_proj, None, None, c)
        fill.linear(big.q_b_proj, small.q_b_proj, q_rows, None, q_scale)
    # the latent: kv_lora_rank dims (through kv_a_layernorm), then the shared rotary key
    c_kv = fill.norm(big.kv_a_layernorm, small.kv_a_layernorm, None, b.kv_lora / s.kv_lora)
    kv_a_rows = torch.cat((torch.arange(s.kv_lora), b.kv_lora + rope))
    kv_a_scale = torch.cat((torch.full((s.kv_lora,), c_kv), torch.ones(s.rope)))
    fill.linear(big.kv_a_proj_with_mqa, small.kv_a_proj_with_mqa, kv_a_rows, None, kv_a_scale)
    kv_b_rows = _head_positions(s.heads, s.nope + s.v, b.nope + b.v,
                                torch.cat((torch.arange(s.nope), b.nope + torch.arange(s.v))))
    fill.linear(big.kv_b_proj, small.kv_b_proj, kv_b_rows, None)
    fill.linear(big.o_proj, small.o_proj, None, _head_positions(s.heads, s.v, b.v))


def _grown_config(small_config: Any, family: str, b: _Dims, r_hidden: float, dtype: torch.dtype,
                  clip_scale: float) -> Any:
    """The grown model's config: the small one's with the target's dimensions, the hidden norms' epsilon divided
    by the hidden ratio, and OLMoE's clip bound scaled with q, k and v."""
    data = small_config.to_dict()
    data.update(hidden_size=b.hidden, num_attention_heads=b.heads, num_key_value_heads=b.kv_heads,
                rms_norm_eps=small_config.rms_norm_eps / r_hidden, dtype=str(dtype).removeprefix("torch."))
    if family == "olmoe":
        data["intermediate_size"] = b.expert
        if "head_dim" in data:
            data["head_dim"] = b.head_dim
        if data.get("clip_qkv") is not None:
            data["clip_qkv"] = data["clip_qkv"] * clip_scale
    else:
        data.update(moe_intermediate_size=b.expert, intermediate_size=b.dense, kv_lora_rank=b.kv_lora,
                    q_lora_rank=b.q_lora, qk_nope_head_dim=b.nope, qk_rope_head_dim=b.rope, v_head_dim=b.v,
                    head_dim=b.rope, qk_head_dim=b.nope + b.rope)  # the derived fields too: from_dict keeps them
    return type(small_config).from_dict(data)


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _expert_bytes(model: torch.nn.Module) -> tuple[int, str]:
    """Bytes of one routed expert (gate, up, down) and the experts' dtype."""
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            E = experts.gate_up_proj.shape[0]
            total = experts.gate_up_proj.numel() + experts.down_proj.numel()
            dtype = str(experts.gate_up_proj.dtype).removeprefix("torch.")
            return total // E * experts.gate_up_proj.element_size(), dtype
    return 0, "?"


@torch.no_grad()
def grow(model: torch.nn.Module, target: GrowTarget | str | None = None, *, device: Any = None,
         dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A new model of ``target``'s dimensions that computes ``model``'s function (module docstring); ``model``
    is not changed.

    Args:
        model: the small model: ``OlmoeForCausalLM`` or ``DeepseekV3ForCausalLM`` (native classes).
        target: a :class:`GrowTarget`, a preset's name, or None: the preset of the model's family
            (:func:`default_target`).
        device: where to build the grown model (default: the small model's, read from its embedding). It is
            built directly there with no random initialisation, so a real-size bfloat16 model can be built on a
            GPU.
        dtype: the grown model's dtype (default: the small model's). Values are computed in float32 per tensor
            and cast.

    Returns the grown model in eval mode. ``ValueError`` naming the problem for a model or target that cannot be
    grown exactly (not a Mixture of Experts, another family, a target smaller in some dimension, a head
    dimension that is not a multiple, a RoPE type whose frequencies depend on the head size, ...).
    """
    from transformers.initialization import no_init_weights

    family = _check_model(model)
    if target is None:
        target = default_target(family)
    elif isinstance(target, str):
        target = target_by_name(target)
    elif not isinstance(target, GrowTarget):
        raise ValueError(f"target must be a GrowTarget, a preset name ({', '.join(PRESETS)}) or None; got "
                         f"{type(target).__name__}")
    config = model.config
    s, b = _Dims.of_config(config), _Dims.of_target(target)
    _check_target(family, s, b, target, config)
    embed = model.model.embed_tokens.weight
    device = torch.device(device) if device is not None else embed.device
    dtype = dtype or embed.dtype
    r_hidden = b.hidden / s.hidden
    clip = family == "olmoe" and getattr(config, "clip_qkv", None) is not None
    clip_scale = (b.head_dim // s.head_dim) ** 0.25 if clip else 1.0

    big_config = _grown_config(config, family, b, r_hidden, dtype, clip_scale)
    with torch.device(device), no_init_weights():
        big = type(model)._from_config(big_config, dtype=dtype,
                                       attn_implementation=getattr(config, "_attn_implementation", None))
    if getattr(model, "generation_config", None) is not None:
        big.generation_config = copy.deepcopy(model.generation_config)

    fill = _Filler()
    hid = None  # hidden dimensions keep their positions: the first s.hidden of b.hidden
    fill.put(big.model.embed_tokens.weight, model.model.embed_tokens.weight, (None, hid))
    if big.lm_head.weight is not big.model.embed_tokens.weight:
        fill.put(big.lm_head.weight, model.lm_head.weight, (None, hid))

    def hidden_norm(big_norm: Any, small_norm: Any) -> None:
        if fill.norm(big_norm, small_norm, hid, r_hidden) != 1.0:
            raise ValueError(f"grow: {type(small_norm).__name__} over the hidden size does not use "
                             "config.rms_norm_eps; its epsilon cannot be matched without scaling the residual stream")

    hidden_norm(big.model.norm, model.model.norm)
    interleaved = bool(getattr(config, "rope_interleave", False))
    for index, (bl, sl) in enumerate(zip(big.model.layers, model.model.layers, strict=True)):
        hidden_norm(bl.input_layernorm, sl.input_layernorm)
        hidden_norm(bl.post_attention_layernorm, sl.post_attention_layernorm)
        if family == "olmoe":
            _olmoe_attention(fill, bl.self_attn, sl.self_attn, s, b, clip)
        else:
            _mla_attention(fill, bl.self_attn, sl.self_attn, s, b, interleaved)
        big_mlp, small_mlp = bl.mlp, sl.mlp
        if hasattr(small_mlp, "experts"):
            router_small, router_big = small_mlp.gate, big_mlp.gate
            fill.put(router_big.weight, router_small.weight, (None, hid))
            for name in ("bias", "e_score_correction_bias"):
                if getattr(router_small, name, None) is not None:
                    fill.put(getattr(router_big, name), getattr(router_small, name), (None,))
            _experts(fill, big_mlp.experts, small_mlp.experts, s.expert, b.expert, hid)
            shared = getattr(small_mlp, "shared_experts", None)
            if shared is not None:
                _mlp(fill, big_mlp.shared_experts, shared, hid)
        elif hasattr(small_mlp, "gate_proj"):
            _mlp(fill, big_mlp, small_mlp, hid)
        else:
            raise ValueError(f"grow: decoder layer {index}'s {type(small_mlp).__name__} is neither an MoE block "
                             "nor a gate/up/down MLP")

    # every parameter and saved buffer was written (a new tensor in another transformers version is named here)
    persistent = set(big.state_dict(keep_vars=True))
    missed = [name for name, t in [*big.named_parameters(), *big.named_buffers()]
              if name in persistent and id(t) not in fill.filled]
    if missed:
        raise ValueError(f"grow does not know how to map {', '.join(missed[:5])}"
                         f"{' ...' if len(missed) > 5 else ''} ({type(model).__name__} of this transformers version)")
    _check_rotary(big, model, b, s, family)

    before, after = _param_count(model), _param_count(big)
    small_bytes, _ = _expert_bytes(model)
    big_bytes, expert_dtype = _expert_bytes(big)
    logger.info("grew %s %s -> %s: %s -> %s parameters; one routed expert %.3f MB -> %.2f MB (%s); hidden norms' "
                "eps %.3g -> %.3g", family, type(model).__name__, target.name, f"{before:,}", f"{after:,}",
                small_bytes / 1e6, big_bytes / 1e6, expert_dtype, config.rms_norm_eps, big_config.rms_norm_eps)
    return big.eval()


def _check_rotary(big: Any, small: Any, b: _Dims, s: _Dims, family: str) -> None:
    """The grown model's rotary frequencies at the mapped pairs are the small model's (a backstop for the RoPE
    rules: a rope type whose frequencies depend on the head size fails here)."""
    small_rot, big_rot = small.model.rotary_emb, big.model.rotary_emb
    f = b.head_dim // s.head_dim if family == "olmoe" else b.rope // s.rope
    ours = big_rot.inv_freq.detach().float().cpu()[::f]
    theirs = small_rot.inv_freq.detach().float().cpu()
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-6, atol=0) or \
            float(getattr(big_rot, "attention_scaling", 1.0)) != float(getattr(small_rot, "attention_scaling", 1.0)):
        raise ValueError("grow: the grown model's rotary frequencies are not the small model's at the mapped pairs "
                         f"(rope parameters {big.config.rope_parameters!r})")


# ---------------------------------------------------------------------------------------------------- on disk
def _usual_modes(folder: Path) -> None:
    """Give the files in ``folder`` the mode a new file gets under the user's umask (safetensors writes its file
    through a private temporary file, mode 0600, which other users of a shared model folder could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def grow_pretrained(src_dir: str | Path, out_dir: str | Path, target: GrowTarget | str | None = None, *,
                    dtype: torch.dtype = torch.bfloat16, device: Any = "cpu") -> Path:
    """Load the model directory ``src_dir``, grow it to ``target`` (default: its family's preset) and save it to
    ``out_dir`` (``save_pretrained``: safetensors), with the tokenizer's files, the calibration
    (``calibration.safetensors``, where there is one: routing is unchanged, so it applies) and
    ``grown_from.json`` (the source, the target and both models' dimensions). Returns ``out_dir``.

    ``out_dir`` must be new or empty (nothing is overwritten)."""
    from transformers import AutoModelForCausalLM

    src, out = Path(src_dir).expanduser(), Path(out_dir).expanduser()
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a model directory (no config.json); give a transformers model directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new or empty directory "
                         "(grow overwrites nothing)")
    if isinstance(target, str):
        target = target_by_name(target)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", local_files_only=True).eval()
    target = target or default_target(model.config)
    big = grow(model, target, device=device, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    big.save_pretrained(out)
    copied = []
    for pattern in _COPIED:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)
                copied.append(path.name)
    record = {
        "source": str(src.resolve()),
        "target": target.name,
        "target_dims": target.dims(),
        "source_dims": dataclasses.asdict(_Dims.of_config(model.config)),
        "model_type": model.config.model_type,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters_before": _param_count(model),
        "parameters_after": _param_count(big),
        "copied": copied,
        "rms_norm_eps": {"source": model.config.rms_norm_eps, "grown": big.config.rms_norm_eps},
    }
    (out / "grown_from.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    _usual_modes(out)
    logger.info("saved the grown model to %s (copied %s)", out, ", ".join(copied) or "no tokenizer files")
    return out
