"""What one CUDA graph launch costs the host on this machine, by the graph's size and shape (issue 53: the token
graph's host time per step, about 25 us per MoE layer in `psr-hf bench`, is mostly its launch).

Graphs of N tiny kernels (an in-place add on a 256-element tensor), captured by torch, are replayed with the GPU
synchronised before each replay (as the bench's decode steps are): the host's time inside ``replay()`` per
launch, and the GPU's time per replay back to back. Shapes: ``chain`` (one stream, each kernel after the last),
and ``forked`` (the token graph's: every 16 kernels a side stream forks off and joins later, as its prefetch copies
do). Prints us per launch and per node, and writes a JSON record.

    python benchmarks/engine/graph_launch_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from psr_hf.bench.common import timed_us
from psr_hf.cli.console import write_json


def _capture(nodes: int, shape: str, device: torch.device) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    x = torch.zeros(256, device=device)
    y = torch.zeros(256, device=device)
    side = torch.cuda.Stream(device)
    main = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()

    def body() -> None:
        for i in range(nodes):
            if shape == "forked" and i % 16 == 15:
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    y.add_(1.0)
                torch.cuda.current_stream(device).wait_stream(side)
            else:
                x.add_(1.0)

    main.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(main):
        body()  # warm-up outside the graph
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, stream=main):
        body()
    torch.cuda.synchronize(device)
    return graph, [x, y]


def _host_us(graph: torch.cuda.CUDAGraph, replays: int, device: torch.device) -> list[float]:
    spent = []
    for _ in range(replays):
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        graph.replay()
        spent.append((time.perf_counter() - begin) * 1e6)
    torch.cuda.synchronize(device)
    return spent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[25, 50, 100, 200, 400, 800])
    ap.add_argument("--shapes", nargs="+", default=["chain", "forked"], choices=["chain", "forked"])
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_probe needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        for nodes in args.nodes:
            graph, keep = _capture(nodes, shape, device)
            host = _host_us(graph, args.replays, device)
            gpu = timed_us(graph.replay, args.replays, device) / args.replays  # back to back
            median = statistics.median(host)
            rows.append({"shape": shape, "nodes": nodes, "host_us_median": median,
                         "host_us_p10_p90": [sorted(host)[len(host) // 10], sorted(host)[9 * len(host) // 10]],
                         "host_us_per_node": median / nodes, "gpu_us_per_replay": gpu})
            print(f"{shape:<7} {nodes:>4} nodes: launch {median:8.1f} us on the host ({median / nodes:.3f} us per "
                  f"node), {gpu:8.1f} us on the GPU back to back")
            del graph, keep
    record = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "replays": args.replays, "rows": rows}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
