"""What every grow mapping shares: the target dimensions (:class:`GrowTarget`), one model's dimensions
(:class:`Dims`), the writer of zero-padded tensors (:class:`Filler`: linear layers, and RMSNorms, whose input
scale keeps them exact), the placement of heads and rotary pairs, and the interface a family implements
(:class:`GrowFamily`). The rules behind them are in :mod:`psr_hf.assets.grow`'s docstring and the functions'.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import grow_family, grow_model_types

if TYPE_CHECKING:  # torch is imported where tensors are made: listing the presets needs none
    import torch


# ---------------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class GrowTarget:
    """The dimensions to grow a model of one family to (each family's preset: ``psr_hf.assets.grow.PRESETS``).

    Layers, experts, top-k, groups, scaling, scoring and vocabulary are not here: they are the small model's.
    Build a smaller target of the same code path (for tests) with ``dataclasses.replace(OLMOE_1B_7B, name=...,
    hidden_size=512, ...)`` or ``GrowTarget(...)``; every field is validated (``ValueError`` naming it).

    Attributes:
        name: a label (the presets' names are accepted by :func:`psr_hf.assets.grow.target_by_name`).
        family: the ``config.model_type`` it applies to (one with a grow mapping: ``olmoe``, ``deepseek_v3``).
        hidden_size, num_attention_heads, num_key_value_heads: the config fields of those names.
        expert_intermediate_size: one routed expert's intermediate size (OLMoE ``intermediate_size``,
            DeepSeek-V3 ``moe_intermediate_size``; DeepSeek-V3's shared experts get ``n_shared_experts`` times it).
        head_dim: OLMoE's head dimension (``hidden_size / num_attention_heads``: its ``q_norm`` spans the hidden
            size); None for DeepSeek-V3.
        dense_intermediate_size: DeepSeek-V3's ``intermediate_size`` (the dense first layers' MLP); None for OLMoE.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: DeepSeek-V3's multi-head latent
            attention (``q_lora_rank`` None: no query LoRA); None for OLMoE.
        shared_expert_intermediate_size, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim: Qwen3.5/3.6-MoE's gated shared expert and Gated DeltaNet layers (the config
            fields of those names); None for the others.
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
    shared_expert_intermediate_size: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None

    def __post_init__(self) -> None:
        def fail(why: str) -> None:
            raise ValueError(f"grow target {self.name!r}: {why}")

        family = grow_family(self.family)
        if family is None:
            fail(f"family={self.family!r}; grow supports {', '.join(grow_model_types())}")
        for field in dataclasses.fields(self):
            if field.name in ("name", "family"):
                continue
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                fail(f"{field.name}={value!r} must be an int >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        family.check_target(self, fail)

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


# ---------------------------------------------------------------------------------------------------- the model's dims
@dataclass(frozen=True)
class Dims:
    """One model's dimensions, read from its config (the small model's: its family's :meth:`GrowFamily.dims`) or
    a target (the grown model's)."""

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
    shared: int | None = None  # Qwen3.5/3.6 from here
    linear_k_heads: int | None = None
    linear_v_heads: int | None = None
    linear_k_dim: int | None = None
    linear_v_dim: int | None = None

    @classmethod
    def of_target(cls, t: GrowTarget) -> "Dims":
        return cls(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.expert_intermediate_size,
                   head_dim=t.head_dim, dense=t.dense_intermediate_size, kv_lora=t.kv_lora_rank,
                   q_lora=t.q_lora_rank, nope=t.qk_nope_head_dim, rope=t.qk_rope_head_dim, v=t.v_head_dim,
                   shared=t.shared_expert_intermediate_size, linear_k_heads=t.linear_num_key_heads,
                   linear_v_heads=t.linear_num_value_heads, linear_k_dim=t.linear_key_head_dim,
                   linear_v_dim=t.linear_value_head_dim)


# which target field each dimension comes from (for messages)
DIM_FIELDS = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "expert": "expert_intermediate_size", "head_dim": "head_dim", "dense": "dense_intermediate_size",
              "kv_lora": "kv_lora_rank", "q_lora": "q_lora_rank", "nope": "qk_nope_head_dim",
              "rope": "qk_rope_head_dim", "v": "v_head_dim", "shared": "shared_expert_intermediate_size",
              "linear_k_heads": "linear_num_key_heads", "linear_v_heads": "linear_num_value_heads",
              "linear_k_dim": "linear_key_head_dim", "linear_v_dim": "linear_value_head_dim"}
#: the target fields only Qwen3.5/3.6-MoE has (the other families refuse them)
QWEN_FIELDS = ("shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim")


