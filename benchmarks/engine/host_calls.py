"""Host cost of the single calls on the engine's decode path, torch's against raw runtime calls (cuda-python), and
the host's wait for a graph's result: an event synchronisation (torch's, raw) against spinning on a flag that the
graph writes into pinned memory after its result.

    device run:  python3 benchmarks/engine/host_calls.py --json $OUT/host_calls.json

Prints a table (median host microseconds per call over interleaved rounds, with the 5th-95th percentiles) and
writes the JSON record. The "wait" rows time a replay of a small graph (one [4096] x [4096, 4096] bf16 matvec, about
the GPU time of one MoE layer's graph A) plus the wait, so their difference is the wait's own cost.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _stats(samples_us: list[float]) -> dict[str, float]:
    a = np.asarray(samples_us)
    return {"median_us": float(np.median(a)), "p5_us": float(np.percentile(a, 5)),
            "p95_us": float(np.percentile(a, 95)), "n": int(a.size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    from cuda.bindings import runtime as rt

    from psr_hf.offload.cuda_runtime import Runtime, raw_current_stream

    device = torch.device("cuda", torch.cuda.current_device())
    runtime = Runtime(device)
    expert_bytes = 3 * 1024 * 2048 * 2  # one OLMoE-1B-7B expert in bf16: gate_up [2048, 2048] + down [2048, 1024]
    src = torch.empty(expert_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    copy_stream = torch.cuda.Stream(device)
    raw_copy_stream = int(copy_stream.cuda_stream)
    h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    x = torch.randn(4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    y = torch.empty(4096, device=device, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    host_y = torch.empty(4096, dtype=torch.bfloat16, pin_memory=True)
    host_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    flag = host_flag.numpy()

    def body(with_flag: bool) -> None:
        torch.matmul(w, x, out=y)
        host_y.copy_(y, non_blocking=True)
        if with_flag:
            counter.add_(1)
            host_flag.copy_(counter, non_blocking=True)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body(True)
        body(False)
    torch.cuda.synchronize()
    plain, flagged = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain, stream=side):
        body(False)
    with torch.cuda.graph(flagged, stream=side):
        body(True)
    torch.cuda.synchronize()
    expected = [int(counter.item())]
    torch_event = torch.cuda.Event()
    raw_event = runtime.event()

    def issue_torch_copy() -> None:
        with torch.cuda.stream(copy_stream):
            dst.copy_(src, non_blocking=True)

    def issue_raw_copy() -> None:
        runtime.copy_h2d(dst.data_ptr(), src.data_ptr(), expert_bytes, raw_copy_stream)

    def torch_record() -> None:
        torch_event.record()

    def raw_record() -> None:
        runtime.record(raw_event, raw_current_stream(device))

    def current_stream_torch() -> None:
        torch.cuda.current_stream(device)

    def current_stream_raw() -> None:
        raw_current_stream(device)

    def replay_only() -> None:
        plain.replay()

    plain_exec = runtime.graph_exec(plain.raw_cuda_graph_exec())

    def launch_only() -> None:
        runtime.launch(plain_exec, raw_current_stream(device))

    def wait_torch_event() -> None:
        plain.replay()
        torch_event.record()
        torch_event.synchronize()

    def wait_raw_event() -> None:
        plain.replay()
        stream = raw_current_stream(device)
        runtime.record(raw_event, stream)
        runtime.synchronize(raw_event)

    def wait_flag() -> None:
        flagged.replay()
        expected[0] += 1
        want = expected[0]
        while flag[0] != want:
            pass

    issuing = {"torch copy_ (one expert, issue)": issue_torch_copy,
               "cudaMemcpyAsync (one expert, issue)": issue_raw_copy,
               "torch Event.record": torch_record, "cudaEventRecord": raw_record,
               "torch.cuda.current_stream": current_stream_torch,
               "raw current stream handle": current_stream_raw}
    waiting = {"graph replay (launch only)": replay_only, "cudaGraphLaunch (launch only)": launch_only,
               "replay + torch event record + synchronize": wait_torch_event,
               "replay + cudaEventRecord + cudaEventSynchronize": wait_raw_event,
               "replay + spin on a pinned flag": wait_flag}
    samples: dict[str, list[float]] = {name: [] for name in (*issuing, *waiting)}
    for r in range(args.rounds):
        for name, call in issuing.items():
            for _ in range(args.calls):
                begin = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - begin) * 1e6)
                if "copy" in name or "Memcpy" in name:
                    copy_stream.synchronize()
            torch.cuda.synchronize()
        for name, call in waiting.items():
            for _ in range(args.calls):
                torch.cuda.synchronize()
                begin = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - begin) * 1e6)
            torch.cuda.synchronize()
    # the GPU time of the small graph, for the wait rows
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        plain.replay()
    end.record()
    end.synchronize()
    record = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "graph_gpu_us": start.elapsed_time(end) * 10.0,
              "calls": {name: _stats(values) for name, values in samples.items()}}
    print(f"host us per call on {record['device']} (torch {torch.__version__}); the small graph's GPU time "
          f"{record['graph_gpu_us']:.1f} us")
    for name, s in record["calls"].items():
        print(f"  {name:<52} {s['median_us']:8.2f}  [{s['p5_us']:.2f}, {s['p95_us']:.2f}]")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    runtime.close()


if __name__ == "__main__":
    main()
