"""The engine against the HF path on the same patched model (issue 12, correctness 3; issue 49, the check of the
paper's Section 6.9): the share of token-layer pairs where both select the identical expert set, the held-out
perplexity of both under exact routing, and whether a routed row's change in NLL from exact routing agrees
between the two.

Per row (exact routing with every expert cached, and ``--rows``, default psr_lam0.3_n1 at ``--residency`` 50%),
on windows of the held-out text:

* HF prefill: one forward over the window, the controller recording the selections;
* HF decode: the window one token at a time with a KV cache (what generate() does), the first ``--decode-windows``
  windows only (the HF path is slow per token);
* engine: :class:`psr_hf.engine.graphs.GraphDecoder` (CUDA graphs, compiled blocks on CUDA) teacher-forced.

Without ``--offload`` the rows run on the logical cache only (no copy timing involved). With it the experts are
offloaded (``OffloadConfig`` on the model's device): a model loaded from a fine-grained FP8 checkpoint then keeps
its e4m3 experts in the store, and on a GPU the engine computes its dense projections in FP8 too (``dense_fp8``,
``--dense-fp8``). The Section 6.9 check compares perplexities, not expert sets: the engine's perplexity against the
HF prefill's under exact routing (its ratio minus one, with a 95% interval over windows), and, per routed row, the
engine's change in NLL from exact routing minus the HF path's (paired by window, 95% interval). On the CPU every
path computes in torch, so the two agree up to summation order.

    python benchmarks/engine/engine_agreement.py --json OUT.json [--model grown-olmoe-routing] [--windows 4]
        [--tokens 256] [--decode-windows 1] [--rows psr_lam0.3_n1] [--residency 0.5] [--offload]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

import psr_hf
from psr_hf import Calibration, OffloadConfig, RoutingConfig
from psr_hf.assets.loading import load_model
from psr_hf.assets.texts import default_texts, text_windows
from psr_hf.engine.graphs import GraphDecoder
from psr_hf.eval.grid import routing_from_name
from psr_hf.hf.inputs import cache_keyword

EXACT = "exact"


def sets(recordings, top_k: int) -> np.ndarray:
    """[T * L, K] sorted expert sets of the one sequence recorded."""
    (r,) = recordings
    return np.sort(np.asarray(r.selected).reshape(-1, top_k), axis=1)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token NLL of ``logits [T, V]`` (position t predicts ids[t + 1])."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return float(-logp.gather(1, ids[1:].view(-1, 1).to(logp.device)).mean())


def interval(values: Sequence[float]) -> dict[str, float | list[float] | int]:
    """Mean and 95% t-interval of ``values`` (over windows); the interval is the mean itself for one value."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return {"mean": mean, "ci95": [mean, mean], "n": int(len(v))}
    half = float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": int(len(v))}


def routing_of(name: str, experts: int, residency: float) -> RoutingConfig:
    """``exact`` with every expert cached, else the grid row ``name`` at ``residency``; ``ValueError`` for a
    name no grid row has."""
    if name == EXACT:
        return RoutingConfig(policy="exact", capacity=experts)
    fields = routing_from_name(name)
    if fields is None:
        raise ValueError(f"--rows {name!r}: no routing row has that name (e.g. psr_lam0.3_n1, cp_lam0.2, exact_lru)")
    return RoutingConfig(**fields, residency=residency)


def run_row(model, routing: RoutingConfig, windows: list, calibration, device: str, decode_windows: int,
            offload: bool, dense_fp8: bool | None, top_k: int) -> dict[str, dict[str, list]]:
    """Per path (hf_prefill, hf_decode, engine): each window's NLL and its recorded expert sets."""
    cuda = device == "cuda"
    out = {"hf_prefill": {"nll": [], "sets": []}, "hf_decode": {"nll": [], "sets": []},
           "engine": {"nll": [], "sets": []}}
    keyword = cache_keyword(model)
    placement = OffloadConfig(device=device) if offload else None
    with psr_hf.patched(model, routing, calibration=calibration, offload=placement), torch.no_grad():
        ctl = psr_hf.controller(model)
        decoder = GraphDecoder(model, int(windows[0].numel()), graphs=cuda, dense_fp8=dense_fp8)
        out["dense_fp8"] = getattr(decoder.layers, "dense_fp8", None)
        out["expert_format"] = ctl.expert_store.weight_format if offload else "model"
        for i, ids in enumerate(windows):
            ids_dev = ids.view(1, -1).to(device)
            ctl.reset()
            with ctl.record() as rec:
                logits = model(ids_dev).logits[0]
            out["hf_prefill"]["nll"].append(nll(logits, ids))
            out["hf_prefill"]["sets"].append(sets(rec.recordings, top_k))
            if i < decode_windows:
                from transformers import DynamicCache

                ctl.reset()
                cache = DynamicCache(config=model.config)
                steps = []
                with ctl.record() as rec:
                    for t in range(ids.numel()):
                        steps.append(model(ids_dev[:, t:t + 1], use_cache=True, **{keyword: cache}).logits[0, -1].float())
                out["hf_decode"]["nll"].append(nll(torch.stack(steps), ids))
                out["hf_decode"]["sets"].append(sets(rec.recordings, top_k))
            ctl.reset()
            decoder.reset()
            steps = []
            with ctl.record() as rec:
                for token in ids.tolist():
                    steps.append(decoder.step(token)[0].float().clone())
            out["engine"]["nll"].append(nll(torch.stack(steps), ids))
            out["engine"]["sets"].append(sets(rec.recordings, top_k))
        del decoder
    return out


