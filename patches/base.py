"""What every architecture patch supplies, with the softmax-router behaviour most families share.

A family module subclasses :class:`ArchitecturePatch`, registers it with ``@register_patch("model_type", ...)``,
sets ``default_window`` and the fields of its tiny test config (``tiny``), and overrides what its router does
differently (DeepSeek-V3's grouped sigmoid scoring, for instance). The torch glue in :mod:`psr_hf.hf` and the
tiny-model builders of :mod:`psr_hf.testing` only ever talk to a family through this class, so a new
architecture is one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psr_hf.policy import MASS_SOFTMAX

# special token ids of every tiny test config: psr_hf.testing's byte tokenizer keeps bytes 0, 1, 2 (which never
# occur in text) for pad, eos and bos
TINY_SPECIAL_TOKENS: Mapping[str, int] = MappingProxyType(dict(pad_token_id=0, eos_token_id=1, bos_token_id=2))


@dataclass(frozen=True)
class MoELayer:
    """One routed MoE block: ``index`` counts MoE layers only (0..L-1); ``decoder_index`` is its decoder layer."""

    index: int
    decoder_index: int
    block: nn.Module
    router: nn.Module


class ArchitecturePatch:
    """How psr_hf reads and steers one architecture family's routers.

    Subclasses override what differs from a softmax top-K router (OLMoE's ``OlmoeTopKRouter`` and its kin):
    ``selection_scores`` (the policy's ``z``), ``joint_scores`` (this layer's scores and the next layer's pre-gate
    from one matmul), ``execution_weights`` (ALGORITHM.md step 6) and ``router_mass``/``mass_bias``.
    """

    default_window: int = 4
    #: renormalise the gathered softmax over the selected experts (None: read ``router.norm_topk_prob``)
    normalize: bool | None = None
    #: config fields of the family's tiny random test model (hidden size 64, 3-4 layers, 16 experts) that
    #: :meth:`tiny_config` passes to transformers; empty: the family has no tiny model
    tiny: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    # ------------------------------------------------------------------ tiny test models
    @classmethod
    def tiny_config(cls, model_type: str, **overrides: Any) -> Any:
        """The transformers config (a ``PretrainedConfig``) of a tiny random ``model_type`` model: the fields of
        :attr:`tiny` with the tiny special token ids, ``overrides`` replacing fields."""
        if not cls.tiny:
            raise ValueError(
                f"{cls.__name__} ({model_type!r}) has no tiny test config: set its `tiny` config fields"
            )
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **{**TINY_SPECIAL_TOKENS, **cls.tiny, **overrides})

    @classmethod
    def build_tiny(cls, config: Any) -> nn.Module:
        """A model of ``config`` (from :meth:`tiny_config`) with transformers' initialisation: the causal LM
        class of its model type (families whose tiny model is another class override this)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config)

    # ------------------------------------------------------------------ structure
    def decoder(self) -> nn.Module:
        """The text decoder holding ``.layers`` (the language model of a composite model)."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if decoder is None or not hasattr(decoder, "layers"):
            raise ValueError(f"{type(self.model).__name__} has no text decoder with .layers that psr_hf can patch")
        return decoder

    @staticmethod
    def is_moe_block(block: nn.Module | None) -> bool:
        return block is not None and hasattr(block, "gate") and hasattr(block, "experts")

    def moe_layers(self) -> list[MoELayer]:
        """The routed MoE blocks in model order (dense MLP layers are skipped; shared experts stay untouched)."""
        layers = []
        for decoder_index, layer in enumerate(self.decoder().layers):
            block = getattr(layer, "mlp", None)
            if not self.is_moe_block(block):
                continue
            router = block.gate
            weight = getattr(router, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not hasattr(router, "top_k"):
                raise ValueError(
                    f"decoder layer {decoder_index}: {type(router).__name__} is not a top-k router with a "
                    "[num_experts, hidden] weight; this transformers version changed the architecture psr_hf expects"
                )
            layers.append(MoELayer(len(layers), decoder_index, block, router))
        return layers

    # ------------------------------------------------------------------ scores and weights
    def selection_scores(self, router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` scores ``z`` the policy ranks (ALGORITHM.md, Inputs): the raw logits for softmax routers."""
        return logits

    def normalizes(self, router: nn.Module) -> bool:
        """Whether :meth:`execution_weights` renormalises the top-K weights to sum to one (the router's
        ``norm_topk_prob`` unless the family fixes it)."""
        return bool(router.norm_topk_prob) if self.normalize is None else self.normalize

    def execution_weights(self, router: nn.Module, logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` weights of the experts ``selected`` ``[N, K]`` from the unmodified scores, as the model's
        own router weights its top-K: softmax over all experts, gathered, renormalised if the model does."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(1, selected)
        if self.normalizes(router):
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype)

    def stacked_router_weight(self, weight: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        """``[2E, H]``: this router's weight over the next MoE layer's, so that :meth:`joint_scores` gets this
        layer's logits and the next layer's pre-gate logits from one matmul."""
        return torch.cat((weight, following), dim=0)

    def joint_scores(self, router: nn.Module, following: nn.Module, hidden: torch.Tensor,
                     stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, 2E], scores [N, 2E])`` from one matmul with :meth:`stacked_router_weight`: the logits of
        this router and of ``following`` (the next MoE layer's router) on this block's input ``hidden``, and the
        selection scores of this layer beside the pre-gate of the next (for softmax routers: the logits)."""
        both = F.linear(hidden if hidden.ndim == 2 else hidden.reshape(-1, stacked.shape[1]), stacked)
        return both, both

    #: how the router's own weight of an expert follows from its selection score (for the displaced router mass)
    router_mass: int = MASS_SOFTMAX

    def mass_bias(self, router: nn.Module) -> np.ndarray | None:
        """Per-expert offset of the selection scores over the router's weights (None: none)."""
        return None
