"""The Gated DeltaNet one-kernel step in the engine, A/B on a GPU: two GraphDecoders on grown-qwen36-routing
(Qwen3.6-35B-A3B's shape, bf16; 30 Gated DeltaNet and 10 gated attention layers), all resident (policy exact,
capacity = num_experts, on weight-sharing copies of one model), one with the family's ``gated_delta_kernel=True``
(one Triton launch per layer for the step after the input projections) and one with ``gated_delta_kernel=False``
(the torch step; inside the compiled attention blocks unless ``--no-compile``).

First each decoder's greedy tokens after a short prompt (stepped token by token through the decoder): printed
with the first position where they part and the largest logit difference, never an abort (bf16 rounds the two
steps differently, so greedy tokens can part where two are nearly tied). Then ms/token in interleaved rounds, the
order alternating: per round each decoder runs the prompt and steps the torch decoder's greedy tokens teacher-forced
(the same tokens for both), the GPU synchronised only before and after. The table gives per decoder the median
ms/token and the 95% t-interval of the mean over rounds, the per-round ratio torch/kernel (its median; the geometric
mean with its 95% t-interval, paired by round: ``psr_hf.bench.common.paired_ratio``) and the time saved per token
and per Gated DeltaNet layer, with the HBM bound of a token (the weights one token reads: every parameter but the
embedding table and the unselected routed experts; plus the float32 recurrent states read and written) at the
memory's peak (``--hbm-gbps``, default by the GPU's name: H100 3350, H200 4800). ``--json`` writes the record.
A verdict that the kernel is faster needs the ratio's whole interval above 1; otherwise it is "not shown".

On the lent GPU, from the repository root, with qwen36-routing built (``benchmarks/qwen36/gpu_qwen36.sh``) and
carried xz-compressed as ``.models/qwen36-routing.xz`` (its header shows how); meant to finish within 4 minutes on
an H100 (not yet run there: the timestamps it prints show where the time goes):
    source benchmarks/device_env.sh; export PSR_HF_MODELS=$PWD/.models
    [ -d .models/qwen36-routing ] || unxz_copy .models/qwen36-routing.xz .models/qwen36-routing
    python3 benchmarks/qwen36/gated_delta_engine_ab.py --json "$OUT/gated_delta_engine_ab.json"
Smoke test on the CPU (a tiny random Qwen3.5-MoE, the graph bodies run eagerly, the kernel in Triton's
interpreter; the times mean nothing):
    python3 benchmarks/qwen36/gated_delta_engine_ab.py --model tiny-qwen3_5 --rounds 2 --tokens 4 --check-tokens 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch

MODEL = "grown-qwen36-routing"
TINY = "tiny-qwen3_5"  # the CPU smoke test's model: psr_hf.testing.tiny_model("qwen3_5_moe_text"), float32
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0}
NAMES = ("torch", "kernel")  # gated_delta_kernel=False, True
PROMPT_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
               "books were made and read across Europe. ")


def _random_slice(layers: int, device: torch.device) -> tuple[torch.nn.Module, list[int], dict]:
    """Qwen3.6-35B-A3B's full-size layers (transformers' Qwen3_5MoeTextConfig defaults), ``layers`` of them in its
    layer pattern, random bf16 weights: the shape's speed where the grown model is not at hand or does not fit."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    defaults = Qwen3_5MoeTextConfig()
    config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=list(defaults.layer_types[:layers]))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids, {"name": f"qwen3.6-shape-{layers}-layers", "weights": "random bf16, seed 0"}


def _load(name: str, device: torch.device) -> tuple[torch.nn.Module, list[int], dict]:
    """The model, a prompt's ids (``--prompt`` tokens taken later) and its description."""
    if name.startswith("qwen3.6-shape-"):
        return _random_slice(int(name.rsplit("-", 1)[1]), device)
    if name == TINY:
        from psr_hf.testing import tiny_model

        model = tiny_model("qwen3_5_moe_text", seed=0, norm_noise=0.2).to(device)
        ids = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        return model, ids, {"name": TINY, "weights": "random, seed 0 (psr_hf.testing.tiny_model)"}
    from psr_hf.assets.loading import load_model

    model, tokenizer, info = load_model(name, str(device))
    return model, tokenizer(PROMPT_TEXT * 4)["input_ids"], info


