"""The engine against the HF path on the same patched model in bf16 (issue 12, correctness 3): the share of
token-layer pairs where both select the identical expert set, and the held-out perplexity of both.

Per policy (exact routing with every expert cached, and psr_lam0.3_n1 at 50% residency on the logical cache: no
offload, so no copy timing is involved), on windows of the held-out text:

* HF prefill: one forward over the window (``labels``: its loss), the controller recording the selections;
* HF decode: the window one token at a time with a KV cache (what generate() does), the first ``--decode-windows``
  windows only (the HF path is slow per token);
* engine: :class:`psr_hf.engine.graphs.GraphDecoder` (CUDA graphs, compiled blocks on CUDA) teacher-forced.

    python benchmarks/engine/bf16_agreement.py --json OUT.json [--model grown-olmoe-routing] [--windows 4]
        [--tokens 256] [--decode-windows 1]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

import psr_hf
from psr_hf import Calibration, RoutingConfig
from psr_hf.hf.inputs import cache_keyword
from psr_hf.bench.workloads import default_texts, load_model, text_windows
from psr_hf.engine.graphs import GraphDecoder

POLICIES = {"exact": None, "psr_lam0.3_n1_res50": dict(policy="psr", lam=0.3, eviction="score", budget=1,
                                                       residency=0.5)}


def sets(recordings, top_k: int) -> np.ndarray:
    """[T * L, K] sorted expert sets of the one sequence recorded."""
    (r,) = recordings
    return np.sort(np.asarray(r.selected).reshape(-1, top_k), axis=1)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token NLL of ``logits [T, V]`` (position t predicts ids[t + 1])."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return float(-logp.gather(1, ids[1:].view(-1, 1).to(logp.device)).mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="grown-olmoe-routing")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--decode-windows", type=int, default=1)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, tokenizer, info = load_model(a.model, device)
    calibration = Calibration.load(info["calibration_file"]) if "calibration_file" in info else None
    texts = default_texts(a.model)
    windows = [w[0] for w in text_windows([t for _, t in texts], tokenizer, windows=a.windows, tokens=a.tokens)]
    config = model.config.get_text_config()
    E = int(getattr(config, "num_experts", None) or config.n_routed_experts)
    K = int(config.num_experts_per_tok)
    keyword = cache_keyword(model)
    record = {"model": a.model, "dtype": str(next(model.parameters()).dtype), "device":
              torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "windows": len(windows),
              "tokens": int(windows[0].numel()), "decode_windows": a.decode_windows, "policies": {}}
    for name, fields in POLICIES.items():
        t0 = time.time()
        routing = RoutingConfig(policy="exact", capacity=E) if fields is None else RoutingConfig(**fields)
        out = {"hf_prefill": {"nll": [], "sets": []}, "hf_decode": {"nll": [], "sets": []},
               "engine": {"nll": [], "sets": []}}
        with psr_hf.patched(model, routing, calibration=calibration), torch.no_grad():
            ctl = psr_hf.controller(model)
            decoder = GraphDecoder(model, int(windows[0].numel()), graphs=cuda)
            for i, ids in enumerate(windows):
                ids_dev = ids.view(1, -1).to(device)
                ctl.reset()
                with ctl.record() as rec:
                    logits = model(ids_dev).logits[0]
                out["hf_prefill"]["nll"].append(nll(logits, ids))
                out["hf_prefill"]["sets"].append(sets(rec.recordings, K))
                if i < a.decode_windows:
                    from transformers import DynamicCache

                    ctl.reset()
                    cache = DynamicCache(config=model.config)
                    steps = []
                    with ctl.record() as rec:
                        for t in range(ids.numel()):
                            steps.append(model(ids_dev[:, t:t + 1], use_cache=True,
                                               **{keyword: cache}).logits[0, -1].float())
                    out["hf_decode"]["nll"].append(nll(torch.stack(steps), ids))
                    out["hf_decode"]["sets"].append(sets(rec.recordings, K))
                ctl.reset()
                decoder.reset()
                steps = []
                with ctl.record() as rec:
                    for token in ids.tolist():
                        steps.append(decoder.step(token)[0].float().clone())
                out["engine"]["nll"].append(nll(torch.stack(steps), ids))
                out["engine"]["sets"].append(sets(rec.recordings, K))
            del decoder
        result = {}
        for path, v in out.items():
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
        result["seconds"] = time.time() - t0
        record["policies"][name] = result
        print(name, json.dumps(result), flush=True)
    with open(a.json, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
