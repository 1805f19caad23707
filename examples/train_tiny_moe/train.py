"""Train a small MoE on the token files of ``make_shards.py``: seeded, resumable, time-budgeted.

    python examples/train_tiny_moe/train.py --shards SHARDS_DIR --out RUN_DIR --minutes 10     # on the GPU
    python examples/train_tiny_moe/train.py --shards SHARDS_DIR --out RUN_DIR --resume         # continue
    python examples/train_tiny_moe/train.py --arch moonlight-routing --shards SHARDS_DIR --out RUN_DIR --minutes 7
    python examples/train_tiny_moe/train.py --arch qwen36-routing --shards SHARDS_DIR --out RUN_DIR --minutes 7

``--arch`` picks the model (every preset uses the shards' tokenizer, 8,192 tokens, and context ``--seq``):

- ``tiny-moe`` (default; the shipped ``psr_hf/assets/tiny_moe``): transformers' OLMoE with OLMoE's routing shape
  (64 experts, top-8, softmax, ``norm_topk_prob=False``), 4 layers, hidden 128, experts of 64, untied embeddings;
  ``--layers/--hidden/--expert-size/--heads/--tie`` change its shape.
- ``olmoe-routing``: ``OlmoeForCausalLM`` with OLMoE-1B-7B's routing geometry: 16 layers, every one MoE, 64 experts
  top-8, softmax, ``norm_topk_prob=False``; hidden 128, 4 heads x 32 (no GQA), experts of 16, tied embeddings.
- ``moonlight-routing``: ``DeepseekV3ForCausalLM`` with Moonlight-16B-A3B's routing geometry: 27 layers, the first
  dense (``first_k_dense_replace=1``, intermediate 64), 64 routed experts top-6 (``n_group=topk_group=1``) plus 2
  shared experts, sigmoid scores plus ``e_score_correction_bias`` for the choice, ``norm_topk_prob=True``,
  ``routed_scaling_factor=2.446``; hidden 128, 4 heads, MLA (no q LoRA, kv LoRA 32, qk nope 32 + rope 16, v 32),
  experts of 16, RoPE theta 50,000 without scaling, tied embeddings.
- ``qwen36-routing``: ``Qwen3_5MoeForCausalLM`` with Qwen3.6-35B-A3B's routing geometry and layer pattern: 40
  layers, three Gated DeltaNet layers to one gated full-attention layer (transformers' default ``layer_types``),
  256 experts top-8, softmax renormalised over the selected, one shared expert behind its sigmoid gate; hidden 64,
  experts and shared expert of 8, tied embeddings. Its head dimensions are the real model's (attention 8 heads x
  256 with one key/value head, partial RoPE over a quarter; Gated DeltaNet one key head and two value heads of 128,
  convolution kernel 4), and its head groupings divide the real ones (8 query heads per key/value head, 2 value
  heads per key head), because ``psr-hf grow`` keeps this family's head dimensions and repeats key heads only.

The routing presets fix their shape (a separate upcycling step relies on these sizes); only ``--layers`` may be
lowered, for tests. Balancing: the OLMoE presets train with the load-balancing loss (``router_aux_loss_coef``
through ``output_router_logits=True``, ``--aux``, default 0.01; ``qwen36-routing`` too, as Qwen's own training does).
``moonlight-routing`` balances as DeepSeek-V3 does:
auxiliary-loss-free, i.e. after every optimizer step each MoE layer's ``e_score_correction_bias`` (a buffer, never
in the optimizer) moves by ``--bias-gamma`` (0.001) times ``sign(mean load - load_i)``, the loads being the top-k
counts of the step's batch, read by a forward hook on the router; plus DeepSeek-V3's sequence-wise balance loss at
``--aux`` (default 1e-4: ``alpha * sum_i f_i P_i`` per sequence, averaged over the batch, summed over MoE layers).

On CUDA the routing presets run the experts with ``grouped_mm_bf16`` (``--experts-implementation``): transformers'
grouped GEMM on bf16 copies of the float32 expert weights (autocast does not reach it: transformers casts the
tokens to the weights' dtype). With the float32 weights transformers' own ``grouped_mm`` was 3.4x slower per step
on the H200 (olmoe-routing 610 -> 178 ms, moonlight-routing 974 -> 295 ms at 128 x 512 tokens), presumably torch's
non-bf16 fallback, which loops over the experts.

Determinism: the weights come from ``--seed``; batch ``s`` is drawn by a
generator seeded with ``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted one would. The
number of steps is fixed at the start (``--steps``, or from ``--minutes`` and the measured time of the first
steps) and stored in the checkpoint, so the learning-rate schedule survives a resume. Validation during training
uses the calib split, and the weights with the lowest calib loss are the ones exported (many epochs over a small
corpus can overfit); the held-out split is read once, at the end, for the reported loss (never for a decision).

Writes ``RUN_DIR/checkpoint.pt`` (every ``--checkpoint-every`` steps and at the end), ``RUN_DIR/model`` (the bf16
checkpoint with the tokenizer: ``AutoModelForCausalLM.from_pretrained``; ``moonlight-routing`` keeps its
``e_score_correction_bias`` in float32) and ``RUN_DIR/train_log.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

# One entry per --arch. "shape": the defaults of --layers/--hidden/--expert-size/--heads; "fixed": only --layers may
# differ from them (the routing presets: their sizes are what an upcycling step expects); "max_mib": the refused
# bf16 size (parameters x 2 bytes, in MiB); "shard": save_pretrained's max_shard_size (a file the GPU machine
# returns must be under 16 MiB).
PRESETS: dict[str, dict] = {
    "tiny-moe": dict(family="olmoe", layers=4, hidden=128, expert_size=64, heads=4, tie=False, fixed=False,
                     aux=0.01, bias_gamma=0.0, max_mib=25.0, shard="10MB"),
    "olmoe-routing": dict(family="olmoe", layers=16, hidden=128, expert_size=16, heads=4, tie=True, fixed=True,
                          aux=0.01, bias_gamma=0.0, max_mib=25.0, shard=15 * 2**20),
    # 13.33 M parameters = 25.4 MiB (26.7 MB) in bf16: its fixed sizes do not fit 25 MiB, hence 26
    "moonlight-routing": dict(family="deepseek_v3", layers=27, hidden=128, expert_size=16, heads=4, tie=True,
                              fixed=True, aux=1e-4, bias_gamma=1e-3, max_mib=26.0, shard=15 * 2**20),
    # 256 experts in each of 40 layers: 23.28 M parameters (44.4 MiB in bf16) at hidden 64; built, not shipped
    "qwen36-routing": dict(family="qwen3_5_moe_text", layers=40, hidden=64, expert_size=8, heads=8, tie=True,
                           fixed=True, aux=0.01, bias_gamma=0.0, max_mib=45.0, shard=15 * 2**20),
}
#: the families whose training adds transformers' load-balancing loss (``output_router_logits=True``)
AUX_LOSS_FAMILIES = ("olmoe", "qwen3_5_moe_text")
MAX_CHECKPOINT_MB = PRESETS["tiny-moe"]["max_mib"]  # the default preset's limit (MiB)


def apply_preset(args: argparse.Namespace) -> dict:
    """Fill the shape and balancing options that were not given from ``args.arch``'s preset (a resumed run's
    saved values are already filled); refuse a shape change of a fixed preset. Returns the preset."""
    preset = PRESETS[args.arch]
    if preset["fixed"]:
        changed = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("hidden", "expert_size", "heads")
                   if getattr(args, k) is not None and getattr(args, k) != preset[k]]
        if changed:
            raise SystemExit(f"--arch {args.arch} fixes its shape; only --layers may change (for tests): "
                             f"remove {', '.join(changed)}")
        minimum = 2 if preset["family"] == "deepseek_v3" else 1  # the dense first layer plus at least one MoE layer
        if args.layers is not None and args.layers < minimum:
            raise SystemExit(f"--arch {args.arch} needs --layers >= {minimum}")
    for key in ("layers", "hidden", "expert_size", "heads", "aux", "bias_gamma"):
        if getattr(args, key, None) is None:
            setattr(args, key, preset[key])
    args.tie = bool(args.tie or preset["tie"])
    if args.bias_gamma and preset["family"] != "deepseek_v3":
        raise SystemExit(f"--bias-gamma: --arch {args.arch} has no e_score_correction_bias")
    return preset


def model_config(vocab_size: int, eos: int, pad: int, args: argparse.Namespace):
    family = PRESETS[args.arch]["family"]
    if family == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(
            vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_size,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=args.aux,
            output_router_logits=False, max_position_embeddings=args.seq, tie_word_embeddings=args.tie,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-5,
        )
    if family == "qwen3_5_moe_text":
        from transformers import Qwen3_5MoeTextConfig

        # the real model's head dimensions and a divisor of its head groupings (grow keeps the former)
        return Qwen3_5MoeTextConfig(
            vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=1, head_dim=256,
            moe_intermediate_size=args.expert_size, shared_expert_intermediate_size=args.expert_size,
            num_experts=256, num_experts_per_tok=8, linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            router_aux_loss_coef=args.aux, output_router_logits=False, max_position_embeddings=args.seq,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-6,
        )
    from transformers import DeepseekV3Config

    # Moonlight-16B-A3B's routing: transformers' DeepseekV3TopkRouter always scores with sigmoid and chooses with
    # scores + e_score_correction_bias (Moonlight's scoring_func="sigmoid", topk_method="noaux_tc"); the config
    # has no field for either
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=64, moe_intermediate_size=args.expert_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, max_position_embeddings=args.seq,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-5,
        num_mtp_layers=0,  # no multi-token-prediction module (transformers' default says 1; it builds none)
    )


class _Bf16Experts:
    """The experts module as ``grouped_mm_experts_forward`` sees it, with its weights cast to bf16 (differentiably:
    the float32 master weights get the gradients)."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if isinstance(value, torch.nn.Parameter) and value.is_floating_point():
            return value.to(torch.bfloat16)
        return value


