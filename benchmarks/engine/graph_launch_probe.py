"""What one CUDA graph launch costs the host on this machine, by the graph's size and shape (issue 53: the token
graph's host time per step, about 25 us per MoE layer in `psr-hf bench`, is mostly its launch).

Graphs of N tiny kernels (an in-place add on a 256-element tensor), captured by torch, are replayed with the GPU
synchronised before each replay (as the bench's decode steps are): the host's time inside ``replay()`` per
launch, and the GPU's time per replay back to back. Shapes: ``chain`` (one stream, each kernel after the last),
``chain_kept`` (the same captured with ``keep_graph=True`` and instantiated by ``instantiate()``),
``chain_memcpy`` (a chain whose every sixth node is a device-to-device memcpy, as torch captures a same-dtype
``copy_``), ``host_read`` (a chain whose every 16th kernel is the token graph's copy kernel, reading mapped pinned
host memory), ``forked`` (every 16 kernels one kernel on a side stream, joined at once), ``branches`` (the token
graph's topology: every 16 kernels two kernels fork off on a side stream, joined 16 kernels later, as its prefetch
copies are), and ``split`` (a chain's work as two chains launched one after the other: the host's cost of both
launches). Each graph is also launched through
``cudaGraphLaunch`` itself (cuda-python), without torch's ``replay()``, where cuda-python imports. Then a chain of
400 launched right after another operation on its stream (a copy from pinned memory, an event record, a kernel),
as a decode step enqueues its inputs before the token graph, and the launch of the first and the newest of N such
chains while the process holds N of them (``--graphs-alive``), and last a launch before and after a torch.profiler
session (``--profiler-effect``). Prints us per launch and per node, the driver's
version, and writes a JSON record.

    python benchmarks/engine/graph_launch_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from psr_hf.bench.common import timed_us
from psr_hf.cli.console import write_json


SHAPES = ("chain", "chain_kept", "chain_memcpy", "host_read", "forked", "branches", "split")


def _capture(nodes: int, shape: str, device: torch.device) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
    if shape == "split":
        main_graph, keep = _capture(nodes - nodes // 16, "chain", device)
        side_graph, keep_side = _capture(nodes // 16, "chain", device)
        return main_graph + side_graph, keep + keep_side
    x = torch.zeros(256, device=device)
    y = torch.zeros(256, device=device)
    if shape == "host_read":  # the token graph's copy kernel: 64 KiB of one pinned expert into a slot, each time
        from psr_hf.engine.device_copies import LayerCopies

        host_copies = LayerCopies([torch.zeros(2, 16384, pin_memory=True)], [torch.zeros(2, 16384, device=device)])
        copy_list = torch.tensor([[1, 1, 0]], dtype=torch.int32, device=device)
    side = torch.cuda.Stream(device)
    main = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph(keep_graph=shape == "chain_kept")

    joins: list[torch.cuda.Event] = []

    def fork(i: int) -> None:
        """The token graph's prefetch branch: two kernels on the side stream that the main stream joins 16 nodes
        later (every earlier branch joined first)."""
        main_now = torch.cuda.current_stream(device)
        while joins:
            main_now.wait_event(joins.pop())
        side.wait_stream(main_now)
        with torch.cuda.stream(side):
            y.add_(1.0)
            y.add_(1.0)
            done = torch.cuda.Event()
            done.record(side)
        joins.append(done)
        x.add_(1.0)

    def body() -> None:
        for i in range(nodes):
            if shape == "forked" and i % 16 == 15:
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    y.add_(1.0)
                torch.cuda.current_stream(device).wait_stream(side)
            elif shape == "branches" and i % 16 == 0:
                fork(i)
            elif shape == "chain_memcpy" and i % 6 == 5:
                y.copy_(x)  # a device-to-device memcpy node, as torch's same-dtype copy_ is captured
            elif shape == "host_read" and i % 16 == 0:
                host_copies.launch(copy_list, 0, 0, 8)  # a kernel reading mapped pinned host memory
            else:
                x.add_(1.0)
        while joins:
            torch.cuda.current_stream(device).wait_event(joins.pop())

    main.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(main):
        body()  # warm-up outside the graph
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, stream=main):
        body()
    if shape == "chain_kept":
        graph.instantiate()
    torch.cuda.synchronize(device)
    return [graph], [x, y]


def _host_us(graphs: list[torch.cuda.CUDAGraph], replays: int, device: torch.device,
             before: Callable[[], None] | None = None) -> list[float]:
    spent = []
    for _ in range(replays):
        torch.cuda.synchronize(device)
        if before is not None:  # work enqueued on the launch's stream just before it, outside the timing
            before()
        begin = time.perf_counter()
        for graph in graphs:
            graph.replay()
        spent.append((time.perf_counter() - begin) * 1e6)
    torch.cuda.synchronize(device)
    return spent


def _before_launch(replays: int, device: torch.device) -> list[dict]:
    """A 400-kernel chain launched on an idle stream, and right after one more operation on that stream (a
    16-byte copy from pinned memory, an event record, a kernel), as a decode step enqueues its inputs' copy
    before the token graph: the host's us per launch for each."""
    graphs, keep = _capture(400, "chain", device)
    pinned = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    target = torch.zeros(2, dtype=torch.int64, device=device)
    event = torch.cuda.Event()
    before = {"idle": None, "h2d_copy": lambda: target.copy_(pinned, non_blocking=True),
              "event_record": lambda: event.record(), "kernel": lambda: target.add_(1)}
    rows = []
    for name, call in before.items():
        median = statistics.median(_host_us(graphs, replays, device, call))
        rows.append({"before": name, "nodes": 400, "host_us_median": median})
        print(f"chain 400 nodes launched after {name:<12}: {median:8.1f} us on the host", flush=True)
    del graphs, keep
    return rows


