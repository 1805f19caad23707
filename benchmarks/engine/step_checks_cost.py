"""The host's per-step checks of the engine's decoders, timed alone on the CPU: the routers' weights compared with
what the graphs were built from (``DecodeLayers.sync_routers``), the slot buffers' addresses
(``GraphDecoder._check_slot_buffers``), the prefetch source and the position. Each runs ``--calls`` times on
olmoe-routing offloaded at 50% (PSR lam 0.3 n1); prints us per call and writes a JSON record. With ``PYTHONPATH``
pointing at an older tree it times that tree's checks, for a before/after pair.

    python benchmarks/engine/step_checks_cost.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import psr_hf
from psr_hf.assets.loading import load_model
from psr_hf.engine.graphs import GraphDecoder


def _us(call, calls: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, _, info = load_model("olmoe-routing", "cpu")
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
                 calibration=info.get("calibration_file"), offload=psr_hf.OffloadConfig(device="cpu"))
    decoder = GraphDecoder(model, 64, graphs=False)
    layers, handle = decoder.layers, decoder.decode_handle
    checks = {
        "sync_routers": lambda: layers.sync_routers(handle),
        "check_slot_buffers": decoder._check_slot_buffers,
        "check_prefetch_source": lambda: layers.check_prefetch_source(decoder.controller.predictor),
        "check_position": lambda: layers.check_position(5),
    }
    rows = {name: sorted(_us(call, args.calls) for _ in range(args.rounds)) for name, call in checks.items()}
    for name, times in rows.items():
        print(f"{name:24s} {times[len(times) // 2]:8.2f} us per call (median of {args.rounds}; "
              f"range {times[0]:.2f}-{times[-1]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "step_checks_cost", "machine": platform.processor() or platform.machine(),
                       "calls": args.calls, "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
