"""Device time of the token choice's variants as CUDA graphs, on a [1, V] bf16 logits row (where generate()'s
sampling time goes beyond greedy's: docs/engine.md, "Behind generate()").

Run on the lent GPU from the repository root: ``python3 benchmarks/engine/token_choice_kernels.py OUT.json``.
Each variant is captured once and replayed ``--replays`` times back to back between two timing events, in
interleaved rounds; the record gives the median us per replay and the variants' ratios to greedy.
"""

from __future__ import annotations

from typing import Callable

import json
import sys
import time

import numpy as np
import torch

V = 50304
K = 50
ROUNDS = 15
REPLAYS = 400


def _variants(logits: torch.Tensor, eos_mask: torch.Tensor, out: torch.Tensor, host: torch.Tensor) -> dict:
    def greedy() -> None:
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        out[0] = torch.argmax(s, dim=-1)[0]

    def draw(s: torch.Tensor) -> None:
        probs = torch.nn.functional.softmax(s, dim=-1)
        q = torch.empty_like(probs).exponential_(1)
        torch.div(probs, q, out=q)
        value, index = torch.max(q, dim=-1)
        out[0] = index[0]
        out[1] = value[0]

    def sample_sorted() -> None:  # transformers' TopKLogitsWarper
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        s = s.masked_fill(s < torch.topk(s, K)[0][..., -1, None], -float("inf"))
        draw(s)

    def sample_unsorted() -> None:  # the same threshold: the smallest of the unsorted top k
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        threshold = torch.topk(s, K, sorted=False)[0].amin(dim=-1, keepdim=True)
        s = s.masked_fill(s < threshold, -float("inf"))
        draw(s)

    def topk_sorted() -> None:
        out[0] = torch.topk(logits, K)[0][0, -1]

    def topk_unsorted() -> None:
        out[0] = torch.topk(logits, K, sorted=False)[0][0, -1]

    def draw_only() -> None:
        draw(logits.to(copy=True, dtype=torch.float32))

    def two_stage(chunks: int) -> Callable[[], None]:
        width = -(-V // chunks)
        padded = torch.full((chunks * width,), -float("inf"), device=logits.device)

        def call() -> None:
            s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
            padded[:V].copy_(s[0])
            firsts = torch.topk(padded.view(chunks, width), K, dim=-1, sorted=False)[0]
            threshold = torch.topk(firsts.reshape(1, -1), K, sorted=False)[0].amin(dim=-1, keepdim=True)
            s = s.masked_fill(s < threshold, -float("inf"))
            out[0] = threshold[0, 0]

        return call

    noise = torch.empty(1, V, device=logits.device)

    def topk_bf16() -> None:  # the same threshold where the scores are bf16 values: half the radix passes
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        threshold = torch.topk(s.to(torch.bfloat16), K, sorted=False)[0].amin(dim=-1, keepdim=True).float()
        s = s.masked_fill(s < threshold, -float("inf"))
        out[0] = threshold[0, 0]

    def sample_bf16_outside_draw() -> None:
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        threshold = torch.topk(s.to(torch.bfloat16), K, sorted=False)[0].amin(dim=-1, keepdim=True).float()
        s = s.masked_fill(s < threshold, -float("inf"))
        probs = torch.nn.functional.softmax(s, dim=-1)
        value, index = torch.max(probs / noise, dim=-1)
        out[0] = index[0]
        out[1] = value[0]
        host.copy_(out, non_blocking=True)

    def sample_outside_draw() -> None:  # the draw is eager, before the replay: no random numbers in the graph
        s = logits.to(copy=True, dtype=torch.float32).masked_fill(eos_mask, -float("inf"))
        s = s.masked_fill(s < torch.topk(s, K, sorted=False)[0].amin(dim=-1, keepdim=True), -float("inf"))
        probs = torch.nn.functional.softmax(s, dim=-1)
        value, index = torch.max(probs / noise, dim=-1)
        out[0] = index[0]
        out[1] = value[0]

    def pinned_copy() -> None:
        out[0] = torch.argmax(logits, dim=-1)[0]
        host.copy_(out, non_blocking=True)

    return {"greedy": greedy, "sample_sorted": sample_sorted, "sample_unsorted": sample_unsorted,
            "topk_sorted": topk_sorted, "topk_unsorted": topk_unsorted, "draw_only": draw_only,
            "argmax_pinned_copy": pinned_copy, "topk_two_stage_32": two_stage(32), "topk_two_stage_64": two_stage(64),
            "topk_two_stage_128": two_stage(128), "topk_two_stage_256": two_stage(256),
            "sample_outside_draw": sample_outside_draw, "topk_bf16": topk_bf16,
            "sample_bf16_outside_draw": sample_bf16_outside_draw, "_noise": noise}


def main(path: str) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    logits = (torch.randn(1, V, device=device) * 3).to(torch.bfloat16)
    eos_mask = torch.zeros(V, dtype=torch.bool, device=device)
    eos_mask[50279] = True
    out = torch.zeros(2, dtype=torch.float64, device=device)
    host = torch.zeros(2, dtype=torch.float64, pin_memory=True)
    graphs = {}
    stream = torch.cuda.Stream()
    variants = _variants(logits, eos_mask, out, host)
    noise = variants.pop("_noise")
    for name, call in variants.items():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call()
        graphs[name] = graph
    torch.cuda.synchronize()
    # the bf16 threshold is the float32 one (the scores are bf16 values)
    for _ in range(50):
        x = (torch.randn(1, V, device=device) * 3).to(torch.bfloat16).float()
        exact = torch.topk(x, K)[0][..., -1]
        assert torch.equal(torch.topk(x.to(torch.bfloat16), K, sorted=False)[0].amin(dim=-1).float(), exact)
    # host time to issue one replay with the GPU idle (what the decoding loop pays), and an eager draw's
    issue = {name: [] for name in graphs}
    issue["eager exponential_"] = []
    for _ in range(200):
        for name, graph in graphs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            issue[name].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        noise.exponential_(1)
        issue["eager exponential_"].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    per_replay = {name: [] for name in graphs}
    host_us = {name: [] for name in graphs}
    for r in range(ROUNDS):
        names = list(graphs)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(REPLAYS):
                graphs[name].replay()
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            per_replay[name].append(start.elapsed_time(end) * 1e3 / REPLAYS)
            host_us[name].append((t1 - t0) * 1e6 / REPLAYS)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": V, "top_k": K,
              "rounds": ROUNDS, "replays": REPLAYS,
              "device_us_per_replay": {n: float(np.median(v)) for n, v in per_replay.items()},
              "host_us_per_replay": {n: float(np.median(v)) for n, v in host_us.items()},
              "host_us_to_issue_idle": {n: float(np.median(v)) for n, v in issue.items()}}
    base = record["device_us_per_replay"]["greedy"]
    record["over_greedy_us"] = {n: v - base for n, v in record["device_us_per_replay"].items()}
    print(f"{'variant':22s} {'device us':>10s} {'host us':>8s} {'over greedy':>12s}")
    for n in graphs:
        print(f"{n:22s} {record['device_us_per_replay'][n]:10.1f} {record['host_us_per_replay'][n]:8.1f} "
              f"{record['over_greedy_us'][n]:12.1f}")
    for n, v in record["host_us_to_issue_idle"].items():
        print(f"issue {n:22s} {v:8.1f} us")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
