"""ms/token against the share of expert memory on the GPU: the engine rows of a ``psr-hf bench --engine`` record
beside llama.cpp's figures on the same lent H200 (measured by the project before the engine existed, no log in this repository: random OLMoE-1B-7B shape, bf16, batch-1
decode of 64 tokens, ``--n-cpu-moe`` 0 / 4 / 8 / 12 / 16 of 16 MoE layers' experts on the CPU).

    python benchmarks/engine/plot_vs_llamacpp.py benchmarks/engine/h200/bench_engine.json --out FIG.png
"""

from __future__ import annotations

import argparse
import json

from matplotlib.figure import Figure

# share of the experts' memory on the GPU -> ms/token (llama.cpp, the issue's figures)
LLAMA_CPP = {1.0: 1.73, 0.75: 6.5, 0.5: 12.1, 0.25: 17.2, 0.0: 20.0}
ROWS = (("psr_lam0.3_n1", "C4", "o"), ("cp_lam0.2", "C2", "s"), ("exact_lru", "C0", "^"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("record")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    record = json.load(open(a.record))
    rows = {r["configuration"]: r for r in record["results"]}

    def ms(name: str) -> tuple[float, float, float]:
        m = rows[name]["ms_per_token"]
        return m["mean"], m["mean"] - m["ci95"][0], m["ci95"][1] - m["mean"]

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    xs = sorted(LLAMA_CPP)
    ax.plot([100 * x for x in xs], [LLAMA_CPP[x] for x in xs], "k--", marker="x",
            label="llama.cpp (--n-cpu-moe; random weights, same shape)")
    for policy, colour, marker in ROWS:
        pts = [(res, *ms(f"engine_{policy}_res{round(100 * res)}")) for res in (0.5, 0.25)
               if f"engine_{policy}_res{round(100 * res)}" in rows]
        if "engine_resident" in rows:
            pts.insert(0, (1.0, *ms("engine_resident")))
        ax.errorbar([100 * x for x, *_ in pts], [m for _, m, _, _ in pts],
                    yerr=[[lo for *_, lo, _ in pts], [hi for *_, hi in pts]], color=colour, marker=marker,
                    capsize=3, label=f"psr_hf engine, {policy}")
    hf = [(1.0, "resident")] + [(res, f"psr_lam0.3_n1_res{round(100 * res)}") for res in (0.5, 0.25)]
    hf = [(x, *ms(n)) for x, n in hf if n in rows]
    if hf:
        ax.errorbar([100 * x for x, *_ in hf], [m for _, m, _, _ in hf],
                    yerr=[[lo for *_, lo, _ in hf], [hi for *_, hi in hf]], color="grey", marker="o",
                    linestyle=":", capsize=3, label="transformers + psr_hf offload, psr_lam0.3_n1")
    ax.set_yscale("log")
    ax.set_xlim(105, -5)
    ax.set_xlabel("expert memory on the GPU (%)")
    ax.set_ylabel("ms per token (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{record['model']['name']}, bf16, batch 1, {record['machine']['device']}", fontsize=10)
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()
