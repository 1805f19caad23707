"""``psr-hf quantize``: a bf16 or float32 model written as the block-wise FP8 checkpoint that DeepSeek-V3 and Qwen3.6
ship (docs/quantized.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ..assets import NAMED_MODELS

WHAT = ("write a bfloat16 or float32 model as the official fine-grained FP8 checkpoint (e4m3 weights with one "
        "float32 scale per 128x128 block, as DeepSeek-V3 and Qwen3.6 ship them); embeddings, the output head, "
        "norms, routers and Gated DeltaNet's small tensors stay as they are")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("quantize", help=WHAT, description=WHAT + " (docs/quantized.md)")
    p.add_argument("src", metavar="SRC", help=f"the model to quantize: {', '.join(NAMED_MODELS)}, a model "
                                              "directory or a hub id owner/name in the local hub cache")
    p.add_argument("dst", metavar="DST", help="folder to write the FP8 checkpoint to (new or empty)")
    p.set_defaults(func=quantize)


def _size(n: int) -> str:
    """Bytes for people: 17.2 MB, 34.70 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def quantize(args: argparse.Namespace) -> int:
    from .._paths import check_output
    from ..assets import resolve_model
    from ..assets.quantize import quantize_checkpoint

    check_output("DST", args.dst, directory=True)
    source = resolve_model(args.src)  # a typo or a model psr_hf cannot patch fails here, before reading weights
    if source.directory is None:
        raise ValueError(f"{args.src}: quantize reads a local model folder; download it first "
                         f"(huggingface-cli download {args.src}) and give the folder")
    report = quantize_checkpoint(source.directory, args.dst)
    kept = ", ".join(f"{count} {reason}" for reason, count in report.kept.items())
    print(f"quantized {args.src} to {report.dst} (FP8 e4m3, 128x128 blocks): {report.quantized} weights quantized "
          f"with their scales, {sum(report.kept.values())} tensors kept as they were ({kept}); "
          f"{_size(report.bytes_before)} -> {_size(report.bytes_after)}")
    return 0
