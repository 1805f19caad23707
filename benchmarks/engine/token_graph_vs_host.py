"""The token graph (device routing, one CUDA graph per token) against the host-routed GraphDecoder on the same model,
side by side in one process: greedy tokens and every step's logits compared bitwise, the routing statistics and
copy counts compared, then ms/token of the held-out text's next tokens teacher-forced after the prompt (``--timed
greedy``: the greedy tokens after a repeated paragraph, as the records before it), in interleaved rounds (median
and a 95% interval of the per-round ratio host/device), with the routing statistics of the timed tokens. ``--prefetch-programs`` compares token graphs whose prefetch copies run
on that many programs. ``--torch-attention`` adds a token graph whose OLMoE attention runs the torch ops instead
of the Triton kernels (``attention_kernels=False``; the other decoders take the default, the kernels on CUDA), and
prints the speed-up of the kernels: its ms/token over the default token graph's, per round. ``--dense-model`` adds
a token graph with ``dense_fp8=False`` and prints the speed-up of the FP8 dense projections the same way (on a
model loaded from an FP8 checkpoint, in the offloaded rows: ``exact_lru@1.0`` is all resident in FP8).

    python benchmarks/engine/token_graph_vs_host.py --model grown-olmoe-routing --tokens 64 --rounds 5 --json OUT

Rows: all resident (exact), and psr lam0.3 n1 / cp lam0.2 / exact lru at the given residencies, offloaded.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import numpy as np
import torch

import psr_hf
from psr_hf.assets.loading import load_model
from psr_hf.bench.common import teacher_forced_ms
from psr_hf.bench.runners import weight_sharing_copy
from psr_hf.engine.graphs import GraphDecoder
from psr_hf.engine.token_graph import TokenGraphDecoder
from psr_hf.assets.texts import measured_texts, text_windows
from psr_hf.eval.grid import routing_from_name

DEFAULT_ROWS = ("psr_lam0.3_n1", "cp_lam0.2", "exact_lru")


def _case(row: str) -> tuple[str, dict, float | None]:
    """``resident_exact``, or a routing grid name at a residency (``psr_lam0.3_n1_d2@0.5``)."""
    if row == "resident_exact":
        return row, dict(policy="exact"), None
    name, _, residency = row.partition("@")
    fields = routing_from_name(name)
    if fields is None or not residency:
        raise SystemExit(f"--rows {row!r}: give resident_exact or a routing grid name at a residency, e.g. "
                         "psr_lam0.3_n1@0.5 or psr_lam0.3_n1_d2@0.25")
    return row, dict(fields, residency=float(residency)), float(residency)


def _repeated(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of one paragraph said eight times (the text of the records before --timed heldout)."""
    text = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
            "books were made and read across Europe. ") * 8
    return tokenizer(text)["input_ids"][:n]


