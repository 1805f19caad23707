"""OLMoE's engine layers (``OlmoeForCausalLM``): q/k RMSNorm over the whole projections, RoPE (rotate-half),
grouped-query attention when ``num_key_value_heads < num_attention_heads``, ``clip_qkv``; a softmax router (its
scores are the raw logits: softmax is monotone) and no shared experts.

KV layout: ``keys[l]`` / ``values[l]`` are ``[max_len, num_key_value_heads, head_dim]``, keys after the k-norm and
RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import decode_attention_kernel, gemv_kernel
from .. import dense_fp8 as dense_fp8_module
from ..attention import (StaticKVCache, apply_rope, cache_attention, check_kernel_option, choose_kernel, cos_sin,
                         output_projection, projections, rms_norm, write_kv)
from ..layers import DecodeLayers
from . import register_layers


@register_layers("olmoe")
class OlmoeLayers(DecodeLayers):
    """OLMoE: q/k RMSNorm over the whole projections, RoPE (rotate-half), grouped-query attention when
    ``num_key_value_heads < num_attention_heads``, ``clip_qkv``; softmax router, no shared experts.

    ``attention_kernels``, the family's option (every family takes it, with this rule): the q/k/v projections as one Triton
    launch (:func:`~psr_hf.engine.gemv_kernel.linear_many`) and the attention over the cache's filled slots only
    (:func:`~psr_hf.engine.decode_attention_kernel.decode_attention`, which reads the position on the device; the
    torch path scores all ``max_len`` slots and masks the later ones). None (default): the kernels where the model
    is on CUDA and they run there, else torch; True: the kernels or ``ValueError`` saying why not (on the CPU in
    triton's interpreter, for tests); False: torch. The two agree within the dtype's rounding, not bitwise.

    ``dense_fp8``: the q/k/v and output projections of a decode step in block-wise FP8, read from the FP8
    checkpoint whose experts the offload holds (:mod:`psr_hf.engine.dense_fp8`: None, where it can; True, or
    ``ValueError``; False, the model's own weights). The batched prefill keeps the model's own weights."""

    listing_order = 1  # first in the lists of supported families (the paper's first model)

    def __init__(self, model: torch.nn.Module, max_len: int, *, attention_kernels: bool | None = None,
                 dense_fp8: bool | None = None):
        check_kernel_option(attention_kernels, "attention_kernels")
        dense_fp8_module.check_option(dense_fp8)
        self._kernel_option = attention_kernels
        self._dense_fp8_option = dense_fp8
        super().__init__(model, max_len)

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
            self._attn.append({**self._projections(i, a, ("q_proj", "k_proj", "v_proj", "o_proj")),
                               **self._norms_of(i, a, ("q_norm", "k_norm"))})
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

        why = gemv_kernel.unsupported(self.device) or decode_attention_kernel.unsupported(
            self.device, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
        self.attention_kernels = choose_kernel(self._kernel_option, "attention_kernels", self.device, why)
        self.dense_fp8 = self._read_dense_fp8(self._dense_fp8_option, {
            i: ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")) for i in range(self.num_layers)})
        self._attention_fn = _olmoe_attention
        self._static = _OlmoeStatic(self.num_heads, self.num_kv_heads, self.head_dim, self.scaling, self.clip_qkv,
                                    self.rope_scaling, self.attention_kernels, self.dense_fp8)
        for refs in self._attn:
            refs["inv_freq"] = self.inv_freq

    def _build_kv_cache(self) -> StaticKVCache:
        return StaticKVCache(self.num_layers, self.max_len, self.num_kv_heads, self.head_dim, self.head_dim,
                             dtype=self.dtype, device=self.device)

    def _cache(self, layer: int) -> tuple:
        return self.kv.keys[layer], self.kv.values[layer], self.kv.slots, self.kv.locks[layer]

    def _prompt_kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        s, a = self._static, self._attn[layer]
        S = x.shape[0]
        k = rms_norm(F.linear(x, *a["k_proj"]), *a["k_norm"])
        v = F.linear(x, *a["v_proj"])
        if s.clip_qkv is not None:
            k = k.clamp(min=-s.clip_qkv, max=s.clip_qkv)
            v = v.clamp(min=-s.clip_qkv, max=s.clip_qkv)
        cos, sin = cos_sin(positions[:, None], a["inv_freq"], s.rope_scaling, k.dtype, False)  # [S, D]
        k = apply_rope(k.view(S, s.num_kv_heads, s.head_dim), cos[:, None], sin[:, None], False)
        return k, v.view(S, s.num_kv_heads, s.head_dim)

    def _transformers_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        # transformers' OLMoE attention caches k_norm(k_proj(x)) after RoPE and v_proj(x), [1, nKV, S, D]
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)


@dataclass(frozen=True)
class _OlmoeStatic:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    clip_qkv: float | None
    rope_scaling: float
    kernels: bool  # the attention_kernels option
    fp8: bool  # the dense_fp8 option: q/k/v and o in FP8 ("<name>_fp8": (weight, scales) in the tensors)


def _olmoe_attention(s: _OlmoeStatic, a: dict, x: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, slots: torch.Tensor, locks: torch.Tensor) -> torch.Tensor:
    """OLMoE attention of one token (``keys``/``values`` ``[T, nKV, D]``, written at ``position``)."""
    nH, nKV, D = s.num_heads, s.num_kv_heads, s.head_dim
    q, k, v = projections(x, a, ("q_proj", "k_proj", "v_proj"), s.kernels, s.fp8)
    q = rms_norm(q, *a["q_norm"])
    k = rms_norm(k, *a["k_norm"])
    if s.clip_qkv is not None:
        q = q.clamp(min=-s.clip_qkv, max=s.clip_qkv)
        k = k.clamp(min=-s.clip_qkv, max=s.clip_qkv)
        v = v.clamp(min=-s.clip_qkv, max=s.clip_qkv)
    cos, sin = cos_sin(position, a["inv_freq"], s.rope_scaling, q.dtype, False)
    q = apply_rope(q.view(nH, D), cos, sin, False)
    k = apply_rope(k.view(nKV, D), cos, sin, False)
    write_kv(keys, position, k)
    write_kv(values, position, v.view(nKV, D))
    out = cache_attention(q, keys, values, position, slots, s.scaling, s.kernels, locks)  # [nH, D]
    return output_projection(out.reshape(1, nH * D), a["o_proj"], s.kernels, a["o_proj_fp8"] if s.fp8 else None)
