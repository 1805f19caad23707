"""The engine's per-layer decode functions over a loaded transformers model's own weights: :class:`DecodeLayers`,
the base every family's layers derive from (:mod:`psr_hf.engine.families`, one module per family, where
:func:`~psr_hf.engine.families.build_layers` picks the family registered for the model's ``config.model_type``).
The base names no family and never imports their package.

The base holds what every family shares: **references** to the model's parameters (nothing is copied; it adds
the static KV cache, one ``[2E, H]`` stack of two router weights per MoE layer that has a next MoE layer, and
a few vectors), the static buffers, the routers and pre-gate, dense and shared MLPs, the final norm and lm_head,
and the eager reference decode step with exact routing. A family adds its attention function and KV cache
layout. Every function works on one token (batch 1) and is capturable in a CUDA graph as written; the capture
rules, the router contract and the KV layouts are in docs/engine.md ("Inside the engine").
"""

from __future__ import annotations

import abc
import inspect
import logging
import types
from collections.abc import Container
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from psr_hf.patches import get_patch
from psr_hf.patches.base import ArchitecturePatch
from .attention import StaticKVCache, attention_block, check_rope, norm_params, rms_norm
from .moe import SoftmaxRouting

logger = logging.getLogger(__name__)


class RouterStacks(Protocol):
    """Where the layers read a stacked router weight again when a router changed (:meth:`DecodeLayers.sync_routers`):
    a controller's :class:`~psr_hf.hf.decode_handle.DecodeHandle`."""

    def stacked_weight(self, layer: int) -> torch.Tensor:
        """``[2E, H]``: MoE layer ``layer``'s router weight over what ranks the next layer's prefetches."""


@dataclass(frozen=True)
class DecodeBuffers:
    """The static buffers of :meth:`DecodeLayers.decode_step_reference` (and the shapes the graphs will use):
    allocated once, rewritten in place every step."""

    token: torch.Tensor  # [1] int64, followed in memory by
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
    shared_gate: nn.Module | None  # a sigmoid gate on the shared expert's output (Qwen3.5/3.6), or None
    predicted: bool = False  # the pre-gate half of ``stacked`` is a learned predictor's (softmax priorities)
    source: tuple = ()  # the router weights' versions and addresses when ``stacked`` was built (see sync_routers)


def _weight(module: nn.Module) -> torch.Tensor:
    """``module.weight`` without ``Module.__getattr__`` (about 1 us a call)."""
    weight = module._parameters.get("weight")
    return module.weight if weight is None else weight


def _router_source(router: nn.Module, following: nn.Module | None) -> tuple:
    """What an in-place change (``_version``), a new ``Parameter`` (identity) or a replacement of its data
    (``data_ptr``) of the router weights that ``stacked`` is built from changes: one ``(parameters, weight,
    version, address)`` entry per weight (:func:`_unchanged` reads them before every step). ``parameters`` is the
    module's parameter dict, or None where its weight is not a registered parameter (then never unchanged)."""
    entries = []
    for module in (router, following):
        if module is None:
            continue
        weight = _weight(module)
        params = module._parameters if module._parameters.get("weight") is weight else None
        entries.append((params, weight, weight._version, weight.data_ptr()))
    return tuple(entries)


def _unchanged(entries: tuple) -> bool:
    """Whether every weight of :func:`_router_source`'s ``entries`` is still the one it read, unchanged (a tight
    loop of attribute reads: it runs before every step, on the host's path between two tokens)."""
    for params, weight, version, address in entries:
        if params is None:
            return False
        now = params.get("weight")
        if now is not weight or now._version != version or now.data_ptr() != address:
            return False
    return True


def _all_entries(routers: dict) -> tuple:
    """Every router's :func:`_router_source` entries in one tuple (one :func:`_unchanged` pass checks them all).
    A weight two routers read (a router is the one before it's pre-gate) is checked once where both read it at
    the same version and address, and twice where they do not (one of them was stacked again since)."""
    entries: dict[tuple, tuple] = {}
    for r in routers.values():
        for entry in r.source:
            params, weight, version, address = entry
            entries.setdefault((id(params), id(weight), version, address), entry)
    return tuple(entries.values())