def _heldout(model: str, tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the model's held-out text (the bench's and the sweep's), else of the standard
    library's sources."""
    texts, _ = measured_texts(model, [], option="--model")
    return text_windows(texts, tokenizer, windows=1, tokens=n - 1)[0][0].tolist()


def _greedy(decoder, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    logits = decoder.prefill(prompt, batched=False)
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits[0].float().clone())
        token = int(torch.argmax(logits[0]))
        tokens.append(token)
        logits = decoder.step(token)
    return tokens, seen


def _ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ratios = [x / y for x, y in zip(a, b)]
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return mean, mean, mean
    from scipy import stats

    half = stats.t.ppf(0.975, len(ratios) - 1) * statistics.stdev(ratios) / len(ratios) ** 0.5
    return mean, mean - half, mean + half


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="grown-olmoe-routing")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--residency", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--rows", nargs="+", default=None,
                    help="these rows instead (resident_exact, or a grid name at a residency: psr_lam0.3_n1_d2@0.5)")
    ap.add_argument("--prefetch-programs", type=int, nargs="+", default=[8],
                    help="the token graph's programs for a layer's prefetch copies; one device decoder per value")
    ap.add_argument("--max-len", type=int, default=None,
                    help="the decoders' KV cache length (default: prompt + tokens + 2; attach() uses up to 4096)")
    ap.add_argument("--torch-attention", action="store_true",
                    help="also a token graph with attention_kernels=False: the kernels' speed-up side by side")
    ap.add_argument("--dense-model", action="store_true",
                    help="also a token graph with dense_fp8=False: the FP8 dense projections' speed-up side by side")
    ap.add_argument("--timed", choices=["heldout", "greedy"], default="heldout",
                    help="the tokens timed, teacher-forced after the prompt: the held-out text's next tokens, as "
                         "psr-hf bench times (default), or the host path's greedy tokens after a repeated paragraph "
                         "(the records before this option)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    source, tokenizer, info = load_model(args.model, "cuda")
    calibration = info.get("calibration_file")
    if args.timed == "heldout":
        text = _heldout(args.model, tokenizer, args.prompt + args.tokens)
        prompt, timed = text[:args.prompt], text[args.prompt:]
    else:
        prompt, timed = _repeated(tokenizer, args.prompt), None
    max_len = args.max_len or args.prompt + args.tokens + 2
    if max_len < args.prompt + args.tokens + 1:
        raise SystemExit(f"--max-len {max_len}: the prompt and the tokens need {args.prompt + args.tokens + 1}")
    records = []
    rows = args.rows or ["resident_exact"] + [f"{name}@{r}" for r in args.residency for name in DEFAULT_ROWS]
    cases = [_case(row) for row in rows]
    for name, kw, residency in cases:
        model = weight_sharing_copy(source)
        if residency is None:  # every expert cached: nothing offloaded
            kw = dict(kw, capacity=int(source.config.num_experts))
        config = psr_hf.RoutingConfig(**kw)
        offload = psr_hf.OffloadConfig() if residency is not None else None
        psr_hf.patch(model, config, calibration=calibration, offload=offload)
        ctl = psr_hf.controller(model)
        decoders = {"host": GraphDecoder(model, max_len)}
        for programs in args.prefetch_programs:
            label = "device" if len(args.prefetch_programs) == 1 else f"device_p{programs}"
            decoders[label] = TokenGraphDecoder(model, max_len, prefetch_programs=programs)
        if args.torch_attention:
            decoders["device_torch_attention"] = TokenGraphDecoder(model, max_len, attention_kernels=False)
        if args.dense_model:
            decoders["device_dense_model"] = TokenGraphDecoder(model, max_len, dense_fp8=False)
        greedy = {}
        for label, decoder in decoders.items():
            ctl.reset()
            ctl.reset_stats()
            tokens, logits = _greedy(decoder, prompt, args.tokens)
            greedy[label] = (tokens, logits, ctl.stats())
        host_tokens, host_logits, host_stats = greedy["host"]
        times: dict[str, list[float]] = {label: [] for label in decoders}
        timed_stats = {}
        for r in range(args.rounds):  # interleaved rounds, the order turned each round
            order = list(decoders.items())
            for label, decoder in (order if r % 2 == 0 else order[::-1]):
                ctl.reset_stats()
                times[label].append(teacher_forced_ms(decoder, prompt, timed or host_tokens, torch.cuda.synchronize,
                                                      batched=False))
                timed_stats.setdefault(label, repr(ctl.stats()))  # the prompt's positions and the timed tokens'
        record = {"row": name, "host_stats": repr(host_stats), "timed_stats": timed_stats, "host_ms": times["host"],
                  "host_ms_median": statistics.median(times["host"]), "devices": {}}
        print(f"{name:22s} host {record['host_ms_median']:.3f} ms/token   greedy: {host_stats}", flush=True)
        if args.timed == "heldout":
            print(f"{'':22s} timed tokens: {timed_stats['host']}; the token graph's the same: "
                  f"{len(set(timed_stats.values())) == 1}", flush=True)
        for label in list(decoders)[1:]:
            tokens, logits, stats = greedy[label]
            same_tokens = tokens == host_tokens
            same_logits = all(torch.equal(a, b) for a, b in zip(host_logits, logits))
            ratio = _ratio_interval(times["host"], times[label])
            record["devices"][label] = {
                "same_tokens": same_tokens, "same_logits": same_logits, "stats": repr(stats),
                "same_stats": repr(stats) == repr(host_stats), "ms": times[label],
                "ms_median": statistics.median(times[label]), "host_over_device": ratio}
            print(f"   {label:12s} tokens equal {same_tokens} logits equal {same_logits} stats equal "
                  f"{repr(stats) == repr(host_stats)}  {statistics.median(times[label]):.3f} ms/token  host/device "
                  f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]", flush=True)
        if args.torch_attention and "device" in times:
            speedup = _ratio_interval(times["device_torch_attention"], times["device"])
            record["attention_kernels_speedup"] = speedup
            print(f"   attention kernels: torch/kernels {speedup[0]:.3f} [{speedup[1]:.3f}, {speedup[2]:.3f}]", flush=True)
        if args.dense_model and "device" in times:
            in_fp8 = bool(getattr(decoders["device"].layers, "dense_fp8", False))
            speedup = _ratio_interval(times["device_dense_model"], times["device"])
            record["dense_fp8"] = in_fp8
            record["dense_fp8_speedup"] = speedup
            print(f"   dense projections in FP8 {in_fp8}: model weights / FP8 {speedup[0]:.3f} "
                  f"[{speedup[1]:.3f}, {speedup[2]:.3f}]", flush=True)
        records.append(record)
        del decoders, ctl
        gc.collect()  # the decoders' graphs and buffers, before unpatch copies the experts back to the GPU
        torch.cuda.empty_cache()
        psr_hf.unpatch(model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "tokens": args.tokens,
                       "max_len": max_len, "timed": args.timed,
                       "rounds": args.rounds, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
