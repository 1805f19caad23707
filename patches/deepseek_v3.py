"""DeepSeek-V3 and Moonlight-16B-A3B (``DeepseekV3ForCausalLM``, the native class).

Selection scores are ``sigmoid(logits) + e_score_correction_bias`` with the experts outside the kept groups at
``-inf`` (group-limited routing, exactly as ``DeepseekV3TopkRouter`` keeps groups; where the kept groups hold
fewer than top-K experts, one less than the lowest kept score, so that top-K exists, as transformers' top-k picks
masked experts then); execution weights come from
the unbiased ``sigmoid(logits)``, normalised if ``norm_topk_prob``, times ``routed_scaling_factor``. The first
``first_k_dense_replace`` layers are dense and skipped; the shared experts run unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psr_hf.policy import MASS_SIGMOID_BIAS

from . import register_patch
from .base import ArchitecturePatch


@register_patch("deepseek_v3")
class DeepseekV3Patch(ArchitecturePatch):
    default_window = 4  # the paper's window for Moonlight
    # Moonlight's structure in small: grouped sigmoid routing (4 groups, 2 kept), a dense first layer, a shared
    # expert, scaled and renormalised weights, multi-head latent attention
    tiny = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    )

    def selection_scores(self, router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.sigmoid() + router.e_score_correction_bias  # [N, E]
        groups, keep = router.num_group, router.topk_group
        if groups > 1 and keep < groups:
            per_group = scores.view(-1, groups, router.num_experts // groups)  # [N, G, E/G]
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
            kept = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
            outside = ~mask.unsqueeze(-1)  # [N, G, 1]
            if keep * per_group.shape[-1] >= router.top_k:
                scores = per_group.masked_fill(outside, float("-inf"))
            else:
                # the kept groups hold fewer than top_k experts (a degenerate config): transformers' top-k then
                # takes masked experts too, so here they score below every kept one instead of -inf
                floor = per_group.masked_fill(outside, float("inf")).amin(dim=(1, 2), keepdim=True) - 1.0
                scores = torch.where(outside, floor, per_group)
            scores = scores.reshape(-1, router.num_experts)
        return scores

    def execution_weights(self, router: nn.Module, logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        weights = logits.sigmoid().gather(1, selected)
        if router.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * router.routed_scaling_factor

    router_mass = MASS_SIGMOID_BIAS  # the router's own weight of expert e is z[e] - bias[e] = sigmoid(logit)

    def mass_bias(self, router: nn.Module) -> np.ndarray:
        return router.e_score_correction_bias.detach().double().cpu().numpy()

    def stacked_router_weight(self, weight: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        return torch.cat((weight.float(), following.float()), dim=0)  # the router computes in float32

    def joint_scores(self, router: nn.Module, following: nn.Module, hidden: torch.Tensor,
                     stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = F.linear(hidden.reshape(-1, stacked.shape[1]).float(), stacked)  # [N, 2E] float32
        E = router.num_experts
        scores = torch.cat((self.selection_scores(router, both[:, :E]), self.selection_scores(following, both[:, E:])), -1)
        return both, scores
