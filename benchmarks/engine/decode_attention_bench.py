"""Device time of one token's attention over a static KV cache at OLMoE's shape (16 heads, 16 key-value heads, head
size 128, bf16): the engine's torch path over the whole cache
(:func:`~psr_hf.engine.decode_attention_kernel.decode_attention_reference`, six kernels) against the two kernels
that read the cache up to the position only (:func:`~psr_hf.engine.decode_attention_kernel.decode_attention`), at
each cache length ``T`` and position (``-1``: the last slot, ``T - 1``).

Each is captured as one CUDA graph of ``--layers`` calls, every layer with its own cache (so that the keys and
values stream from memory, not from L2, as in decoding), and replayed ``--replays`` times between two timing
events, in interleaved rounds (the order rotated by one per round). The table gives us per call (median over
rounds, the 95% t-interval of the mean), the speed-up over torch paired by round and the GB/s achieved on the keys
and values a call must read (slots ``0 .. position``). Before timing, each kernel variant's output is compared
with the torch path's and with the same math in float32 (largest |difference| in the table and the record).
Kernel variants beyond the default plan: ``--splits``, ``--block-t``, ``--num-warps`` (every combination given);
each variant also in one launch (``_one``: the last program per key-value head combines the chunks).

On the lent GPU, from the repository root (``source benchmarks/device_env.sh`` first):
    python3 benchmarks/engine/decode_attention_bench.py --json "$OUT/decode_attention.json"
    python3 benchmarks/engine/decode_attention_bench.py --splits 8 16 32 --block-t 32 64 --json "$OUT/sweep.json"
Smoke test on the CPU (no graphs, the kernels in Triton's interpreter; the times mean nothing):
    python3 benchmarks/engine/decode_attention_bench.py --device cpu --heads 2 --kv-heads 2 --head-dim 16 \\
        --lengths 40 --layers 1 --rounds 1 --replays 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable

import torch

from psr_hf.bench.common import graph_replay, machine, paired_ratio, rotated, summarize, timed_us, versions
from psr_hf.engine.decode_attention_kernel import (attended_bytes, decode_attention, decode_attention_reference,
                                                    new_locks, new_workspace, plan)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH = "torch"


def _variants(args: argparse.Namespace) -> dict[str, dict]:
    """Name -> the kernel's keywords: the default plan, then every combination of the overrides given; each also in
    one launch (``_one``: counters, the last program per key-value head combining)."""
    out = {"kernel": {}}
    for splits, block_t, warps in itertools.product(args.splits or [None], args.block_t or [None],
                                                    args.num_warps or [None]):
        kw = {k: v for k, v in (("splits", splits), ("block_t", block_t), ("num_warps", warps)) if v is not None}
        if kw:
            out["kernel" + "".join(f"_{k[0]}{v}" for k, v in kw.items())] = kw
    return {**out, **{name + "_one": {**kw, "one_launch": True} for name, kw in out.items()}}


def _keywords(kw: dict, keys: torch.Tensor) -> dict:
    """A variant's keywords for decode_attention (``one_launch``: counters of their own)."""
    kw = dict(kw)
    if kw.pop("one_launch", False):
        kw["locks"] = new_locks(keys)
    return kw