def register_bf16_grouped_mm() -> str:
    """Register the experts kernel ``grouped_mm_bf16`` with transformers and return its name: transformers'
    ``grouped_mm`` on bf16 copies of the tokens and expert weights, as bf16 autocast does for every other matmul of
    the model. (Under autocast transformers casts the tokens to the weights' dtype, so float32 master weights miss
    the bf16 grouped GEMM; see the module docstring for the speed.)"""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, grouped_mm_experts_forward

    name = "grouped_mm_bf16"
    if name not in ALL_EXPERTS_FUNCTIONS:
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = grouped_mm_experts_forward(_Bf16Experts(self), hidden_states.to(torch.bfloat16), top_k_index,
                                             top_k_weights)
            return out.to(hidden_states.dtype)

        ExpertsInterface.register(name, forward)
    return name


def routers(model) -> list[torch.nn.Module]:
    """The routed MoE layers' routers (``layer.mlp.gate``; a dense layer's MLP has none), in order."""
    found = []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
            found.append(gate)
    return found


class RouterTap:
    """Forward hooks on the routers: while ``active``, keep each router's logits and chosen experts.

    Both OLMoE's and DeepSeek-V3's routers return ``(router_logits, top_k_weights, top_k_indices)`` (transformers
    5.17 and later)."""

    def __init__(self, gates: list[torch.nn.Module]):
        self.gates, self.active = gates, False
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.handles = [g.register_forward_hook(self._hook) for g in gates]

    def _hook(self, module, inputs, output) -> None:
        if not self.active:
            return
        logits, indices = output[0], output[-1]
        if indices.dtype != torch.int64 or indices.shape[-1] != module.top_k:
            raise RuntimeError(f"{type(module).__name__} returned {tuple(indices.shape)} {indices.dtype} as its "
                               f"last output, not the [tokens, {module.top_k}] chosen experts")
        self.logits.append(logits)
        self.indices.append(indices.reshape(-1, module.top_k))

    def clear(self) -> None:
        self.logits, self.indices = [], []