def _weight_bytes(model: torch.nn.Module) -> dict[str, float]:
    """Bytes of weights one batch-1 token reads: the top-k selected of every layer's routed experts and every other
    parameter except the embedding table (one row read; all of it where the lm_head shares it)."""
    config = model.config.get_text_config()
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    rest = total - experts - embed.numel() * embed.element_size()
    head = model.get_output_embeddings()
    if head is not None and head.weight is embed:
        rest += embed.numel() * embed.element_size()
    selected = experts * int(config.num_experts_per_tok) / int(config.num_experts)
    return {"selected_experts": float(selected), "other": float(rest), "total": float(selected + rest)}


def _decoder(source: torch.nn.Module, kernel: bool, max_len: int, graphs: bool, compile: bool | None) -> Any:
    import psr_hf
    from psr_hf.bench.runners import weight_sharing_copy
    from psr_hf.engine.graphs import GraphDecoder

    model = weight_sharing_copy(source)
    experts = int(source.config.get_text_config().num_experts)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", capacity=experts))  # every expert resident
    return GraphDecoder(model, max_len, graphs=graphs, compile=compile, gated_delta_kernel=kernel)


def _greedy(decoder: Any, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    logits = decoder.prefill(prompt, batched=False)
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits[0].float().clone())
        tokens.append(int(torch.argmax(logits[0])))
        logits = decoder.step(tokens[-1])
    return tokens, seen


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help=f"{MODEL} (default), qwen3.6-shape-N (N full-size layers of "
                   f"Qwen3.6-35B-A3B, random bf16 weights) or {TINY} (the CPU smoke test)")
    p.add_argument("--device", default=None, help="default cuda (cpu for the tiny model)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared between the two decoders")
    p.add_argument("--tokens", type=int, default=64, help="tokens stepped per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the attention blocks through torch.compile (default: GraphDecoder's, on CUDA with triton)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="the memory's peak GB/s (default by the GPU's name)")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.model == TINY else "cuda"))
    cuda = device.type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel runs in Triton's interpreter (CPU tensors)

    from psr_hf.bench.common import (device_sync, machine, paired_ratio, quiet_uncalibrated, summarize,
                                     teacher_forced_ms, versions)
    from psr_hf.engine.gated_delta_kernel import Shape, step_bytes

    sync = device_sync(device)
    began = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {text}", flush=True)

    source, ids, info = _load(args.model, device)
    prompt = ids[:args.prompt]
    config = source.config.get_text_config()
    linear = sum(t == "linear_attention" for t in config.layer_types)
    say(f"loaded {info['name']} ({source.dtype}, {linear} Gated DeltaNet layers of {len(config.layer_types)})")
    max_len = len(prompt) + max(args.check_tokens, args.tokens) + 1
    decoders = {}
    with quiet_uncalibrated():
        for name in NAMES:
            decoders[name] = _decoder(source, name == "kernel", max_len, cuda, args.compile)
            say(f"{name}: GraphDecoder built (gated_delta_kernel={decoders[name].layers.gated_delta_kernel}, "
                f"compiled blocks {decoders[name].compiled}, CUDA graphs {decoders[name].graphs})")

    n = max(args.check_tokens, args.tokens)
    greedy = {name: _greedy(d, prompt, n) for name, d in decoders.items()}
    (continuation, want_logits), (got, got_logits) = greedy["torch"], greedy["kernel"]
    want, got = continuation[:args.check_tokens], got[:args.check_tokens]
    parted = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    shared = len(want) if parted is None else parted + 1  # the logits up to the first parting see the same tokens
    logit_diff = max(float((a - b).abs().max()) for a, b in zip(want_logits[:shared], got_logits[:shared]))
    say(f"greedy tokens after a {len(prompt)}-token prompt: " + (
        f"equal over {len(want)}" if parted is None else f"part at new token {parted} of {len(want)}")
        + f"; largest |logit difference| {logit_diff:.3g} (up to the first parting)")

    ms: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(args.rounds):  # interleaved, the first one alternating
        for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
            ms[name].append(teacher_forced_ms(decoders[name], prompt, continuation[:args.tokens], sync,
                                              batched=False))
    say("timed")

    rows = {name: summarize(ms[name]) for name in NAMES}
    ratio = paired_ratio(ms["torch"], ms["kernel"])
    ratio["median"] = statistics.median(ratio["rounds"])
    saved_ms = rows["torch"]["median"] - rows["kernel"]["median"]
    layers = decoders["kernel"].layers
    shape = Shape(layers.k_heads, layers.v_heads, layers.k_dim, layers.v_dim, layers.kernel)
    weights = _weight_bytes(source)
    states = linear * step_bytes(shape, source.dtype)["state"]  # float32 state read and written per layer
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.hbm_gbps or next((v for k, v in PEAK_GBPS.items() if k in gpu), None)
    moved = weights["total"] + states
    bound_ms = moved / (peak * 1e9) * 1e3 if peak else None
    verdict = ("kernel faster (interval above 1)" if ratio["ci95"][0] > 1 else
               "kernel slower (interval below 1)" if ratio["ci95"][1] < 1 else "not shown")

    print(f"\n{gpu}: {info['name']}, all resident (exact, capacity {config.num_experts}), {args.rounds} rounds x "
          f"{args.tokens} tokens, order alternating; compiled blocks {decoders['kernel'].compiled}")
    print(f"{'step':8s} {'ms/token':>9s} {'95% interval':>18s}   rounds")
    for name in NAMES:
        row = rows[name]
        print(f"{name:8s} {row['median']:9.3f} {'[%.3f, %.3f]' % tuple(row['ci95']):>18s}   "
              + ", ".join(f"{v:.3f}" for v in row["rounds"]))
    print(f"torch/kernel per round: median {ratio['median']:.3f}, geometric mean {ratio['ratio']:.3f} "
          f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] (95%, paired by round): {verdict}")
    print(f"saved per token {saved_ms:.3f} ms (medians), {saved_ms * 1e3 / max(linear, 1):.1f} us per Gated DeltaNet "
          f"layer")
    print(f"bytes per token {moved / 1e9:.3f} GB (weights {weights['total'] / 1e9:.3f}, recurrent states "
          f"{states / 1e6:.1f} MB): HBM bound " + (f"{bound_ms:.3f} ms at {peak:.0f} GB/s; kernel at "
                                                 f"{rows['kernel']['median'] / bound_ms:.2f}x the bound"
                                                 if bound_ms else "unknown (give --hbm-gbps)"))
    record = {"what": "the engine's ms/token with the Gated DeltaNet one-kernel step (gated_delta_kernel=True) and "
                      "with the torch step (False), GraphDecoder, all resident",
              "model": info, "device": gpu, "prompt_tokens": len(prompt), "tokens": args.tokens,
              "rounds": args.rounds, "order": "interleaved, the first decoder alternating by round",
              "compiled_blocks": decoders["kernel"].compiled, "graphs": decoders["kernel"].graphs,
              "gated_delta_layers": linear, "shape": shape._asdict(),
              "greedy": {"tokens": len(want), "equal": parted is None, "first_parting": parted,
                         "max_abs_logit_diff": logit_diff, "torch": want, "kernel": got},
              "ms_per_token": rows, "torch_over_kernel": ratio, "verdict": verdict,
              "saved_ms_per_token": saved_ms, "bytes_per_token": {"weights": weights, "recurrent_states": states,
                                                                  "total": moved},
              "hbm_gbps": peak, "hbm_bound_ms": bound_ms, "machine": machine(device), "versions": versions()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    del decoders
    gc.collect()
    return record


if __name__ == "__main__":
    main()
