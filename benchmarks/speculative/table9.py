"""The paper's Table 9 here, beside the paper's figures (docs/speculative.md, "Table 9 here"): reads the engine records
of the first 80 HumanEval problems (h200/speculative_h200_blocks.json: the AR rows and block selection;
h200/speculative_h200_exact.json: exact verification beside its own AR rows, two device calls of at most ten
minutes), the harness summary (harness/summary.json) and the drafter-effect record (drafter_effect.json) and writes
table9.md. The break-even drafting times come from each record's own rows (psr_hf.bench.speculative.break_even).
Usage: python benchmarks/speculative/table9.py"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy import stats

from psr_hf.bench.speculative import break_even, parse_rows

HERE = Path(__file__).parent
# the paper's Table 9, HumanEval columns (RTX 4090, OLMoE, OLMo-1B drafting): pass@1, tau, copies/token, ms/token
PAPER = {
    "engine_resident": ("AR, all experts resident", 32.9, None, 0.0, 6.1),
    "engine_psr_lam0.25_n1_res37": ("AR-PSR lam 0.25", 30.5, None, 10.0, 9.2),
    "engine_psr_lam0.3_n1_res37": ("AR-PSR lam 0.3", 34.8, None, 9.8, 9.1),
    "sd_exact_k16": ("SD, exact verification", 31.1, 6.5, 29.3, 27.3),
    "sd_position_k16": ("SD, block selection, position weights", 35.4, 6.7, 6.2, 13.6),
    "sd_confidence_k16": ("SD, block selection, confidence + top-1", 29.9, 6.4, 6.4, 14.3),
    "sd_confidence_k16_skip": ("same, copies skipped", None, 6.4, None, 10.7),
    "sd_confidence_k8": ("SD, confidence + top-1, k=8", None, 5.0, 9.3, 13.1),
    "sd_exact_k8": ("SD, exact verification, k=8", None, None, None, None),
}
RECORDS = ("speculative_h200_blocks.json", "speculative_h200_exact.json")
HARNESS = {"engine_resident": "ar_exact", "engine_psr_lam0.25_n1_res37": "ar_psr_lam0.25",
           "engine_psr_lam0.3_n1_res37": "ar_psr_lam0.3", "sd_exact_k16": "sd_exact_k16",
           "sd_position_k16": "sd_position_k16", "sd_confidence_k16": "sd_confidence_k16"}


def _f(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(record: dict, name: str, against: str) -> str:
    """Time per token over the PSR row's, paired by round: the geometric mean and its 95% t-interval."""
    a = np.log([r["ms_per_token"] for r in record["per_round"][name]])
    b = np.log([r["ms_per_token"] for r in record["per_round"][against]])
    d = a[:len(b)] - b[:len(a)]
    half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    return f"{np.exp(d.mean()):.2f} [{np.exp(d.mean() - half):.2f}, {np.exp(d.mean() + half):.2f}]"


def _be_lines(record: dict) -> list[str]:
    rows = record["rows"]
    sd = [n for n in rows if n.startswith("sd_")]
    be = break_even(rows, parse_rows(sd), [n for n in rows if n.startswith("engine_")])
    lines = []
    for name in sd:
        if name not in be["rows"]:
            lines.append(f"| {name} | {be['against']} ({be['psr_ms_per_token']:.2f}) | "
                         f"{_ratio(record, name, be['against'])} | {rows[name]['tau']:.2f} | "
                         f"{rows[name]['draft_ms_per_verification']:.2f} | "
                         f"{rows[name]['verify_ms_per_verification']:.2f} | - | - | - | - |")
            continue
        e = be["rows"][name]
        lines.append(f"| {name} | {be['against']} ({be['psr_ms_per_token']:.2f}) | "
                     f"{_ratio(record, name, be['against'])} | {rows[name]['tau']:.2f} | "
                     f"{e['drafting_ms']:.2f} | {rows[name]['verify_ms_per_verification']:.2f} | "
                     f"{_f(e.get('verify_compute_ms'), 2)} | {_f(e.get('verify_copies_ms'), 2)} | "
                     f"{e['break_even_drafting_ms']:.2f} | {_f(e.get('break_even_drafting_ms_copies_hidden_as_psr'), 2)} |")
    return lines


