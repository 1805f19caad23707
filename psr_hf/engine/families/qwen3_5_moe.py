"""Qwen3.5 / Qwen3.6 MoE's engine layers (``Qwen3_5MoeForCausalLM``, and the language model of
``Qwen3_5MoeForConditionalGeneration``): a hybrid decoder whose ``config.layer_types`` mix Gated DeltaNet layers
(``linear_attention``) with gated full attention (``full_attention``), zero-centred RMSNorms (``1 + weight``), a
softmax router renormalised over the selected experts and one shared expert behind a sigmoid gate.

State layout, all static and written in place (no allocation, no host synchronisation per step):

- a full-attention layer: ``keys`` / ``values`` ``[max_len, num_key_value_heads, head_dim]``, keys after the
  k-norm and the partial RoPE (the first ``head_dim * partial_rotary_factor`` dimensions of each head);
- a Gated DeltaNet layer: ``conv`` ``[conv_dim, kernel]``, the last ``kernel`` inputs of the short convolution
  (model dtype), and ``recurrent`` ``[num_value_heads, key_head_dim, value_head_dim]`` float32, as transformers
  keeps them. Both are cleared at a sequence's first position (:meth:`Qwen35MoeLayers.begin_sequence`).

A Gated DeltaNet layer's step after its input projections is one Triton kernel on CUDA
(:func:`~psr_hf.engine.gated_delta_kernel.gated_delta_step`, which updates these two buffers in place) or the same
step in torch (:func:`~psr_hf.engine.gated_delta_kernel.gated_delta_step_reference`): the family's option
``gated_delta_kernel`` (:class:`Qwen35MoeLayers`), chosen once when the layers are built. The kernel runs as the
custom op ``torch.ops.psr_hf.gated_delta_step``, so that the compiled attention blocks
(:meth:`~psr_hf.engine.layers.DecodeLayers.compile_blocks`, ``fullgraph=True``) call it as one opaque op that
mutates the two buffers, not a graph break.

A prompt runs as one block through the model's own forward (:mod:`psr_hf.engine.prefill`): transformers' cache
holds the same tensors after it (the keys after the k-norm and RoPE, the values, the last ``kernel`` convolution
inputs and the final recurrent state), and they are copied into this state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .. import decode_attention_kernel, gemv_kernel
from .. import dense_fp8 as dense_fp8_module
from ..attention import (apply_rope, cache_attention, check_kernel_option, choose_kernel, cos_sin,
                         output_projection, projections, write_kv, zero_centred_rms_norm)
from ..gated_delta_kernel import gated_delta_step, gated_delta_step_reference, unsupported
from ..layers import DecodeLayers
from . import register_layers


LINEAR, FULL = "linear_attention", "full_attention"


class HybridState:
    """The engine's per-sequence state of a hybrid decoder: a KV cache for each full-attention layer and the
    convolution and recurrent state of each Gated DeltaNet layer (``None`` where a layer has the other kind)."""

    def __init__(self, layer_types: list[str], max_len: int, *, kv_heads: int, head_dim: int, conv_dim: int,
                 kernel: int, value_heads: int, key_head_dim: int, value_head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        if max_len < 1:
            raise ValueError(f"max_len must be at least 1, got {max_len}")
        self.max_len = max_len
        self.separate_values = True
        full = [t == FULL for t in layer_types]
        self.keys = [torch.zeros(max_len, kv_heads, head_dim, dtype=dtype, device=device) if f else None
                     for f in full]
        self.values = [torch.zeros(max_len, kv_heads, head_dim, dtype=dtype, device=device) if f else None
                       for f in full]
        self.conv = [None if f else torch.zeros(conv_dim, kernel, dtype=dtype, device=device) for f in full]
        self.recurrent = [None if f else torch.zeros(value_heads, key_head_dim, value_head_dim, dtype=torch.float32,
                                                     device=device) for f in full]
        self.slots = torch.arange(max_len, dtype=torch.int64, device=device)
        # the decode attention kernel's counters of the full-attention layers (zero between calls)
        self.locks = [torch.zeros(kv_heads, dtype=torch.int32, device=device) if f else None for f in full]

    def clear_recurrent(self) -> None:
        """Zero the Gated DeltaNet layers' states (a new sequence starts from none)."""
        for t in self.conv + self.recurrent:
            if t is not None:
                t.zero_()

    def reset(self) -> None:
        """Zero everything (the KV cache needs it for no sequence: this clears old data)."""
        for t in self.keys + self.values:
            if t is not None:
                t.zero_()
        self.clear_recurrent()

    def tensors(self) -> dict[str, torch.Tensor]:
        owned: dict[str, torch.Tensor] = {}
        for name in ("keys", "values", "conv", "recurrent"):
            owned.update({f"kv.{name}.{i}": t for i, t in enumerate(getattr(self, name)) if t is not None})
        owned["kv.slots"] = self.slots
        return owned

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items() if name != "kv.slots")