def expert_counts(indices: list[torch.Tensor], rows: int, num_experts: int) -> torch.Tensor:
    """``[L, rows, E]`` top-k counts per layer, row (sequence) and expert from each layer's ``[rows * T, K]``
    chosen experts. Counts by sorting (exact and deterministic on the GPU, unlike ``bincount``'s atomics)."""
    L = len(indices)
    idx = torch.stack([i.reshape(rows, -1) for i in indices])  # [L, rows, T*K]
    offset = (torch.arange(L * rows, device=idx.device) * num_experts).view(L, rows, 1)
    keys = (idx + offset).flatten().sort().values
    edges = torch.searchsorted(keys, torch.arange(L * rows * num_experts + 1, device=idx.device))
    return edges.diff().view(L, rows, num_experts)


@torch.no_grad()
def update_bias(gates: list[torch.nn.Module], loads: torch.Tensor, gamma: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: ``bias_i += gamma * sign(mean load - load_i)`` per layer
    (``loads``: ``[L, E]`` top-k counts of the step's batch): an overloaded expert's bias goes down by ``gamma``,
    an underloaded one's up. The bias shifts only which experts are chosen, never their weights."""
    loads = loads.float()
    step = gamma * torch.sign(loads.mean(dim=-1, keepdim=True) - loads)  # [L, E]
    for gate, delta in zip(gates, step):
        gate.e_score_correction_bias.add_(delta.to(gate.e_score_correction_bias.dtype))


def sequence_balance_loss(logits: list[torch.Tensor], counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without its alpha, summed over layers: per sequence
    ``sum_i f_i P_i`` with ``f_i = E / (K T) * (top-k count of expert i)`` and ``P_i`` the mean over the sequence of
    the normalised sigmoid scores ``s_i / sum_j s_j``; averaged over sequences (1 per layer when balanced).
    ``counts``: :func:`expert_counts`, ``[L, rows, E]``."""
    L, rows, E = counts.shape
    total = logits[0].new_zeros(())
    for layer, z in enumerate(logits):
        s = z.float().sigmoid().view(rows, -1, E)  # [rows, T, E]
        P = (s / s.sum(dim=-1, keepdim=True)).mean(dim=1)  # [rows, E]
        f = counts[layer].float() * E / (top_k * s.shape[1])
        total = total + (f * P).sum(dim=-1).mean()
    return total


def max_violation(loads: torch.Tensor) -> float:
    """Mean over layers of ``(max load - mean load) / mean load`` (the loss-free balancing paper's MaxVio)."""
    loads = loads.float()
    mean = loads.mean(dim=-1)
    return float(((loads.max(dim=-1).values - mean) / mean).mean())


def load_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


def batch(tokens: np.ndarray, step: int, seed: int, size: int, seq: int) -> torch.Tensor:
    """``[size, seq + 1]`` windows at offsets drawn by a generator seeded with ``(seed, step)``."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - seq - 1, size=size)
    return torch.from_numpy(np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, seq: int, device: torch.device, windows: int) -> float:
    """Mean next-token loss over ``windows`` consecutive, non-overlapping windows from the start of ``tokens``."""
    model.eval()
    n = min(windows, (tokens.size - 1) // seq)
    losses = []
    for i in range(0, n, 16):
        rows = [tokens[j * seq : j * seq + seq + 1] for j in range(i, min(i + 16, n))]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
        # labels are shifted inside the model: the loss covers positions 1..seq-1 of each window
        losses.append(float(out.loss) * len(rows))
    model.train()
    return sum(losses) / max(n, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", choices=list(PRESETS), default="tiny-moe",
                   help="the model preset (default tiny-moe; see the module docstring)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: from --minutes)")
    p.add_argument("--minutes", type=float, default=10.0, help="time budget that fixes --steps (default 10)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, help="stop this invocation after this many steps (checkpointed; "
                                                   "continue with --resume), e.g. to fit a command time limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's, 4/16/27); the routing presets "
                                              "accept a lower count only for tests (moonlight-routing: >= 2)")
    p.add_argument("--hidden", type=int, help="hidden size (tiny-moe only; default 128)")
    p.add_argument("--expert-size", type=int, help="expert intermediate size (tiny-moe only; default 64)")
    p.add_argument("--heads", type=int, help="attention heads (tiny-moe only; default 4)")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings (the routing presets do)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--aux", type=float, help="balance loss weight: OLMoE's load-balancing loss (default 0.01), or "
                                             "moonlight-routing's sequence-wise balance loss alpha (default 1e-4)")
    p.add_argument("--bias-gamma", type=float, help="moonlight-routing: e_score_correction_bias update speed, "
                                                    "auxiliary-loss-free balancing (default 0.001; 0: off)")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--experts-implementation", choices=["eager", "grouped_mm", "batched_mm", "grouped_mm_bf16"],
                   help="the experts kernel: transformers' eager, grouped_mm or batched_mm, or grouped_mm_bf16 "
                        "(transformers' grouped_mm on bf16 copies of the expert weights: 3.4x faster steps on the "
                        "H200). Default: grouped_mm_bf16 for the routing presets on CUDA, else transformers' choice")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "checkpoint.pt"
    tokenizer = AutoTokenizer.from_pretrained(args.shards / "tokenizer")
    train_tokens = load_tokens(args.shards / "train.bin")
    calib_tokens = load_tokens(args.shards / "calib.bin")
    state = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.exists() else None
    if state is not None:
        saved = state["args"]
        args.arch = saved.get("arch", "tiny-moe")  # a checkpoint without one predates --arch: tiny-moe
        for key, value in saved.items():  # a resumed run keeps the run's settings
            if key not in ("resume", "stop_after", "device", "out", "shards", "steps", "minutes"):
                setattr(args, key, value)
    preset = apply_preset(args)
    family = preset["family"]
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)  # where a kernel has no deterministic version: warn
    config = model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, args)
    if args.experts_implementation is None and args.arch != "tiny-moe" and device.type == "cuda":
        args.experts_implementation = "grouped_mm_bf16"  # stored with the run's settings, so a resume keeps it
    if args.experts_implementation == "grouped_mm_bf16":
        register_bf16_grouped_mm()
    extra = {} if args.experts_implementation is None else {"experts_implementation": args.experts_implementation}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra).to(device)
    params = sum(p.numel() for p in model.parameters())
    bf16_mib = params * 2 / 2**20
    if bf16_mib > preset["max_mib"]:
        raise SystemExit(f"{params / 1e6:.2f} M parameters: {bf16_mib:.1f} MiB in bf16 exceeds --arch {args.arch}'s "
                         f"{preset['max_mib']} MiB; shrink --layers/--hidden/--expert-size or --tie")
    gates = routers(model)
    num_experts, top_k = int(gates[0].weight.shape[0]), int(gates[0].top_k)
    tap = RouterTap(gates)
    print(f"--arch {args.arch}: {type(model).__name__}, {params:,} parameters ({bf16_mib:.2f} MiB in bf16), "
          f"{len(gates)} MoE layers of {len(model.model.layers)}, {num_experts} experts top-{top_k}, experts "
          f"kernel {getattr(model.config, '_experts_implementation', None)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log: list[dict] = []
    step, total = 0, args.steps
    best: dict | None = None  # the weights with the lowest calib loss so far (exported at the end)
    if state is not None:
        model.load_state_dict(state["model"])  # with the routers' e_score_correction_bias (buffers)
        optimizer.load_state_dict(state["optimizer"])
        step, total, log, best = state["step"], state["total"], state["log"], state.get("best")
        print(f"resumed at step {step} of {total}")
    model.train()
    start = time.perf_counter()
    probe_from, probe, probe_start = 5, 20, 0.0

    def save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "total": total,
                    "log": log, "best": best,
                    "args": vars(args) | {"shards": str(args.shards), "out": str(args.out)}}, ckpt_path)

    first = step
    while total is None or step < total:
        if args.stop_after is not None and step - first >= args.stop_after:
            save()
            print(f"stopped at step {step} of {total}; continue with --resume")
            return
        ids = batch(train_tokens, step, args.seed, args.batch, args.seq).to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total or 10**9, args.lr, args.warmup)
        logging = (step + 1) % 50 == 0 or step + 1 == total
        tap.active = True
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if family in AUX_LOSS_FAMILIES:
                out = model(input_ids=ids[:, :-1], labels=ids[:, :-1], output_router_logits=True)
            else:
                out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
        tap.active = False
        loss, balance, counts = out.loss, None, None
        if family == "deepseek_v3" or logging:
            counts = expert_counts(tap.indices, ids.shape[0], num_experts)  # [L, rows, E]
        if family == "deepseek_v3" and args.aux:
            balance = sequence_balance_loss(tap.logits, counts, top_k)
            loss = loss + args.aux * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if family == "deepseek_v3" and args.bias_gamma:
            update_bias(gates, counts.sum(dim=1), args.bias_gamma)  # after the step, from this batch's loads
        tap.clear()
        step += 1
        if total is None and step in (probe_from, probe_from + probe):
            # the first steps are slow (allocation, kernel selection): time the steps after them, then give the
            # rest of the budget to steps at that speed
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            if step == probe_from:
                probe_start = now
            else:
                per_step = (now - probe_start) / probe
                total = step + max(int((args.minutes * 60 - (now - start)) / per_step), 1)
                memory = (f", {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB peak"
                          if device.type == "cuda" else "")
                print(f"{per_step * 1e3:.1f} ms/step -> {total} steps in {args.minutes} min "
                      f"({total * args.batch * args.seq / 1e6:.0f} M tokens{memory})")
        if step % 50 == 0 or step == total:
            # aux_loss: OLMoE's load-balancing loss, or the sequence-wise balance per MoE layer (1 = balanced);
            # max_vio: the batch's (max load - mean load) / mean load, mean over layers
            aux = out.aux_loss if family in AUX_LOSS_FAMILIES else (
                balance / len(gates) if balance is not None else None)
            entry = {"step": step, "loss": loss.item(), "aux_loss": None if aux is None else aux.item(),
                     "lr": optimizer.param_groups[0]["lr"], "seconds": time.perf_counter() - start}
            if counts is not None:
                entry["max_vio"] = max_violation(counts.sum(dim=1))
            if family == "deepseek_v3":
                entry["bias_abs_max"] = max(float(g.e_score_correction_bias.abs().max()) for g in gates)
            if step % args.checkpoint_every == 0 or step == total:
                entry["calib_loss"] = evaluate(model, calib_tokens, args.seq, device, args.eval_windows)
                if best is None or entry["calib_loss"] < best["calib_loss"]:  # the calib split decides, never heldout
                    best = {"step": step, "calib_loss": entry["calib_loss"],
                            "model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}
                save()
            log.append(entry)
            print(json.dumps(entry))
    seconds = time.perf_counter() - start
    if best is not None and best["step"] != step:
        print(f"exporting step {best['step']} (calib loss {best['calib_loss']:.4f}, the lowest)")
        model.load_state_dict(best["model"])
    exported = best["step"] if best is not None else step
    heldout = evaluate(model, load_tokens(args.shards / "heldout.bin"), args.seq, device, args.eval_windows)
    export = args.out / "model"
    # the routers' e_score_correction_bias stays float32 (transformers keeps it so on load): in bf16 it would lose
    # the 0.001 steps it moved by
    biases = [g.e_score_correction_bias.detach().clone() for g in gates if hasattr(g, "e_score_correction_bias")]
    model.to(torch.bfloat16)
    for gate, bias in zip((g for g in gates if hasattr(g, "e_score_correction_bias")), biases):
        gate.e_score_correction_bias.data = bias.float()
    # shards under 16 MiB: a file the GPU machine returns may have at most 16 MiB
    model.save_pretrained(export, max_shard_size=preset["shard"])
    tokenizer.model_max_length = args.seq  # the context it was trained on
    tokenizer.save_pretrained(export)
    size = sum(f.stat().st_size for f in export.glob("*.safetensors")) / 2**20
    summary = {
        "arch": args.arch, "model_class": type(model).__name__, "parameters": params, "bf16_mib": bf16_mib,
        "checkpoint_mb": size, "moe_layers": len(gates), "experts": num_experts, "top_k": top_k,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "cuda_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "steps": step, "tokens_seen": step * args.batch * args.seq, "train_seconds": seconds,
        "train_tokens_available": int(train_tokens.size), "final_train_loss": log[-1]["loss"] if log else None,
        "exported_step": exported, "calib_loss": best["calib_loss"] if best is not None else None,
        "heldout_loss": heldout,
        "args": vars(args) | {"shards": str(args.shards), "out": str(args.out)}, "log": log,
    }
    (args.out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(f"done: {step} steps, {summary['tokens_seen'] / 1e6:.1f} M tokens, heldout loss {heldout:.3f}, "
          f"checkpoint {size:.1f} MiB -> {export}")


if __name__ == "__main__":
    main()