def summary(out: dict) -> dict:
    """A row's perplexity per path and the shares of identical expert sets between paths."""
    result = {"dense_fp8": out["dense_fp8"], "expert_format": out["expert_format"]}
    for path in ("hf_prefill", "hf_decode", "engine"):
        v = out[path]
        if v["nll"]:
            m = float(np.mean(v["nll"]))
            result[path] = {"nll": m, "perplexity": math.exp(m), "windows": len(v["nll"]), "per_window": v["nll"]}

    def identical(x: str, y: str) -> float | None:
        n = min(len(out[x]["sets"]), len(out[y]["sets"]))
        if n == 0:
            return None
        return float(np.mean(np.concatenate([(a_ == b_).all(axis=1) for a_, b_ in
                                             zip(out[x]["sets"][:n], out[y]["sets"][:n])])))

    result["identical_sets"] = {"engine_vs_hf_prefill": identical("engine", "hf_prefill"),
                                "engine_vs_hf_decode": identical("engine", "hf_decode"),
                                "hf_decode_vs_hf_prefill": identical("hf_decode", "hf_prefill")}
    return result


def section_6_9(rows: dict[str, dict]) -> dict:
    """The paper's check: the engine's perplexity against the HF prefill's under exact routing, and per routed
    row the engine's change in NLL from exact minus the HF path's, each paired by window with a 95% interval."""
    exact = rows[EXACT]
    hf0, en0 = np.asarray(exact["hf_prefill"]["per_window"]), np.asarray(exact["engine"]["per_window"])
    check = {"exact_engine_over_hf_perplexity_minus_1": interval(np.exp(en0 - hf0) - 1.0), "rows": {}}
    for name, row in rows.items():
        if name == EXACT:
            continue
        hf_change = np.asarray(row["hf_prefill"]["per_window"]) - hf0
        en_change = np.asarray(row["engine"]["per_window"]) - en0
        check["rows"][name] = {"hf_nll_change": interval(hf_change), "engine_nll_change": interval(en_change),
                               "engine_minus_hf": interval(en_change - hf_change)}
    return check


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="grown-olmoe-routing", help="a model name or folder (an FP8 checkpoint too)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--decode-windows", type=int, default=1)
    p.add_argument("--rows", default="psr_lam0.3_n1", help="routed rows beside exact, comma-separated")
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument("--offload", action="store_true", help="offload the experts (an FP8 checkpoint's in FP8)")
    p.add_argument("--dense-fp8", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--device", default=None, help="default: cuda where torch sees one, else cpu")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dense_fp8 = {"auto": None, "on": True, "off": False}[a.dense_fp8]
    names = [EXACT] + [n for n in a.rows.split(",") if n]
    for name in names[1:]:
        routing_of(name, 1, a.residency)  # a name no grid row has: refused before the model loads
    model, tokenizer, info = load_model(a.model, device)
    calibration = Calibration.load(info["calibration_file"]) if "calibration_file" in info else None
    texts = default_texts(a.model) or default_texts("olmoe-routing")
    windows = [w[0] for w in text_windows([t for _, t in texts], tokenizer, windows=a.windows, tokens=a.tokens)]
    config = model.config.get_text_config()
    E = int(getattr(config, "num_experts", None) or config.n_routed_experts)
    K = int(config.num_experts_per_tok)
    routings = {name: routing_of(name, E, a.residency) for name in names}
    record = {"model": info["name"], "dtype": str(next(model.parameters()).dtype),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "windows": len(windows), "tokens": int(windows[0].numel()), "decode_windows": a.decode_windows,
              "residency": a.residency, "offload": a.offload, "policies": {}}
    for name, routing in routings.items():
        t0 = time.time()
        result = summary(run_row(model, routing, windows, calibration, device, a.decode_windows, a.offload,
                                 dense_fp8, K))
        result["seconds"] = time.time() - t0
        record["policies"][name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k not in ("hf_prefill", "hf_decode", "engine")}),
              flush=True)
    record["section_6_9"] = section_6_9(record["policies"])
    check = record["section_6_9"]
    ratio = check["exact_engine_over_hf_perplexity_minus_1"]
    print(f"exact: engine perplexity / HF prefill's - 1 = {ratio['mean']:+.5f} "
          f"[{ratio['ci95'][0]:+.5f}, {ratio['ci95'][1]:+.5f}] over {ratio['n']} windows")
    for name, row in check["rows"].items():
        d = row["engine_minus_hf"]
        print(f"{name}: NLL change from exact, HF {row['hf_nll_change']['mean']:+.4f}, engine "
              f"{row['engine_nll_change']['mean']:+.4f} nats/token; engine - HF {d['mean']:+.4f} "
              f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]")
    with open(a.json, "w") as f:
        json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
