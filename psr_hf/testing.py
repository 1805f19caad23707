"""For experiments and tests: tiny random models of every supported family, built offline from configs.

They keep each family's routing structure (OLMoE's plain softmax router, DeepSeek-V3's grouped sigmoid router
with a dense first layer and shared experts, Qwen3.5-MoE's hybrid attention and gated shared expert, Qwen3-Next's
``mlp_only_layers``) at hidden size 64 with 16 experts, so a forward pass takes milliseconds on a CPU. Random
weights: no trained specialisation (see the shipped trained model for that).
"""

from __future__ import annotations

from typing import Any

import torch

from .bench.workloads import byte_tokenizer

FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

_SPECIAL = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
_QWEN_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=16, num_experts_per_tok=4, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False, **_SPECIAL,
)
_CONFIGS: dict[str, dict[str, Any]] = {
    "olmoe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, **_SPECIAL,
    ),
    "deepseek_v3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **_SPECIAL,
    ),
    "qwen3_5_moe_text": _QWEN_TEXT,
    "qwen3_next": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, full_attention_interval=2, **_SPECIAL,
    ),
}


def tiny_config(family: str, **overrides: Any) -> Any:
    """The config of a tiny ``family`` model (see :data:`FAMILIES`); ``overrides`` replace fields."""
    from transformers import AutoConfig

    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig

        text = {**_QWEN_TEXT, **overrides}
        return Qwen3_5MoeConfig(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
            tie_word_embeddings=False, **_SPECIAL,
        )
    if family not in _CONFIGS:
        raise ValueError(f"family={family!r}; allowed: {', '.join(FAMILIES)}")
    return AutoConfig.for_model(family, **{**_CONFIGS[family], **overrides})


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A seeded random tiny ``family`` model in eval mode (the composite image-text class for ``qwen3_5_moe``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "qwen3_5_moe":
            from transformers import Qwen3_5MoeForConditionalGeneration

            model = Qwen3_5MoeForConditionalGeneration(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
        # a random router at std 0.02 gives nearly uniform scores; a wider one gives the peaked distributions
        # of trained routers, so policies have something to choose between
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and param.ndim == 2 and param.shape[0] > 1:
                torch.nn.init.normal_(param, std=0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.05)
    return model.to(dtype).eval()


def save_tiny(family: str, path: Any, *, seed: int = 0, **overrides: Any) -> Any:
    """Save a tiny ``family`` model with :func:`byte_tokenizer` to ``path`` (loadable offline with
    ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(path)``, e.g. by lm-eval's ``hf`` model); returns path."""
    tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
