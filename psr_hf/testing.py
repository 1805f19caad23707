"""For experiments and tests: tiny random models of every supported family, built offline from configs.

They keep each family's routing structure (OLMoE's plain softmax router, DeepSeek-V3's grouped sigmoid router
with a dense first layer and shared experts, Qwen3.5-MoE's hybrid attention and gated shared expert, Qwen3-Next's
``mlp_only_layers``) at hidden size 64 with 16 experts, so a forward pass takes milliseconds on a CPU. Random
weights: no trained specialisation (see the shipped trained model for that).
"""

from __future__ import annotations

from typing import Any

import torch

from .assets.loading import byte_tokenizer
from .patches import get_patch, supported_model_types

#: the tiny families: every supported ``model_type`` (sorted), each with the tiny config of its patch module
FAMILIES: tuple[str, ...] = tuple(supported_model_types())


def tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny ``family`` model (see :data:`FAMILIES`), from the family's patch module
    (``tiny_config`` in ``patches/<family>.py``, shipped as ``psr_hf.patches``); ``overrides`` replace fields.
    ``ValueError`` listing the supported families for an unknown one."""
    # the registry, not FAMILIES: a family module found on psr_hf.patches.__path__ later (a plugin) counts too
    return get_patch(family).tiny_config(family, **overrides)


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, norm_noise: float = 0.0,
               **overrides: Any) -> torch.nn.Module:
    """A seeded random tiny ``family`` model in eval mode (the composite image-text class for ``qwen3_5_moe``).
    ``norm_noise``: the std of seeded noise added to every norm weight (initialised norms are the identity: a
    zero-centred norm's weight starts at zero, so a mapping error of it would go unseen)."""
    patch = get_patch(family)
    config = patch.tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = patch.build_tiny(config)
        # a random router at std 0.02 gives nearly uniform scores; a wider one gives the peaked distributions
        # of trained routers, so policies have something to choose between
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and param.ndim == 2 and param.shape[0] > 1:
                torch.nn.init.normal_(param, std=0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.05)
        if norm_noise:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.add_(torch.randn_like(param) * norm_noise)
    return model.to(dtype).eval()


def save_tiny(family: str, path: Any, *, seed: int = 0, **overrides: Any) -> Any:
    """Save a tiny ``family`` model with :func:`byte_tokenizer` to ``path`` (loadable offline with
    ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(path)``, e.g. by lm-eval's ``hf`` model); returns path."""
    tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def warm_up(families: tuple[str, ...] = ("olmoe", "deepseek_v3"), progress: bool = False) -> int:
    """Compile the policy kernels into numba's on-disk cache (``make install`` runs this through ``psr-hf
    warm-up``), so a user's first ``psr-hf demo`` or ``generate()`` loads them instead of compiling for 10-40 s.

    Runs a prompt and two decode steps of a tiny random model of each of ``families`` (softmax and
    sigmoid-with-bias routers) under every policy of the policy table, resident and on the CPU offload path, so
    the kernels are compiled for exactly the argument types the controller passes. ``progress``: a tqdm bar on
    stderr. Returns the number of runs.
    """
    from ._progress import tqdm

    from .hf.calibrate import calibrate
    from .hf.patching import patch, unpatch
    from .offload.config import OffloadConfig
    from .policy.config import RoutingConfig
    from .policy.policies import POLICY_TABLE

    runs = 0
    bar = tqdm(total=len(families) * len(POLICY_TABLE) * 2, unit="run", desc="warm-up", disable=not progress)
    for family in families:
        model = tiny_model(family)
        E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
        vocab = model.config.get_text_config().vocab_size
        ids = torch.arange(24).remainder(vocab).reshape(2, 12)
        calibration = calibrate(model, ids, max_length=12, progress=False)
        for policy in POLICY_TABLE:
            for offload in (None, OffloadConfig(device="cpu")):
                config = RoutingConfig(policy=policy, capacity=E // 2)
                patch(model, config, calibration=calibration, offload=offload)
                try:
                    with torch.no_grad():
                        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
                        model(ids)  # a block of rows: the prompt path with several rows
                finally:
                    unpatch(model)
                runs += 1
                bar.update()
    bar.close()
    return runs