# ---------------------------------------------------------------------------------------------------- filling
def _snap(x: float) -> float:
    """``x`` as the integer or integer reciprocal it equals up to rounding (1, 16, 1/4, ...), else ``x``."""
    for value, invert in ((x, False), (1.0 / x, True)):
        nearest = round(value)
        if nearest >= 1 and abs(value - nearest) <= 1e-9 * value:
            return 1.0 / nearest if invert else float(nearest)
    return x


class Filler:
    """Writes the grown model's tensors from the small one's and remembers which it wrote. ``stream_scale``: the
    factor the grown residual stream carries against the small one's (1 but where a family keeps the config's
    epsilon, :meth:`GrowFamily.grown_epsilon`): the embeddings and every projection that writes into the stream
    are scaled by it, and the norms that read the stream undo it."""

    def __init__(self, stream_scale: float = 1.0) -> None:
        self.filled: set[int] = set()
        self.stream_scale = stream_scale

    def put(self, dst: torch.Tensor, src: torch.Tensor, maps: Sequence[Any], scale: Any = 1.0) -> None:
        """``dst`` = zeros with ``src * scale`` at the mapped positions. ``maps``: per axis None (the first
        ``src.shape[axis]`` positions), a tensor of destination positions (one per source position), or a pair
        ``(source positions, destination positions)`` (to repeat source entries). ``scale``: a number or a tensor
        broadcastable to ``src``. Computed in float32, cast to ``dst``'s dtype."""
        import torch

        with torch.no_grad():  # dst may be a parameter that requires grad
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
        import torch

        rs = row_scale.reshape(-1, 1) if isinstance(row_scale, torch.Tensor) else row_scale
        cs = col_scale.reshape(1, -1) if isinstance(col_scale, torch.Tensor) else col_scale
        self.put(big.weight, small.weight, (rows, cols), rs * cs)
        if (big.bias is None) != (small.bias is None):
            raise ValueError("grow: a linear layer gained or lost its bias")
        if small.bias is not None:
            self.put(big.bias, small.bias, (rows,), row_scale)

    def mlp(self, big: Any, small: Any, hid: Any) -> None:
        """A gate/up/down MLP (a dense layer or shared experts): padded intermediate units are zero; its output
        goes into the residual stream (times the stream's scale)."""
        self.linear(big.gate_proj, small.gate_proj, None, hid)
        self.linear(big.up_proj, small.up_proj, None, hid)
        self.linear(big.down_proj, small.down_proj, hid, None, self.stream_scale)

    def norm(self, big: Any, small: Any, where: Any, r: float, scale: float = 1.0, *,
             zero_centred: bool = False) -> float:
        """An RMSNorm over a vector that grows ``r`` times (real entries at ``where``); returns the factor ``c``
        that its input must be scaled by.

        Over a zero-padded vector (``n`` real of ``n' = r n`` entries) the mean of squares is ``ms / r``. With the
        input scaled by ``c`` and the grown epsilon ``eps'``: ``c x / sqrt(c^2 ms / r + eps') = sqrt(r) x /
        sqrt(ms + r eps' / c^2)``, so ``c^2 = r eps' / eps`` and the weight ``w / sqrt(r)`` on the real entries
        give the small norm's output exactly (with ``r`` a power of 4 the scaling is exact in bfloat16 too).
        ``zero_centred``: a norm that multiplies by ``1 + weight`` (Qwen3.5/3.6's), whose real entries become
        ``(1 + w) scale / sqrt(r) - 1`` (exact in float32; rounded in bfloat16, where ``-1`` costs bits)."""
        import torch

        eps_small = _epsilon(small)
        eps_big = _epsilon(big)
        if eps_small is None or eps_big is None or eps_small <= 0:
            raise ValueError(f"grow: {type(small).__name__} is not an RMSNorm with a positive variance_epsilon")
        if zero_centred and scale / math.sqrt(r) != 1.0:
            effective = (1.0 + small.weight.detach().to(torch.float32)) * (scale / math.sqrt(r)) - 1.0
            self.put(big.weight, effective, (where,))
        else:
            self.put(big.weight, small.weight, (where,), scale / math.sqrt(r))
        return norm_input_scale(r, eps_small, eps_big)


def norm_input_scale(r: float, eps_small: float, eps_big: float) -> float:
    """The factor ``c`` an RMSNorm's input must carry when its vector grows ``r`` times and its epsilon goes from
    ``eps_small`` to ``eps_big`` (:meth:`Filler.norm`): ``c^2 = r eps_big / eps_small``."""
    return math.sqrt(_snap(r * eps_big / eps_small))


def _epsilon(norm: Any) -> float | None:
    value = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if value is None else float(value)


