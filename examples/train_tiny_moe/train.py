"""Train the tiny OLMoE on the token files of ``make_shards.py``: seeded, resumable, time-budgeted.

    python examples/train_tiny_moe/train.py --shards SHARDS_DIR --out RUN_DIR --minutes 10     # on the GPU
    python examples/train_tiny_moe/train.py --shards SHARDS_DIR --out RUN_DIR --resume         # continue

The model is transformers' OLMoE with OLMoE's routing shape (64 experts, top-8, softmax, ``norm_topk_prob=False``)
at a size whose bf16 checkpoint stays under 25 MB, trained with the load-balancing loss (``router_aux_loss_coef``
through ``output_router_logits=True``). Determinism: the weights come from ``--seed``; batch ``s`` is drawn by a
generator seeded with ``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted one would. The
number of steps is fixed at the start (``--steps``, or from ``--minutes`` and the measured time of the first
steps) and stored in the checkpoint, so the learning-rate schedule survives a resume. Validation during training
uses the calib split, and the weights with the lowest calib loss are the ones exported (many epochs over a small
corpus can overfit); the held-out split is read once, at the end, for the reported loss (never for a decision).

Writes ``RUN_DIR/checkpoint.pt`` (every ``--checkpoint-every`` steps and at the end), ``RUN_DIR/model`` (the bf16
checkpoint with the tokenizer: ``AutoModelForCausalLM.from_pretrained``) and ``RUN_DIR/train_log.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

MAX_CHECKPOINT_MB = 25.0


def model_config(vocab_size: int, eos: int, pad: int, args: argparse.Namespace):
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=args.aux,
        output_router_logits=False, max_position_embeddings=args.seq, tie_word_embeddings=args.tie,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-5,
    )


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
    p.add_argument("--steps", type=int, help="optimizer steps (default: from --minutes)")
    p.add_argument("--minutes", type=float, default=10.0, help="time budget that fixes --steps (default 10)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, help="stop this invocation after this many steps (checkpointed; "
                                                   "continue with --resume), e.g. to fit a command time limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--expert-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--eval-windows", type=int, default=256)
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
        for key, value in saved.items():  # a resumed run keeps the run's settings
            if key not in ("resume", "stop_after", "device", "out", "shards", "steps", "minutes"):
                setattr(args, key, value)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)  # where a kernel has no deterministic version: warn
    config = model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, args)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    params = sum(p.numel() for p in model.parameters())
    if params * 2 / 2**20 > MAX_CHECKPOINT_MB:
        raise SystemExit(f"{params / 1e6:.1f} M parameters: {params * 2 / 2**20:.1f} MB in bf16 exceeds "
                         f"{MAX_CHECKPOINT_MB} MB; shrink --layers/--hidden/--expert-size or --tie")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log: list[dict] = []
    step, total = 0, args.steps
    best: dict | None = None  # the weights with the lowest calib loss so far (exported at the end)
    if state is not None:
        model.load_state_dict(state["model"])
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
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids[:, :-1], labels=ids[:, :-1], output_router_logits=True)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
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
                print(f"{per_step * 1e3:.1f} ms/step -> {total} steps in {args.minutes} min "
                      f"({total * args.batch * args.seq / 1e6:.0f} M tokens)")
        if step % 50 == 0 or step == total:
            entry = {"step": step, "loss": out.loss.item(), "aux_loss": out.aux_loss.item(),
                     "lr": optimizer.param_groups[0]["lr"], "seconds": time.perf_counter() - start}
            if step % args.checkpoint_every == 0 or step == total:
                entry["calib_loss"] = evaluate(model, calib_tokens, args.seq, device, args.eval_windows)
                if best is None or entry["calib_loss"] < best["calib_loss"]:  # the calib split decides, never heldout
                    best = {"step": step, "calib_loss": entry["calib_loss"],
                            "model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}
                save()
            log.append(entry)
            print(json.dumps(entry))
    if best is not None and best["step"] != step:
        print(f"exporting step {best['step']} (calib loss {best['calib_loss']:.4f}, the lowest)")
        model.load_state_dict(best["model"])
    exported = best["step"] if best is not None else step
    heldout = evaluate(model, load_tokens(args.shards / "heldout.bin"), args.seq, device, args.eval_windows)
    export = args.out / "model"
    # shards of at most 10 MB: a file the GPU machine returns may have at most 16 MiB
    model.to(torch.bfloat16).save_pretrained(export, max_shard_size="10MB")
    tokenizer.model_max_length = args.seq  # the context it was trained on
    tokenizer.save_pretrained(export)
    size = sum(f.stat().st_size for f in export.glob("*.safetensors")) / 2**20
    summary = {
        "parameters": params, "checkpoint_mb": size, "steps": step, "tokens_seen": step * args.batch * args.seq,
        "train_tokens_available": int(train_tokens.size), "final_train_loss": log[-1]["loss"] if log else None,
        "exported_step": exported, "calib_loss": best["calib_loss"] if best is not None else None,
        "heldout_loss": heldout,
        "args": vars(args) | {"shards": str(args.shards), "out": str(args.out)}, "log": log,
    }
    (args.out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(f"done: {step} steps, {summary['tokens_seen'] / 1e6:.1f} M tokens, heldout loss {heldout:.3f}, "
          f"checkpoint {size:.1f} MB -> {export}")


if __name__ == "__main__":
    main()
