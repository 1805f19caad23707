"""The token graph's decision kernel alone (psr_hf.engine.device_decisions), by what it does: each variant turns one
feature on or off (the policy's part 1 and bias, the offload's slot maps and copy lists, the token prior) and is
timed at several warp counts, so that a profile of the kernel's time per MoE layer says which part costs it.

On a GPU each variant is a CUDA graph of one token's decisions over ``--layers`` MoE layers (each layer's scores
copied in, then its decision), replayed back to back; a graph of the score copies alone is subtracted. The state
evolves over the replays as a decode's does. With ``--cold`` each layer's scores follow a write of scratch memory
twice the GPU's L2 (in both graphs, so the subtraction removes it): in a decode step the weights streamed between
two visits of a layer evict its state from L2, so the kernel's loads miss there, as they do not when the decisions
alone are replayed back to back. Prints a table (us per layer, median of rounds with its range) and
writes a JSON record.

    python benchmarks/engine/decide_kernel_bench.py --json OUT.json            # OLMoE's routing shape on CUDA
    python benchmarks/engine/decide_kernel_bench.py --cold --warps 4 8         # as in a decode step: L2 cold
    python benchmarks/engine/decide_kernel_bench.py --device cpu --layers 2 --experts 16 --top-k 4 --rounds 1

On the CPU the kernel runs in Triton's interpreter, once per variant, to check that the script runs (its times
mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch

from psr_hf.bench.common import graph_replay, timed_us

#: name -> (routing config keywords, offloaded, token prior)
VARIANTS = {
    "exact": (dict(policy="exact"), False, False),
    "exact_offloaded": (dict(policy="exact"), True, False),
    "cache_prior": (dict(policy="cache_prior", lam=0.2), False, False),
    "psr": (dict(policy="psr", lam=0.3, budget=1), False, False),
    "psr_prior": (dict(policy="psr", lam=0.3, budget=1), False, True),
    "psr_offloaded": (dict(policy="psr", lam=0.3, budget=1), True, False),
    "psr_offloaded_prior": (dict(policy="psr", lam=0.3, budget=1), True, True),
}


def _state(name: str, args: argparse.Namespace, device: torch.device, warps: int):
    from psr_hf.engine.device_state import DeviceState
    from psr_hf.policy import Calibration, LogicalCache, RoutingConfig

    kw, offloaded, prior = VARIANTS[name]
    L, E, V = args.layers, args.experts, args.vocab
    rng = np.random.default_rng(0)
    token_prior = (rng.random((V, L, E)) < 0.1) * rng.random((V, L, E)) if prior else None
    calibration = Calibration.from_arrays(delta=rng.random(L) + 0.5, expert_counts=rng.integers(0, 50, size=(L, E)),
                                          token_prior=token_prior,
                                          token_counts=None if token_prior is None else np.ones(V, dtype=np.int64))
    cache = LogicalCache(RoutingConfig(**kw, residency=args.residency), num_layers=L, num_experts=E,
                         top_k=args.top_k, calibration=calibration, vocab_size=V)
    state = DeviceState(cache, device, offloaded=offloaded, max_positions=1, num_warps=warps)
    slots = np.full((L, E), -1)
    for layer in range(L):  # the warm set in slots 0 .. C - 1
        held = np.flatnonzero(cache.state[layer, 0, 3])
        slots[layer, held] = np.arange(held.size)
    state.upload(slots=slots if offloaded else None)
    state.token.fill_(int(rng.integers(0, V)))
    state.position.fill_(0)
    scores = torch.from_numpy(rng.standard_normal((L, 2 * E)).astype(np.float32)).to(device)
    return state, scores


def _token(state, scores: torch.Tensor, decide: bool, flush: torch.Tensor | None = None) -> None:
    for m in range(scores.shape[0]):
        if flush is not None:
            flush.add_(1)  # reads and writes every byte: L2 holds none of the decision state after it
        state.scores.copy_(scores[m])
        if decide:
            state.decide(m)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=16, help="MoE layers (OLMoE: 16)")
    ap.add_argument("--experts", type=int, default=64, help="experts per layer (OLMoE: 64)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024, help="the token prior's vocabulary")
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--cold", action="store_true",
                    help="evict L2 before each layer's decision, as the weights of a decode step do (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    flush = None
    if args.cold:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 1 << 20
        flush = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=device)
    rows = []
    for name in args.variants:
        for warps in args.warps:
            state, scores = _state(name, args, device, warps)
            if cuda:
                with_decide = graph_replay(lambda: _token(state, scores, True, flush), device)
                copies_only = graph_replay(lambda: _token(state, scores, False, flush), device)
                rounds = [(timed_us(with_decide, args.replays, device) - timed_us(copies_only, args.replays, device))
                          / args.replays / args.layers for _ in range(args.rounds)]
            else:
                rounds = [timed_us(lambda: _token(state, scores, True, flush), 1, device) / args.layers]
            state.check()
            row = {"variant": name, "warps": warps, "us_per_layer_rounds": rounds,
                   "us_per_layer_median": statistics.median(rounds)}
            rows.append(row)
            print(f"{name:22s} warps {warps}: {row['us_per_layer_median']:8.2f} us per layer "
                  f"[{min(rounds):.2f}, {max(rounds):.2f}]", flush=True)
    record = {"benchmark": "decide_kernel", "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
              "layers": args.layers, "experts": args.experts, "top_k": args.top_k, "residency": args.residency,
              "l2_cold": bool(args.cold), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
