"""Device time of the engine's batch-1 MoE over expert slots: bf16 weights (:func:`~psr_hf.engine.moe.moe_slots`)
against FP8 weights with 128x128 block scales (:func:`~psr_hf.engine.moe_fp8.moe_slots_fp8`), both through their
Triton kernels, at the OLMoE-1B-7B shape (H=2048, I=1024, K=8 of C=64 slots) and Qwen3.6-35B-A3B's (H=2048, I=512,
K=8 of C=128). Each is captured as one CUDA graph of ``--layers`` layers' calls, every layer with its own slot
buffers and selection (so that the selected weights stream from HBM, never from L2), replayed ``--replays`` times
between two timing events, in interleaved rounds (the order rotated by one per round). The record gives us per
layer (median over rounds, the 95% t-interval of the mean), each variant's time over bf16's paired by round, the
bandwidth achieved on the bytes the K selected experts' weights (and scales) take and, with ``--hbm-gbps``, the time
those bytes take at the memory's peak. Before timing, the FP8 kernels are compared with the FP8 torch reference on
one layer (largest |difference| over the largest |reference|, in the record).

On the lent GPU, from the repository root (``source benchmarks/device_env.sh`` first):
    python3 benchmarks/engine/moe_fp8_bench.py --json "$OUT/moe_fp8.json" --hbm-gbps 3350
(3350 on an H100 SXM, 4800 on an H200). ``--fp8-tiles 32,128,4,1024,4`` adds FP8 variants with other tile sizes.
Smoke test on the CPU (no graphs, the kernels in Triton's interpreter, a tiny shape; the times mean nothing):
    python3 benchmarks/engine/moe_fp8_bench.py --device cpu --shapes tiny --layers 2 --rounds 2 --replays 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable

import torch

from psr_hf.bench.common import graph_replay, machine, paired_ratio, rotated, summarize, timed_us, versions
from psr_hf.engine.moe import MoeShape, moe_slots, new_workspace
from psr_hf.engine.moe_fp8 import (
    FP8_DTYPE,
    check_blocks,
    check_fp8_shapes,
    fp8_triton_blocks,
    moe_slots_fp8,
    moe_slots_fp8_reference,
    moe_slots_fp8_triton,
    scale_shapes,
)

SHAPES = {"olmoe": MoeShape(hidden=2048, intermediate=1024, capacity=64, top_k=8),
          "qwen36": MoeShape(hidden=2048, intermediate=512, capacity=128, top_k=8),
          "tiny": MoeShape(hidden=256, intermediate=192, capacity=6, top_k=2)}  # the CPU smoke test's
BF16, FP8 = "bf16", "fp8"
TILE_KEYS = ("BLOCK_I1", "BLOCK_H1", "BLOCK_O2", "BLOCK_I2", "num_warps")


# ---------------------------------------------------------------------------------------------- layers
def _selection(shape: MoeShape, g: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's token and routing: x [H] bf16, K distinct slots (int32), their weights, out, workspace."""
    slots = torch.randperm(shape.capacity, generator=g)[:shape.top_k].to(torch.int32)
    return {"x": torch.randn(shape.hidden, generator=g).to(torch.bfloat16).to(device), "slots": slots.to(device),
            "weights": torch.rand(shape.top_k, generator=g).to(device),
            "out": torch.empty(shape.hidden, dtype=torch.bfloat16, device=device),
            "workspace": new_workspace(shape.top_k, shape.intermediate, device)}


