"""DeepSeek-V3's engine layers (``DeepseekV3ForCausalLM``, Moonlight): multi-head latent attention, dense first
layers, shared experts and the grouped sigmoid router (computing in float32: its scores are ``sigmoid(logits) +
e_score_correction_bias`` with the groups outside ``topk_group`` at ``-inf``; the executed weights carry
``routed_scaling_factor``).

KV layout: one tensor per layer, ``keys[l]`` ``[max_len, 1, kv_lora_rank + qk_rope_head_dim]``, the compressed
latent after ``kv_a_layernorm`` then the roped ``k_pe``; ``values[l]`` is the view of its first ``kv_lora_rank``
columns: what transformers' own cache keeps for MLA, from which the per-head keys and values are linear. Attention
absorbs ``kv_b_proj`` into the query and the output (``absorb_mla=True``, the default: no per-slot expansion) or
expands every slot as transformers does (``absorb_mla=False``, ``max_len`` times the work; a second reference):
the same function of the stored latent in another rounding order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import decode_attention_kernel, gemv_kernel  # noqa: F401  (gemv_kernel: the op the shared experts call)
from .. import dense_fp8 as dense_fp8_module
from ..attention import (StaticKVCache, apply_rope, check_kernel_option, choose_kernel, cos_sin,
                         norm_params, output_projection, projections, rms_norm, rope_params, write_kv)
from ..layers import DecodeLayers
from . import register_layers


@register_layers("deepseek_v3")
class DeepseekV3Layers(DecodeLayers):
    """DeepSeek-V3 / Moonlight: multi-head latent attention (``q_lora_rank`` None or set, RoPE on the
    ``qk_rope_head_dim`` part, DeepSeek's interleaved pairs if ``rope_interleave``, softmax scale with the yarn
    ``mscale_all_dim`` correction), dense first layers, shared experts, grouped sigmoid router.

    ``absorb_mla``: attention with ``kv_b_proj`` absorbed into the query and output (default) or every slot
    expanded as transformers does. ``attention_kernels`` (absorbed attention only): the attention over the cache's
    filled slots as :func:`~psr_hf.engine.decode_attention_kernel.decode_attention`, and the query, latent and
    output projections as the fused GEMV (the query's first projection and the latent's in one launch), whose rule
    is OLMoE's (:class:`~psr_hf.engine.families.olmoe.OlmoeLayers`). ``dense_fp8``: those projections and the
    dense and shared MLPs in block-wise FP8 from the checkpoint the offload's FP8 experts come from
    (:mod:`psr_hf.engine.dense_fp8`); ``kv_b_proj``, absorbed into the query and the output, keeps the model's
    weights."""

    listing_order = 2  # second in the lists of supported families (the paper's second model)

    def __init__(self, model: nn.Module, max_len: int, *, absorb_mla: bool = True,
                 attention_kernels: bool | None = None, dense_fp8: bool | None = None):
        # the family's options (DecodeLayers.family_options), passed on by build_layers
        self.absorb_mla = bool(absorb_mla)
        check_kernel_option(attention_kernels, "attention_kernels")
        dense_fp8_module.check_option(dense_fp8)
        self._kernel_option = attention_kernels
        self._dense_fp8_option = dense_fp8
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
        params = rope_params(c)
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
                refs["q_a_norm"] = norm_params(a.q_a_layernorm, f"layer {i} q_a_layernorm")
                self._ref(f"layers.{i}.q_a_layernorm", refs["q_a_norm"][0])
                refs["q_b_proj"] = lin("q_b_proj", a.q_b_proj)
            refs["kv_a_proj"] = lin("kv_a_proj_with_mqa", a.kv_a_proj_with_mqa)
            refs["kv_a_norm"] = norm_params(a.kv_a_layernorm, f"layer {i} kv_a_layernorm")
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
        why = "it runs the absorbed attention only (absorb_mla=True)" if not self.absorb_mla else (
            decode_attention_kernel.unsupported(self.device, self.num_heads, 1, self.kv_lora_rank + self.rope_dim,
                                                self.dtype))
        self.attention_kernels = choose_kernel(self._kernel_option, "attention_kernels", self.device, why)
        queries = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        self.dense_fp8 = self._read_dense_fp8(self._dense_fp8_option, {
            i: ("self_attn", (*queries, "kv_a_proj_with_mqa", "o_proj")) for i in range(self.num_layers)})
        self._attention_fn = _mla_attention
        self._static = _MlaStatic(self.num_heads, self.q_lora_rank is not None, self.kv_lora_rank, self.nope_dim,
                                  self.rope_dim, self.v_dim, self.max_len, self.interleave, self.scaling,
                                  self.rope_scaling, self.absorb_mla, self.attention_kernels, self.dense_fp8)

    def _build_kv_cache(self) -> StaticKVCache:
        r = self.kv_lora_rank
        return StaticKVCache(self.num_layers, self.max_len, 1, r + self.rope_dim, None, value_prefix=r,
                             dtype=self.dtype, device=self.device)

    def _cache(self, layer: int) -> tuple:
        return self.kv.keys[layer], self.kv.slots, self.kv.locks[layer]

    def _prompt_kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        s, a = self._static, self._attn[layer]
        r = s.kv_lora_rank
        compressed = F.linear(x, *a["kv_a_proj"])  # [S, r + rope]
        latent = rms_norm(compressed[:, :r], *a["kv_a_norm"])
        cos, sin = cos_sin(positions[:, None], a["inv_freq"], s.rope_scaling, x.dtype, s.interleave)
        k_pe = apply_rope(compressed[:, r:], cos, sin, s.interleave)
        return torch.cat((latent, k_pe), dim=-1), None


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
    kernels: bool  # the attention_kernels option
    fp8: bool = False  # the dense_fp8 option ("<module name>_fp8": (weight, scales) in the tensors)


def _mla_attention(s: _MlaStatic, a: dict, x: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
                   slots: torch.Tensor, locks: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 multi-head latent attention of one token (``keys [T, 1, r + rope]``, written at
    ``position``)."""
    nH, r, nope, rope, vd, T = s.num_heads, s.kv_lora_rank, s.nope_dim, s.rope_dim, s.v_dim, s.max_len
    if not s.q_lora:  # the latent's projection is keyed kv_a_proj, its module kv_a_proj_with_mqa
        q, compressed = projections(x, a, ("q_proj", "kv_a_proj"), s.kernels, s.fp8,
                                    ("q_proj", "kv_a_proj_with_mqa"))
    else:
        q_a, compressed = projections(x, a, ("q_a_proj", "kv_a_proj"), s.kernels, s.fp8,
                                      ("q_a_proj", "kv_a_proj_with_mqa"))
        (q,) = projections(rms_norm(q_a, *a["q_a_norm"]), a, ("q_b_proj",), s.kernels, s.fp8)
    q = q.view(nH, nope + rope)
    q_nope, q_pe = q[:, :nope], q[:, nope:]  # compressed: [1, r + rope]
    latent = rms_norm(compressed[:, :r], *a["kv_a_norm"])  # [1, r]
    k_pe = compressed[:, r:]  # [1, rope]
    cos, sin = cos_sin(position, a["inv_freq"], s.rope_scaling, q.dtype, s.interleave)
    q_pe = apply_rope(q_pe, cos, sin, s.interleave)
    k_pe = apply_rope(k_pe, cos, sin, s.interleave)
    write_kv(keys, position, torch.cat((latent, k_pe), dim=-1))
    cache = keys.view(T, r + rope)  # [T, r + rope]: latent | roped k_pe
    future = slots > position
    if s.absorb:
        q_lat = torch.bmm(q_nope.unsqueeze(1), a["w_uk"]).squeeze(1)  # [nH, r]
        if s.kernels:  # the filled slots only; the values are the latent columns of the keys
            out_lat = torch.ops.psr_hf.decode_attention(torch.cat((q_lat, q_pe), dim=-1), keys, keys[..., :r],
                                                        position, s.scaling, locks)
        else:
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
    return output_projection(out.reshape(1, nH * vd), a["o_proj"], s.kernels, a["o_proj_fp8"] if s.fp8 else None)
