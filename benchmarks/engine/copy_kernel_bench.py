"""Where the token graph's expert copies lose time (issue 53): one MoE layer's copies of ``--experts`` experts from
pinned host memory into device slots, by the DMA engines (``copy_`` with ``non_blocking`` on a stream, as the
host-routed engine issues them) and by the device copy kernel (:mod:`psr_hf.engine.device_copies`: SM programs
that read the host memory through its unified address, as the token graph issues them) at several programs x
block sizes x warps. A program has one block in flight, so programs x block is what travels at once: on a host
whose link has a long latency the kernel needs more of it than the DMA engines do. Prints ms per expert and GB/s
(medians of ``--repeats``, with their range) and writes a JSON record.

    python benchmarks/engine/copy_kernel_bench.py --json OUT.json      # a GPU: OLMoE-1B-7B's expert (12.6 MB)
    python benchmarks/engine/copy_kernel_bench.py --device cpu --hidden 64 --intermediate 32 --programs 1 2 \\
        --blocks 8 64 --warps 4 --repeats 2                               # the CPU: checks that it runs

On the CPU the kernel runs in Triton's interpreter and the copies are memcpys: the times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from psr_hf.bench.common import timed_us
from psr_hf.cli.console import write_json


def _time_ms(run, device: torch.device) -> float:
    return timed_us(run, 1, device) / 1e3


def _row(name: str, times: list[float], experts: int, nbytes: int, **settings) -> dict:
    per_expert = [t / experts for t in times]
    median = statistics.median(per_expert)
    return {"copy": name, **settings, "ms_per_expert": median, "ms_range": [min(per_expert), max(per_expert)],
            "gb_per_s": nbytes / median / 1e6, "rounds_ms": times}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8, help="experts copied per layer (one slot each)")
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32, 132])
    ap.add_argument("--blocks", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--warps", type=int, nargs="+", default=[8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    from psr_hf.engine.device_copies import LayerCopies

    n, H, I = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(2 * n, 2 * I, H, generator=gen).to(torch.bfloat16),
            torch.randn(2 * n, H, I, generator=gen).to(torch.bfloat16)]
    if cuda:
        host = [t.pin_memory() for t in host]
    slots = [torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=device) for t in host]
    nbytes = sum(t[0].numel() * t.element_size() for t in host)
    experts = list(range(1, 2 * n, 2))  # every other expert into slots 0 .. n - 1
    copies = torch.tensor([[n] + [v for e, s in zip(experts, range(n)) for v in (e, s)]], dtype=torch.int32,
                          device=device)

    def check() -> None:
        for h, s in zip(host, slots):
            assert torch.equal(s.cpu(), h[experts].cpu()), "the copies did not move the listed experts"

    def dma() -> None:
        for slot, expert in enumerate(experts):
            for h, s in zip(host, slots):
                s[slot].copy_(h[expert], non_blocking=True)

    rows = []
    for t in slots:
        t.zero_()
    times = [_time_ms(dma, device) for _ in range(args.repeats + 1)][1:]
    check()
    rows.append(_row("dma", times, n, nbytes))
    layer = LayerCopies(host, slots)
    for programs in args.programs:
        for block in args.blocks:
            for warps in args.warps:
                for t in slots:
                    t.zero_()

                def kernel(programs=programs, block=block, warps=warps) -> None:
                    layer.launch(copies, 0, 0, programs, block=block, warps=warps)

                times = [_time_ms(kernel, device) for _ in range(args.repeats + 1)][1:]
                check()
                rows.append(_row("kernel", times, n, nbytes, programs=programs, block=block, warps=warps))
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton's interpreter: times mean nothing)"
    print(f"{n} experts of {nbytes / 1e6:.2f} MB from pinned host memory into device slots, {name}, medians of "
          f"{args.repeats}:")
    for r in rows:
        what = "DMA (copy_, non_blocking)" if r["copy"] == "dma" else (
            f"kernel, {r['programs']:>3} programs x {r['block']:>5} words x {r['warps']} warps")
        print(f"  {what:<48} {r['ms_per_expert']:.4f} ms per expert [{r['ms_range'][0]:.4f}, {r['ms_range'][1]:.4f}]"
              f"  {r['gb_per_s']:.1f} GB/s")
    record = {"device": name, "experts": n, "bytes_per_expert": nbytes, "repeats": args.repeats, "rows": rows}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
