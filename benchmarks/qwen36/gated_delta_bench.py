"""Device time of a Gated DeltaNet layer's decode step after its input projections, at Qwen3.6-35B-A3B's shape: the
engine's torch step (:func:`~psr_hf.engine.gated_delta_kernel.gated_delta_step_reference`, ~30 launches) against the
one-kernel step (:func:`~psr_hf.engine.gated_delta_kernel.gated_delta_step`). Each is captured as one CUDA graph of
``--layers`` layers' steps, every layer with its own weights, window and float32 state (so that the state streams
from memory as in decoding), and replayed ``--replays`` times between two timing events, in interleaved rounds (the
order rotated by one per round). The record gives us per layer (median over rounds, the 95% t-interval of the
mean), the kernel's speed-up paired by round, the bandwidth achieved on the bytes a step must move (the state read
and written; everything) and, with ``--hbm-gbps``, the time those bytes take at the memory's peak. Before timing,
one step of each from the same inputs and states is compared (largest differences in the record).

On the lent GPU, from the repository root (``source benchmarks/device_env.sh`` first):
    python3 benchmarks/qwen36/gated_delta_bench.py --json "$OUT/gated_delta.json" --num-warps 4 8 --hbm-gbps 4800
Smoke test on the CPU (no graphs, the kernel in Triton's interpreter, a few layers; the times mean nothing):
    python3 benchmarks/qwen36/gated_delta_bench.py --device cpu --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from psr_hf.bench.common import graph_replay, machine, paired_ratio, rotated, summarize, timed_us, versions
from psr_hf.engine.gated_delta_kernel import Shape, gated_delta_step, gated_delta_step_reference, step_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QWEN36 = Shape(k_heads=16, v_heads=32, k_dim=128, v_dim=128, kernel=4)
TORCH = "torch"


def _layer(shape: Shape, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> dict:
    """One layer's step arguments, random: the projections' outputs, the layer's weights, a nonzero window and
    state."""
    conv_dim = 2 * shape.k_heads * shape.k_dim + shape.v_heads * shape.v_dim

    def rand(*size: int, scale: float = 1.0, like: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=like)

    return {"mixed": rand(conv_dim), "z": rand(shape.v_heads, shape.v_dim), "b": rand(shape.v_heads),
            "g_in": rand(shape.v_heads), "conv": rand(conv_dim, shape.kernel),
            "recurrent": rand(shape.v_heads, shape.k_dim, shape.v_dim, scale=0.1, like=torch.float32),
            "conv_weight": rand(conv_dim, shape.kernel, scale=0.5), "conv_bias": None,
            "A_log": rand(shape.v_heads, scale=0.5), "dt_bias": rand(shape.v_heads),
            "norm_weight": 1.0 + rand(shape.v_dim, scale=0.1), "norm_eps": 1e-6}


def _step(name: str) -> Callable[..., torch.Tensor]:
    if name == TORCH:
        return gated_delta_step_reference
    warps = int(name.rsplit("_w", 1)[1]) if "_w" in name else None
    return lambda **kw: gated_delta_step(**kw, num_warps=warps)


def _steps(layers: list[dict], step: Callable[..., torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for layer in layers:
            step(**layer)
    return run


def _agreement(shape: Shape, dtype: torch.dtype, device: torch.device, names: list[str]) -> dict[str, dict]:
    """Largest absolute differences of each kernel variant's output and updated states from the torch step's,
    after one step from the same inputs and states."""
    layer = _layer(shape, dtype, device, torch.Generator().manual_seed(1))
    fresh = lambda: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}  # noqa: E731
    want_args = fresh()
    want = gated_delta_step_reference(**want_args)
    out = {}
    for name in names:
        if name == TORCH:
            continue
        args = fresh()
        got = _step(name)(**args)
        out[name] = {key: float((a.float() - b.float()).abs().max())
                     for key, a, b in (("out", got, want), ("conv", args["conv"], want_args["conv"]),
                                       ("recurrent", args["recurrent"], want_args["recurrent"]))}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the model's dtype (the state is float32)")
    p.add_argument("--layers", type=int, default=None,
                   help="Gated DeltaNet layers per graph (cuda: 30, as Qwen3.6-35B-A3B; cpu: 2)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--replays", type=int, default=None, help="graph replays per timed interval (cuda 50, cpu 1)")
    p.add_argument("--num-warps", type=int, nargs="*", default=[],
                   help="kernel variants with these warps per program (the wrapper's choice is always timed)")
    p.add_argument("--k-heads", type=int, default=QWEN36.k_heads)
    p.add_argument("--v-heads", type=int, default=QWEN36.v_heads)
    p.add_argument("--k-dim", type=int, default=QWEN36.k_dim)
    p.add_argument("--v-dim", type=int, default=QWEN36.v_dim)
    p.add_argument("--kernel", type=int, default=QWEN36.kernel, help="the short convolution's width")
    p.add_argument("--hbm-gbps", type=float, default=None, help="the memory's peak GB/s (H200 4800, H100 3350)")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel runs in Triton's interpreter
    replays = args.replays or (50 if device.type == "cuda" else 1)
    layers = args.layers or (30 if device.type == "cuda" else 2)
    shape = Shape(args.k_heads, args.v_heads, args.k_dim, args.v_dim, args.kernel)
    dtype = DTYPES[args.dtype]
    names = [TORCH, "kernel", *(f"kernel_w{w}" for w in args.num_warps)]

    agreement = _agreement(shape, dtype, device, names)
    g = torch.Generator().manual_seed(0)
    calls = {}
    for name in names:  # every variant its own layers, so that none reads another's state
        steps = [_layer(shape, dtype, device, g) for _ in range(layers)]
        calls[name] = graph_replay(_steps(steps, _step(name)), device)
    per_layer = {name: [] for name in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            per_layer[name].append(timed_us(calls[name], replays, device) / (replays * layers))

    moved = step_bytes(shape, dtype)
    rows = {}
    for name in names:
        row = summarize(per_layer[name])
        seconds = row["median"] * 1e-6
        row["state_gbps"] = moved["state"] / seconds / 1e9
        row["total_gbps"] = moved["total"] / seconds / 1e9
        row["speedup_over_torch"] = paired_ratio(per_layer[TORCH], per_layer[name])
        if args.hbm_gbps:
            row["over_hbm_bound"] = seconds / (moved["total"] / (args.hbm_gbps * 1e9))
        rows[name] = row
    record = {"what": "Gated DeltaNet decode step after the input projections, us per layer",
              "shape": shape._asdict(), "dtype": args.dtype, "layers": layers, "rounds": args.rounds,
              "replays": replays, "graphs": device.type == "cuda", "bytes_per_step": moved,
              "hbm_gbps": args.hbm_gbps,
              "hbm_bound_us": moved["total"] / (args.hbm_gbps * 1e3) if args.hbm_gbps else None,
              "max_abs_diff_vs_torch": agreement, "us_per_layer": rows,
              "machine": machine(device), "versions": versions()}

    print(f"{record['machine']['device']}: {shape}, {args.dtype}, {layers} layers per graph, {args.rounds} rounds "
          f"x {replays} replays")
    print(f"{'step':12s} {'us/layer':>9s} {'95% interval':>20s} {'x torch':>8s} {'state GB/s':>11s} {'all GB/s':>9s}"
          + (f" {'x HBM bound':>11s}" if args.hbm_gbps else ""))
    for name, row in rows.items():
        low, high = row["ci95"]
        print(f"{name:12s} {row['median']:9.2f} {f'[{low:.2f}, {high:.2f}]':>20s} "
              f"{row['speedup_over_torch']['ratio']:8.2f} {row['state_gbps']:11.1f} {row['total_gbps']:9.1f}"
              + (f" {row['over_hbm_bound']:11.2f}" if args.hbm_gbps else ""))
    for name, diff in agreement.items():
        print(f"{name} vs torch, largest |difference|: " + ", ".join(f"{k} {v:.3g}" for k, v in diff.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
