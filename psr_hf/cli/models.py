"""Commands that make a model's files: ``psr-hf calibrate`` (a calibration from held-out text) and ``psr-hf grow``
(a small trained model grown exactly to real-size dimensions, docs/models.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..assets.grow_families import grow_family, grow_model_types
from ..assets.grow_families.base import QWEN_FIELDS
from .options import add_device, add_model, add_out, add_threads, set_threads

CALIBRATE_DTYPES = ("auto", "bf16", "fp16", "fp32")
GROW_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}


def grow_presets() -> list[str]:
    """The name of every grow family's preset target, in listing order, read from the families themselves
    (:data:`psr_hf.assets.grow.PRESETS` holds the same, but that module imports torch)."""
    return [grow_family(model_type).preset.name for model_type in grow_model_types()]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="calibrate a model's routing policy on held-out text")
    add_model(p, built=False)
    p.add_argument("--text", required=True, nargs="+", help="held-out text files (UTF-8)")
    add_out(p, "calibration file to write (.safetensors)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    add_device(p)
    p.add_argument("--dtype", default="auto", choices=CALIBRATE_DTYPES, help="weights' dtype (default auto: as saved)")
    add_threads(p)
    p.set_defaults(func=calibrate)

    presets = grow_presets()
    what = ("grow a small trained MoE model to real-size dimensions that compute exactly its function: same routing, "
            f"real-size experts for latency benchmarks; targets: {', '.join(presets)}")
    p = subparsers.add_parser("grow", help=what, description=what + " (docs/models.md)")
    add_model(p, built=False, note="; a hub id must be in the local hub cache")
    p.add_argument("--target", help=f"{', '.join(presets[:-1])} or {presets[-1]} (default: the preset of the "
                                    "model's family)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="replace one dimension of the target (repeatable), e.g. a reduced target of the same code "
                        "path for tests: --override hidden_size=512 --override num_attention_heads=8 "
                        "--override num_key_value_heads=8 --override head_dim=64 --override "
                        "expert_intermediate_size=96; fields: hidden_size, num_attention_heads, num_key_value_heads, "
                        "expert_intermediate_size, head_dim (OLMoE), dense_intermediate_size, kv_lora_rank, "
                        "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (DeepSeek-V3), "
                        f"{', '.join(QWEN_FIELDS)} (Qwen3.5/3.6)")
    add_out(p, "directory to write the grown model to (new or empty)", directory=True)
    p.add_argument("--dtype", default="bfloat16", choices=list(GROW_DTYPES),
                   help="dtype of the grown model's weights (default bfloat16)")
    add_device(p, note="; cuda builds a real-size model faster")
    p.set_defaults(func=grow)


def calibrate(args: argparse.Namespace) -> int:
    import torch

    from ..assets import resolve_model
    from ..assets.loading import load_pretrained
    from ..assets.texts import read_texts
    from ..hf.calibrate import calibrate as calibrate_model

    source = resolve_model(args.model)  # a typo or a model psr_hf cannot patch fails here, before loading
    set_threads(args, device=args.device, hidden_size=source.hidden_size)
    texts = read_texts("--text", args.text)
    dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model, tokenizer = load_pretrained(source, args.device, dtype)
    calibration = calibrate_model(model, texts, tokenizer=tokenizer, max_length=args.max_length,
                                  batch_size=args.batch_size, max_tokens=args.max_tokens, progress=True)
    calibration.save(args.out)
    print(f"calibration of {calibration.num_layers} MoE layers x {calibration.num_experts} experts, "
          f"token prior over {calibration.vocab_size} ids: {args.out}")
    print("delta per layer: " + " ".join(f"{d:.3f}" for d in calibration.delta))
    return 0


def _count(n: int) -> str:
    """A parameter count for people: 8.7 M, 6.92 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def grow(args: argparse.Namespace) -> int:
    import torch

    from ..assets import resolve_model
    from ..assets.grow import default_target, grow_pretrained, target_by_name

    source = resolve_model(args.model)  # a typo or a model psr_hf cannot patch fails here, before loading
    if source.directory is None:
        raise ValueError(f"--model {args.model}: grow needs a local model directory; download it first "
                         f"(huggingface-cli download {args.model}) and give the directory")
    target = target_by_name(args.target) if args.target else default_target(source.model_type)
    changes = {}
    for item in args.override:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ValueError(f"--override {item!r}: give FIELD=VALUE, e.g. hidden_size=512")
        changes[field.strip().replace("-", "_")] = value
    target = target.with_dims(**changes)
    dtype = getattr(torch, GROW_DTYPES[args.dtype])
    out = grow_pretrained(source.directory, args.out, target, dtype=dtype, device=args.device)
    record = json.loads((out / "grown_from.json").read_text(encoding="utf-8"))
    print(f"grew {args.model} ({record['model_type']}, {_count(record['parameters_before'])} parameters) to "
          f"{target.name} ({_count(record['parameters_after'])} parameters, {record['dtype']}): {out}")
    return 0
