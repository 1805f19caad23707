"""Where the engine's host time goes: a cProfile of GraphDecoder steps on a grown model, per routing row.

    device run:  python3 benchmarks/engine/profile_host.py --out $OUT/profile_host.txt

For each row (engine resident, psr_lam0.3_n1 copies skipped, psr_lam0.3_n1 and exact_lru offloaded at 50%): the
plain ms/token and host us per MoE layer (the step's wall time less its waits on graph A) over ``--tokens``
teacher-forced steps, then the same steps under cProfile, top functions by own time.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats

import numpy as np
import torch

import psr_hf
from psr_hf.bench.decode import decode_engine_window
from psr_hf.bench.runners import offload_config
from psr_hf.bench.workloads import default_texts, load_model, model_calibration, text_windows
from psr_hf.engine.graphs import GraphDecoder


def _steps(decoder: GraphDecoder, ids: torch.Tensor) -> tuple[float, float]:
    """ms/token and host us per MoE layer of one teacher-forced window, as ``psr-hf bench --engine`` times it."""
    run = decode_engine_window(decoder, ids, device=decoder.device)
    return float(np.mean(run.ms)), 1e3 * float(np.mean(run.host_ms)) / len(decoder.moe_layers)


def _gpu_floor(decoder: GraphDecoder, steps: int) -> float:
    """ms per token of the decoder's replay units launched back to back (the last step's expert ids and slots
    stay in their buffers), timed with CUDA events: what the GPU needs when the host never makes it wait."""
    from psr_hf.offload.cuda_runtime import raw_current_stream

    stream = raw_current_stream(decoder.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        for unit in decoder._units:
            unit(stream)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="grown-olmoe-routing")
    parser.add_argument("--tokens", type=int, default=65)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--gpu-floor", action="store_true",
                        help="only engine_resident: its step against the same graphs replayed back to back with no "
                             "host work between them (the GPU's own time per token)")
    args = parser.parse_args()
    model, tokenizer, info = load_model(args.model, "cuda")
    calibration, _ = model_calibration(model, tokenizer, tokens=4096, beside=info.get("calibration_file"))
    texts = default_texts(args.model)
    ids = text_windows([t for _, t in texts], tokenizer, windows=1, tokens=args.tokens - 1)[0]  # [1, tokens]
    E = model.config.get_text_config().num_experts
    rows = {
        "engine_resident": (psr_hf.RoutingConfig(policy="exact", capacity=E), None),
        "psr_lam0.3_n1_res50_nocopy": (psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5), None),
        "psr_lam0.3_n1_res50": (psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
                                offload_config("cuda")),
        "exact_lru_res50": (psr_hf.RoutingConfig(policy="exact", residency=0.5), offload_config("cuda")),
    }
    report = io.StringIO()
    if args.gpu_floor:
        rows = {"engine_resident": rows["engine_resident"]}
    for name, (routing, offload) in rows.items():
        patched = copy.deepcopy(model)
        psr_hf.patch(patched, routing, calibration=calibration, offload=offload)
        torch.cuda.empty_cache()
        decoder = GraphDecoder(patched, ids.shape[1] + 8)
        _steps(decoder, ids)  # warm
        ms, host = _steps(decoder, ids)
        link = getattr(psr_hf.controller(patched).offload, "link", None)
        if args.gpu_floor:
            floor = _gpu_floor(decoder, ids.shape[1] - 1)
            head = (f"== {name}: step {ms:.3f} ms/token (host {host:.1f} us per MoE layer); the same graphs replayed "
                    f"back to back, no host work between them: {floor:.3f} ms/token (the GPU's time)")
            print(head, flush=True)
            report.write(head + "\n")
            continue
        profile = cProfile.Profile()
        profile.enable()
        _steps(decoder, ids)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        head = (f"== {name}: {ms:.3f} ms/token, host {host:.1f} us per MoE layer (unprofiled), merged graphs "
                f"{decoder.merged}, link {type(link).__name__ if link is not None else None}, host wait "
                f"{'cuda-python event' if decoder._runtime is not None else 'torch event'}")
        print(head, flush=True)
        report.write(head + "\n" + text.getvalue() + "\n")
        del decoder
        psr_hf.unpatch(patched)
        del patched
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report.getvalue())


if __name__ == "__main__":
    main()