def _graphs_alive(counts: list[int], replays: int, device: torch.device) -> list[dict]:
    """The host's us per launch of the first and of the newest 400-kernel chain while a process holds ``count``
    of them (captured one after another, each kept alive): whether the driver's fast launch depends on how many
    graphs a process holds (the token graph's launch varied 15x between captures of one graph)."""
    held: list = []
    rows = []
    for count in counts:
        while len(held) < count:
            held.append(_capture(400, "chain", device))
        first = statistics.median(_host_us(held[0][0], replays, device))
        newest = statistics.median(_host_us(held[-1][0], replays, device))
        rows.append({"graphs_alive": count, "first_host_us_median": first, "newest_host_us_median": newest})
        print(f"{count:>4} chains of 400 alive: launch of the first {first:8.1f} us, of the newest {newest:8.1f} us",
              flush=True)
    return rows


def _profiler_effect(replays: int, device: torch.device) -> dict:
    """The launch of one 400-kernel chain before and after a torch.profiler session of a few replays in the same
    process (the token graph's launches measured after torch.profiler had run were 4-50x slower)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, keep = _capture(400, "chain", device)
    before = statistics.median(_host_us(graphs, replays, device))
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(4):
            graphs[0].replay()
        torch.cuda.synchronize(device)
    after = statistics.median(_host_us(graphs, replays, device))
    print(f"chain 400 nodes: launch {before:8.1f} us before a torch.profiler session, {after:8.1f} us after",
          flush=True)
    del graphs, keep
    return {"nodes": 400, "before_host_us_median": before, "after_host_us_median": after}


def raw_launch_us(execs: list[int], replays: int, device: torch.device) -> list[float] | None:
    """The host's us per launch of the graph execs ``execs`` (``raw_cuda_graph_exec()``) through cuda-python's
    ``cudaGraphLaunch`` on the current stream, the GPU synchronised before each (None: no cuda-python)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    stream = runtime.cudaStream_t(init_value=torch.cuda.current_stream(device).cuda_stream)
    handles = [runtime.cudaGraphExec_t(init_value=e) for e in execs]
    spent = []
    for _ in range(replays):
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for h in handles:
            err, = runtime.cudaGraphLaunch(h, stream)
        spent.append((time.perf_counter() - begin) * 1e6)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaGraphLaunch: {err}")
    torch.cuda.synchronize(device)
    return spent


