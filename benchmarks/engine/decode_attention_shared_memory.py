"""The shared memory the decode attention kernel's split program needs, compiled for a GPU target without a GPU
(Triton's ahead-of-time compile: ptxas must be on the PATH), for the engine families' head shapes in bfloat16 and
float32: a program needing more than the target's shared memory per block (227 KB on an H100) cannot launch.

    python benchmarks/engine/decode_attention_shared_memory.py            # sm_90, the default shapes
"""

from __future__ import annotations

import argparse
import os

SHAPES = {  # name: (query heads per key-value head, key head size, value head size)
    "olmoe": (1, 128, 128),
    "qwen3.6_full": (8, 256, 256),
    "gqa4": (4, 128, 128),
    "mla_192": (16, 192, 128),
    "mla_absorbed": (16, 576, 512),
}


def shared_bytes(group: int, d: int, dv: int, dtype: str, capability: int) -> int:
    """The split kernel's shared memory per program for one shape, as the engine launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from psr_hf.engine.decode_attention_kernel import _pow2
    from psr_hf.engine.device_decisions import triton_module

    kernel = triton_module("decode_attention_kernel.py", False).decode_split_kernel
    block_d = max(16, _pow2(d))
    const = dict(G=group, D=d, DV=dv, SPLITS=256, BLOCK_G=max(16, _pow2(group)) if group > 1 else 1,
                 BLOCK_T=max(16, min(64, 8192 // block_d)), BLOCK_D=block_d, BLOCK_DV=max(16, _pow2(dv)),
                 DOT=group > 1, DOT_F32=dtype == "fp32", WIDE=False)
    ptr = "*" + dtype
    signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "pos_ptr": "*i64", "ws_ptr": "*fp32", "T": "i32",
                 "scaling": "fp32"}
    for name in kernel.arg_names:
        signature.setdefault(name, "constexpr" if name in const else "i32")
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": 4 if block_d <= 256 else 8})
    return int(compiled.metadata.shared)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capability", type=int, default=90, help="the target's compute capability (H100: 90)")
    ap.add_argument("--limit-kb", type=float, default=227, help="shared memory per block on the target")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    print(f"triton {triton.__version__}, sm_{args.capability}, limit {args.limit_kb:g} KB per block")
    print(f"{'shape':14s} {'G':>3s} {'D':>4s} {'Dv':>4s} {'dtype':6s} {'shared KB':>10s}  fits")
    for name, (group, d, dv) in SHAPES.items():
        for dtype in ("bf16", "fp32"):
            kb = shared_bytes(group, d, dv, dtype, args.capability) / 1024
            print(f"{name:14s} {group:3d} {d:4d} {dv:4d} {dtype:6s} {kb:10.1f}  {'yes' if kb <= args.limit_kb else 'NO'}")


if __name__ == "__main__":
    main()
