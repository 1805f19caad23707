"""Batch-1 decode building blocks over a loaded transformers model's own weights, written to be captured in CUDA
graphs, and the eager reference decode step that chains them.

Build one with :func:`build_layers`; it returns the family's class (:class:`OlmoeLayers`,
:class:`DeepseekV3Layers`), which holds **references** to the model's parameters (nothing is copied; the only
memory it adds is the static KV cache, one ``[2E, H]`` stack of two router weights per MoE layer that has a next
MoE layer, and a few vectors: its static buffers, a ``[max_len]`` slot index).

Every per-layer function works on one token (batch 1) and is capturable as written:

* no host synchronisation: no ``.item()``/``.tolist()``/``.cpu()``, no Python branch on a tensor's value (the
  only checks are on shapes, dtypes and devices, which are host metadata);
* static shapes: attention runs over all ``max_len`` slots of the KV cache with a mask derived from the position
  tensor, so nothing depends on the position but values;
* the position is a 0-d int64 tensor on the model's device; the KV cache is written at it with ``index_copy_``;
* every output is written into a buffer the caller passes (``copy_`` or ``out=``); temporaries inside a function
  are allocated by torch as usual (under capture they come from the graph's private pool, same sizes every step).

The range of the position cannot be checked inside a graph: the host calls :meth:`DecodeLayers.check_position`
with the step's position (a Python int) before writing it to the position tensor and replaying.

Router contract (what the host-side policy reads, identical to ``psr_hf.hf.Controller._route_joint``):
:meth:`DecodeLayers.router_logits` writes ``[1, W]`` raw logits, ``W = 2E`` when the layer has a next MoE layer
(this layer's logits, then the next layer's pre-gate logits, from one matmul over the family's
``stacked_router_weight``) and ``W = E`` for the last MoE layer; they are in the router's dtype (the model's for
OLMoE, float32 for DeepSeek-V3, whose router computes in float32). :meth:`DecodeLayers.router_scores` turns them
into the family's ``joint_scores``: the policy's ``z`` of this layer in columns ``[:E]`` and the pre-gate ``g`` of
the next in ``[E:]``. For OLMoE (a softmax router) the scores are the raw logits themselves (softmax is monotone;
the policy's bias is added to logits, ``router_mass`` is ``MASS_SOFTMAX``); for DeepSeek-V3 they are
``sigmoid(logits) + e_score_correction_bias`` with the experts of the groups outside the kept ``topk_group`` at
``-inf``. The weights of the executed experts always come from the unmodified logits
(:meth:`DecodeLayers.execution_weights`, the family's ``execution_weights``): OLMoE the softmax over all experts
gathered (renormalised only if ``norm_topk_prob``), DeepSeek-V3 the gathered sigmoid, renormalised if
``norm_topk_prob``, times ``routed_scaling_factor`` (so the routed scaling is in the weights the MoE receives).

KV layout. OLMoE: ``keys[l]``/``values[l]`` are ``[max_len, num_key_value_heads, head_dim]``, keys after the
k-norm and RoPE. DeepSeek-V3 (multi-head latent attention): one tensor per layer, ``keys[l]`` of shape
``[max_len, 1, kv_lora_rank + qk_rope_head_dim]`` holding the compressed kv latent after ``kv_a_layernorm``
followed by the roped ``k_pe``, and ``values[l]`` is the view of its first ``kv_lora_rank`` columns. That is
exactly what transformers' own cache keeps for MLA, ``(kv_lora_rank + rope) / (heads * (qk_head + v_head))`` of
the expanded keys and values (1/9 for Moonlight), and it loses nothing: the per-head keys and values are a linear
function of it. Attention then either absorbs ``kv_b_proj`` into the query and the output (``absorb_mla=True``,
the default: the scores are ``(q_nope W_UK) . latent + q_pe . k_pe``, the output ``(p . latent) W_UV``, no
per-slot expansion) or expands every slot through ``kv_b_proj`` as transformers does (``absorb_mla=False``,
``max_len`` times the work; kept as a second reference). Both are the same function of the stored latent; they
differ only in float rounding order.
"""

from __future__ import annotations

import abc
import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psr_hf.patches import get_patch

logger = logging.getLogger(__name__)

#: model types the engine builds layers for, and their classes (filled below)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("olmoe", "deepseek_v3")
#: families psr_hf patches but the engine refuses: their decoders mix in linear-attention (Gated DeltaNet) layers
HYBRID_MODEL_TYPES: tuple[str, ...] = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
#: RoPE types whose frequencies and output scaling are fixed (independent of the sequence length)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