@register_layers("qwen3_5_moe", "qwen3_5_moe_text")
class Qwen35MoeLayers(DecodeLayers):
    """Qwen3.5/3.6 MoE: Gated DeltaNet and gated full-attention layers in ``config.layer_types``' pattern,
    zero-centred RMSNorms, the gated shared expert (:meth:`DecodeLayers.shared_expert`).

    ``gated_delta_kernel``, the family's option: the Gated DeltaNet step after the input projections as one Triton
    kernel per layer (:func:`~psr_hf.engine.gated_delta_kernel.gated_delta_step`) or in torch. None (default): the
    kernel where the model is on CUDA and it can run there (triton imports, the heads fit), else the torch step;
    True: the kernel, ``ValueError`` saying why it cannot run (also on the CPU inside triton's interpreter,
    ``TRITON_INTERPRET=1``, for tests); False: the torch step. Built, ``gated_delta_kernel`` is what runs (a
    bool). The two agree within float32 rounding, not bitwise (``tests/test_engine_gated_delta_kernel.py``)."""

    listing_order = 3
    norm_fn = staticmethod(zero_centred_rms_norm)
    #: the Gated DeltaNet's input projections: separate (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    #: ``in_proj_a``), or fused per key head (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``)
    fused_projections = False
    projection_names: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    #: the Gated DeltaNet's linears an FP8 checkpoint stores in FP8 (the per-head ``b``/``a`` stay in bf16, as in
    #: the official releases; ``psr-hf quantize`` keeps them)
    fp8_projection_names: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "out_proj")

    def __init__(self, model: nn.Module, max_len: int, *, gated_delta_kernel: bool | None = None,
                 attention_kernels: bool | None = None, dense_fp8: bool | None = None):
        # the family's options (DecodeLayers.family_options), passed on by build_layers; decided in
        # _build_attention, once the heads are known
        check_kernel_option(gated_delta_kernel, "gated_delta_kernel")
        check_kernel_option(attention_kernels, "attention_kernels")
        dense_fp8_module.check_option(dense_fp8)
        self._dense_fp8_option = dense_fp8
        self._kernel_option = gated_delta_kernel
        self._attention_kernels_option = attention_kernels
        super().__init__(model, max_len)

    def _build_attention(self) -> None:
        c = self.config
        self.layer_types = list(getattr(c, "layer_types", None) or [])
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"config.layer_types {self.layer_types!r}: expected one of {LINEAR!r} / {FULL!r} per "
                             f"decoder layer ({self.num_layers})")
        if FULL not in self.layer_types or LINEAR not in self.layer_types:
            raise ValueError("the Qwen3.5 engine layers expect both linear-attention and full-attention layers")
        self.num_heads = int(c.num_attention_heads)
        self.num_kv_heads = int(c.num_key_value_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // self.num_heads)
        self.rotary_dim = int(self.inv_freq.numel() * 2)
        if not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dimension {self.rotary_dim} is not within head_dim {self.head_dim}")
        self.v_heads, self.k_heads = int(c.linear_num_value_heads), int(c.linear_num_key_heads)
        self.k_dim, self.v_dim = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
        if self.v_heads % self.k_heads:
            raise ValueError(f"linear_num_value_heads {self.v_heads} is not a multiple of linear_num_key_heads "
                             f"{self.k_heads}")
        self.kernel = int(c.linear_conv_kernel_dim)
        self.conv_dim = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        self._attn = []
        for i, layer in enumerate(self.layers):
            if self.layer_types[i] == FULL:
                self._attn.append(self._full_refs(i, layer.self_attn))
            else:
                self._attn.append(self._linear_refs(i, layer.linear_attn))
        why = gemv_kernel.unsupported(self.device) or decode_attention_kernel.unsupported(
            self.device, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
        self.attention_kernels = choose_kernel(self._attention_kernels_option, "attention_kernels", self.device, why)
        self.dense_fp8 = self._read_dense_fp8(self._dense_fp8_option, {
            i: ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")) if t == FULL
            else ("linear_attn", self.fp8_projection_names) for i, t in enumerate(self.layer_types)})
        self._full = _FullStatic(self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim,
                                 self.head_dim ** -0.5, self.rope_scaling, self.attention_kernels, self.dense_fp8)
        self.gated_delta_kernel = self._choose_gated_delta_step()
        self._linear = _LinearStatic(self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.fused_projections,
                                     self.gated_delta_kernel, self.attention_kernels, self.dense_fp8)

    def _choose_gated_delta_step(self) -> bool:
        """Whether the Gated DeltaNet layers run the one-kernel step (the ``gated_delta_kernel`` option)."""
        if self._kernel_option is False:
            return False
        norm_dtype = next(a["norm"][0].dtype for t, a in zip(self.layer_types, self._attn) if t == LINEAR)
        why = unsupported(self.device, self.k_dim, self.v_dim, self.dtype, norm_dtype)
        return choose_kernel(self._kernel_option, "gated_delta_kernel", self.device, why)

    def _full_refs(self, i: int, a: torch.nn.Module) -> dict:
        refs = {**self._projections(i, a, ("q_proj", "k_proj", "v_proj", "o_proj")),
                **self._norms_of(i, a, ("q_norm", "k_norm"))}
        if refs["q_proj"][0].shape[0] != 2 * self.num_heads * self.head_dim:
            raise ValueError(f"layer {i} q_proj {tuple(refs['q_proj'][0].shape)}: expected the query and its gate "
                             f"({2 * self.num_heads * self.head_dim} rows)")
        refs["inv_freq"] = self.inv_freq
        return refs

    def _linear_refs(self, i: int, a: torch.nn.Module) -> dict:
        refs = {**self._projections(i, a, (*self.projection_names, "out_proj")), **self._norms_of(i, a, ("norm",))}
        conv = a.conv1d
        if tuple(conv.weight.shape) != (self.conv_dim, 1, self.kernel):
            raise ValueError(f"layer {i} conv1d weight {tuple(conv.weight.shape)}: expected "
                             f"({self.conv_dim}, 1, {self.kernel})")
        refs["conv_weight"] = self._ref(f"layers.{i}.conv1d", conv.weight)[:, 0]  # [conv_dim, kernel]
        refs["conv_bias"] = self._ref(f"layers.{i}.conv1d.bias", conv.bias)
        refs["A_log"] = self._ref(f"layers.{i}.A_log", a.A_log)
        refs["dt_bias"] = self._ref(f"layers.{i}.dt_bias", a.dt_bias)
        if getattr(a, "activation", "silu") != "silu":
            raise ValueError(f"layer {i}: the short convolution's activation {a.activation!r} is not silu")
        return refs

    def _layer_attention(self, layer: int) -> tuple:
        if self.layer_types[layer] == FULL:
            return _gated_attention, self._full, self._attn[layer]
        return _gated_delta_net, self._linear, self._attn[layer]

    def _build_kv_cache(self) -> HybridState:
        return HybridState(self.layer_types, self.max_len, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           conv_dim=self.conv_dim, kernel=self.kernel, value_heads=self.v_heads,
                           key_head_dim=self.k_dim, value_head_dim=self.v_dim, dtype=self.dtype, device=self.device)

    def _cache(self, layer: int) -> tuple:
        if self.layer_types[layer] == FULL:
            return self.kv.keys[layer], self.kv.values[layer], self.kv.slots, self.kv.locks[layer]
        return self.kv.conv[layer], self.kv.recurrent[layer]

    def begin_sequence(self) -> None:
        self.kv.clear_recurrent()

    def _transformers_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        # a full-attention layer caches the keys after the k-norm and the partial RoPE, [1, nKV, S, D]
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)

    @torch.no_grad()
    def write_transformers_layer(self, layer: int, cache_layer: Any, start: int) -> None:
        if self.layer_types[layer] == FULL:
            super().write_transformers_layer(layer, cache_layer, start)
            return
        if start != 0:
            raise ValueError("a Gated DeltaNet layer's state is written after a prompt from position 0 only")
        conv, recurrent = cache_layer.conv_states[0], cache_layer.recurrent_states[0]  # [1, conv_dim, kernel], [1, Hv, Dk, Dv]
        if conv is None or recurrent is None:
            raise RuntimeError(f"psr_hf.engine prefill: transformers' cache holds no Gated DeltaNet state for layer "
                               f"{layer} after the prompt")
        self.kv.conv[layer].copy_(conv[0])
        self.kv.recurrent[layer].copy_(recurrent[0])


@dataclass(frozen=True)
class _FullStatic:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    scaling: float
    rope_scaling: float
    kernels: bool  # the attention_kernels option
    fp8: bool = False  # the dense_fp8 option: q/k/v and o in FP8 ("<name>_fp8": (weight, scales) in the tensors)


@dataclass(frozen=True)
class _LinearStatic:
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    fused: bool  # Qwen3-Next's projections fused per key head (in_proj_qkvz, in_proj_ba)
    kernel: bool = False  # the step after the projections as one Triton kernel (else in torch)
    projections_kernel: bool = False  # the attention_kernels option: the projections by the fused GEMV
    fp8: bool = False  # the dense_fp8 option: the FP8 projections ("<name>_fp8") by the GEMV's FP8 form


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE (rotate-half) over the first ``rotary_dim`` dimensions of each head, the rest passed through."""
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin, False), x[..., rotary_dim:]), dim=-1)


def _gated_attention(s: _FullStatic, a: dict, x: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, slots: torch.Tensor, locks: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's gated full attention of one token: the query and its gate from one projection, per-head
    zero-centred q/k norms, partial RoPE, grouped-query attention over the static cache, the output times
    ``sigmoid(gate)``."""
    nH, nKV, D = s.num_heads, s.num_kv_heads, s.head_dim
    qg, k, v = projections(x, a, ("q_proj", "k_proj", "v_proj"), s.kernels, s.fp8)
    q, gate = torch.chunk(qg.view(nH, 2 * D), 2, dim=-1)
    q = zero_centred_rms_norm(q, *a["q_norm"])
    k = zero_centred_rms_norm(k.view(nKV, D), *a["k_norm"])
    v = v.view(nKV, D)
    cos, sin = cos_sin(position, a["inv_freq"], s.rope_scaling, q.dtype, False)
    q = _partial_rope(q, cos, sin, s.rotary_dim)
    k = _partial_rope(k, cos, sin, s.rotary_dim)
    write_kv(keys, position, k)
    write_kv(values, position, v)
    out = cache_attention(q, keys, values, position, slots, s.scaling, s.kernels, locks).reshape(1, nH * D)
    return output_projection(out * torch.sigmoid(gate.reshape(1, nH * D)), a["o_proj"], s.kernels,
                             a["o_proj_fp8"] if s.fp8 else None)


def _linear_inputs(s: _LinearStatic, a: dict, x: torch.Tensor) -> tuple:
    """A Gated DeltaNet layer's projections of one token: the convolution's input ``[conv_dim]`` (q, k, v, each
    head after head), the output gate ``z [Hv, Dv]``, and ``b`` and ``a`` ``[Hv]``. Fused projections hold, per
    key head, its q and k and the q/k/v/z (b/a) of the value heads that share it: reordered on the outputs, so
    the model's weights are read in place. With the attention kernels the projections run in the fused GEMV, in
    two launches with FP8 projections (the FP8 ones, then ``b``/``a`` in the model's dtype), else one."""
    kernels = s.projections_kernel
    if not s.fused:
        if s.fp8:
            qkv, z = projections(x, a, ("in_proj_qkv", "in_proj_z"), kernels, True)
            b, g_in = projections(x, a, ("in_proj_b", "in_proj_a"), kernels, False)
        else:
            qkv, z, b, g_in = projections(x, a, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), kernels, False)
        return qkv[0], z.view(s.v_heads, s.v_dim), b[0], g_in[0]
    group = s.v_heads // s.k_heads * s.v_dim
    if s.fp8:
        (qkvz,) = projections(x, a, ("in_proj_qkvz",), kernels, True)
        (ba,) = projections(x, a, ("in_proj_ba",), kernels, False)
    else:
        qkvz, ba = projections(x, a, ("in_proj_qkvz", "in_proj_ba"), kernels, False)
    qkvz = qkvz.view(s.k_heads, 2 * s.k_dim + 2 * group)
    q, k, v, z = torch.split(qkvz, (s.k_dim, s.k_dim, group, group), dim=-1)
    mixed = torch.cat((q.reshape(-1), k.reshape(-1), v.reshape(-1)))
    ba = ba.view(s.k_heads, 2 * (s.v_heads // s.k_heads))
    b, g_in = torch.chunk(ba, 2, dim=-1)
    return mixed, z.reshape(s.v_heads, s.v_dim), b.reshape(s.v_heads), g_in.reshape(s.v_heads)


def _gated_delta_net(s: _LinearStatic, a: dict, x: torch.Tensor, position: torch.Tensor, conv: torch.Tensor,
                     recurrent: torch.Tensor) -> torch.Tensor:
    """One token of a Gated DeltaNet layer, updating its convolution window and recurrent state in place:
    the short causal convolution (silu) over q, k and v, the L2-normalised q and k, the gated delta rule in
    float32 (decay ``exp(g)``, write strength ``beta``), the gated RMSNorm of the output and its projection. The
    step after the input projections is :mod:`~psr_hf.engine.gated_delta_kernel`'s: one Triton kernel where
    ``s.kernel`` (through its custom op), else its torch step, the reference the kernel is tested against."""
    mixed, z, b, g_in = _linear_inputs(s, a, x)
    step = torch.ops.psr_hf.gated_delta_step if s.kernel else gated_delta_step_reference
    h = step(mixed, z, b, g_in, conv, recurrent, a["conv_weight"], a["conv_bias"], a["A_log"], a["dt_bias"],
             *a["norm"])
    return output_projection(h, a["out_proj"], s.projections_kernel, a["out_proj_fp8"] if s.fp8 else None)


# The kernel as a custom op: torch.compile (the engine's compiled attention blocks, fullgraph) cannot trace into a
# Triton launch behind a Python wrapper; as an op that declares the two states it mutates, inductor calls it on the
# engine's own state buffers (no copies) and the CUDA graph captures its launch. Its first call compiles the kernel:
# the decoders make it before any capture, in GraphDecoder's warm-up (graphs.py, _capture: at least one eager run
# of every graph body, warmup >= 1) and TokenGraphDecoder's (_capture_token: one eager run of the token body).
@torch.library.custom_op("psr_hf::gated_delta_step", mutates_args=("conv", "recurrent"))
def _gated_delta_step_op(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, g_in: torch.Tensor,
                         conv: torch.Tensor, recurrent: torch.Tensor, conv_weight: torch.Tensor,
                         conv_bias: Optional[torch.Tensor], A_log: torch.Tensor, dt_bias: torch.Tensor,
                         norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    return gated_delta_step(mixed, z, b, g_in, conv, recurrent, conv_weight, conv_bias, A_log, dt_bias, norm_weight,
                            norm_eps)


@_gated_delta_step_op.register_fake
def _(mixed: torch.Tensor, z: torch.Tensor, *args: Any) -> torch.Tensor:
    return mixed.new_empty(1, z.shape[0] * z.shape[1])  # [1, Hv * Dv], a new tensor as the kernel returns
