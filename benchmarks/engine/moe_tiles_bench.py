"""Tiles of the engine's bf16 slot MoE kernels (psr_hf.engine.moe), each kernel timed by itself, on the decode
step's shape: which rows per program, columns per loop step, warps, pipeline stages (and, for kernel 2, the unroll
of its loop over the K experts) stream the selected experts' weights fastest.

A tile decides the order of the float32 sums, so the engine fixes its tiles (``triton_blocks``); this script is
how they are chosen. Kernel 1 (gate/up) is swept with kernel 2 at the default, then kernel 2 with kernel 1 at the
best found, then the default, the chosen pair and the chosen pair with programmatic dependent launches are timed
together in interleaved rounds (rotated order), paired by round. Each kernel is a CUDA graph of ``--layers``
launches, every layer with its own slot buffers and selection (so the weights come from HBM, as in a decode step),
replayed ``--replays`` times between two events; medians over ``--rounds``. The bandwidth is the selected experts' weight bytes over the time. Every tile's output is compared
with the default tile's (largest |difference| over the largest |value|: a tile changes only the sums' order).

On the lent GPU, from the repository root (``source benchmarks/device_env.sh`` first):
    python3 benchmarks/engine/moe_tiles_bench.py --json "$OUT/moe_tiles.json" --hbm-gbps 3350
Smoke test on the CPU (Triton's interpreter, a tiny shape, two tiles per kernel; the times mean nothing):
    python3 benchmarks/engine/moe_tiles_bench.py --device cpu --shape tiny --layers 2 --rounds 2 --replays 1 \\
        --tiles1 8,64,4,1 16,32,4,3 --tiles2 4,64,4,1,1 8,64,4,3,2
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import torch

from psr_hf.bench.common import graph_replay, machine, paired_ratio, rotated, summarize, timed_us, versions
from psr_hf.cli.console import write_json
from psr_hf.engine import tuned_tiles
from psr_hf.engine.moe import (
    MoeShape,
    check_blocks,
    launch_down,
    launch_gate_up,
    moe_slots_triton,
    new_workspace,
    shape_key,
    triton_blocks,
)

SHAPES = {"olmoe": MoeShape(hidden=2048, intermediate=1024, capacity=64, top_k=8),
          "moonlight": MoeShape(hidden=2048, intermediate=1408, capacity=64, top_k=6),
          "qwen36": MoeShape(hidden=2048, intermediate=512, capacity=128, top_k=8),
          "tiny": MoeShape(hidden=128, intermediate=96, capacity=6, top_k=2)}
KEYS1 = ("BLOCK_I1", "BLOCK_H1", "WARPS1", "STAGES1")
KEYS2 = ("BLOCK_O2", "BLOCK_I2", "WARPS2", "STAGES2", "UNROLL2")
#: the default sweeps (the defaults among them): tiles of at most 8192 float32 accumulators per matrix, kernel 2's
#: stages and unroll in three pairs
GRID1 = [t for t in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1, 3)) if t[0] * t[1] <= 8192]
GRID2 = [(o, i, w, s, u) for o, i, w, (s, u) in itertools.product((2, 4, 8), (512, 1024), (4, 8),
                                                                  ((3, 1), (1, 4), (3, 4)))]


def _tile(keys: tuple) -> callable:
    def parse(text: str) -> tuple:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != len(keys):
            raise argparse.ArgumentTypeError(f"tile {text!r}: expected {len(keys)} integers {','.join(keys)}")
        return values
    return parse


def _layers(shape: MoeShape, count: int, device: torch.device) -> list[dict]:
    """``count`` layers, each its own slot buffers, token, K distinct slots, routing weights, workspace, output."""
    g = torch.Generator().manual_seed(0)
    C, H, I, K = shape.capacity, shape.hidden, shape.intermediate, shape.top_k
    out = []
    for _ in range(count):
        out.append({"x": torch.randn(H, generator=g).to(torch.bfloat16).to(device),
                    "slots": torch.randperm(C, generator=g)[:K].to(torch.int32).to(device),
                    "weights": torch.rand(K, generator=g).to(device),
                    "gate_up": (torch.randn(C, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16).to(device),
                    "down": (torch.randn(C, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).to(device),
                    "h": new_workspace(K, I, device), "out": torch.empty(H, dtype=torch.bfloat16, device=device)})
    return out


def _run(layers: list[dict], blocks: dict, which: str, interpret: bool) -> None:
    for a in layers:
        if which in ("gate_up", "both"):
            launch_gate_up(a["x"], a["slots"], a["weights"], a["gate_up"], a["h"], blocks, interpret)
        if which in ("down", "both"):
            launch_down(a["h"], a["slots"], a["down"], a["out"], None, blocks, interpret)


def _reference(layers: list[dict]) -> list[torch.Tensor]:
    """Each layer's output with the default tiles (both kernels), the comparison for every tile."""
    outs = []
    for a in layers:
        moe_slots_triton(a["x"], a["slots"], a["weights"], a["gate_up"], a["down"], a["out"], workspace=a["h"])
        outs.append((a["h"].clone(), a["out"].float().clone()))
    return outs


