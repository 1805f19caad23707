"""What one device-to-host round trip per MoE layer costs in transformers decoding, with no policy at all.

The patched HF path moves each MoE layer's scores to the host once per forward pass (docs/transformers.md); this
measures that floor on the same random OLMoE-1B-7B-shaped model as ``psr-hf bench-patch``: unpatched decoding against
decoding with a forward hook on every router that copies its logits to the host (``.cpu()``, which waits for
the device). Interleaved rounds; decode-only ms/token as in bench-patch. Run on a GPU:

    python benchmarks/hf/sync_floor.py --rounds 5 --new-tokens 128 [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from psr_hf.bench.common import paired_ratio
from psr_hf.bench.patch import decode_run
from psr_hf.bench.workloads import build_random_model, olmoe_1b_7b_config, prompt_ids


def _to_host(module: torch.nn.Module, args: tuple, output: tuple) -> None:
    output[0].cpu()  # copy the logits to the host: waits for the device, like the patched path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = build_random_model(olmoe_1b_7b_config(), device="cuda", dtype=torch.bfloat16)
    ids = prompt_ids(model.config.vocab_size, 32, 0).cuda()
    routers = [layer.mlp.gate for layer in model.model.layers]
    times: dict[str, list[float]] = {"unpatched": [], "sync per layer": []}
    for r in range(args.rounds + 1):
        for name in (list(times) if r % 2 else list(times)[::-1]):
            hooks = []
            if name == "sync per layer":
                hooks = [router.register_forward_hook(_to_host) for router in routers]
            run = decode_run(model, None, ids, args.new_tokens)
            for hook in hooks:
                hook.remove()
            if r:  # round 0 warms up
                times[name].append(run.ms_per_token)
    ratio = paired_ratio(times["sync per layer"], times["unpatched"])
    record = {"rounds": args.rounds, "new_tokens": args.new_tokens, "ms_per_token": times, "ratio": ratio,
              "device": torch.cuda.get_device_name()}
    for name, values in times.items():
        print(f"{name:<16} mean {np.mean(values):6.2f} ms/token  median {np.median(values):6.2f}")
    lo, hi = ratio["ci95"]
    print(f"ratio sync/unpatched {ratio['ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
