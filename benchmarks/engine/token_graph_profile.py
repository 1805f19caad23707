"""Where a token's time goes in the token graph (device routing, one CUDA graph per token), on a GPU.

For the resident model (exact, every expert cached) and an offloaded routed row: the token graph replayed back to
back with no host work between replays (the GPU's own time per token), the host's time per step (the call's wall
time, the GPU not waited for), and the CUDA kernels of the replays under torch.profiler (count and device time per
token, by kernel, with the bytes of weights a token reads and the bandwidth that implies), and the host's time of
``cudaGraphLaunch`` alone on the token graph (cuda-python); with ``--launch-variants`` also the token graph
captured again in variants (no side branch, no prefetch copies, no copies), each with its nodes by type. The
kernel profile runs last in each row: once torch.profiler has run, later launches in the process are slower, so
with it only the first row's launch and host figures are clean (``--no-kernel-profile`` for clean ones). Prints a table and writes a JSON record.

    python benchmarks/engine/token_graph_profile.py --model grown-olmoe-routing --json OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import psr_hf
from psr_hf.assets.loading import load_model
from psr_hf.bench.common import describe_model
from psr_hf.engine.token_graph import TokenGraphDecoder

PEAK_TBPS = {"H100": 3.35, "H200": 4.8}


def _weight_bytes(model: torch.nn.Module, info: dict) -> dict[str, float]:
    """Bytes of weights one batch-1 token reads: the K selected experts of every MoE layer and every other
    parameter except the embedding table (one row read) and the routed experts not selected."""
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) - experts - embed.numel() * embed.element_size()
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    if tied:
        rest += embed.numel() * embed.element_size()
    selected = info["expert_bytes"] / info["num_experts"] * info["top_k"]  # expert_bytes: every layer's experts
    return {"selected_experts": float(selected), "dense": float(rest), "total": float(selected + rest)}


def _back_to_back(decoder: TokenGraphDecoder, token: int, n: int) -> float:
    """ms per token of ``n`` steps launched without waiting for the GPU between them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        decoder.step(token)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / n


def _host_us(decoder: TokenGraphDecoder, token: int, n: int) -> list[float]:
    """The host's time per step: the call's wall time, the GPU synchronised after (not inside) it."""
    spent = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.step(token)
        spent.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return spent


def _host_parts(decoder: TokenGraphDecoder, token: int, n: int = 2000) -> dict[str, float]:
    """Median us of each host check a step makes before its launch, each called alone ``n`` times (no profiler:
    the step's host time less these is the inputs' write, the launch and the calls between them)."""
    L, ctl, handle = decoder.layers, decoder.controller, decoder.decode_handle

    def ready():
        with handle.holding():
            decoder._device_step_ready()

    def no_grad():
        with torch.no_grad():
            pass

    parts = {"one_token": lambda: decoder._one_token(token), "no_grad": no_grad,
             "holding_and_ready": ready, "check_slot_buffers": decoder._check_slot_buffers,
             "check_prefetch_source": lambda: L.check_prefetch_source(ctl),
             "sync_routers": lambda: L.sync_routers(handle)}
    out = {}
    for name, part in parts.items():
        try:
            part()
        except AttributeError:  # a build before this check existed (an A/B's _old): the part is left out
            continue
        spent = []
        for _ in range(n):
            start = time.perf_counter()
            part()
            spent.append((time.perf_counter() - start) * 1e6)
        out[name] = statistics.median(spent)
    return out


def _launch_variants(decoder: TokenGraphDecoder, dot_dir: str | None, row: str) -> dict:
    """The token graph captured again by the decoder itself (``_capture_token``, as a step uses it) in variants:
    as built (prefetch copies on a side branch), with the side branch on the main stream (no fork), without
    prefetch copies, and without any copy; for each the host's ``cudaGraphLaunch`` alone, and the census of the
    same body captured once more with ``keep_graph=True`` (never launched; ``dot_dir``: its DOT file too). A
    variant without copies leaves slots the device maps unfilled: run this after every timing."""
    from graph_launch_probe import graph_census, raw_launch_us
    from psr_hf.engine import device_copies

    launch = device_copies.LayerCopies.launch
    body = TokenGraphDecoder._token_body
    out = {}
    variants = (("as_built", True, None), ("no_side_branch", False, None), ("no_prefetch_copies", True, 0),
                ("no_copies", True, -1))
    for name, separate, keep_column in variants:
        if keep_column is not None:  # copy launches skipped: all, or all but the demand copies (column 0)
            device_copies.LayerCopies.launch = (
                lambda self, copies, layer, column, *a, keep=keep_column, **k:
                launch(self, copies, layer, column, *a, **k) if column == keep else None)
        if not separate:  # the prefetch copies on the stream being captured
            decoder._token_body = lambda side: body(decoder, torch.cuda.current_stream())
        try:
            decoder._capture_token()
            stream = torch.cuda.Stream()
            kept = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(kept, stream=stream, capture_error_mode="thread_local"):
                decoder._token_body(torch.cuda.Stream())
        finally:
            device_copies.LayerCopies.launch = launch
            decoder.__dict__.pop("_token_body", None)
        dot = None if dot_dir is None else f"{dot_dir}/{row.replace('@', '_at_')}_{name}.dot"
        census = graph_census(kept.raw_cuda_graph(), dot)
        del kept
        raw = raw_launch_us([decoder._token_graph.raw_cuda_graph_exec()], 64, torch.device("cuda"))
        out[name] = {"raw_launch_us_median": None if raw is None else statistics.median(raw), "census": census}
    return out


