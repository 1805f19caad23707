"""A quick look at the engine on a GPU, before the full bench: the grown OLMoE-1B-7B-shape model (bf16), resident
and offloaded, eager Decoder vs GraphDecoder (CUDA graphs), ms/token over one held-out window, and where the host
time of a graph step goes. Prints a short table and writes a JSON record (``--json``).

    python benchmarks/engine/probe.py --json probe.json [--tokens 64] [--model grown-olmoe-routing]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback

import numpy as np
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(decoder, ids, repeats=3):
    """ms/token of decoding ``ids`` (teacher-forced) ``repeats`` times, each a new sequence; the per-repeat means."""
    means = []
    for _ in range(repeats):
        decoder.reset()
        sync()
        t = time.perf_counter()
        for token in ids:
            decoder.step(token)
        sync()
        means.append((time.perf_counter() - t) * 1e3 / len(ids))
    return means


def host_split(decoder, ids):
    """Host seconds per step spent in graph replays, waiting on graph A's event, the controller, and the offload."""
    from psr_hf.engine import graphs as G

    spent = {"replay": 0.0, "event_wait": 0.0, "select+prefetch": 0.0, "decode_slots+done": 0.0}
    ctl = decoder.controller
    orig = {k: getattr(ctl, k) for k in ("select", "prefetch")}

    def wrap(obj, name, key):
        fn = getattr(obj, name)

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, w)
        return fn

    wrap(ctl, "select", "select+prefetch")
    wrap(ctl, "prefetch", "select+prefetch")
    off = ctl.offload
    if off is not None:
        o1 = wrap(off, "decode_slots", "decode_slots+done")
        o2 = wrap(off, "decode_done", "decode_slots+done")
    run = dict(decoder._run)
    for name, fn in run.items():
        def w(fn=fn):
            t = time.perf_counter()
            fn()
            spent["replay"] += time.perf_counter() - t
        decoder._run[name] = w
    ev = decoder._event
    if ev is not None:
        class E:
            def record(self):
                ev.record()

            def synchronize(self):
                t = time.perf_counter()
                ev.synchronize()
                spent["event_wait"] += time.perf_counter() - t
        decoder._event = E()
    decoder.reset()
    sync()
    t0 = time.perf_counter()
    for token in ids:
        decoder.step(token)
    sync()
    total = time.perf_counter() - t0
    decoder._run.update(run)
    decoder._event = ev
    for k, fn in orig.items():
        setattr(ctl, k, fn)
    if off is not None:
        del off.decode_slots, off.decode_done
    n = len(ids)
    out = {k: v * 1e3 / n for k, v in spent.items()}
    out["total"] = total * 1e3 / n
    return out


def kernel_profile(decoder, ids, top=12):
    """CUDA kernels of ``len(ids)`` eager steps (the graph bodies run eagerly): count per step, summed device
    time per step, and the top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    decoder.reset()
    for token in ids[:2]:
        decoder.step(token)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for token in ids[2:]:
            decoder.step(token)
        sync()
    n = len(ids) - 2
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events)
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"kernels_per_step": count / n, "device_ms_per_step": total_us / 1e3 / n,
            "top": [(e.key[:90], e.count / n, e.self_device_time_total / n) for e in rows]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="grown-olmoe-routing")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import psr_hf
    from psr_hf import Calibration, OffloadConfig, RoutingConfig
    from psr_hf.bench.workloads import default_texts, load_model, text_windows
    from psr_hf.engine.decoder import Decoder
    from psr_hf.engine.graphs import GraphDecoder

    record = {"model": a.model, "tokens": a.tokens, "device": torch.cuda.get_device_name() if CUDA else "cpu", "rows": {}, "errors": {}}
    t = time.perf_counter()
    model, tok, info = load_model(a.model, DEV)
    record["load_s"] = time.perf_counter() - t
    calib = Calibration.load(info["calibration_file"]) if "calibration_file" in info else None
    texts = default_texts(a.model)
    ids = text_windows([x for _, x in texts], tok, windows=1, tokens=a.tokens)[0][0].tolist()
    E = getattr(model.config, 'num_experts', None) or model.config.n_routed_experts

    def row(name, routing, offload, kinds=("eager", "graphs")):
        """kinds: eager (Decoder), graphs (GraphDecoder, compiled blocks), graphs_nocompile, profile[_nocompile]
        (the graph bodies run eagerly under the profiler)."""
        m = copy.deepcopy(model)
        try:
            psr_hf.patch(m, routing, calibration=calib, offload=offload)
            torch.cuda.empty_cache()
            for kind in kinds:
                key = f"{name}/{kind}"
                try:
                    t = time.perf_counter()
                    if kind == "eager":
                        dec = Decoder(m, a.tokens + 1)
                    else:
                        dec = GraphDecoder(m, a.tokens + 1, graphs=CUDA and not kind.startswith("profile"),
                                           compile=CUDA and not kind.endswith("nocompile"))
                    build = time.perf_counter() - t
                    if kind.startswith("profile"):
                        prof = kernel_profile(dec, ids[:10])
                        record["rows"][key] = prof
                        print(f"{key}: {prof['kernels_per_step']:.0f} kernels/step, "
                              f"{prof['device_ms_per_step']:.3f} device ms/step", flush=True)
                        for k, c, us in prof["top"]:
                            print(f"   {us:8.1f} us/step  {c:6.1f}/step  {k}", flush=True)
                        del dec
                        continue
                    dec.prefill(ids[:2])
                    means = timed(dec, ids)
                    entry = {"ms_per_token": means, "build_s": build}
                    if kind.startswith("graphs"):
                        entry["host_split_ms"] = host_split(dec, ids)
                        entry["d2h_outside"] = sorted(dec._d2h_outside)
                    st = psr_hf.controller(m).stats() if hasattr(psr_hf.controller(m), "stats") else None
                    record["rows"][key] = entry
                    print(f"{key:40s} {np.median(means):8.3f} ms/token  build {build:6.1f} s  "
                          f"{entry.get('host_split_ms', '')}", flush=True)
                    del dec
                except Exception as e:  # keep going: this is a probe
                    record["errors"][key] = traceback.format_exc()
                    print(f"{key}: FAILED {type(e).__name__}: {e}", flush=True)
        finally:
            psr_hf.unpatch(m)
            del m
            torch.cuda.empty_cache()

    row("resident_exact", RoutingConfig(policy="exact", capacity=E), None,
        ("graphs", "graphs_nocompile", "profile", "profile_nocompile"))
    row("nocopy_psr_lam0.3_n1_res50", RoutingConfig(policy="psr", capacity=E // 2, lam=0.3, eviction="score", budget=1), None, ("graphs",))
    off = OffloadConfig(device=DEV, max_in_flight=2, pin_memory=CUDA)
    for res in (0.5, 0.25):
        C = int(E * res)
        for pol, rc in (("exact_lru", RoutingConfig(policy="exact", capacity=C, eviction="lru", budget=0)),
                        ("psr_lam0.3_n1", RoutingConfig(policy="psr", capacity=C, lam=0.3, eviction="score", budget=1))):
            row(f"{pol}_res{int(res * 100)}", rc, off, ("graphs",))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if not record["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