def _layers(args: argparse.Namespace, length: int, dtype: torch.dtype, device: torch.device,
            g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's queries and cache, random (values a prefix view of the keys when ``--values-view``)."""
    layers = []
    for _ in range(args.layers):
        q = torch.randn(args.heads, args.head_dim, generator=g, device=device).to(dtype)
        keys = torch.randn(length, args.kv_heads, args.head_dim, generator=g, device=device).to(dtype)
        if args.values_view:
            values = keys[..., :args.v_dim]
        else:
            values = torch.randn(length, args.kv_heads, args.v_dim, generator=g, device=device).to(dtype)
        layers.append((q, keys, values))
    return layers


def _calls(name: str, kw: dict, layers: list, position: torch.Tensor, scaling: float) -> Callable[[], None]:
    """One graph body: the attention of every layer, into outputs and workspaces allocated once."""
    if name == TORCH:
        def run() -> None:
            for q, keys, values in layers:
                decode_attention_reference(q, keys, values, position, scaling)
        return run
    outs = [torch.empty(q.shape[0], values.shape[-1], dtype=q.dtype, device=q.device) for q, _, values in layers]
    spaces = [new_workspace(q, keys, values, splits=kw.get("splits"), block_t=kw.get("block_t"))
              for q, keys, values in layers]
    keywords = [_keywords(kw, keys) for _, keys, _ in layers]

    def run() -> None:
        for (q, keys, values), out, space, kws in zip(layers, outs, spaces, keywords):
            decode_attention(q, keys, values, position, scaling, out=out, workspace=space, **kws)
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=16, help="query heads (OLMoE: 16)")
    p.add_argument("--kv-heads", type=int, default=16, help="key-value heads (OLMoE: 16)")
    p.add_argument("--head-dim", type=int, default=128, help="the queries' and keys' head size (OLMoE: 128)")
    p.add_argument("--v-dim", type=int, default=None, help="the values' head size (default: --head-dim)")
    p.add_argument("--values-view", action="store_true",
                   help="values as a prefix view of the keys (DeepSeek's absorbed MLA: --head-dim 576 --v-dim 512)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="cache lengths T")
    p.add_argument("--positions", type=int, nargs="+", default=[100, 1000, -1],
                   help="positions attended up to (-1: T - 1; those past T - 1 are left out)")
    p.add_argument("--layers", type=int, default=16, help="calls per graph, each on its own cache (OLMoE: 16)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=200, help="graph replays per timed interval")
    p.add_argument("--splits", type=int, nargs="*", default=[], help="kernel variants with these splits")
    p.add_argument("--block-t", type=int, nargs="*", default=[], help="kernel variants with these slot blocks")
    p.add_argument("--num-warps", type=int, nargs="*", default=[], help="kernel variants with these warps")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args(argv)
    args.v_dim = args.v_dim or args.head_dim
    if args.values_view and args.v_dim > args.head_dim:
        p.error("--values-view needs --v-dim <= --head-dim")
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter
    dtype = DTYPES[args.dtype]
    scaling = args.head_dim ** -0.5
    variants = _variants(args)
    names = [TORCH, *variants]
    g = torch.Generator(device=device).manual_seed(0)  # drawn on the device: 16 caches of 4096 slots

    rows = []
    for length in args.lengths:
        layers = _layers(args, length, dtype, device, g)
        position = torch.tensor(0, device=device)
        calls = {}
        for name in names:  # captured at position 0, replayed at each position (the graphs read it on the device)
            calls[name] = graph_replay(_calls(name, variants.get(name, {}), layers, position, scaling), device)
        positions = sorted({length - 1 if x < 0 else x for x in args.positions if x < length})
        for at in positions:
            position.fill_(at)
            q, keys, values = layers[0]
            want = decode_attention_reference(q, keys, values, position, scaling).float()
            exact = decode_attention_reference(q.float(), keys.float(), values.float(), position, scaling)
            diff, diff_exact = {}, {}
            for name, kw in variants.items():
                got = decode_attention(q, keys, values, position, scaling, **_keywords(kw, keys)).float()
                diff[name] = float((got - want).abs().max())
                diff_exact[name] = float((got - exact).abs().max())
            times = {name: [] for name in names}
            for r in range(args.rounds):
                for name in rotated(names, r):
                    times[name].append(timed_us(calls[name], args.replays, device) / (args.replays * args.layers))
            moved = attended_bytes(args.kv_heads, args.head_dim, 0 if args.values_view else args.v_dim, dtype, at)
            per_call = {}
            for name in names:
                row = summarize(times[name])
                row["gbps"] = moved / (row["median"] * 1e-6) / 1e9
                row["speedup_over_torch"] = paired_ratio(times[TORCH], times[name])
                per_call[name] = row
            rows.append({"length": length, "position": at, "bytes": moved, "us_per_call": per_call,
                         "max_abs_diff_vs_torch": diff, "max_abs_diff_vs_float32": diff_exact})

    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "v_dim": args.v_dim,
             "values_view": args.values_view}
    record = {"what": "batch-1 decode attention over a static KV cache, us per call", "shape": shape,
              "dtype": args.dtype, "layers": args.layers, "rounds": args.rounds, "replays": args.replays,
              "graphs": device.type == "cuda", "variants": variants,
              "plans": {str(n): dict(zip(("splits", "block_t"), plan(n, args.kv_heads, args.head_dim)))
                        for n in args.lengths},
              "rows": rows, "machine": machine(device), "versions": versions()}

    print(f"{record['machine']['device']}: {shape}, {args.dtype}, {args.layers} calls per graph, {args.rounds} rounds "
          f"x {args.replays} replays; default plans (splits, block_t): {record['plans']}")
    print(f"{'T':>5s} {'pos':>5s} {'variant':22s} {'us/call':>8s} {'95% interval':>18s} {'x torch':>8s} "
          f"{'GB/s':>7s} {'|d| torch':>10s} {'|d| fp32':>9s}")
    for row in rows:
        for name, t in row["us_per_call"].items():
            low, high = t["ci95"]
            d = row["max_abs_diff_vs_torch"].get(name)
            de = row["max_abs_diff_vs_float32"].get(name)
            print(f"{row['length']:5d} {row['position']:5d} {name:22s} {t['median']:8.2f} "
                  f"{f'[{low:.2f}, {high:.2f}]':>18s} {t['speedup_over_torch']['ratio']:8.2f} {t['gbps']:7.1f} "
                  f"{'' if d is None else f'{d:.3g}':>10s} {'' if de is None else f'{de:.3g}':>9s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
