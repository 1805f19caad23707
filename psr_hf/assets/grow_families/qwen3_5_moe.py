"""Qwen3.5/3.6-MoE's grow mapping (``Qwen3_5MoeForCausalLM``) and its preset :data:`QWEN3_6_35B_A3B`.

What grows: the hidden size, the heads of both kinds of layer, the routed and the shared experts' intermediate
sizes. What must not: the head dimensions (``head_dim``, ``linear_key_head_dim``, ``linear_value_head_dim``),
because three things of this family read them and cannot be rescaled exactly: the Gated DeltaNet's queries are
L2-normalised and then divided by ``sqrt(linear_key_head_dim)``; the gated RMSNorm over the value head and the
per-head q/k norms share ``config.rms_norm_eps`` with the hidden norms; and the partial RoPE covers a fraction of
the head dimension. So a small model to grow has the real model's head dimensions (the ``qwen36-routing`` recipe).

Because every norm reads ``rms_norm_eps``, the grown config keeps the small one's epsilon, and the residual stream
carries ``sqrt(hidden ratio)`` instead (:meth:`GrowFamily.grown_epsilon`): the embeddings and every projection
into the stream (attention and Gated DeltaNet outputs, routed and shared experts) are scaled by it, and the
zero-centred hidden norms (``1 + weight``) undo it. Extra heads compute zero: their projections are zero, so
their queries, keys, values, gates and convolution channels are zero, and their output columns too. Grouped heads
(query heads per key/value head; value heads per key head of a Gated DeltaNet layer) follow OLMoE's rule: each
small key head is repeated where the target groups fewer heads per key head. The dimensions of the preset are
transformers' ``Qwen3_5MoeTextConfig`` defaults, which are Qwen3.6-35B-A3B's (and Qwen3.5-35B-A3B's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import register_grow
from .base import Dims, Filler, GrowFamily, GrowTarget, head_positions

if TYPE_CHECKING:
    import torch

_NOT_QWEN = ("dense_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim")
_REQUIRED = ("head_dim", "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim")


def _grouped(small_groups: int, big_groups: int, small_keys: int) -> torch.Tensor:
    """Which small key head each big key head holds: small key head ``j`` repeated ``small_groups / big_groups``
    times (a big group is a part of a small one), for the first ``small_keys * repeat`` big key heads."""
    import torch

    return torch.repeat_interleave(torch.arange(small_keys), small_groups // big_groups)


def _channels(heads: torch.Tensor, dim: int, big_dim: int | None = None) -> torch.Tensor:
    """Channel indices ``h * dim + i`` of the heads ``heads`` (``big_dim``: the stride, default ``dim``)."""
    import torch

    stride = dim if big_dim is None else big_dim
    return (heads.view(-1, 1) * stride + torch.arange(dim).view(1, -1)).reshape(-1)


@register_grow("qwen3_5_moe_text")
class Qwen35MoeGrow(GrowFamily, model_name="Qwen3.6-35B-A3B", rotary="head_dim", listing_order=3):
    """Qwen3.5/3.6-MoE: Gated DeltaNet and gated full-attention layers, zero-centred norms, a gated shared
    expert; head dimensions kept."""

    zero_centred_norms = True
    #: how messages name the family, and its models' head dimensions
    target_label, heads_label = "Qwen3.5/3.6-MoE", "Qwen3.5/3.6"

    def check_target(self, target: GrowTarget, fail: Callable[[str], None]) -> None:
        extra = [f for f in _NOT_QWEN if getattr(target, f) is not None]
        if extra:
            fail(f"{', '.join(extra)} are DeepSeek-V3 fields; leave them None for a {self.target_label} target")
        missing = [f for f in _REQUIRED if getattr(target, f) is None]
        if missing:
            fail(f"{', '.join(missing)} required for a {self.target_label} target")
        if target.linear_num_value_heads % target.linear_num_key_heads:
            fail(f"linear_num_value_heads={target.linear_num_value_heads} is not a multiple of "
                 f"linear_num_key_heads={target.linear_num_key_heads}")

    def dims(self, config: Any) -> Dims:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Dims(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                    config.moe_intermediate_size, head_dim=head_dim, shared=config.shared_expert_intermediate_size,
                    linear_k_heads=config.linear_num_key_heads, linear_v_heads=config.linear_num_value_heads,
                    linear_k_dim=config.linear_key_head_dim, linear_v_dim=config.linear_value_head_dim)

    def grown_epsilon(self, eps: float, r_hidden: float) -> float:
        return eps  # the head norms read it too: the residual stream is scaled instead

    def check_growth(self, s: Dims, b: Dims) -> None:
        kept = [(f, getattr(s, k), getattr(b, k)) for k, f in (("head_dim", "head_dim"),
                                                               ("linear_k_dim", "linear_key_head_dim"),
                                                               ("linear_v_dim", "linear_value_head_dim"))
                if getattr(s, k) != getattr(b, k)]
        if kept:
            raise ValueError(f"grow keeps {self.heads_label}'s head dimensions (the L2-normalised Gated DeltaNet "
                             "queries, the head norms' shared epsilon and the partial RoPE read them): "
                             + "; ".join(f"target {f}={big} against the model's {small}" for f, small, big in kept)
                             + "; grow a model with the target's head dimensions")
        ratio_s, ratio_b = s.linear_v_heads // s.linear_k_heads, b.linear_v_heads // b.linear_k_heads
        if ratio_s % ratio_b:
            raise ValueError(f"grow: the target has {ratio_b} value heads per key head of a Gated DeltaNet layer, "
                             f"the model {ratio_s}; the model's must be a multiple of the target's (key heads can be "
                             "repeated, not merged)")

    def token_mixer(self, fill: Filler, big_layer: Any, small_layer: Any, s: Dims, b: Dims, config: Any) -> None:
        if getattr(small_layer, "self_attn", None) is not None:
            self.attention(fill, big_layer.self_attn, small_layer.self_attn, s, b, config)
        else:
            self._gated_delta_net(fill, big_layer.linear_attn, small_layer.linear_attn, s, b)

    def attention(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, config: Any) -> None:
        """Gated attention: ``q_proj`` holds each head's query then its gate (``2 head_dim`` rows a head); small
        query head ``h`` is big head ``h``, each small key/value head is repeated ``g / g'`` times."""
        import torch

        D = s.head_dim
        heads = torch.arange(s.heads)
        q_rows = _channels(heads, 2 * D, 2 * D)  # the query and the gate of each small head, at its big head
        kv = _channels(_grouped(s.heads // s.kv_heads, b.heads // b.kv_heads, s.kv_heads), D)  # source channels
        kv_to = torch.arange(kv.numel())  # the first big key/value heads
        fill.linear(big.q_proj, small.q_proj, q_rows, None)
        fill.linear(big.k_proj, small.k_proj, (kv, kv_to), None)
        fill.linear(big.v_proj, small.v_proj, (kv, kv_to), None)
        fill.linear(big.o_proj, small.o_proj, None, head_positions(s.heads, D, D), fill.stream_scale)
        for name in ("q_norm", "k_norm"):  # over the head dimension, which is kept: copied
            if fill.norm(getattr(big, name), getattr(small, name), None, 1.0, zero_centred=True) != 1.0:
                raise ValueError(f"grow: the {name} epsilon of the grown model is not the small model's")

    def _gated_delta_net(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims) -> None:
        """One Gated DeltaNet layer. Its channels are ``[q (key heads) | k (key heads) | v (value heads)]``,
        through the input projection and the depthwise convolution alike; ``z``, ``b``, ``a``, ``A_log`` and
        ``dt_bias`` are per value head; small value head ``v`` is big value head ``v``."""
        import torch

        Dk, Dv = s.linear_k_dim, s.linear_v_dim
        keys = _grouped(s.linear_v_heads // s.linear_k_heads, b.linear_v_heads // b.linear_k_heads,
                        s.linear_k_heads)  # the small key head of each of the first big key heads
        n = keys.numel()
        big_key_block = b.linear_k_heads * Dk
        qkv_from = torch.cat((_channels(keys, Dk), s.linear_k_heads * Dk + _channels(keys, Dk),
                              2 * s.linear_k_heads * Dk + torch.arange(s.linear_v_heads * Dv)))
        qkv_to = torch.cat((torch.arange(n * Dk), big_key_block + torch.arange(n * Dk),
                            2 * big_key_block + torch.arange(s.linear_v_heads * Dv)))
        self._input_projections(fill, big, small, s, b, keys, (qkv_from, qkv_to))
        fill.put(big.conv1d.weight, small.conv1d.weight, ((qkv_from, qkv_to), None, None))
        if small.conv1d.bias is not None:
            fill.put(big.conv1d.bias, small.conv1d.bias, ((qkv_from, qkv_to),))
        values = torch.arange(s.linear_v_heads)
        fill.put(big.A_log, small.A_log, (values,))
        fill.put(big.dt_bias, small.dt_bias, (values,))
        if fill.norm(big.norm, small.norm, None, 1.0) != 1.0:  # over the value head (kept), weight x (not 1 + w)
            raise ValueError("grow: the gated norm's epsilon of the grown model is not the small model's")
        fill.linear(big.out_proj, small.out_proj, None, None, fill.stream_scale)

    def _input_projections(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, keys: torch.Tensor,
                           qkv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A Gated DeltaNet layer's input projections: ``in_proj_qkv`` on the channels ``qkv`` (the convolution's:
        source and destination), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` per value head. ``keys``: the
        small key head of each of the first big key heads."""
        import torch

        values = torch.arange(s.linear_v_heads)
        fill.linear(big.in_proj_qkv, small.in_proj_qkv, qkv, None)
        fill.linear(big.in_proj_z, small.in_proj_z, None, None)
        fill.linear(big.in_proj_b, small.in_proj_b, values, None)
        fill.linear(big.in_proj_a, small.in_proj_a, values, None)

    def shared_expert(self, fill: Filler, big_block: Any, small_block: Any, hid: Any) -> bool:
        shared = getattr(small_block, "shared_expert", None)
        if shared is None:
            return False
        fill.mlp(big_block.shared_expert, shared, hid)
        fill.linear(big_block.shared_expert_gate, small_block.shared_expert_gate, None, hid)  # reads the normed input
        return True

    def update_config(self, data: dict[str, Any], s: Dims, b: Dims) -> None:
        data.update(moe_intermediate_size=b.expert, shared_expert_intermediate_size=b.shared,
                    linear_num_key_heads=b.linear_k_heads, linear_num_value_heads=b.linear_v_heads,
                    head_dim=b.head_dim, linear_key_head_dim=b.linear_k_dim, linear_value_head_dim=b.linear_v_dim)


#: Qwen3.6-35B-A3B's dimensions: transformers' ``Qwen3_5MoeTextConfig`` defaults (40 layers, 256 experts of
#: 512, top-8, three Gated DeltaNet layers to one gated attention layer; layers, experts and vocabulary are the
#: grown model's own, as for every family)
QWEN3_6_35B_A3B = Qwen35MoeGrow.preset = GrowTarget(
    name="qwen3.6-35b-a3b", family="qwen3_5_moe_text", hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, expert_intermediate_size=512, shared_expert_intermediate_size=512,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
)
