"""The fused batch-1 GEMV (psr_hf.engine.gemv_kernel.linear_many) against cuBLAS (F.linear once per weight), on the
decode step's shapes: OLMoE's q/k/v (3 x [2048, 2048] in one launch), its o_proj alone ([2048, 2048]), a router
stack ([128, 2048]) and an lm_head-like [50304, 2048], bf16, each for several block configurations.

On a GPU each row is a CUDA graph of ``--calls`` calls replayed, timed between events, median over ``--rounds``.
The calls cycle over copies of the weights whose bytes together pass ``--min-bytes`` (four H100 L2 caches by
default), so that, as in a decode step where every other layer's weights pass through the L2 between two calls,
the weights come from HBM. Prints a table (us per call, the weights' bytes over the time in TB/s, the largest
difference from cuBLAS and from the float32 product) and writes a JSON record. A configuration that fails (does not
compile, runs out of resources) is reported on its row and the others still run.

    python benchmarks/engine/gemv_bench.py --json OUT.json                  # the four shapes on CUDA
    python benchmarks/engine/gemv_bench.py --shapes qkv --configs auto 16x512x4x1 8x512x8x1
    python benchmarks/engine/gemv_bench.py --device cpu --hidden 64 --shapes router --configs auto --rounds 1

A configuration is ``auto`` (linear_many's defaults) or ``BNxBHxWxS``: rows per program, H columns per loop step,
warps, programs per row block along H (``split_h``), optionally ``xP``: the loop's software-pipeline stages, and
``xD``: 1 for programmatic dependent launches (each call may start while the one before it runs). On
the CPU the kernel runs in Triton's interpreter, once, to check that the script runs (its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from psr_hf.bench.common import graph_replay, machine, timed_us

#: name -> rows of each weight launched together (H from --hidden)
SHAPES = {"qkv": (2048, 2048, 2048), "o_proj": (2048,), "router": (128,), "lm_head": (50304,)}
CONFIGS = ["auto", "4x512x4x1", "8x512x4x1", "16x512x4x1", "16x256x4x1", "32x256x4x1", "16x512x8x1",
           "32x256x8x1", "8x1024x4x1", "4x512x4x2", "4x512x4x4", "16x512x4x2"]


def parse_config(text: str) -> dict:
    """``auto`` -> {} (the defaults); ``BNxBHxWxS``, ``BNxBHxWxSxP`` or ``BNxBHxWxSxPxD`` -> linear_many's keywords
    (``P``: stages, ``D``: 1 for a programmatic dependent launch)."""
    if text == "auto":
        return {}
    try:
        values = [int(v) for v in text.split("x")]
    except ValueError:
        values = []
    if len(values) not in (4, 5, 6) or (len(values) == 6 and values[5] not in (0, 1)):
        raise argparse.ArgumentTypeError(f"config {text!r}: 'auto', BNxBHxWxS, BNxBHxWxSxP or BNxBHxWxSxPxD, D 0 or 1 "
                                         "(e.g. 16x512x4x1, 4x1024x4x1x2, 4x2048x4x1x1x1)")
    keys = ("block_n", "block_h", "num_warps", "split_h", "num_stages", "pdl")
    return dict(zip(keys, values))


def _copies(rows: tuple, hidden: int, min_bytes: int, max_copies: int) -> int:
    set_bytes = sum(rows) * hidden * 2
    return max(1, min(max_copies, -(-min_bytes // set_bytes)))


def _time(call_i, copies: int, args: argparse.Namespace, device: torch.device) -> list[float]:
    """us per call over rounds: ``--calls`` calls (``call_i(i)`` uses copy ``i % copies``) in one graph, replayed."""
    calls = args.calls if device.type == "cuda" else 1

    def run() -> None:
        for i in range(calls):
            call_i(i % copies)

    replay = graph_replay(run, device)
    if device.type != "cuda":
        return [timed_us(replay, 1, device) / calls]
    return [timed_us(replay, 1, device) / calls for _ in range(args.rounds)]


def bench_shape(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    from psr_hf.engine.gemv_kernel import default_blocks, linear_many

    rows = SHAPES[name] if name != "lm_head" else (args.vocab,)
    H = args.hidden
    g = torch.Generator(device="cpu").manual_seed(0)
    copies = _copies(rows, H, args.min_bytes, args.max_copies) if device.type == "cuda" else 1
    weight_sets = [tuple((torch.randn(n, H, generator=g) / H ** 0.5).to(device=device, dtype=torch.bfloat16)
                         for n in rows) for _ in range(copies)]
    x = torch.randn(1, H, generator=g).to(device=device, dtype=torch.bfloat16)
    weight_bytes = sum(rows) * H * 2
    exact = [F.linear(x.float(), w.float()) for w in weight_sets[0]]
    cublas_out = [F.linear(x, w) for w in weight_sets[0]]

    def diffs(got: list) -> dict:
        return {"vs_cublas": max((a.float() - b.float()).abs().max().item() for a, b in zip(got, cublas_out)),
                "vs_fp32": max((a.float() - b).abs().max().item() for a, b in zip(got, exact))}

    record = {"rows": list(rows), "hidden": H, "weight_bytes": weight_bytes, "copies": copies,
              "hbm_bound_us": weight_bytes / (args.hbm_tbps * 1e6), "default_blocks": default_blocks(rows, H, device),
              "rows_timed": []}
    print(f"\n{name}: rows {list(rows)}, H {H}, {weight_bytes / 1e6:.2f} MB of weights, {copies} copies; HBM bound "
          f"{record['hbm_bound_us']:.2f} us at {args.hbm_tbps} TB/s; defaults (block_n, block_h) "
          f"{record['default_blocks']}", flush=True)
    print(f"  {'config':14s} {'us/call':>9s} {'[min, max]':>18s} {'TB/s':>6s} {'vs cuBLAS':>10s} {'vs fp32':>9s}")
    entries = [("cublas", None)] + [(c, parse_config(c)) for c in args.configs]
    for label, kw in entries:
        row = {"config": label}
        try:
            if kw is None:
                def call_i(i: int) -> None:
                    for w in weight_sets[i]:
                        F.linear(x, w)

                got = [F.linear(x, w) for w in weight_sets[0]]
            else:
                outs = [torch.empty(1, n, device=device, dtype=x.dtype) for n in rows]

                def call_i(i: int, kw=kw, outs=outs) -> None:
                    linear_many(x, weight_sets[i], outs, **kw)

                got = [t.clone() for t in linear_many(x, weight_sets[0], **kw)]
            rounds = _time(call_i, copies, args, device)
            us = statistics.median(rounds)
            row.update({"us_rounds": rounds, "us_median": us, "tb_per_s": weight_bytes / (us * 1e6), **diffs(got)})
            print(f"  {label:14s} {us:9.2f} [{min(rounds):7.2f}, {max(rounds):7.2f}] {row['tb_per_s']:6.2f} "
                  f"{row['vs_cublas']:10.3g} {row['vs_fp32']:9.3g}", flush=True)
        except Exception as exc:  # one configuration failing must not stop the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=3)
            print(f"  {label:14s} failed: {row['error'][:200]}", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
        record["rows_timed"].append(row)
    return record


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="'auto' or BNxBHxWxS each (see above)")
    ap.add_argument("--hidden", type=int, default=2048, help="H of every shape (OLMoE: 2048)")
    ap.add_argument("--vocab", type=int, default=50304, help="rows of the lm_head shape")
    ap.add_argument("--calls", type=int, default=200, help="calls captured in one graph")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-bytes", type=int, default=200 << 20,
                    help="the weight copies the calls cycle over hold at least this many bytes (beyond the L2)")
    ap.add_argument("--max-copies", type=int, default=1024)
    ap.add_argument("--hbm-tbps", type=float, default=3.35, help="the HBM bandwidth the bound is quoted at")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None,
                    help="write each shape's fastest configuration (one launch, no PDL) into this tuned-tiles table "
                         "(psr_hf/engine/tuned_tiles.json) when its slowest round beats the defaults' fastest")
    args = ap.parse_args(argv)
    for c in args.configs:
        try:
            parse_config(c)
        except argparse.ArgumentTypeError as exc:
            ap.error(str(exc))
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"
    record = {"benchmark": "gemv", "dtype": "bfloat16", "machine": machine(device), "calls": args.calls,
              "rounds": args.rounds, "configs": args.configs, "shapes": {}}
    for name in args.shapes:
        record["shapes"][name] = bench_shape(name, args, device)
    if args.table:
        for name, result in record["shapes"].items():
            print(f"table {args.table}, {name}: {choose_for_table(result, args.table, device)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def choose_for_table(result: dict, table: str, device: torch.device) -> str:
    """Writes the shape's fastest one-launch configuration without PDL into the table when its slowest round beats
    the defaults' fastest; says what it did."""
    from psr_hf.engine import tuned_tiles
    from psr_hf.engine.gemv_kernel import shape_key

    timed = {row["config"]: row for row in result["rows_timed"] if "us_median" in row}
    auto = timed.get("auto")
    candidates = [row for name, row in timed.items() if name not in ("auto", "cublas")
                  and parse_config(name).get("split_h") == 1 and not parse_config(name).get("pdl")]
    if auto is None or not candidates or device.type != "cuda":
        return "left as it was (no defaults' row, no candidate, or not on a GPU)"
    best = min(candidates, key=lambda row: row["us_median"])
    if max(best["us_rounds"]) >= min(auto["us_rounds"]):
        return f"left as it was (the fastest, {best['config']}, does not beat the defaults in every round)"
    tiles = {k: v for k, v in parse_config(best["config"]).items() if k not in ("split_h", "pdl")}
    evidence = {"benchmark": "benchmarks/engine/gemv_bench.py", "us_defaults": auto["us_median"],
                "us_chosen": best["us_median"], "us_rounds_defaults": auto["us_rounds"],
                "us_rounds_chosen": best["us_rounds"]}
    tuned_tiles.record("linear_many", device, shape_key(result["rows"], result["hidden"]), tiles, evidence,
                       Path(table))
    return f"{best['config']} written ({best['us_median']:.2f} against {auto['us_median']:.2f} us)"


if __name__ == "__main__":
    main()