# ---------------------------------------------------------------------------------------------------- helpers
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (OLMoE, DeepSeek-V3): normalise in float32, cast back, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _norm_params(module: nn.Module, what: str) -> tuple[torch.Tensor, float]:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or eps is None:
        raise ValueError(f"{what}: {type(module).__name__} is not an RMSNorm with a weight and variance_epsilon")
    return weight, float(eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(position: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
             interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at ``position`` as transformers' rotary embedding computes them: ``[D]`` over the duplicated
    frequencies, or ``[D/2]`` (one angle per pair) for DeepSeek's interleaved layout."""
    freqs = position.to(torch.float32) * inv_freq  # [D/2]
    emb = freqs if interleave else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    x1, x2 = x[..., 0::2], x[..., 1::2]  # DeepSeek's pairs (x0, x1), (x2, x3)...: out is de-interleaved
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _write_kv(cache: torch.Tensor, position: torch.Tensor, row: torch.Tensor) -> None:
    """Write one token's ``row`` into ``cache [max_len, ...]`` at the 0-d ``position``."""
    cache.index_copy_(0, position.view(1), row.reshape(1, *cache.shape[1:]))


def _attention_block(attention: Any, static: Any, tensors: dict, norms: tuple, hidden: torch.Tensor,
                     position: torch.Tensor, out_hidden: torch.Tensor, out_normed: torch.Tensor,
                     cache: tuple) -> None:
    """``out_hidden = hidden + attention(input_norm(hidden))``, ``out_normed = post_norm(out_hidden)``: one
    function of tensors and constants (the family's ``attention``, its ``static`` sizes, one layer's weights
    ``tensors``, ``norms`` and KV ``cache``), so that ``torch.compile`` compiles it once for every layer."""
    (w_in, eps_in), (w_post, eps_post) = norms
    attn = attention(static, tensors, _rms_norm(hidden, w_in, eps_in), position, *cache)
    out_hidden.copy_(hidden + attn)
    out_normed.copy_(_rms_norm(out_hidden, w_post, eps_post))


def _rope_params(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = dict(params)
    return params


def _rope_type(config: Any) -> str:
    params = _rope_params(config)
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def _check_rope(config: Any, model_type: str) -> str:
    rope_type = _rope_type(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"the engine does not support rope type {rope_type!r} ({model_type}); supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (rope types whose frequencies do not depend on the sequence length)"
        )
    return rope_type


@dataclass(frozen=True)
class DecodeBuffers:
    """The static buffers of :meth:`DecodeLayers.decode_step_reference` (and the shapes the graphs will use):
    allocated once, rewritten in place every step."""

    token: torch.Tensor  # [1] int64
    position: torch.Tensor  # [] int64
    hidden: torch.Tensor  # [1, H] the residual stream
    normed: torch.Tensor  # [1, H] the post-attention RMSNorm output: the MLP / MoE / router input
    router_logits: torch.Tensor  # [1, 2E] (or [1, E] if no layer has a next MoE layer), router dtype
    router_scores: torch.Tensor  # same shape, float32: the family's joint scores (the controller's)
    expert_ids: torch.Tensor  # [1, K] int64
    expert_weights: torch.Tensor  # [1, K] router dtype
    mlp_out: torch.Tensor  # [1, H] the MLP / MoE block output
    shared_out: torch.Tensor  # [1, H] the shared experts' output (DeepSeek-V3)
    logits: torch.Tensor  # [1, V]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class StaticKVCache:
    """The KV cache of one sequence: per layer preallocated ``keys[l]`` and ``values[l]`` of shape
    ``[max_len, heads, dim]``, written at a 0-d position tensor with ``index_copy_``; ``future(position)`` is the
    ``[max_len]`` mask of the slots after the position, which attention sets to ``-inf``.

    ``value_dim`` None: no separate values; ``values[l]`` is the view of the first ``value_prefix`` columns of
    ``keys[l]`` (multi-head latent attention, where the value is the latent part of the key).
    """

    def __init__(self, num_layers: int, max_len: int, heads: int, key_dim: int, value_dim: int | None, *,
                 dtype: torch.dtype, device: torch.device, value_prefix: int | None = None):
        if max_len < 1:
            raise ValueError(f"max_len must be at least 1, got {max_len}")
        self.max_len = max_len
        self.keys = [torch.zeros(max_len, heads, key_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        if value_dim is None:
            if value_prefix is None or not 0 < value_prefix <= key_dim:
                raise ValueError("a cache without separate values needs 0 < value_prefix <= key_dim")
            self.values = [k[..., :value_prefix] for k in self.keys]
            self.separate_values = False
        else:
            self.values = [torch.zeros(max_len, heads, value_dim, dtype=dtype, device=device)
                           for _ in range(num_layers)]
            self.separate_values = True
        self.slots = torch.arange(max_len, dtype=torch.int64, device=device)  # [max_len]

    def write(self, layer: int, position: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None) -> None:
        """Write ``key`` (and ``value``) ``[heads, dim]`` of one token at ``position`` (0-d int64)."""
        index = position.view(1)
        self.keys[layer].index_copy_(0, index, key.reshape(1, *self.keys[layer].shape[1:]))
        if self.separate_values:
            self.values[layer].index_copy_(0, index, value.reshape(1, *self.values[layer].shape[1:]))

    def future(self, position: torch.Tensor) -> torch.Tensor:
        """``[max_len]`` bool: the slots after ``position`` (not yet written in this sequence)."""
        return self.slots > position

    def reset(self) -> None:
        """Zero every slot (a new sequence needs no reset, the mask hides later slots; this clears old data)."""
        for k in self.keys:
            k.zero_()
        if self.separate_values:
            for v in self.values:
                v.zero_()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this cache owns (the MLA values are views of the keys and not listed)."""
        owned = {f"kv.keys.{i}": k for i, k in enumerate(self.keys)}
        if self.separate_values:
            owned.update({f"kv.values.{i}": v for i, v in enumerate(self.values)})
        owned["kv.slots"] = self.slots
        return owned

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items() if name != "kv.slots")


@dataclass
class _Router:
    """One routed MoE layer as the engine reads it."""

    moe_index: int  # index among the MoE layers (the policy's layer)
    block: nn.Module
    router: nn.Module
    following: nn.Module | None  # the next MoE layer's router
    stacked: torch.Tensor  # [2E, H] own-memory stack, or the router's own weight [E, H] for the last MoE layer
    gate_up: torch.Tensor  # [E, 2I, H] ([E, H, 2I] if transposed)
    down: torch.Tensor  # [E, H, I] ([E, I, H] if transposed)
    transposed: bool
    act: nn.Module
    shared: nn.Module | None
    predicted: bool = False  # the pre-gate half of ``stacked`` is a learned predictor's (softmax priorities)
    source: tuple = ()  # the router weights' versions and addresses when ``stacked`` was built (see sync_routers)


def _router_source(router: nn.Module, following: nn.Module | None) -> tuple:
    """What an in-place change (``_version``) or a replacement or conversion (``data_ptr``) of the router weights
    that ``stacked`` is built from changes (read before every step: two attributes per weight)."""
    a = router.weight
    if following is None:
        return a._version, a.data_ptr()
    b = following.weight
    return a._version, a.data_ptr(), b._version, b.data_ptr()


# ---------------------------------------------------------------------------------------------------- base class
class DecodeLayers(abc.ABC):
    """The per-layer decode functions of one family over ``model``'s own weights, a static KV cache of
    ``max_len`` positions and the static buffers of the reference step. See the module docstring for the
    capture rules and the router contract. Build with :func:`build_layers`."""

    model_type: str = ""

    def __init__(self, model: nn.Module, max_len: int):
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        self.model = model
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.family = get_patch(self.model_type)(model)
        self.decoder = self.family.decoder()
        self.max_len = max_len
        self._refs: dict[str, torch.Tensor] = {}
        self._ref_places: dict[str, tuple] = {}  # (data_ptr, dtype, device) of each when the engine read it
        self._owned: dict[str, torch.Tensor] = {}

        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(model).__name__} has no input/output embeddings: not a causal LM")
        self.embed_weight = self._ref("embed", embed.weight)
        self.device, self.dtype = self.embed_weight.device, self.embed_weight.dtype
        self.hidden_size = self.embed_weight.shape[1]
        self.final_norm_weight, self.final_norm_eps = _norm_params(self.decoder.norm, "final norm")
        self._ref("final_norm", self.final_norm_weight)
        self.lm_head_weight = self._ref("lm_head", head.weight)
        self.lm_head_bias = self._ref("lm_head.bias", getattr(head, "bias", None))

        self.layers = list(self.decoder.layers)
        self.num_layers = len(self.layers)
        self._norms = []
        for i, layer in enumerate(self.layers):
            a = _norm_params(layer.input_layernorm, f"layer {i} input norm")
            b = _norm_params(layer.post_attention_layernorm, f"layer {i} post-attention norm")
            self._ref(f"layers.{i}.input_norm", a[0])
            self._ref(f"layers.{i}.post_norm", b[0])
            self._norms.append((a, b))

        self._build_rope()
        self._routers = self._build_routers()
        for i, layer in enumerate(self.layers):
            if i not in self._routers:  # a dense layer (DeepSeek-V3's first first_k_dense_replace)
                self._ref_mlp(f"layers.{i}.mlp", layer.mlp)
        self.num_experts = self.family.moe_layers()[0].router.num_experts if self._routers else 0
        self.top_k = next(iter(self._routers.values())).router.top_k if self._routers else 0
        self._build_attention()
        self.kv = self._build_kv_cache()
        self._owned.update(self.kv.tensors())
        self.buffers = self._build_buffers()
        logger.debug("engine layers for %s: %d layers (%d MoE), max_len %d, KV cache %.2f MiB", self.model_type,
                     self.num_layers, len(self._routers), max_len, self.kv.nbytes / 2**20)

    # ------------------------------------------------------------------ bookkeeping
    def _ref(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Record ``tensor`` (a model parameter or buffer, or a view of one) as used in place."""
        if tensor is not None:
            self._refs[name] = tensor
            self._ref_places[name] = (tensor.data_ptr(), tensor.dtype, tensor.device)
        return tensor

    def _own(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self._owned[name] = tensor
        return tensor

    def referenced_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors (parameters, buffers, views of them) the functions use in place."""
        return dict(self._refs)

    def check_references(self, ctl: Any) -> None:
        """At a sequence start: ``RuntimeError`` if a model tensor the engine reads in place now has other memory
        or another dtype than when the engine was built (``model.to(dtype)``, a move), where the engine would
        read stale memory (edits in place are read as they are). The experts of an offloaded model are left out:
        the offload copies them into its own slots."""
        offloaded = getattr(ctl, "offload", None) is not None
        for name, tensor in self._refs.items():
            if offloaded and ".experts." in name:
                continue
            was = self._ref_places[name]
            now = (tensor.data_ptr(), tensor.dtype, tensor.device)
            if now != was:
                raise RuntimeError(
                    f"the model's {name} changed after psr_hf's engine was built on it ({was[1]} on {was[2]} -> "
                    f"{now[1]} on {now[2]}, or new memory: model.to(), a moved or converted model); the engine reads "
                    "the tensors it was built on: compile the model again (psr_hf.engine.compile) or build a new "
                    "decoder")

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine allocated: the KV cache, the stacked router weights, the static buffers and
        a few vectors (slot index; a float32 copy of the RoPE frequencies only where the model's are not)."""
        owned = dict(self._owned)
        owned.update({f"buffers.{k}": v for k, v in self.buffers.tensors().items()})
        return owned

    # ------------------------------------------------------------------ building
    def _build_rope(self) -> None:
        rotary = getattr(self.decoder, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            raise ValueError(f"{type(self.decoder).__name__} has no rotary_emb.inv_freq: unsupported architecture")
        self.rope_type = _check_rope(self.config, self.model_type)
        if inv_freq.dtype == torch.float32:  # transformers computes the angles in float32
            self.inv_freq = self._ref("rotary.inv_freq", inv_freq)
        else:
            self.inv_freq = self._own("rotary.inv_freq", inv_freq.detach().float())
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def _build_routers(self) -> dict[int, _Router]:
        moe = self.family.moe_layers()
        routers: dict[int, _Router] = {}
        # the dtype the family's router computes in (DeepSeek-V3: float32 whatever the weights'; others: the
        # weights'): probed on one row of a router weight, so the last MoE layer (no stack) computes like the rest
        self.router_dtype = (self.family.stacked_router_weight(moe[0].router.weight[:1].detach(),
                                                               moe[0].router.weight[:1].detach()).dtype
                             if moe else self.dtype)
        # a model patched with RoutingConfig(prefetch="predictor"): the pre-gate half of each stack is the
        # controller's (the predictor's B A), the same tensor the transformers path multiplies
        ctl = getattr(self.model, "_psr_hf_controller", None)
        predictor = getattr(ctl, "predictor", None)
        self.predictor = predictor  # what the stacks were built with (check_prefetch_source)
        for n, m in enumerate(moe):
            following = moe[n + 1].router if n + 1 < len(moe) else None
            if following is not None and predictor is not None:
                stacked = self._own(f"layers.{m.decoder_index}.stacked_router", ctl.stacked_weight(n).detach())
            elif following is not None:
                stacked = self._own(f"layers.{m.decoder_index}.stacked_router",
                                    self.family.stacked_router_weight(m.router.weight.detach(),
                                                                      following.weight.detach()))
            else:
                stacked = self._ref(f"layers.{m.decoder_index}.router", m.router.weight)
            bias = getattr(m.router, "e_score_correction_bias", None)  # read by the family's selection scores
            if isinstance(bias, torch.Tensor):
                self._ref(f"layers.{m.decoder_index}.router.e_score_correction_bias", bias)
            experts = m.block.experts
            gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
            if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.ndim != 3:
                raise ValueError(
                    f"decoder layer {m.decoder_index}: {type(experts).__name__} has no fused 3-D gate_up_proj / "
                    "down_proj (transformers 5.x layout); the engine supports that layout only"
                )
            if (not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False)
                    or not getattr(experts, "has_gate", True)):
                raise ValueError(
                    f"decoder layer {m.decoder_index}: experts with an interleaved gate/up layout, biases or no gate "
                    "are not supported; supported: concatenated [gate; up] weights without bias"
                )
            transposed = bool(getattr(experts, "is_transposed", False))
            H = self.hidden_size
            if (gate_up.shape[2] if not transposed else gate_up.shape[1]) != H:
                raise ValueError(f"decoder layer {m.decoder_index}: gate_up_proj {tuple(gate_up.shape)} does not "
                                 f"match hidden size {H} (is_transposed={transposed})")
            self._ref(f"layers.{m.decoder_index}.experts.gate_up", gate_up)
            self._ref(f"layers.{m.decoder_index}.experts.down", down)
            shared = getattr(m.block, "shared_experts", None)
            if shared is not None:
                self._ref_mlp(f"layers.{m.decoder_index}.shared", shared)
            routers[m.decoder_index] = _Router(n, m.block, m.router, following, stacked, gate_up, down, transposed,
                                               experts.act_fn, shared, predicted=predictor is not None,
                                               source=_router_source(m.router, following))
        return routers

    def sync_routers(self, ctl: Any) -> None:
        """Before a step: a router weight changed in place or replaced since the engine read it
        (``load_state_dict``, ``param.copy_``, a new ``Parameter``) is stacked again into the same memory, so the
        captured graphs route with the new weights; the last MoE layer's router, which the graphs read where it
        lives, must keep its memory (``RuntimeError`` otherwise)."""
        for r in self._routers.values():
            source = _router_source(r.router, r.following)
            if source == r.source:
                continue
            if r.following is None:
                if r.router.weight.data_ptr() != r.stacked.data_ptr() or r.router.weight.dtype != r.stacked.dtype:
                    raise RuntimeError(
                        f"the router weight of MoE layer {r.moe_index} was replaced (new memory or dtype) after the "
                        "engine was built; the engine reads it where it was: compile the model again "
                        "(psr_hf.engine.compile) or build a new decoder")
            else:
                fresh = ctl.stacked_weight(r.moe_index).detach()  # the controller's stack, kept by the same versions
                if fresh.shape != r.stacked.shape:
                    raise RuntimeError(
                        f"the router weights of MoE layer {r.moe_index} changed shape after the engine was built "
                        f"({tuple(r.stacked.shape)} -> {tuple(fresh.shape)}): build a new decoder")
                r.stacked.copy_(fresh.to(device=r.stacked.device, dtype=r.stacked.dtype))
            logger.info("psr_hf engine: the router weights of MoE layer %d changed; the engine routes with the new "
                        "ones", r.moe_index)
            r.source = source

    def _ref_mlp(self, name: str, mlp: nn.Module) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = getattr(mlp, proj, None)
            if module is None:
                raise ValueError(f"{name}: {type(mlp).__name__} is not a gated MLP (gate_proj/up_proj/down_proj)")
            self._ref(f"{name}.{proj}", module.weight)
            self._ref(f"{name}.{proj}.bias", module.bias)

    def _build_buffers(self) -> DecodeBuffers:
        H, dev, dt = self.hidden_size, self.device, self.dtype
        width = max((self.router_width(i) for i in self._routers), default=1)
        rdt = self.router_dtype
        K = max(self.top_k, 1)
        return DecodeBuffers(
            token=torch.zeros(1, dtype=torch.int64, device=dev),
            position=torch.zeros((), dtype=torch.int64, device=dev),
            hidden=torch.zeros(1, H, dtype=dt, device=dev),
            normed=torch.zeros(1, H, dtype=dt, device=dev),
            router_logits=torch.zeros(1, width, dtype=rdt, device=dev),
            router_scores=torch.zeros(1, width, dtype=torch.float32, device=dev),  # lossless for every family
            expert_ids=torch.zeros(1, K, dtype=torch.int64, device=dev),
            expert_weights=torch.zeros(1, K, dtype=rdt, device=dev),
            mlp_out=torch.zeros(1, H, dtype=dt, device=dev),
            shared_out=torch.zeros(1, H, dtype=dt, device=dev),
            logits=torch.zeros(1, self.lm_head_weight.shape[0], dtype=self.lm_head_weight.dtype, device=dev),
        )

    # family hooks
    @abc.abstractmethod
    def _build_attention(self) -> None:
        """References to the family's attention weights (and any precomputed tables)."""

    @abc.abstractmethod
    def _build_kv_cache(self) -> StaticKVCache:
        """The family's static KV cache."""

    @abc.abstractmethod
    def _cache(self, layer: int) -> tuple:
        """The KV cache tensors the family's attention function takes after the position (one layer's)."""

    # the family's attention: a module-level function ``(static, tensors, x, position, *cache) -> [1, H]`` (the
    # output after o_proj of the normed input ``x``; it writes the cache at ``position``) and its constants
    _attention_fn: Any = None
    _static: Any = None

    def compile_blocks(self, enabled: bool = True, **options: Any) -> None:
        """Run :meth:`attention_block` through ``torch.compile`` (``fullgraph=True, dynamic=False`` and
        ``options``; it compiles once, on the first call, for every layer: the function takes each layer's
        weights and cache as arguments) or, ``enabled=False``, eagerly again. Compiled, the elementwise work of
        the block (norms, RoPE, masking, softmax) is fused into a few kernels; the result is the same function
        with another rounding order in low precision. On a GPU this needs triton (inductor's code generator)."""
        if enabled:
            options = {"fullgraph": True, "dynamic": False, **options}
            self._block = torch.compile(_attention_block, **options)
        else:
            self._block = _attention_block
        self.compiled = bool(enabled)

    _block: Any = staticmethod(_attention_block)
    compiled: bool = False

    def check_prefetch_source(self, ctl: Any) -> None:
        """``RuntimeError`` when the controller's learned predictor is not the one the router stacks were built
        with (``reconfigure`` to or from ``prefetch="predictor"`` after the decoder was built): build a new one."""
        if getattr(ctl, "predictor", None) is not self.predictor:
            raise RuntimeError("the engine's router stacks were built for another prefetch ranking (the "
                               "controller's predictor changed with reconfigure()); build a new decoder")

    # ------------------------------------------------------------------ host-side checks (metadata only)
    def check_position(self, position: int) -> None:
        """Host-side check before a step (a graph cannot check its position tensor): ``0 <= position <
        max_len``; ``ValueError`` otherwise."""
        if isinstance(position, torch.Tensor):
            raise ValueError("check_position takes the host's position (an int), not the device tensor")
        if not 0 <= int(position) < self.max_len:
            raise ValueError(
                f"position {position} is outside the static KV cache (max_len {self.max_len}): the engine decodes "
                f"positions 0..{self.max_len - 1}; build it with a larger max_len"
            )

    def _check_row(self, x: torch.Tensor, what: str, width: int | None = None) -> None:
        if x.ndim != 2 or x.shape[0] != 1:
            raise ValueError(f"{what} must be [1, {width or 'N'}] (the engine decodes batch 1, one token), got "
                             f"{tuple(x.shape)}")
        if width is not None and x.shape[1] != width:
            raise ValueError(f"{what} must be [1, {width}], got {tuple(x.shape)}")

    def _check_position_tensor(self, position: torch.Tensor) -> None:
        if (not isinstance(position, torch.Tensor) or position.ndim != 0 or position.dtype != torch.int64
                or position.device != self.device):
            raise ValueError(f"position must be a 0-d int64 tensor on the model's device ({self.device}); check its "
                             "value on the host with check_position")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range: the model has {self.num_layers} decoder layers")

    def _moe(self, layer: int) -> _Router:
        self._check_layer(layer)
        r = self._routers.get(layer)
        if r is None:
            raise ValueError(f"decoder layer {layer} is a dense MLP layer, not a routed MoE layer")
        return r

    # ------------------------------------------------------------------ structure
    def is_moe(self, layer: int) -> bool:
        return layer in self._routers

    def moe_index(self, layer: int) -> int:
        """The policy's layer index (MoE layers only) of decoder layer ``layer``."""
        return self._moe(layer).moe_index

    def router_width(self, layer: int) -> int:
        """Columns of :meth:`router_logits`'s output: ``2E`` with the next MoE layer's pre-gate, ``E`` for the
        last MoE layer."""
        r = self._moe(layer)
        return r.stacked.shape[0]

    # ------------------------------------------------------------------ the per-layer functions
    @torch.no_grad()
    def embed(self, token: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, H]`` = the embedding of ``token`` (``[1]`` or 0-d int64 on the device)."""
        if token.numel() != 1:
            raise ValueError(f"the engine decodes batch 1, one token per step; got {token.numel()} token ids")
        if token.dtype != torch.int64 or token.device != self.device:
            raise ValueError(f"token must be an int64 tensor on the model's device ({self.device})")
        self._check_row(out, "embed out", self.hidden_size)
        torch.index_select(self.embed_weight, 0, token.reshape(1), out=out)

    @torch.no_grad()
    def attention_block(self, layer: int, hidden: torch.Tensor, position: torch.Tensor, out_hidden: torch.Tensor,
                        out_normed: torch.Tensor) -> None:
        """``out_hidden = hidden + attention(input_norm(hidden))`` (writing the KV cache at ``position``) and
        ``out_normed = post_attention_norm(out_hidden)``, the MLP / MoE / router input. ``out_hidden`` may be
        ``hidden`` itself."""
        self._check_layer(layer)
        for x, what in ((hidden, "hidden"), (out_hidden, "out_hidden"), (out_normed, "out_normed")):
            self._check_row(x, what, self.hidden_size)
        self._check_position_tensor(position)
        self._block(self._attention_fn, self._static, self._attn[layer], self._norms[layer], hidden, position,
                    out_hidden, out_normed, self._cache(layer))

    @torch.no_grad()
    def router_logits(self, layer: int, normed: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, router_width(layer)]``: this layer's router logits, then (when there is a next MoE layer)
        the next layer's pre-gate logits on the same input, from one matmul over the stacked weights."""
        r = self._moe(layer)
        self._check_row(normed, "normed", self.hidden_size)
        self._check_row(out, "router logits out", r.stacked.shape[0])
        dt = self.router_dtype  # a no-op cast but for a last layer whose weight is not in the router's dtype
        out.copy_(F.linear(normed.to(dt), r.stacked.to(dt)))

    @torch.no_grad()
    def router_scores(self, layer: int, logits: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (same shape as ``logits``): the family's selection scores of this layer and pre-gate of the
        next, exactly the controller's ``joint_scores`` (see the module docstring)."""
        r = self._moe(layer)
        E = self.num_experts
        self._check_row(logits, "router logits", r.stacked.shape[0])
        self._check_row(out, "router scores out", r.stacked.shape[0])
        out[:, :E].copy_(self.family.selection_scores(r.router, logits[:, :E]))
        if r.following is not None and r.predicted:  # a learned predictor's priorities (Controller.joint_scores)
            out[:, E:].copy_(torch.softmax(logits[:, E:].float(), dim=-1))
        elif r.following is not None:
            out[:, E:].copy_(self.family.selection_scores(r.following, logits[:, E:]))

    @torch.no_grad()
    def router_top_k(self, layer: int, scores: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, K]`` int64: the router's own top-K of this layer's scores (exact routing)."""
        self._moe(layer)
        self._check_row(out, "expert ids out", self.top_k)
        out.copy_(torch.topk(scores[:, : self.num_experts], self.top_k, dim=-1).indices)

    @torch.no_grad()
    def execution_weights(self, layer: int, logits: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, K]``: the weights of ``expert_ids`` from the unmodified logits (the family's
        ``execution_weights``, routed scaling included)."""
        r = self._moe(layer)
        self._check_row(out, "expert weights out", expert_ids.shape[-1])
        out.copy_(self.family.execution_weights(r.router, logits[:, : self.num_experts], expert_ids.reshape(1, -1)))

    @torch.no_grad()
    def dense_mlp(self, layer: int, normed: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, H]``: the dense MLP of a dense layer (DeepSeek-V3's first ``first_k_dense_replace``)."""
        self._check_layer(layer)
        if layer in self._routers:
            raise ValueError(f"decoder layer {layer} is a routed MoE layer; dense_mlp runs the dense layers only")
        self._check_row(normed, "normed", self.hidden_size)
        self._check_row(out, "dense mlp out", self.hidden_size)
        out.copy_(self._mlp(self.layers[layer].mlp, normed))

    @torch.no_grad()
    def shared_expert(self, layer: int, normed: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, H]``: the shared experts of a MoE layer (DeepSeek-V3; OLMoE has none)."""
        r = self._moe(layer)
        if r.shared is None:
            raise ValueError(f"{self.model_type} decoder layer {layer} has no shared experts")
        self._check_row(normed, "normed", self.hidden_size)
        self._check_row(out, "shared expert out", self.hidden_size)
        out.copy_(self._mlp(r.shared, normed))

    def has_shared_experts(self, layer: int) -> bool:
        return self._moe(layer).shared is not None

    @staticmethod
    def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        return F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    @torch.no_grad()
    def final(self, hidden: torch.Tensor, out_logits: torch.Tensor) -> None:
        """``out_logits [1, V]`` = lm_head(final_norm(hidden))."""
        self._check_row(hidden, "hidden", self.hidden_size)
        self._check_row(out_logits, "logits out", self.lm_head_weight.shape[0])
        x = _rms_norm(hidden, self.final_norm_weight, self.final_norm_eps)
        out_logits.copy_(F.linear(x, self.lm_head_weight, self.lm_head_bias))

    # ------------------------------------------------------------------ references (tests, the eager path)
    @torch.no_grad()
    def moe_reference(self, layer: int, normed: torch.Tensor, expert_ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """``[1, H]``: ``sum_k weights[k] * expert_{ids[k]}(normed)`` straight from the model's fused expert
        weights (gate_up_proj ``[E, 2I, H]`` = [gate; up], down_proj ``[E, H, I]``, or their transposes when the
        experts are ``is_transposed``). No shared experts, no residual; the weights carry any routed scaling."""
        r = self._moe(layer)
        self._check_row(normed, "normed", self.hidden_size)
        ids = expert_ids.reshape(-1)
        K = ids.shape[0]
        gate_up = torch.index_select(r.gate_up, 0, ids)  # [K, 2I, H] or [K, H, 2I]
        down = torch.index_select(r.down, 0, ids)  # [K, H, I] or [K, I, H]
        x = normed.reshape(1, 1, -1).expand(K, 1, self.hidden_size)
        h = torch.bmm(x, gate_up if r.transposed else gate_up.transpose(1, 2))  # [K, 1, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(r.act(gate) * up, down if r.transposed else down.transpose(1, 2))  # [K, 1, H]
        y = (y * weights.reshape(K, 1, 1)).to(normed.dtype)
        return y.sum(dim=0)

    def reset(self) -> None:
        """Clear the KV cache (not needed between sequences: the position mask hides later slots)."""
        self.kv.reset()

    @torch.no_grad()
    def decode_step_reference(self, token: int | torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """One eager decode step with exact routing (the router's own top-K, HF's weights): embed, every layer's
        attention block, router, MoE (:meth:`moe_reference` plus shared experts) or dense MLP, the residual, and
        the final norm and lm_head. Returns the static ``[1, V]`` logits buffer (rewritten by the next step).

        ``token``/``position``: Python ints (checked, then written into the static token/position buffers) or
        device tensors (``[1]``/0-d int64, used as they are and not range-checked: see :meth:`check_position`).
        Positions must be decoded in order from 0 for a sequence: a step attends to slots ``0..position``."""
        b = self.buffers
        if isinstance(token, torch.Tensor):
            tok = token
        else:
            b.token.fill_(int(token))
            tok = b.token
        if isinstance(position, torch.Tensor):
            pos = position
        else:
            self.check_position(position)
            b.position.fill_(int(position))
            pos = b.position
        self.embed(tok, b.hidden)
        for layer in range(self.num_layers):
            self.attention_block(layer, b.hidden, pos, b.hidden, b.normed)
            if layer in self._routers:
                width = self.router_width(layer)
                logits, scores = b.router_logits[:, :width], b.router_scores[:, :width]
                self.router_logits(layer, b.normed, logits)
                self.router_scores(layer, logits, scores)
                self.router_top_k(layer, scores, b.expert_ids)
                self.execution_weights(layer, logits, b.expert_ids, b.expert_weights)
                b.mlp_out.copy_(self.moe_reference(layer, b.normed, b.expert_ids, b.expert_weights))
                if self.has_shared_experts(layer):
                    self.shared_expert(layer, b.normed, b.shared_out)
                    b.mlp_out.add_(b.shared_out)  # transformers: routed + shared, then the residual
            else:
                self.dense_mlp(layer, b.normed, b.mlp_out)
            b.hidden.add_(b.mlp_out)
        self.final(b.hidden, b.logits)
        return b.logits


# ---------------------------------------------------------------------------------------------------- OLMoE
class OlmoeLayers(DecodeLayers):
    """OLMoE: q/k RMSNorm over the whole projections, RoPE (rotate-half), grouped-query attention when
    ``num_key_value_heads < num_attention_heads``, ``clip_qkv``; softmax router, no shared experts."""

    model_type = "olmoe"

    def _build_attention(self) -> None:
        c = self.config
        if getattr(c, "sliding_window", None):
            raise ValueError("the engine does not support sliding-window attention (config.sliding_window is set)")
        self.num_heads = int(c.num_attention_heads)
        self.num_kv_heads = int(getattr(c, "num_key_value_heads", None) or self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        self._attn = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            refs = {}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                module = getattr(a, proj)
                refs[proj] = (self._ref(f"layers.{i}.{proj}", module.weight),
                              self._ref(f"layers.{i}.{proj}.bias", module.bias))
            refs["q_norm"] = _norm_params(a.q_norm, f"layer {i} q_norm")
            refs["k_norm"] = _norm_params(a.k_norm, f"layer {i} k_norm")
            self._ref(f"layers.{i}.q_norm", refs["q_norm"][0])
            self._ref(f"layers.{i}.k_norm", refs["k_norm"][0])
            self._attn.append(refs)
        q_out = self._attn[0]["q_proj"][0].shape[0]
        self.head_dim = int(getattr(self.layers[0].self_attn, "head_dim", 0) or q_out // self.num_heads)
        if self.inv_freq.numel() * 2 != self.head_dim:
            raise ValueError(f"rotary dimension {self.inv_freq.numel() * 2} != head_dim {self.head_dim}: partial "
                             "rotary embeddings are not supported")
        self.scaling = self.head_dim ** -0.5
        module_scaling = getattr(self.layers[0].self_attn, "scaling", None)
        if module_scaling is not None and not math.isclose(module_scaling, self.scaling, rel_tol=1e-12):
            raise ValueError(f"OLMoE attention scale {module_scaling} of this transformers version is not "
                             f"head_dim**-0.5 = {self.scaling}: unsupported")
        self.clip_qkv = getattr(self.config, "clip_qkv", None)

        self._attention_fn = _olmoe_attention
        self._static = _OlmoeStatic(self.num_heads, self.num_kv_heads, self.head_dim, self.scaling, self.clip_qkv,
                                    self.rope_scaling)
        for refs in self._attn:
            refs["inv_freq"] = self.inv_freq

    def _build_kv_cache(self) -> StaticKVCache:
        return StaticKVCache(self.num_layers, self.max_len, self.num_kv_heads, self.head_dim, self.head_dim,
                             dtype=self.dtype, device=self.device)

    def _cache(self, layer: int) -> tuple:
        return self.kv.keys[layer], self.kv.values[layer], self.kv.slots


@dataclass(frozen=True)
class _OlmoeStatic:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    clip_qkv: float | None
    rope_scaling: float


def _olmoe_attention(s: _OlmoeStatic, a: dict, x: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """OLMoE attention of one token (``keys``/``values`` ``[T, nKV, D]``, written at ``position``)."""
    nH, nKV, D = s.num_heads, s.num_kv_heads, s.head_dim
    q = _rms_norm(F.linear(x, *a["q_proj"]), *a["q_norm"])
    k = _rms_norm(F.linear(x, *a["k_proj"]), *a["k_norm"])
    v = F.linear(x, *a["v_proj"])
    if s.clip_qkv is not None:
        q = q.clamp(min=-s.clip_qkv, max=s.clip_qkv)
        k = k.clamp(min=-s.clip_qkv, max=s.clip_qkv)
        v = v.clamp(min=-s.clip_qkv, max=s.clip_qkv)
    cos, sin = _cos_sin(position, a["inv_freq"], s.rope_scaling, q.dtype, False)
    q = _apply_rope(q.view(nH, D), cos, sin, False)
    k = _apply_rope(k.view(nKV, D), cos, sin, False)
    _write_kv(keys, position, k)
    _write_kv(values, position, v.view(nKV, D))
    scores = torch.matmul(q.view(nKV, nH // nKV, D), keys.permute(1, 2, 0)) * s.scaling  # [nKV, G, T]
    scores = scores.masked_fill(slots > position, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.transpose(0, 1))  # [nKV, G, D]
    return F.linear(out.reshape(1, nH * D), *a["o_proj"])


# ---------------------------------------------------------------------------------------------------- DeepSeek-V3
class DeepseekV3Layers(DecodeLayers):
    """DeepSeek-V3 / Moonlight: multi-head latent attention (``q_lora_rank`` None or set, RoPE on the
    ``qk_rope_head_dim`` part, DeepSeek's interleaved pairs if ``rope_interleave``, softmax scale with the yarn
    ``mscale_all_dim`` correction), dense first layers, shared experts, grouped sigmoid router."""

    model_type = "deepseek_v3"

    def __init__(self, model: nn.Module, max_len: int, *, absorb_mla: bool = True):
        self.absorb_mla = bool(absorb_mla)
        super().__init__(model, max_len)

    def _build_attention(self) -> None:
        c = self.config
        self.num_heads = int(c.num_attention_heads)
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        self.kv_lora_rank = int(c.kv_lora_rank)
        self.nope_dim, self.rope_dim = int(c.qk_nope_head_dim), int(c.qk_rope_head_dim)
        self.v_dim = int(c.v_head_dim)
        self.qk_dim = self.nope_dim + self.rope_dim
        self.interleave = bool(getattr(c, "rope_interleave", False))
        if self.inv_freq.numel() * 2 != self.rope_dim:
            raise ValueError(f"rotary dimension {self.inv_freq.numel() * 2} != qk_rope_head_dim {self.rope_dim}")
        # the softmax scale: qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 for scaled RoPE (yarn)
        scaling = self.qk_dim ** -0.5
        params = _rope_params(c)
        if self.rope_type != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scaling *= mscale * mscale
        self.scaling = scaling
        self._attn = []
        H = self.hidden_size
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            refs: dict[str, Any] = {}

            def lin(name: str, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
                return (self._ref(f"layers.{i}.{name}", module.weight), self._ref(f"layers.{i}.{name}.bias",
                                                                                 module.bias))

            if self.q_lora_rank is None:
                refs["q_proj"] = lin("q_proj", a.q_proj)
            else:
                refs["q_a_proj"] = lin("q_a_proj", a.q_a_proj)
                refs["q_a_norm"] = _norm_params(a.q_a_layernorm, f"layer {i} q_a_layernorm")
                self._ref(f"layers.{i}.q_a_layernorm", refs["q_a_norm"][0])
                refs["q_b_proj"] = lin("q_b_proj", a.q_b_proj)
            refs["kv_a_proj"] = lin("kv_a_proj_with_mqa", a.kv_a_proj_with_mqa)
            refs["kv_a_norm"] = _norm_params(a.kv_a_layernorm, f"layer {i} kv_a_layernorm")
            self._ref(f"layers.{i}.kv_a_layernorm", refs["kv_a_norm"][0])
            w_kv_b, b_kv_b = lin("kv_b_proj", a.kv_b_proj)
            if b_kv_b is not None:
                raise ValueError(f"layer {i}: kv_b_proj has a bias; the engine supports DeepSeek's bias-free kv_b_proj")
            w = w_kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)  # a view, no copy
            refs["kv_b"] = w_kv_b
            refs["w_uk"] = w[:, : self.nope_dim, :]  # [nH, nope, r]
            refs["w_uv"] = w[:, self.nope_dim:, :]  # [nH, v, r]
            refs["o_proj"] = lin("o_proj", a.o_proj)
            if refs["kv_a_proj"][0].shape != (self.kv_lora_rank + self.rope_dim, H):
                raise ValueError(f"layer {i}: kv_a_proj_with_mqa {tuple(refs['kv_a_proj'][0].shape)} does not match "
                                 "kv_lora_rank + qk_rope_head_dim")
            module_scaling = getattr(a, "scaling", None)
            if module_scaling is not None and not math.isclose(module_scaling, self.scaling, rel_tol=1e-9):
                raise ValueError(
                    f"layer {i}: this transformers version scales DeepSeek-V3 attention by {module_scaling}, the "
                    f"engine computes {self.scaling} (qk_head_dim**-0.5 with the yarn mscale_all_dim correction) "
                    f"for rope type {self.rope_type!r}: unsupported rope configuration"
                )
            refs["inv_freq"] = self.inv_freq
            self._attn.append(refs)
        self._attention_fn = _mla_attention
        self._static = _MlaStatic(self.num_heads, self.q_lora_rank is not None, self.kv_lora_rank, self.nope_dim,
                                  self.rope_dim, self.v_dim, self.max_len, self.interleave, self.scaling,
                                  self.rope_scaling, self.absorb_mla)

    def _build_kv_cache(self) -> StaticKVCache:
        r = self.kv_lora_rank
        return StaticKVCache(self.num_layers, self.max_len, 1, r + self.rope_dim, None, value_prefix=r,
                             dtype=self.dtype, device=self.device)

    def _cache(self, layer: int) -> tuple:
        return self.kv.keys[layer], self.kv.slots


@dataclass(frozen=True)
class _MlaStatic:
    num_heads: int
    q_lora: bool
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    max_len: int
    interleave: bool
    scaling: float
    rope_scaling: float
    absorb: bool


def _mla_attention(s: _MlaStatic, a: dict, x: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 multi-head latent attention of one token (``keys [T, 1, r + rope]``, written at
    ``position``)."""
    nH, r, nope, rope, vd, T = s.num_heads, s.kv_lora_rank, s.nope_dim, s.rope_dim, s.v_dim, s.max_len
    if not s.q_lora:
        q = F.linear(x, *a["q_proj"])
    else:
        q = F.linear(_rms_norm(F.linear(x, *a["q_a_proj"]), *a["q_a_norm"]), *a["q_b_proj"])
    q = q.view(nH, nope + rope)
    q_nope, q_pe = q[:, :nope], q[:, nope:]
    compressed = F.linear(x, *a["kv_a_proj"])  # [1, r + rope]
    latent = _rms_norm(compressed[:, :r], *a["kv_a_norm"])  # [1, r]
    k_pe = compressed[:, r:]  # [1, rope]
    cos, sin = _cos_sin(position, a["inv_freq"], s.rope_scaling, q.dtype, s.interleave)
    q_pe = _apply_rope(q_pe, cos, sin, s.interleave)
    k_pe = _apply_rope(k_pe, cos, sin, s.interleave)
    _write_kv(keys, position, torch.cat((latent, k_pe), dim=-1))
    cache = keys.view(T, r + rope)  # [T, r + rope]: latent | roped k_pe
    future = slots > position
    if s.absorb:
        q_lat = torch.bmm(q_nope.unsqueeze(1), a["w_uk"]).squeeze(1)  # [nH, r]
        scores = torch.matmul(torch.cat((q_lat, q_pe), dim=-1), cache.t()) * s.scaling  # [nH, T]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out_lat = torch.matmul(probs, cache[:, :r])  # [nH, r]
        out = torch.bmm(out_lat.unsqueeze(1), a["w_uv"].transpose(1, 2)).squeeze(1)  # [nH, v]
    else:
        kv = F.linear(cache[:, :r], a["kv_b"]).view(T, nH, nope + vd)  # [T, nH, nope + v]
        expanded = torch.cat((kv[..., :nope], cache[:, None, r:].expand(T, nH, rope)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)  # [nH, qk]
        scores = torch.matmul(query.unsqueeze(1), expanded.permute(1, 2, 0)).squeeze(1) * s.scaling  # [nH, T]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.unsqueeze(1), kv[..., nope:].transpose(0, 1)).squeeze(1)  # [nH, v]
    return F.linear(out.reshape(1, nH * vd), *a["o_proj"])


_CLASSES: dict[str, type[DecodeLayers]] = {"olmoe": OlmoeLayers, "deepseek_v3": DeepseekV3Layers}


def build_layers(model: nn.Module, max_len: int, *, absorb_mla: bool = True) -> DecodeLayers:
    """The decode building blocks of ``model`` (a loaded transformers causal LM, in eval mode) with a static KV
    cache of ``max_len`` positions. ``absorb_mla``: DeepSeek-V3's attention with ``kv_b_proj`` absorbed (see the
    module docstring). ``ValueError`` for an unsupported family, rope type or layout."""
    model_type = getattr(model.config, "model_type", None)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = [t for t in (model_type, getattr(text, "model_type", None)) if t]
    for t in types:
        if t in HYBRID_MODEL_TYPES:
            raise ValueError(
                f"the engine does not support hybrid linear attention yet (model_type {t!r} mixes Gated DeltaNet "
                f"layers into its decoder); supported: {', '.join(SUPPORTED_MODEL_TYPES)}. psr_hf.patch() still "
                "routes this model through transformers"
            )
    for t in types:
        if t in _CLASSES:
            cls = _CLASSES[t]
            return cls(model, max_len, absorb_mla=absorb_mla) if cls is DeepseekV3Layers else cls(model, max_len)
    raise ValueError(f"the engine does not support model_type {model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
