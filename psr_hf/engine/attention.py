"""Graph-capturable attention pieces shared by the engine's families: RMSNorm, RoPE (rotate-half or DeepSeek's
interleaved pairs), the one attention block function that ``torch.compile`` compiles once for every layer, the
rope checks, and the static KV cache written at a 0-d position tensor. Nothing here synchronises with the host
or depends on a tensor's value (the capture rules: docs/engine.md, "Inside the engine").
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .device_decisions import PDL_BY_DEFAULT

logger = logging.getLogger(__name__)

#: RoPE types whose frequencies and output scaling are fixed (independent of the sequence length)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (OLMoE, DeepSeek-V3): normalise in float32, cast back, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/3.6's RMSNorm: normalise in float32, times ``1 + weight`` in float32, cast back at the end."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def norm_params(module: nn.Module, what: str) -> tuple[torch.Tensor, float]:
    """The weight and epsilon of an RMSNorm module; ``ValueError`` naming ``what`` for anything else."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or eps is None:
        raise ValueError(f"{what}: {type(module).__name__} is not an RMSNorm with a weight and variance_epsilon")
    return weight, float(eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin(position: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
            interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at ``position`` as transformers' rotary embedding computes them: ``[D]`` over the duplicated
    frequencies, or ``[D/2]`` (one angle per pair) for DeepSeek's interleaved layout."""
    freqs = position.to(torch.float32) * inv_freq  # [D/2]
    emb = freqs if interleave else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    x1, x2 = x[..., 0::2], x[..., 1::2]  # DeepSeek's pairs (x0, x1), (x2, x3)...: out is de-interleaved
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                     slots: torch.Tensor, scaling: float) -> torch.Tensor:
    """One token's attention in torch over every slot of a static cache, the slots after ``position`` masked:
    ``q [nH, D]``, ``keys [T, nKV, D]``, ``values [T, nKV, Dv]``, ``slots [T]`` (0 .. T-1); query head ``h`` reads
    key-value head ``h // (nH / nKV)``; ``[nH, Dv]`` in q's dtype (the probabilities rounded to it)."""
    nH, D = q.shape
    nKV = keys.shape[1]
    scores = torch.matmul(q.reshape(nKV, nH // nKV, D), keys.permute(1, 2, 0)) * scaling  # [nKV, G, T]
    scores = scores.masked_fill(slots > position, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values.transpose(0, 1)).reshape(nH, values.shape[-1])  # [nKV, G, Dv]: heads in order


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                    slots: torch.Tensor, scaling: float, kernel: bool, locks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """:func:`masked_attention`, or with ``kernel`` the same attention over the filled slots only by the custom op
    ``torch.ops.psr_hf.decode_attention`` (registered by :mod:`psr_hf.engine.decode_attention_kernel`, which a
    family that chose it has imported); with the layer's ``locks`` (:class:`StaticKVCache`) in one launch."""
    if kernel:
        return torch.ops.psr_hf.decode_attention(q, keys, values, position, scaling, locks)
    return masked_attention(q, keys, values, position, slots, scaling)


def projections(x: torch.Tensor, tensors: dict, names: tuple[str, ...], kernels: bool, fp8: bool,
                fp8_names: tuple[str, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """``x``'s projections by the linears ``names`` of one layer's ``tensors`` (``(weight, bias)`` each), ``[1, N]``
    each: one launch of the fused GEMV (``torch.ops.psr_hf.linear_many``) with the attention kernels, its FP8 form
    (``linear_many_fp8``) on ``tensors["<name>_fp8"]`` (e4m3 weight, block scales; the biases the model's) with
    ``fp8`` (``dense_fp8``), else ``F.linear`` each. ``fp8_names``: the module names the FP8 weights are kept
    under, where a family keys a linear otherwise (default ``names``)."""
    biases = [tensors[n][1] for n in names]
    if fp8:
        weights, scales = zip(*(tensors[f"{n}_fp8"] for n in (fp8_names or names)))
        return tuple(torch.ops.psr_hf.linear_many_fp8(x, list(weights), list(scales), biases))
    if kernels:
        return tuple(torch.ops.psr_hf.linear_many(x, [tensors[n][0] for n in names], biases))
    return tuple(F.linear(x, *tensors[n]) for n in names)


def output_projection(x: torch.Tensor, weight_bias: tuple, kernels: bool, fp8: tuple | None = None) -> torch.Tensor:
    """The attention's output projection of one token ``x [1, nH * Dv]``: the fused GEMV
    (``torch.ops.psr_hf.linear_many``, registered by :mod:`psr_hf.engine.gemv_kernel`) with the attention
    kernels, which streams the weight faster than cuBLAS's batch-1 kernel; ``F.linear`` without them. With
    ``device_decisions.PDL_BY_DEFAULT`` the GEMV is a programmatic dependent launch where the GPU has them: after
    the one-launch decode attention, which lets it start early, it loads its first weight tile while the attention
    finishes. ``fp8``: ``(e4m3 weight, block scales)`` in place of the weight (``dense_fp8``), the bias
    ``weight_bias``'s, by the GEMV's FP8 form (``torch.ops.psr_hf.linear_many_fp8``)."""
    if fp8 is not None:
        return torch.ops.psr_hf.linear_many_fp8(x, [fp8[0]], [fp8[1]], [weight_bias[1]], PDL_BY_DEFAULT)[0]
    if kernels:
        weight, bias = weight_bias
        return torch.ops.psr_hf.linear_many(x, [weight], [bias], PDL_BY_DEFAULT)[0]
    return F.linear(x, *weight_bias)


def write_kv(cache: torch.Tensor, position: torch.Tensor, row: torch.Tensor) -> None:
    """Write one token's ``row`` into ``cache [max_len, ...]`` at the 0-d ``position``."""
    cache.index_copy_(0, position.view(1), row.reshape(1, *cache.shape[1:]))


def attention_block(attention: Any, static: Any, tensors: dict, norms: tuple, hidden: torch.Tensor,
                    position: torch.Tensor, out_hidden: torch.Tensor, out_normed: torch.Tensor,
                    cache: tuple, norm: Any = rms_norm) -> None:
    """``out_hidden = hidden + attention(input_norm(hidden))``, ``out_normed = post_norm(out_hidden)``: one
    function of tensors and constants (the family's ``attention``, its ``static`` sizes, one layer's weights
    ``tensors``, ``norms`` and KV ``cache``, the family's ``norm``), so that ``torch.compile`` compiles it once
    for every layer (once per attention function where a family mixes two)."""
    (w_in, eps_in), (w_post, eps_post) = norms
    attn = attention(static, tensors, norm(hidden, w_in, eps_in), position, *cache)
    out_hidden.copy_(hidden + attn)
    out_normed.copy_(norm(out_hidden, w_post, eps_post))


def check_kernel_option(option: Any, name: str) -> None:
    """``ValueError`` unless a kernel option ``name`` is None, True or False (:func:`choose_kernel`)."""
    if option not in (None, True, False):
        raise ValueError(f"{name} must be None (the kernel on CUDA where it runs), True or False, got {option!r}")


def choose_kernel(option: bool | None, name: str, device: torch.device, why: str | None) -> bool:
    """Whether a family's optional Triton kernel runs (its option ``name``): None, on CUDA where it can (``why`` is
    None), else the torch path; True, the kernel or ``ValueError`` saying ``why`` not (on the CPU it runs inside
    triton's interpreter, ``TRITON_INTERPRET=1``, for tests); False, the torch path."""
    check_kernel_option(option, name)
    if option is False:
        return False
    if option is True:
        if why is not None:
            raise ValueError(f"{name}=True: the kernel cannot run here: {why}; pass {name}=None (the kernel where it "
                             f"can run, else the torch path) or False (the torch path)")
        return True
    if device.type != "cuda":
        return False  # off CUDA the torch path (the interpreter only when asked for, with True)
    if why is not None:
        logger.info("psr_hf engine: %s is off: %s", name, why)
    return why is None


def rope_params(config: Any) -> dict:
    """The config's RoPE parameters (``rope_parameters``, or the older ``rope_scaling``) as a dict."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = dict(params)
    return params


def _rope_type(config: Any) -> str:
    params = rope_params(config)
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def check_rope(config: Any, model_type: str) -> str:
    """The config's rope type; ``ValueError`` for one whose frequencies depend on the sequence length."""
    rope_type = _rope_type(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"the engine does not support rope type {rope_type!r} ({model_type}); supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (rope types whose frequencies do not depend on the sequence length)"
        )
    return rope_type


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
        # the decode attention kernel's counters (one per head, zero between calls: decode_attention_kernel.new_locks)
        self.locks = [torch.zeros(heads, dtype=torch.int32, device=device) for _ in range(num_layers)]

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