def head_positions(heads: int, dim_small: int, dim_big: int, inner: torch.Tensor | None = None) -> torch.Tensor:
    """Destination positions of ``heads`` heads of ``dim_small`` entries each: small entry ``h * dim_small + i``
    goes to ``h * dim_big + inner[i]`` (``inner``: default the identity)."""
    import torch

    inner = torch.arange(dim_small) if inner is None else inner
    return (torch.arange(heads).view(-1, 1) * dim_big + inner.view(1, -1)).reshape(-1)


def rope_map(small: int, big: int, interleaved: bool) -> torch.Tensor:
    """Where each of ``small`` rotary dimensions goes among ``big``: with ``rotate_half`` (dim ``i`` pairs with
    ``i + d/2``, frequency ``theta^(-2i/d)``) dim ``i`` goes to ``f i``, ``f = big / small`` (an integer), which
    keeps the pairs and the frequencies; DeepSeek's interleaved pairs ``(2j, 2j+1)`` map ``2j + e -> 2fj + e``."""
    import torch

    f = big // small
    i = torch.arange(small)
    return 2 * f * (i // 2) + i % 2 if interleaved else f * i


# ---------------------------------------------------------------------------------------------------- a family
class GrowFamily(abc.ABC):
    """How :func:`psr_hf.assets.grow.grow` maps one family exactly: what differs between families (attention,
    config fields, target fields, the preset). One subclass per module of this package, registered with
    ``@register_grow("model_type")``; the embeddings, norms over the hidden size, routers, experts, dense and
    shared MLPs are mapped by ``grow`` itself.

    A subclass states its facts in its class statement (``class OlmoeGrow(GrowFamily, model_name="OLMoE-1B-7B",
    rotary="head_dim", listing_order=1)``): ``model_name``, the real model whose shape the preset is (for
    messages); ``rotary``, the :class:`Dims` field of the rotary head dimension (each rotary pair moves to a pair
    of its frequency); ``listing_order``, where it comes in lists of families (:mod:`psr_hf._registry`)."""

    #: the family's default target, the real model's dimensions: set by the family's module after the class,
    #: since a target is validated by its family's (registered) mapping
    preset: GrowTarget
    #: whether the family's RMSNorms multiply by ``1 + weight`` (Qwen3.5/3.6) rather than ``weight``
    zero_centred_norms: bool = False
    model_name: str = ""
    rotary: str = "head_dim"
    listing_order: float = math.inf

    def __init_subclass__(cls, *, model_name: str = "", rotary: str = "head_dim", listing_order: float = math.inf,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.model_name, cls.rotary, cls.listing_order = model_name, rotary, listing_order

    @abc.abstractmethod
    def check_target(self, target: GrowTarget, fail: Callable[[str], None]) -> None:
        """Call ``fail(why)`` for a target field the family does not have, lacks or cannot take."""

    @abc.abstractmethod
    def dims(self, config: Any) -> Dims:
        """The dimensions of a model of this family from its config."""

    def check_model(self, small: Dims) -> None:
        """``ValueError`` for a model of this family that grow cannot map (default: none)."""

    def check_growth(self, small: Dims, big: Dims) -> None:
        """``ValueError`` for a growth from ``small`` to ``big`` this family cannot map exactly (default: none;
        the checks every family shares run after it)."""

    @abc.abstractmethod
    def attention(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, config: Any) -> None:
        """Fill one decoder layer's attention module ``big`` from ``small`` (dimensions ``s`` -> ``b``; the
        small model's ``config``)."""

    def token_mixer(self, fill: Filler, big_layer: Any, small_layer: Any, s: Dims, b: Dims, config: Any) -> None:
        """Fill one decoder layer's token mixer (default: its ``self_attn``, :meth:`attention`)."""
        self.attention(fill, big_layer.self_attn, small_layer.self_attn, s, b, config)

    def grown_epsilon(self, eps: float, r_hidden: float) -> float:
        """The grown config's ``rms_norm_eps`` (default ``eps / r_hidden``: the hidden norms stay exact on the
        unscaled residual stream). A family whose other norms read ``rms_norm_eps`` too keeps ``eps`` and scales
        the residual stream instead (:attr:`Filler.stream_scale`)."""
        return eps / r_hidden

    def shared_expert(self, fill: Filler, big_block: Any, small_block: Any, hid: Any) -> bool:
        """Fill a MoE block's shared experts a family of its own has; False where it has none (DeepSeek-V3's
        ``shared_experts``, a plain gate/up/down MLP, grow maps itself)."""
        return False

    @abc.abstractmethod
    def update_config(self, data: dict[str, Any], s: Dims, b: Dims) -> None:
        """Write the grown config's family fields into ``data``: the small config's ``to_dict()`` with the hidden
        size, heads and hidden norms' epsilon already grown."""