def _difference(layers: list[dict], reference: list, which: str) -> float:
    got = [a["h"] if which == "gate_up" else a["out"].float() for a in layers]
    want = [h if which == "gate_up" else out for h, out in reference]
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def _time(layers: list[dict], blocks: dict, which: str, args: argparse.Namespace, device: torch.device,
          interpret: bool) -> list[float]:
    """us per layer in each round: one graph of the layers' launches replayed ``--replays`` times."""
    replay = graph_replay(lambda: _run(layers, blocks, which, interpret), device)
    replays = args.replays if device.type == "cuda" else 1
    return [timed_us(replay, replays, device) / (replays * len(layers)) for _ in range(args.rounds)]


def sweep(which: str, base: dict, tiles: list[tuple], keys: tuple, layers: list[dict], reference: list,
          bytes_per_layer: int, args: argparse.Namespace, device: torch.device, interpret: bool) -> list[dict]:
    """Every tile of one kernel (the other kernel's tiles from ``base``), timed alone: its rows, fastest first;
    a tile that fails (does not compile, too many resources) is kept with its error."""
    rows = []
    for values in tiles:
        blocks = {**base, **dict(zip(keys, values))}
        row = {"tile": dict(zip(keys, values))}
        try:
            check_blocks(blocks)
            _run(layers, blocks, "both" if which == "down" else which, interpret)  # compiles, and h for kernel 2
            row["difference"] = _difference(layers, reference, which)
            row.update(summarize(_time(layers, blocks, which, args, device, interpret)))
            row["gbps"] = bytes_per_layer / (row["median"] * 1e-6) / 1e9
        except Exception as exc:  # one tile failing must not stop the sweep
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if device.type == "cuda":
                torch.cuda.synchronize()
        rows.append(row)
        shown = (f"{row['median']:8.2f} us/layer {row['gbps']:6.0f} GB/s  |d| {row['difference']:.1e}"
                 if "error" not in row else f"failed: {row['error'][:120]}")
        print(f"  {which:8s} {','.join(map(str, values)):22s} {shown}", flush=True)
    return sorted(rows, key=lambda r: r.get("median", float("inf")))