def graph_census(raw_graph: int, dot_path: str | None = None) -> dict | None:
    """Node types of a ``cudaGraph_t`` (``raw_cuda_graph()`` of a graph captured with ``keep_graph=True``), its
    edges and how many nodes fork (more than one successor): what decides whether the driver launches it in
    constant time (a straight line of kernel nodes); ``dot_path``: also the graph as a DOT file, with each node's
    parameters. None without cuda-python."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    graph = runtime.cudaGraph_t(init_value=raw_graph)
    count = runtime.cudaGraphGetNodes(graph, 0)[-1]
    nodes = runtime.cudaGraphGetNodes(graph, count)[1]
    types: dict[str, int] = {}
    forks = 0
    sequence = []
    for node in nodes:
        err, kind = runtime.cudaGraphNodeGetType(node)
        name = getattr(kind, "name", str(kind))
        types[name] = types.get(name, 0) + 1
        successors = runtime.cudaGraphNodeGetDependentNodes(node, 0)[-1]  # the count is last
        forks += successors > 1
        sequence.append(_kernel_name(node) if "kernel" in name.lower() else name)
    edges = runtime.cudaGraphGetEdges(graph, 0)[-1]  # the count is last (cuda-bindings 12 and 13 differ before)
    if dot_path:
        runtime.cudaGraphDebugDotPrint(graph, dot_path.encode(), 1 << 0 | 1 << 1 | 1 << 2)  # verbose, params
    return {"nodes": int(count), "types": types, "edges": int(edges), "forking_nodes": int(forks),
            "first_nodes": sequence[:80]}


def _kernel_name(node: object) -> str:
    """A kernel node's function name (driver API), or "KERNEL" where the driver does not say."""
    try:
        from cuda.bindings import driver

        err, params = driver.cuGraphKernelNodeGetParams(driver.CUgraphNode(init_value=int(node)))
        err, name = driver.cuFuncGetName(params.func)
        return name.decode()[:60] if isinstance(name, bytes) else str(name)[:60]
    except Exception as exc:  # an older driver or binding: the type alone
        return f"KERNEL ({type(exc).__name__})"


def driver_version() -> int | None:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return int(runtime.cudaDriverGetVersion()[1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[25, 50, 100, 200, 400, 800])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--graphs-alive", type=int, nargs="*", default=[1, 4, 16, 64],
                    help="launch times while the process holds this many 400-kernel graphs (none: skip)")
    ap.add_argument("--profiler-effect", action=argparse.BooleanOptionalAction, default=True,
                    help="last, a launch before and after a torch.profiler session")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_probe needs a CUDA GPU")
    device = torch.device("cuda")
    print(f"driver {driver_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    rows = []
    for shape in args.shapes:
        for nodes in args.nodes:
            graphs, keep = _capture(nodes, shape, device)
            host = _host_us(graphs, args.replays, device)
            raw = raw_launch_us([g.raw_cuda_graph_exec() for g in graphs], args.replays, device)
            gpu = timed_us(lambda: [g.replay() for g in graphs], args.replays, device) / args.replays  # back to back
            median = statistics.median(host)
            raw_median = None if raw is None else statistics.median(raw)
            rows.append({"shape": shape, "nodes": nodes, "host_us_median": median,
                         "host_us_p10_p90": [sorted(host)[len(host) // 10], sorted(host)[9 * len(host) // 10]],
                         "host_us_per_node": median / nodes, "raw_launch_us_median": raw_median,
                         "gpu_us_per_replay": gpu})
            print(f"{shape:<7} {nodes:>4} nodes: launch {median:8.1f} us on the host ({median / nodes:.3f} us per "
                  f"node; cudaGraphLaunch alone {raw_median if raw_median is None else round(raw_median, 1)} us), "
                  f"{gpu:8.1f} us on the GPU back to back", flush=True)
            del graphs, keep
    before_rows = _before_launch(args.replays, device)
    alive_rows = _graphs_alive(args.graphs_alive, args.replays, device) if args.graphs_alive else []
    profiler = _profiler_effect(args.replays, device) if args.profiler_effect else None  # last: it may stay
    record = {"device": torch.cuda.get_device_name(device), "before_launch": before_rows, "graphs_alive": alive_rows, "profiler_effect": profiler, "torch": torch.__version__,
              "cuda": torch.version.cuda, "driver": driver_version(), "replays": args.replays, "rows": rows}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