def _bf16_layer(shape: MoeShape, g: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    C, H, I = shape.capacity, shape.hidden, shape.intermediate
    weights = lambda *size, n: torch.randn(*size, dtype=torch.bfloat16, device=device).mul_(n ** -0.5)  # noqa: E731
    return {**_selection(shape, g, device), "gate_up": weights(C, 2 * I, H, n=H), "down": weights(C, H, I, n=I)}


def _fp8_layer(shape: MoeShape, g: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Random e4m3 values (normal times 16, well inside e4m3's range) and positive block scales."""
    C, H, I = shape.capacity, shape.hidden, shape.intermediate
    gate_up_blocks, down_blocks = scale_shapes(H, I)
    fp8 = lambda *size: torch.randn(*size, dtype=torch.bfloat16, device=device).mul_(16).to(FP8_DTYPE)  # noqa: E731
    scale = lambda blocks, n: torch.rand(C, *blocks, device=device).add_(0.5).mul_(n ** -0.5 / 16)  # noqa: E731
    return {**_selection(shape, g, device), "gate_up": fp8(C, 2 * I, H), "gate_up_scale": scale(gate_up_blocks, H),
            "down": fp8(C, H, I), "down_scale": scale(down_blocks, I)}


def _call(name: str, blocks: dict[str, int] | None) -> Callable[[dict], torch.Tensor]:
    if name == BF16:
        return lambda a: moe_slots(a["x"], a["slots"], a["weights"], a["gate_up"], a["down"], a["out"],
                                   workspace=a["workspace"], backend="triton")
    if blocks is None:
        return lambda a: moe_slots_fp8(a["x"], a["slots"], a["weights"], a["gate_up"], a["gate_up_scale"], a["down"],
                                       a["down_scale"], a["out"], workspace=a["workspace"], backend="triton")
    return lambda a: moe_slots_fp8_triton(a["x"], a["slots"], a["weights"], a["gate_up"], a["gate_up_scale"],
                                          a["down"], a["down_scale"], a["out"], workspace=a["workspace"],
                                          blocks=blocks)


def _tiles(text: str) -> dict[str, int]:
    """``"I1,H1,O2,I2,W"`` as the blocks of :func:`~psr_hf.engine.moe_fp8.moe_slots_fp8_triton`."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(TILE_KEYS):
        raise argparse.ArgumentTypeError(f"--fp8-tiles {text!r}: expected five integers {','.join(TILE_KEYS)}, "
                                         "e.g. 32,128,4,1024,4")
    try:
        return check_blocks(dict(zip(TILE_KEYS, values)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------------------------------- agreement
def _agreement(layer: dict[str, torch.Tensor]) -> dict[str, float]:
    """The FP8 kernels against the FP8 torch reference on one layer: float32 out against the reference in
    float32 (x upcast), bf16 out against the reference in bf16; largest |difference| / largest |reference|."""
    check_fp8_shapes(**{k: layer[k] for k in ("x", "slots", "weights", "gate_up", "gate_up_scale", "down",
                                               "down_scale", "out", "workspace")})
    weights = [layer[k] for k in ("gate_up", "gate_up_scale", "down", "down_scale")]
    x, slots, routing, H = layer["x"], layer["slots"], layer["weights"], layer["x"].shape[0]
    out = {}
    for what, dtype in (("fp32_out_vs_reference_fp32", torch.float32),
                        ("bf16_out_vs_reference_bf16", torch.bfloat16)):
        want = moe_slots_fp8_reference(x.to(dtype), slots, routing, *weights,
                                       torch.empty(H, dtype=dtype, device=x.device))
        got = moe_slots_fp8_triton(x, slots, routing, *weights, torch.empty(H, dtype=dtype, device=x.device))
        out[what] = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return out


def selected_bytes(shape: MoeShape) -> dict[str, int]:
    """Bytes the K selected experts' weights take per layer: bf16; FP8 values plus their float32 block scales."""
    weights = shape.top_k * 3 * shape.hidden * shape.intermediate
    gate_up_blocks, down_blocks = scale_shapes(shape.hidden, shape.intermediate)
    scales = shape.top_k * 4 * (gate_up_blocks[0] * gate_up_blocks[1] + down_blocks[0] * down_blocks[1])
    return {BF16: 2 * weights, FP8: weights + scales}


# ---------------------------------------------------------------------------------------------- one shape
def _bench_shape(shape: MoeShape, args: argparse.Namespace, device: torch.device) -> dict:
    """Every variant's graph of ``args.layers`` layers built (each its own layers), timed in rotated rounds, freed."""
    g = torch.Generator().manual_seed(0)
    variants = {BF16: None, FP8: None}
    variants.update({"fp8_" + "_".join(map(str, tiles.values())): tiles for tiles in args.fp8_tiles})
    replays, agreement = {}, None
    for name, blocks in variants.items():
        make = _bf16_layer if name == BF16 else _fp8_layer
        layers = [make(shape, g, device) for _ in range(args.layers)]
        if name == FP8:
            agreement = _agreement(layers[0])
        call = _call(name, blocks)
        replays[name] = (graph_replay(lambda layers=layers, call=call: [call(a) for a in layers], device), layers)
    per_layer = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in rotated(list(variants), r):
            per_layer[name].append(timed_us(replays[name][0], args.replays, device) / (args.replays * args.layers))
    moved = selected_bytes(shape)
    rows = {}
    for name in variants:
        row = summarize(per_layer[name])
        row["bytes"] = moved[BF16 if name == BF16 else FP8]
        row["gbps"] = row["bytes"] / (row["median"] * 1e-6) / 1e9
        row["over_bf16"] = paired_ratio(per_layer[name], per_layer[BF16])
        default = None if name == BF16 else fp8_triton_blocks(shape.hidden, shape.intermediate)
        row["blocks"] = variants[name] or default
        if args.hbm_gbps:
            row["over_hbm_bound"] = row["median"] * 1e-6 / (row["bytes"] / (args.hbm_gbps * 1e9))
        rows[name] = row
    del replays
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": dataclasses.asdict(shape), "us_per_layer": rows, "fp8_vs_reference": agreement}


def _print_table(record: dict) -> None:
    hbm = record["hbm_gbps"]
    print(f"{record['machine']['device']}: {record['layers']} layers per graph, {record['rounds']} rounds x "
          f"{record['replays']} replays")
    print(f"{'shape':7s} {'variant':22s} {'us/layer':>9s} {'95% interval':>18s} {'x bf16':>7s} {'MB':>7s} "
          f"{'GB/s':>7s}" + (f" {'x HBM bound':>11s}" if hbm else ""))
    for shape_name, result in record["shapes"].items():
        for name, row in result["us_per_layer"].items():
            low, high = row["ci95"]
            print(f"{shape_name:7s} {name:22s} {row['median']:9.2f} {f'[{low:.2f}, {high:.2f}]':>18s} "
                  f"{row['over_bf16']['ratio']:7.3f} {row['bytes'] / 1e6:7.1f} {row['gbps']:7.0f}"
                  + (f" {row['over_hbm_bound']:11.2f}" if hbm else ""))
        diff = result["fp8_vs_reference"]
        print(f"{shape_name}: FP8 kernels vs the FP8 torch reference, largest |difference| / largest |reference|: "
              + ", ".join(f"{k} {v:.2g}" for k, v in diff.items()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test (Triton's interpreter)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["olmoe", "qwen36"])
    p.add_argument("--layers", type=int, default=16, help="layers per graph, each with its own slots (default 16)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--replays", type=int, default=20, help="graph replays per timed interval (default 20)")
    p.add_argument("--fp8-tiles", type=_tiles, nargs="*", default=[], metavar="I1,H1,O2,I2,W",
                   help="FP8 variants with these tile sizes and warps (BLOCK_I1,BLOCK_H1,BLOCK_O2,BLOCK_I2,num_warps; "
                        "the first three divide 128)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="the memory's peak GB/s (H100 SXM 3350, H200 4800)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the record here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter; the times mean nothing
    elif not torch.cuda.is_available():
        raise SystemExit("moe_fp8_bench: needs an NVIDIA GPU (torch.cuda.is_available() is False); this benchmark "
                         "times CUDA graphs. On the CPU, tests/test_engine_moe_fp8.py checks the kernels in Triton's "
                         "interpreter.")
    if args.layers < 1 or args.rounds < 2 or args.replays < 1:
        raise SystemExit("moe_fp8_bench: --layers and --replays must be >= 1 and --rounds >= 2 (for an interval)")
    torch.manual_seed(0)  # the weights (the selections come from their own generator)
    shapes = {name: _bench_shape(SHAPES[name], args, device) for name in args.shapes}
    record = {"what": "batch-1 MoE over expert slots, bf16 against FP8 (128x128 block scales), us per layer",
              "layers": args.layers, "rounds": args.rounds, "replays": args.replays, "graphs": device.type == "cuda",
              "hbm_gbps": args.hbm_gbps, "shapes": shapes, "machine": machine(device), "versions": versions()}
    _print_table(record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