def _compare(layers: list[dict], variants: dict[str, dict], args: argparse.Namespace, device: torch.device,
             interpret: bool) -> dict:
    """Both kernels with each variant's tiles, in interleaved rounds (rotated order); each variant's time over the
    first's, paired by round."""
    replays = args.replays if device.type == "cuda" else 1
    graphs = {name: graph_replay(lambda b=b: _run(layers, b, "both", interpret), device)
              for name, b in variants.items()}
    times = {name: [] for name in graphs}
    for r in range(max(args.rounds, 2)):
        for name in rotated(list(graphs), r):
            times[name].append(timed_us(graphs[name], replays, device) / (replays * len(layers)))
    first = next(iter(variants))
    return {name: {**summarize(times[name]), "blocks": variants[name],
                   "over_" + first: paired_ratio(times[name], times[first])} for name in variants}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test (Triton's interpreter)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    p.add_argument("--layers", type=int, default=16, help="layers per graph, each with its own slots (default 16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replays", type=int, default=20, help="graph replays per timed interval (default 20)")
    p.add_argument("--tiles1", type=_tile(KEYS1), nargs="+", default=GRID1, metavar=",".join(KEYS1))
    p.add_argument("--tiles2", type=_tile(KEYS2), nargs="+", default=GRID2, metavar=",".join(KEYS2))
    p.add_argument("--hbm-gbps", type=float, default=None, help="the memory's peak GB/s (H100 SXM 3350, H200 4800)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the record here")
    p.add_argument("--table", default=None, metavar="TABLE",
                   help="write the chosen tiles into this tuned-tiles table (psr_hf/engine/tuned_tiles.json) when "
                        "the pair's whole 95%% interval is faster than the defaults")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter; the times mean nothing
    elif not torch.cuda.is_available():
        raise SystemExit("moe_tiles_bench: needs an NVIDIA GPU (torch.cuda.is_available() is False); on the CPU, "
                         "pass --device cpu for a smoke test")
    if args.layers < 1 or args.rounds < 2 or args.replays < 1:
        raise SystemExit("moe_tiles_bench: --layers and --replays must be >= 1 and --rounds >= 2 (for an interval)")
    interpret = device.type == "cpu"
    shape = SHAPES[args.shape]
    H, I, K = shape.hidden, shape.intermediate, shape.top_k
    layers = _layers(shape, args.layers, device)
    reference = _reference(layers)
    default = dict(triton_blocks(H, I))
    bytes1, bytes2 = K * 2 * I * H * 2, K * H * I * 2
    print(f"{args.shape}: H {H}, I {I}, K {K} of {shape.capacity} slots, {args.layers} layers per graph; "
          f"default tiles {default}", flush=True)
    rows1 = sweep("gate_up", default, args.tiles1, KEYS1, layers, reference, bytes1, args, device, interpret)
    best1 = {**default, **rows1[0]["tile"]} if "median" in rows1[0] else default
    rows2 = sweep("down", best1, args.tiles2, KEYS2, layers, reference, bytes2, args, device, interpret)
    chosen = {**best1, **rows2[0]["tile"]} if "median" in rows2[0] else best1
    both = _compare(layers, {"default": default, "chosen": chosen, "chosen_pdl": {**chosen, "PDL": 1}}, args,
                    device, interpret)
    print(f"chosen {chosen}")
    for name, row in both.items():
        ratio = row["over_default"]
        print(f"  both kernels, {name:10s} {row['median']:8.2f} us/layer, over default {ratio['ratio']:.3f} "
              f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] (paired over {len(ratio['rounds'])} rounds)")
    faster = both["chosen"]["over_default"]["ci95"][1] < 1.0
    if args.table and faster and device.type == "cuda":
        evidence = {"benchmark": "benchmarks/engine/moe_tiles_bench.py",
                    "us_per_layer_default": both["default"]["median"], "us_per_layer_chosen": both["chosen"]["median"],
                    "chosen_over_default": both["chosen"]["over_default"]}
        tuned_tiles.record("slot_moe", device, shape_key(H, I, K), chosen, evidence, Path(args.table))
    if args.table:
        print(f"table {args.table}: " + ("chosen tiles written" if faster and device.type == "cuda" else
                                         "left as it was (the chosen tiles are not shown faster, or not on a GPU)"))
    record = {"what": "the bf16 slot MoE's kernels by tile, us per layer, each kernel alone", "shape": args.shape,
              "sizes": {"hidden": H, "intermediate": I, "top_k": K, "capacity": shape.capacity},
              "bytes_per_layer": {"gate_up": bytes1, "down": bytes2}, "layers": args.layers, "rounds": args.rounds,
              "replays": args.replays, "graphs": device.type == "cuda", "hbm_gbps": args.hbm_gbps,
              "default": default, "gate_up": rows1, "down": rows2, "chosen": chosen, "both": both,
              "machine": machine(device), "versions": versions()}
    if args.hbm_gbps:
        record["hbm_bound_us"] = {k: v / (args.hbm_gbps * 1e3) for k, v in record["bytes_per_layer"].items()}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