def main() -> None:
    records = [json.loads((HERE / "h200" / name).read_text()) for name in RECORDS]
    harness = json.loads((HERE / "harness" / "summary.json").read_text())
    effect = json.loads((HERE / "drafter_effect.json").read_text())
    blocks, exact = records
    rows = dict(blocks["rows"])
    rows.update({n: s for n, s in exact["rows"].items() if n.startswith("sd_")})
    rounds = {n: (blocks if n in blocks["rows"] else exact)["rounds_done"] for n in rows}
    lines = [f"Engine: grown-olmoe-routing (bf16) on the lent {blocks['device']}, tiny-moe drafting (bf16), pool "
             f"{blocks['pool']} of 64 experts per layer (37.5%), threshold {blocks['threshold']}; the first "
             f"{blocks['prompts']['count']} HumanEval problems, {blocks['max_new_tokens']} new tokens each "
             f"({blocks['stop']}); ms per generated token, decode only, mean [95% interval over interleaved rounds]. "
             f"Records: h200/{RECORDS[0]} (AR and block selection, {blocks['rounds_done']} rounds) and "
             f"h200/{RECORDS[1]} (exact verification beside its own AR rows, {exact['rounds_done']} of "
             f"{exact['rounds']} rounds: the device call's limit cut the third). pass@1 and harness tau / copies: "
             "psr_humaneval_local (all 164 problems) in lm-eval on the CPU with olmoe-routing (float32). Paper: "
             "RTX 4090, OLMoE with OLMo-1B drafting.", "",
             "| configuration | pass@1 (paper) | tau engine / harness (paper) | copies / token engine / harness "
             "(paper) | ms / token (paper) | rounds |", "|---|---|---|---|---|---|"]
    for name in PAPER:
        if name not in rows:
            continue
        s = rows[name]
        label, p_pass, p_tau, p_copies, p_ms = PAPER[name]
        h = harness.get(HARNESS.get(name, ""), {})
        lo, hi = s["ms_per_token_ci95"]
        copies = "- (skipped)" if name.endswith("_skip") else _f(s["copies_per_token"])
        lines.append(
            f"| {label} | {_f(h.get('pass@1'))} ({_f(p_pass)}) | {_f(s.get('tau'), 2)} / {_f(h.get('tau'), 2)} "
            f"({_f(p_tau)}) | {copies} / {_f(h.get('copies_per_token'))} ({_f(p_copies)}) | "
            f"{s['ms_per_token']:.2f} [{lo:.2f}, {hi:.2f}] ({_f(p_ms)}) | {rounds[name]} |")
    lines += ["", "Time per verification (ms) and the break-even drafting time, each row against the faster AR-PSR "
              "row of its own record (ms/token); time per token over that row's, paired by round (geometric mean "
              "[95% t-interval]); copies hidden as PSR hides its own: at PSR's cost per copy beyond the resident "
              "engine's time:", "",
              "| row | against | ÷ PSR [95% CI] | tau | drafting | verification | of which compute (copies "
              "skipped) | copies | break-even drafting | the same, copies hidden as PSR's |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += _be_lines(blocks) + _be_lines(exact)
    lines += ["", "The drafter in the routing (committed token-layers whose executed set changes when the rejected "
              f"positions carry the true continuation; {effect['problems']} HumanEval problems, {effect['new_tokens']} "
              f"new tokens, k = {effect['k']}, {effect['model']}; the paper: 36% with position weights):", ""]
    for mode, r in effect["results"].items():
        lines.append(f"- {mode} weights: {100 * r['share']:.1f}% ({r['changed']} of {r['committed_token_layers']} "
                     f"committed token-layers in {r['blocks']} blocks)")
    (HERE / "table9.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
