"""The engine's device decisions against the numba kernels on teacher-forced windows of a model, for every routing
policy of the bench's table, as a committed record (issue 53, Build 4).

Per policy and residency: the patched model (logical cache, no offload) decodes held-out windows teacher-forced
under a recording; the recorded trace then runs through :func:`psr_hf.policy.replay` (the numba kernels) and
:func:`psr_hf.engine.device_replay.replay_on_device` (the Triton decision kernel compiled on the GPU), and the
record counts the positions where the selections, prefetch, demand or replaced counts differ (all must be 0) and
where either differs from what the model executed.

    python benchmarks/engine/device_decisions_record.py --model grown-olmoe-routing --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import psr_hf
from psr_hf.assets.loading import load_model
from psr_hf.assets.texts import default_texts, text_windows
from psr_hf.engine.device_replay import replay_on_device
from psr_hf.eval.grid import cache_prior, entry_name, exact_a_pf, exact_lru, psr, spec
from psr_hf.policy import Calibration, RoutingConfig, replay

FIELDS = ("selected", "prefetch_copies", "demand_copies", "replaced")


def policies() -> dict[str, dict]:
    entries = [exact_lru(), exact_a_pf(), cache_prior(0.2), cache_prior(0.2, top_j=2, running=True),
               psr(0.3, 1), psr(0.3, 1, distance=2), psr(0.3, 2, eviction="lru"), spec()]
    return {entry_name(e): e for e in entries}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="grown-olmoe-routing")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--residency", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, info = load_model(args.model, device)
    calibration = Calibration.load(info["calibration_file"]) if "calibration_file" in info else None
    texts = default_texts(args.model) or [("prompt", "The history of the printing press. " * 200)]
    windows = text_windows([text for _, text in texts], tokenizer, windows=args.windows, tokens=args.tokens)
    rows = []
    for residency in args.residency:
        for name, fields in policies().items():
            config = RoutingConfig(**fields, residency=residency)
            differ = {f: 0 for f in FIELDS}
            executed_differ = 0
            positions = 0
            copies = 0.0
            start = time.perf_counter()
            with psr_hf.patched(model, config, calibration=calibration):
                ctl = psr_hf.controller(model)
                for ids in windows:
                    ctl.reset()
                    with torch.no_grad(), ctl.record() as recorder:
                        model(ids.to(device))
                    recording = recorder.recordings[0]
                    want = replay(config, recording, calibration=calibration)
                    got = replay_on_device(config, recording, calibration=calibration, device=device)
                    for f in FIELDS:
                        a, b = getattr(got, f), getattr(want, f)
                        differ[f] += int((a != b).reshape(a.shape[0], -1).any(axis=1).sum())
                    executed_differ += int((got.selected != recording.selected).reshape(
                        recording.num_tokens, -1).any(axis=1).sum())
                    positions += recording.num_tokens
                    copies += float(want.prefetch_copies.sum() + want.demand_copies.sum())
            row = {"policy": name, "residency": residency, "positions": positions, "differing_positions": differ,
                   "differing_from_executed": executed_differ, "copies_per_token": copies / positions,
                   "seconds": time.perf_counter() - start}
            rows.append(row)
            print(f"{name:22s} res {residency:.2f}: {positions} positions, differing {differ}, from executed "
                  f"{executed_differ}, copies/token {row['copies_per_token']:.2f}", flush=True)
    equal = all(sum(r["differing_positions"].values()) == 0 and r["differing_from_executed"] == 0 for r in rows)
    print(f"device decisions equal the numba kernels on every position: {equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "windows": args.windows, "tokens": args.tokens, "all_equal": equal, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