def _host_profile(decoder: TokenGraphDecoder, token: int, n: int, top: int) -> list[dict]:
    """cProfile of ``n`` steps (each followed by a synchronize, outside the step): where the host's time goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        profiler.enable()
        decoder.step(token)
        profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own (total internal) time
    return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls_per_step": calls / n,
             "own_us_per_step": own * 1e6 / n, "cumulative_us_per_step": cum * 1e6 / n}
            for (path, line, name), (_, calls, own, cum, _) in rows]


def _kernels(decoder: TokenGraphDecoder, token: int, n: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            decoder.step(token)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_device_time_total)
    return {"kernels_per_token": sum(e.count for e in events) / n, "kernel_ms_per_token": total_us / 1e3 / n,
            "top": [{"kernel": e.key[:100], "per_token": e.count / n, "us_per_token": e.self_device_time_total / n}
                    for e in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="grown-olmoe-routing")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--decide-warps", type=int, nargs="+", default=[8],
                    help="the decision kernel's warps; each value profiles every row again")
    ap.add_argument("--twins", action="store_true",
                    help="also PSR lam 0.3 n1 and Cache-Prior lam 0.2 at --residency on the all-resident model (the "
                         "bench's copies-skipped twins: their decisions, no copies), to see where PSR's twin spends "
                         "its extra time")
    ap.add_argument("--count-late", action="store_true",
                    help="the offloaded row counts on the device the prefetches its layers still wait for "
                         "(TokenGraphDecoder(count_late=True): one more small kernel per layer with prefetches)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dot-dir", default=None, help="write each launch variant's graph as a DOT file here")
    ap.add_argument("--launch-variants", action="store_true",
                    help="also capture the token graph again in variants and time cudaGraphLaunch on each")
    ap.add_argument("--kernel-profile", action=argparse.BooleanOptionalAction, default=True,
                    help="the kernels by device time under torch.profiler, after the row's timings (default on; "
                         "off: every row's launch and host figures are free of the profiler)")
    args = ap.parse_args()
    source, tokenizer, info_model = load_model(args.model, "cuda")
    calibration = info_model.get("calibration_file")
    info = describe_model(source)
    weights = _weight_bytes(source, info)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TBPS.items() if k in name), None)
    prompt = tokenizer("The history of the printing press begins in the fifteenth century.")["input_ids"][:12]
    record = {"model": args.model, "device": name, "peak_tb_per_s": peak, "weights_bytes_per_token": weights,
              "rows": {}}
    from psr_hf.bench.runners import weight_sharing_copy

    cases = {"resident_exact": (dict(policy="exact", capacity=info["num_experts"]), None),
             f"psr_lam0.3_n1@{args.residency}": (dict(policy="psr", lam=0.3, budget=1, residency=args.residency),
                                                 psr_hf.OffloadConfig())}
    if args.twins:  # the routed rows' copies-skipped twins: their routing on the all-resident model, nothing copied
        cases[f"psr_lam0.3_n1@{args.residency}_twin"] = (dict(policy="psr", lam=0.3, budget=1,
                                                              residency=args.residency), None)
        cases[f"cp_lam0.2@{args.residency}_twin"] = (dict(policy="cache_prior", lam=0.2, residency=args.residency),
                                                     None)
    runs = [(f"{row}" + ("" if len(args.decide_warps) == 1 else f"_w{w}"), kw, offload, w)
            for w in args.decide_warps for row, (kw, offload) in cases.items()]
    for row, kw, offload, warps in runs:
        model = weight_sharing_copy(source)
        psr_hf.patch(model, psr_hf.RoutingConfig(**kw), calibration=calibration, offload=offload)
        max_len = len(prompt) + args.steps * (args.rounds + 3) + 160
        counting = args.count_late and offload is not None
        # count_late only when asked, so that a build before it (an A/B's _old) runs the same command
        decoder = TokenGraphDecoder(model, max_len, decide_warps=warps, **({"count_late": True} if counting else {}))
        decoder.prefill(prompt, batched=False)
        token = prompt[-1]
        _back_to_back(decoder, token, 8)  # warm
        floors, hosts, late = [], [], []
        for _ in range(args.rounds):
            before = decoder.late_prefetches() if counting else None
            floors.append(_back_to_back(decoder, token, args.steps))
            if counting:  # per step of the round replayed back to back
                after = decoder.late_prefetches()
                late.append({key: (after[key] - before[key]) / args.steps for key in ("late", "layers_waited")})
            hosts.extend(_host_us(decoder, token, 16))
        from graph_launch_probe import raw_launch_us

        raw = raw_launch_us([decoder._token_graph.raw_cuda_graph_exec()], 64, torch.device("cuda"))
        parts = _host_parts(decoder, token)
        host_profile = _host_profile(decoder, token, 64, args.top)
        census = None
        if args.launch_variants:
            try:  # its variants without copies leave the slots unfilled: after every timing of the row
                census = _launch_variants(decoder, args.dot_dir, row)
            except Exception as exc:  # a diagnostic: the profile goes on without it
                census = {"error": repr(exc)}
        # torch.profiler last: once it has run, later launches in the process were 4-50x slower (CUPTI staying
        # subscribed, likely), so only the first row's launch figures are clean with --kernel-profile
        kernels = (_kernels(decoder, token, 16, args.top) if args.kernel_profile
                   else {"kernels_per_token": None, "kernel_ms_per_token": None, "top": []})
        floor = statistics.median(floors)
        out = {"decide_warps": warps, "gpu_ms_per_token_back_to_back": floors, "gpu_ms_median": floor,
               "host_us_per_step_median": statistics.median(hosts), "host_us_per_step_p90": sorted(hosts)[int(0.9 * len(hosts))],
               "raw_launch_us_median": None if raw is None else statistics.median(raw), "launch_variants": census,
               **kernels, "host_parts_us": parts, "host_profile": host_profile,
               "late_prefetches_per_step": late or None}
        if offload is None:
            out["achieved_tb_per_s_back_to_back"] = weights["total"] / (floor * 1e-3) / 1e12
            out["memory_bound_ms"] = None if peak is None else weights["total"] / (peak * 1e12) * 1e3
        record["rows"][row] = out
        counted = ("" if kernels["kernels_per_token"] is None else
                   f"{kernels['kernels_per_token']:.0f} kernels/token, {kernels['kernel_ms_per_token']:.3f} kernel ms/token")
        print(f"== {row}: back to back {floor:.3f} ms/token (rounds {', '.join(f'{f:.3f}' for f in floors)}), "
              f"host {out['host_us_per_step_median']:.1f} us/step (p90 {out['host_us_per_step_p90']:.1f}), "
              + counted
              + ("" if offload is not None else f", {out['achieved_tb_per_s_back_to_back']:.2f} TB/s of weights "
                 f"(bound {out['memory_bound_ms']} ms)"), flush=True)
        print(f"   cudaGraphLaunch alone: {out['raw_launch_us_median']} us")
        print("   host checks alone, median us: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        if late:
            print("   late prefetches per step (rounds): " + "; ".join(
                f"{r['late']:.2f} late, {r['layers_waited']:.2f} layers waited" for r in late))
        for variant, v in (census or {}).items():
            print(f"   {variant}: {v if isinstance(v, str) else json.dumps(v)[:3000]}")
        for k in kernels["top"]:
            print(f"   {k['us_per_token']:8.1f} us/token {k['per_token']:6.1f}/token  {k['kernel']}")
        print("   host, by own time (cProfile, us per step: own / cumulative):")
        for h in host_profile:
            print(f"   {h['own_us_per_step']:8.1f} {h['cumulative_us_per_step']:8.1f}  x{h['calls_per_step']:.0f}  "
                  f"{h['function']}")
        del decoder
        gc.collect()  # the decoder's graphs and buffers, before unpatch copies the experts back to the GPU
        torch.cuda.empty_cache()
        psr_hf.unpatch(model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