# ---------------------------------------------------------------------------------------------------- base class
class DecodeLayers(abc.ABC):
    """The per-layer decode functions of one family over ``model``'s own weights, a static KV cache of
    ``max_len`` positions and the static buffers of the reference step (capture rules and router contract:
    docs/engine.md). Build with :func:`psr_hf.engine.families.build_layers`. A family implements
    :meth:`_build_attention`, :meth:`_build_kv_cache` and :meth:`_cache` and sets ``_attention_fn`` / ``_static``
    (:class:`psr_hf.engine.families.EngineFamily`); an option of its own is a keyword-only argument of its
    constructor (:meth:`family_options`)."""

    #: the family's ``attention_kernels`` option as chosen (a family that has the kernels sets it): with them the
    #: router's product runs in the fused GEMV too (:meth:`router_logits`)
    attention_kernels: bool = False

    def __init__(self, model: nn.Module, max_len: int):
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        self.model = model
        self.model_type: str = model.config.model_type
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.family = get_patch(self.model_type)(model)
        self.decoder = self.family.decoder()
        self.max_len = max_len
        self._refs: dict[str, torch.Tensor] = {}
        self._ref_places: dict[str, tuple] = {}  # (data_ptr, dtype, device) of each when the engine read it
        self._owned: dict[str, torch.Tensor] = {}
        self._gated_mlps: dict[str, nn.Module] = {}  # the dense and shared MLPs by name (_ref_mlp)
        self._fp8_mlps: dict[int, tuple] = {}  # id(mlp) -> FP8 (weight, scales) of gate, up, down (dense_fp8)

        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(model).__name__} has no input/output embeddings: not a causal LM")
        self.embed_weight = self._ref("embed", embed.weight)
        self.device, self.dtype = self.embed_weight.device, self.embed_weight.dtype
        self.hidden_size = self.embed_weight.shape[1]
        self.final_norm_weight, self.final_norm_eps = norm_params(self.decoder.norm, "final norm")
        self._ref("final_norm", self.final_norm_weight)
        self.lm_head_weight = self._ref("lm_head", head.weight)
        self.lm_head_bias = self._ref("lm_head.bias", getattr(head, "bias", None))

        self.layers = list(self.decoder.layers)
        self.num_layers = len(self.layers)
        self._norms = []
        for i, layer in enumerate(self.layers):
            a = norm_params(layer.input_layernorm, f"layer {i} input norm")
            b = norm_params(layer.post_attention_layernorm, f"layer {i} post-attention norm")
            self._ref(f"layers.{i}.input_norm", a[0])
            self._ref(f"layers.{i}.post_norm", b[0])
            self._norms.append((a, b))

        self._build_rope()
        self._routers = self._build_routers()
        self._router_entries = _all_entries(self._routers)
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

    @classmethod
    def family_options(cls) -> dict[str, Any]:
        """The options this family takes, with their defaults: the keyword-only arguments of its constructor
        (DeepSeek-V3's ``absorb_mla``; none for the base)."""
        parameters = inspect.signature(cls.__init__).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}

    @classmethod
    def from_model(cls, model: nn.Module, max_len: int, **options: Any) -> "DecodeLayers":
        """What :func:`~psr_hf.engine.families.build_layers` calls: this family's layers over ``model`` with
        ``options``, each one of :meth:`family_options` (``ValueError`` naming the family and what it takes for
        any other), the defaults for the rest."""
        takes = cls.family_options()
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise ValueError(f"the {cls.__name__} engine layers take no option {', '.join(map(repr, unknown))}; "
                             + (f"their options: {', '.join(takes)}" if takes else "they take none"))
        return cls(model, max_len, **options)

    # ------------------------------------------------------------------ bookkeeping
    def _ref(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Record ``tensor`` (a model parameter or buffer, or a view of one) as used in place."""
        if tensor is not None:
            self._refs[name] = tensor
            self._ref_places[name] = (tensor.data_ptr(), tensor.dtype, tensor.device)
        return tensor

    def _projections(self, layer: int, module: nn.Module, names: tuple[str, ...]) -> dict[str, tuple]:
        """``{name: (weight, bias or None)}`` of the linear layers ``names`` of ``module`` (decoder layer
        ``layer``'s), recorded as used in place."""
        refs = {}
        for name in names:
            linear = getattr(module, name)
            refs[name] = (self._ref(f"layers.{layer}.{name}", linear.weight),
                          self._ref(f"layers.{layer}.{name}.bias", linear.bias))
        return refs

    def _read_dense_fp8(self, option: bool | None, projections: dict[int, tuple[str, tuple[str, ...]]]) -> bool:
        """Whether the projections run in block-wise FP8 (the family's ``dense_fp8`` option,
        :mod:`psr_hf.engine.dense_fp8`, after its attention kernels are chosen): ``projections`` names, per decoder
        layer, the module of the layer and its linears that the checkpoint stores in FP8. Where they do, the
        layer's attention tensors gain ``"<name>_fp8": (e4m3 weight, scales)``, tensors of the engine's own read
        from the checkpoint, and so do the dense and shared MLPs (:meth:`_mlp`)."""
        from .dense_fp8 import choose_checkpoint, read_projections

        checkpoint = choose_checkpoint(option, self.model, self.attention_kernels)
        if checkpoint is None:
            return False
        for i, (module, names) in projections.items():
            owner = getattr(self.layers[i], module)
            linears = {name: getattr(owner, name) for name in names}
            for name, (weight, scale) in read_projections(checkpoint, self.model, linears).items():
                self._attn[i][f"{name}_fp8"] = (self._own(f"layers.{i}.{name}.fp8", weight),
                                                self._own(f"layers.{i}.{name}.fp8_scale", scale))
        for prefix, mlp in self._gated_mlps.items():
            linears = {name: getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")}
            read = read_projections(checkpoint, self.model, linears)
            self._fp8_mlps[id(mlp)] = tuple((self._own(f"{prefix}.{name}.fp8", read[name][0]),
                                             self._own(f"{prefix}.{name}.fp8_scale", read[name][1]))
                                            for name in linears)
        logger.info("psr_hf engine: the dense projections of %d layers in FP8 from %s", len(projections),
                    checkpoint.folder)
        return True

    def _norms_of(self, layer: int, module: nn.Module, names: tuple[str, ...]) -> dict[str, tuple]:
        """``{name: (weight, eps)}`` of the RMSNorms ``names`` of ``module``, recorded as used in place."""
        refs = {}
        for name in names:
            refs[name] = norm_params(getattr(module, name), f"layer {layer} {name}")
            self._ref(f"layers.{layer}.{name}", refs[name][0])
        return refs

    def _own(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self._owned[name] = tensor
        return tensor

    def referenced_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors (parameters, buffers, views of them) the functions use in place."""
        return dict(self._refs)

    def check_references(self, offloaded: bool) -> None:
        """At a sequence start: ``RuntimeError`` if a model tensor the engine reads in place now has other memory
        or another dtype than when the engine was built (``model.to(dtype)``, a move), where the engine would
        read stale memory (edits in place are read as they are). The experts of an ``offloaded`` model are left
        out: the offload copies them into its own slots."""
        for name, tensor in self._refs.items():
            if offloaded and ".experts." in name:
                continue
            was = self._ref_places[name]
            now = (tensor.data_ptr(), tensor.dtype, tensor.device)
            if now != was:
                raise RuntimeError(
                    f"the model's {name} changed after psr_hf's engine was built on it ({was[1]} on {was[2]} -> "
                    f"{now[1]} on {now[2]}, or new memory: model.to(), a moved or converted model); the engine reads "
                    "the tensors it was built on: attach the engine again (psr_hf.engine.detach, then "
                    "psr_hf.engine.attach) or build a new decoder")

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
        self.rope_type = check_rope(self.config, self.model_type)
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
        # the family ranks the raw logits (softmax routers: ArchitecturePatch.selection_scores, not overridden)
        self._raw_logit_scores = type(self.family).selection_scores is ArchitecturePatch.selection_scores
        # and weighs the selected experts by the softmax (ArchitecturePatch.execution_weights): one function of
        # tensors and a flag (softmax_execution_weights), which compile_routing compiles once for every layer
        self._softmax_weights = type(self.family).execution_weights is ArchitecturePatch.execution_weights
        self._weights_fn: Any = softmax_execution_weights
        self.router_dtype = (self.family.stacked_router_weight(moe[0].router.weight[:1].detach(),
                                                               moe[0].router.weight[:1].detach()).dtype
                             if moe else self.dtype)
        # a model patched with RoutingConfig(prefetch="predictor"): the pre-gate half of each stack is the
        # controller's (the predictor's B A), the same tensor the transformers path multiplies
        ctl = getattr(self.model, "_psr_hf_controller", None)
        predictor = getattr(ctl, "predictor", None)
        self.predictor = predictor  # what the stacks were built with (check_prefetch_source)
        # RoutingConfig.prefetch_distance D: layer n's stack holds router n + D, whose pre-gate it ranks
        self.distance = ctl.config.prefetch_distance if ctl is not None else 1
        for n, m in enumerate(moe):
            following = moe[n + self.distance].router if n + self.distance < len(moe) else None
            if following is not None and predictor is not None:
                stacked = self._own(f"layers.{m.decoder_index}.stacked_router",
                                    ctl.decode_handle().stacked_weight(n).detach())
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
            # DeepSeek-V3's shared_experts; Qwen3.5/3.6's shared_expert, with its sigmoid gate
            shared = getattr(m.block, "shared_experts", None) or getattr(m.block, "shared_expert", None)
            shared_gate = getattr(m.block, "shared_expert_gate", None) if shared is not None else None
            if shared is not None:
                self._ref_mlp(f"layers.{m.decoder_index}.shared", shared)
            if shared_gate is not None:
                self._ref(f"layers.{m.decoder_index}.shared_gate", shared_gate.weight)
            routers[m.decoder_index] = _Router(n, m.block, m.router, following, stacked, gate_up, down, transposed,
                                               experts.act_fn, shared, shared_gate, predicted=predictor is not None,
                                               source=_router_source(m.router, following))
        return routers

    def sync_routers(self, stacks: RouterStacks, moe_layers: Container[int] | None = None) -> None:
        """Before a step: a router weight changed in place or replaced since the engine read it
        (``load_state_dict``, ``param.copy_``, a new ``Parameter``) is stacked again into the same memory, so the
        captured graphs route with the new weights; the last MoE layer's router, which the graphs read where it
        lives, must keep its memory (``RuntimeError`` otherwise). ``stacks``: where the fresh stacks come from (the
        controller's, kept by the same versions); ``moe_layers``: only the routers of these MoE layers (each before
        the first graph that reads it; default all)."""
        if _unchanged(self._router_entries):
            return
        for r in self._routers.values():
            if moe_layers is not None and r.moe_index not in moe_layers:
                continue
            if _unchanged(r.source):
                continue
            source = _router_source(r.router, r.following)
            if r.following is None:
                if r.router.weight.data_ptr() != r.stacked.data_ptr() or r.router.weight.dtype != r.stacked.dtype:
                    raise RuntimeError(
                        f"the router weight of MoE layer {r.moe_index} was replaced (new memory or dtype) after the "
                        "engine was built; the engine reads it where it was: attach the engine again "
                        "(psr_hf.engine.detach, then psr_hf.engine.attach) or build a new decoder")
            else:
                fresh = stacks.stacked_weight(r.moe_index).detach()
                if fresh.shape != r.stacked.shape:
                    raise RuntimeError(
                        f"the router weights of MoE layer {r.moe_index} changed shape after the engine was built "
                        f"({tuple(r.stacked.shape)} -> {tuple(fresh.shape)}): build a new decoder")
                r.stacked.copy_(fresh.to(device=r.stacked.device, dtype=r.stacked.dtype))
            logger.info("psr_hf engine: the router weights of MoE layer %d changed; the engine routes with the new "
                        "ones", r.moe_index)
            r.source = source
        self._router_entries = _all_entries(self._routers)

    def _ref_mlp(self, name: str, mlp: nn.Module) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = getattr(mlp, proj, None)
            if module is None:
                raise ValueError(f"{name}: {type(mlp).__name__} is not a gated MLP (gate_proj/up_proj/down_proj)")
            self._ref(f"{name}.{proj}", module.weight)
            self._ref(f"{name}.{proj}.bias", module.bias)
        self._gated_mlps[name] = mlp

    def _build_buffers(self) -> DecodeBuffers:
        H, dev, dt = self.hidden_size, self.device, self.dtype
        width = max((self.router_width(i) for i in self._routers), default=1)
        rdt = self.router_dtype
        K = max(self.top_k, 1)
        inputs = torch.zeros(2, dtype=torch.int64, device=dev)  # token and position side by side: one copy writes both
        return DecodeBuffers(
            token=inputs[0:1],
            position=inputs[1],
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

    def _prompt_kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The KV rows of a block of positions: ``(keys, values or None)`` in the cache's layout ``[S, ...]``, from
        the normed attention input ``x [S, H]`` at ``positions [S]`` (what the attention function writes for one
        token). A family that does not define it prefills token by token (:attr:`batched_prefill`)."""
        raise NotImplementedError(f"the {self.model_type} engine layers define no _prompt_kv: no batched prefill")

    @property
    def batched_prefill(self) -> bool:
        """Whether this family writes the KV rows of a prompt block (:meth:`_prompt_kv`, or from transformers'
        cache: :attr:`kv_from_transformers`), so that a prompt can run as one block (:mod:`psr_hf.engine.prefill`)."""
        return type(self)._prompt_kv is not DecodeLayers._prompt_kv or self.kv_from_transformers

    @torch.no_grad()
    def write_prompt_kv(self, layer: int, x: torch.Tensor, start: int) -> None:
        """Write the KV rows of the positions ``start .. start + S - 1`` of decoder layer ``layer`` from its normed
        attention input ``x [S, H]`` (the batched prefill, :mod:`psr_hf.engine.prefill`)."""
        self._check_layer(layer)
        S = int(x.shape[0])
        if x.ndim != 2 or x.shape[1] != self.hidden_size or not 0 <= start <= self.max_len - S:
            raise ValueError(f"write_prompt_kv: x must be [S, {self.hidden_size}] with start + S <= max_len "
                             f"{self.max_len}; got {tuple(x.shape)} at start {start}")
        positions = torch.arange(start, start + S, dtype=torch.int64, device=self.device)
        keys, values = self._prompt_kv(layer, x.to(self.dtype), positions)
        self._write_rows(layer, keys, values, start)

    def _transformers_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        """The KV rows of a block in the cache's layout ``[S, ...]`` from what transformers' attention stored in its
        cache (``keys``, ``values`` ``[1, heads, S, dim]``), where the engine's cache holds the same tensors (then
        the prefill reads them instead of computing them again: :attr:`kv_from_transformers`)."""
        raise NotImplementedError(f"the {self.model_type} engine's KV cache is not transformers' layout")

    @property
    def kv_from_transformers(self) -> bool:
        """Whether the batched prefill takes the KV rows from transformers' cache (:meth:`_transformers_kv`)."""
        return type(self)._transformers_kv is not DecodeLayers._transformers_kv

    @torch.no_grad()
    def write_transformers_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write the KV rows of the positions ``start .. start + S - 1`` of decoder layer ``layer`` from
        transformers' cache tensors ``[1, heads, S, dim]`` (:meth:`_transformers_kv`)."""
        self._check_layer(layer)
        S = int(keys.shape[-2])
        if keys.ndim != 4 or keys.shape[0] != 1 or not 0 <= start <= self.max_len - S:
            raise ValueError(f"write_transformers_kv: keys must be [1, heads, S, dim] with start + S <= max_len "
                             f"{self.max_len}; got {tuple(keys.shape)} at start {start}")
        self._write_rows(layer, *self._transformers_kv(layer, keys, values), start)

    @torch.no_grad()
    def write_transformers_layer(self, layer: int, cache_layer: Any, start: int) -> None:
        """Write what transformers' cache layer ``cache_layer`` (of decoder layer ``layer``) holds after a prompt
        block from ``start``: its keys and values (:meth:`write_transformers_kv`); a family with other state per
        layer (the hybrid families' recurrent states) overrides it."""
        self.write_transformers_kv(layer, cache_layer.keys, cache_layer.values, start)

    def _write_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor | None, start: int) -> None:
        S = int(keys.shape[0])
        self.kv.keys[layer][start:start + S].copy_(keys.reshape(S, *self.kv.keys[layer].shape[1:]))
        if self.kv.separate_values:
            self.kv.values[layer][start:start + S].copy_(values.reshape(S, *self.kv.values[layer].shape[1:]))

    # the family's attention: a module-level function ``(static, tensors, x, position, *cache) -> [1, H]`` (the
    # output after o_proj of the normed input ``x``; it writes the cache at ``position``) and its constants
    _attention_fn: Any = None
    _static: Any = None
    #: the family's RMSNorm (inputs, post-attention, final): transformers' by default
    norm_fn: Any = staticmethod(rms_norm)

    def compile_blocks(self, enabled: bool = True, **options: Any) -> None:
        """Run :meth:`attention_block` through ``torch.compile`` (``fullgraph=True, dynamic=False`` and
        ``options``; it compiles once, on the first call, for every layer: the function takes each layer's
        weights and cache as arguments) or, ``enabled=False``, eagerly again. Compiled, the elementwise work of
        the block (norms, RoPE, masking, softmax) is fused into a few kernels; the result is the same function
        with another rounding order in low precision. On a GPU this needs triton (inductor's code generator).

        Engines that differ in what the compiled code depends on (family, attention constants, dtype, device,
        ``max_len``, options) compile separate copies of the block function, and equal ones share one (and its
        compiled code): dynamo allows 8 compilations per code object, and with ``fullgraph=True`` one more
        raises, so engines of several models or dtypes in one process would otherwise exhaust one budget."""
        if enabled:
            attentions = tuple(dict.fromkeys(self._layer_attention(i)[:2] for i in range(self.num_layers)))
            key = (type(self), attentions, self.dtype, str(self.device), self.max_len)
            self._block = compiled_copy(attention_block, key, options)
        else:
            self._block = attention_block
        self.compiled = bool(enabled)

    _block: Any = staticmethod(attention_block)
    compiled: bool = False

    def compile_routing(self, enabled: bool = True, **options: Any) -> None:
        """Run a softmax router's execution weights (:func:`softmax_execution_weights`: softmax, gather,
        renormalisation, cast, four launches eager) through ``torch.compile`` as :meth:`compile_blocks` does the
        attention block: once for every layer, one fused kernel; the same values up to the rounding order of the
        softmax's sums. ``enabled=False``: eagerly again. A family with its own weights (DeepSeek-V3) keeps them."""
        if enabled:
            key = (self.dtype, str(self.device), self.num_experts, self.top_k)
            self._weights_fn = compiled_copy(softmax_execution_weights, key, options)
        else:
            self._weights_fn = softmax_execution_weights

    def ranks_like(self, controller: Any) -> bool:
        """Whether the router stacks rank prefetches as ``controller`` does now: the same learned predictor and
        the same ``prefetch_distance`` (``reconfigure`` may change either after the decoder was built)."""
        return controller.predictor is self.predictor and controller.config.prefetch_distance == self.distance

    def check_prefetch_source(self, controller: Any) -> None:
        """``RuntimeError`` unless the router stacks rank prefetches as ``controller`` does (:meth:`ranks_like`):
        build a new decoder."""
        if not self.ranks_like(controller):
            raise RuntimeError("the engine's router stacks were built for another prefetch ranking (the "
                               "controller's predictor or prefetch_distance changed with reconfigure()); build a new "
                               "decoder")

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
        attention, static, tensors = self._layer_attention(layer)
        self._block(attention, static, tensors, self._norms[layer], hidden, position, out_hidden, out_normed,
                    self._cache(layer), self.norm_fn)

    def _layer_attention(self, layer: int) -> tuple:
        """``(attention function, its static sizes, the layer's tensors)`` of decoder layer ``layer`` (a family
        that mixes two kinds of layer overrides it)."""
        return self._attention_fn, self._static, self._attn[layer]

    def begin_sequence(self) -> None:
        """Before a sequence's first position (host side, outside any graph): a family with a recurrent state
        clears it here; the KV cache needs nothing (the position mask hides later slots)."""

    @torch.no_grad()
    def router_logits(self, layer: int, normed: torch.Tensor, out: torch.Tensor) -> None:
        """``out [1, router_width(layer)]``: this layer's router logits, then (when there is a MoE layer
        ``distance`` ahead) that layer's pre-gate logits on the same input, from one matmul over the stacked
        weights: cuBLAS's, F.linear's own (the transformers path's bits), or with the attention kernels, whose
        attention already rounds otherwise than torch's, the fused GEMV (float32 sums in a fixed order)."""
        r = self._moe(layer)
        self._check_row(normed, "normed", self.hidden_size)
        self._check_row(out, "router logits out", r.stacked.shape[0])
        dt = self.router_dtype  # a no-op cast but for a last layer whose weight is not in the router's dtype
        if out.dtype == dt and r.stacked.dtype == dt and normed.dtype == dt and out.is_contiguous():
            if self.attention_kernels:  # the fused GEMV, written in place (cuBLAS's batch-1 kernel: 5.5 us at 0.5 MB)
                from .gemv_kernel import linear_many

                linear_many(normed, [r.stacked], outs=[out])
            else:
                torch.mm(normed, r.stacked.t(), out=out)  # F.linear's own product, written in place: one launch
        else:
            out.copy_(F.linear(normed.to(dt), r.stacked.to(dt)))

    def scores_are_logits(self, layer: int) -> bool:
        """Whether this layer's joint scores are its router logits themselves (a softmax router, no learned
        predictor): then :meth:`router_scores` only widens them to float32, which a reader of the logits' dtype
        (the device's decision kernel) does as it loads them."""
        return self._raw_logit_scores and not self._moe(layer).predicted

    @torch.no_grad()
    def router_scores(self, layer: int, logits: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (same shape as ``logits``): the family's selection scores of this layer and the pre-gate of
        layer ``layer + distance``, exactly the controller routing's ``joint_scores`` (docs/engine.md, "Inside the
        engine")."""
        r = self._moe(layer)
        E = self.num_experts
        self._check_row(logits, "router logits", r.stacked.shape[0])
        self._check_row(out, "router scores out", r.stacked.shape[0])
        if self.scores_are_logits(layer):  # softmax routers: the scores are the logits, one copy
            out.copy_(logits)
            return
        out[:, :E].copy_(self.family.selection_scores(r.router, logits[:, :E]))
        if r.following is not None and r.predicted:  # a learned predictor's priorities (LayerRouting.joint_scores)
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
        if self._softmax_weights:
            self._weights_fn(logits[:, : self.num_experts], expert_ids.reshape(1, -1), self.family.normalizes(r.router),
                             out)
            return
        out.copy_(self.family.execution_weights(r.router, logits[:, : self.num_experts], expert_ids.reshape(1, -1)))

    def routed_experts(self, layer: int, moe: Any, slots: torch.Tensor, logits: torch.Tensor, out: torch.Tensor,
                       residual: torch.Tensor | None, workspace: torch.Tensor | None = None,
                       backend: str = "auto") -> None:
        """``out [1, H]`` (``residual +``): the layer's routed experts (``moe``, its
        :class:`~psr_hf.engine.slot_moe.SlotMoe`, on ``slots``) on the buffers' normed input, weighed by
        :meth:`execution_weights` of ``logits`` at the buffers' expert ids (written into the buffers' weights). A
        softmax router's weights are computed inside the slot MoE's first kernel where it runs Triton (the two
        launches of the compiled weights fewer per layer), else beforehand."""
        b = self.buffers
        if self._softmax_weights and moe.weighs_in_kernel(self.device, backend):
            routing = SoftmaxRouting(logits[0, : self.num_experts], b.expert_ids[0],
                                     bool(self.family.normalizes(self._moe(layer).router)))
        else:
            routing = None
            self.execution_weights(layer, logits, b.expert_ids, b.expert_weights)
        moe(b.normed[0], slots, b.expert_weights[0], out[0], None if residual is None else residual[0],
            workspace=workspace, backend=backend, softmax=routing)

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
        """``out [1, H]``: the shared experts of a MoE layer (DeepSeek-V3; Qwen3.5/3.6's gated one; OLMoE has
        none)."""
        r = self._moe(layer)
        if r.shared is None:
            raise ValueError(f"{self.model_type} decoder layer {layer} has no shared experts")
        self._check_row(normed, "normed", self.hidden_size)
        self._check_row(out, "shared expert out", self.hidden_size)
        shared = self._mlp(r.shared, normed)
        if r.shared_gate is not None:  # transformers: sigmoid(gate(x)) * shared_expert(x)
            shared = torch.sigmoid(F.linear(normed, r.shared_gate.weight, r.shared_gate.bias)) * shared
        out.copy_(shared)

    def has_shared_experts(self, layer: int) -> bool:
        return self._moe(layer).shared is not None

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A dense or shared gated MLP of one token ``x [1, H]``: with the attention kernels by the fused GEMV
        (gate and up in one launch, then down; its FP8 form on the checkpoint's weights with ``dense_fp8``), else
        ``F.linear`` each, the transformers path's products."""
        biases = [mlp.gate_proj.bias, mlp.up_proj.bias]
        fp8 = self._fp8_mlps.get(id(mlp))
        if fp8 is not None:
            (wg, sg), (wu, su), (wd, sd) = fp8
            gate, up = torch.ops.psr_hf.linear_many_fp8(x, [wg, wu], [sg, su], biases)
            return torch.ops.psr_hf.linear_many_fp8(mlp.act_fn(gate) * up, [wd], [sd], [mlp.down_proj.bias])[0]
        if self.attention_kernels:
            gate, up = torch.ops.psr_hf.linear_many(x, [mlp.gate_proj.weight, mlp.up_proj.weight], biases)
            return torch.ops.psr_hf.linear_many(mlp.act_fn(gate) * up, [mlp.down_proj.weight],
                                                [mlp.down_proj.bias])[0]
        gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        return F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    @torch.no_grad()
    def final(self, hidden: torch.Tensor, out_logits: torch.Tensor) -> None:
        """``out_logits [1, V]`` = lm_head(final_norm(hidden))."""
        self._check_row(hidden, "hidden", self.hidden_size)
        self._check_row(out_logits, "logits out", self.lm_head_weight.shape[0])
        x = self.norm_fn(hidden, self.final_norm_weight, self.final_norm_eps)
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
        Positions must be decoded in order from 0 for a sequence: a step attends to slots ``0..position``; at an
        int position 0 the recurrent state of a family that has one is cleared (a tensor position 0: call
        :meth:`begin_sequence` first)."""
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
            if int(position) == 0:
                self.begin_sequence()
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


#: the compiled copies of the engine's block functions by function and what their code depends on
#: (DecodeLayers.compile_blocks, DecodeLayers.compile_routing)
_COMPILED: dict[tuple, Any] = {}


def compiled_copy(function: Any, key: tuple, options: dict[str, Any]) -> Any:
    """``torch.compile`` (``fullgraph=True, dynamic=False`` and ``options``) of a copy of ``function``, one per
    ``key`` and options: engines that differ in what the compiled code depends on compile separate copies (dynamo
    allows 8 compilations per code object), equal ones share one."""
    options = {"fullgraph": True, "dynamic": False, **options}
    full = (function.__qualname__, *key, repr(sorted(options.items())))
    if full not in _COMPILED:
        _COMPILED[full] = torch.compile(own_code_copy(function), **options)
    return _COMPILED[full]


def softmax_execution_weights(logits: torch.Tensor, expert_ids: torch.Tensor, normalize: bool,
                              out: torch.Tensor) -> None:
    """``out [1, K]``: a softmax router's weights of ``expert_ids`` from its unmodified ``logits [1, E]``, op for op
    ArchitecturePatch.execution_weights (softmax over every expert in float32, gathered, renormalised when
    ``normalize``, cast to the logits' dtype), as a function of tensors and a flag that compiles once."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, expert_ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out.copy_(weights.to(logits.dtype))


def own_code_copy(function: Any) -> Any:
    """``function`` with a code object of its own (equal, not the same): what torch.compile counts its
    recompilations against."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    return copy
