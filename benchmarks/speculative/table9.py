"""The paper's Table 9 here, beside the paper's figures (docs/speculative.md, "Table 9 here"): reads the engine record
(h200/speculative_h200.json), the harness summary (harness/summary.json) and the drafter-effect record
(drafter_effect.json) and writes table9.md. The break-even drafting times are computed from the record's rows by
psr_hf.bench.speculative.break_even. Usage: python benchmarks/speculative/table9.py"""

from __future__ import annotations

import json
from pathlib import Path

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
    "sd_exact_k8": ("SD, exact verification, k=8", None, None, None, None),
    "sd_position_k8": ("SD, position weights, k=8", None, None, None, None),
    "sd_confidence_k8": ("same, k=8", None, 5.0, 9.3, 13.1),
}
HARNESS = {"engine_resident": "ar_exact", "engine_psr_lam0.25_n1_res37": "ar_psr_lam0.25",
           "engine_psr_lam0.3_n1_res37": "ar_psr_lam0.3", "sd_exact_k16": "sd_exact_k16",
           "sd_position_k16": "sd_position_k16", "sd_confidence_k16": "sd_confidence_k16"}


def _f(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    record = json.loads((HERE / "h200" / "speculative_h200.json").read_text())
    harness = json.loads((HERE / "harness" / "summary.json").read_text())
    effect = json.loads((HERE / "drafter_effect.json").read_text())
    rows = record["rows"]
    sd_rows = parse_rows([n for n in rows if n.startswith("sd_")])
    ar = [n for n in rows if n.startswith("engine_")]
    be = break_even(rows, sd_rows, ar)
    lines = [f"Engine: grown-olmoe-routing (bf16) on the lent {record['device']}, tiny-moe drafting (bf16), pool "
             f"{record['pool']} of 64 experts per layer (37.5%), threshold {record['threshold']}; the first "
             f"{record['prompts']['count']} HumanEval problems, {record['max_new_tokens']} new tokens each "
             f"({record['stop']}), {record['rounds']} interleaved rounds; ms per generated token, decode only, "
             "mean [95% interval over rounds]. pass@1 and harness tau / copies: psr_humaneval_local (all 164 "
             "problems) in lm-eval on the CPU with olmoe-routing (float32). Paper: RTX 4090, OLMoE with OLMo-1B "
             "drafting.", "",
             "| configuration | pass@1 (paper) | tau engine / harness (paper) | copies / token engine / harness "
             "(paper) | ms / token (paper) |", "|---|---|---|---|---|"]
    for name, s in rows.items():
        label, p_pass, p_tau, p_copies, p_ms = PAPER.get(name, (name, None, None, None, None))
        h = harness.get(HARNESS.get(name, ""), {})
        lo, hi = s["ms_per_token_ci95"]
        lines.append(
            f"| {label} | {_f(h.get('pass@1'))} ({_f(p_pass)}) | {_f(s.get('tau'), 2)} / {_f(h.get('tau'), 2)} "
            f"({_f(p_tau)}) | {_f(s['copies_per_token'])} / {_f(h.get('copies_per_token'))} ({_f(p_copies)}) | "
            f"{s['ms_per_token']:.2f} [{lo:.2f}, {hi:.2f}] ({_f(p_ms)}) |")
    lines += ["", f"Time per verification and break-even drafting time, against {be['against']} "
              f"({be['psr_ms_per_token']:.2f} ms/token; its copies cost {be['psr_ms_per_copy']:.3f} ms each "
              "beyond the resident engine's time):", "",
              "| row | drafting ms | verification ms | of which compute (copies skipped) | copies | break-even "
              "drafting ms | the same, copies hidden as PSR hides its own |", "|---|---|---|---|---|---|---|"]
    for name, e in be["rows"].items():
        s = rows[name]
        lines.append(f"| {name} | {e['drafting_ms']:.2f} | {s['verify_ms_per_verification']:.2f} | "
                     f"{_f(e.get('verify_compute_ms'), 2)} | {_f(e.get('verify_copies_ms'), 2)} | "
                     f"{e['break_even_drafting_ms']:.2f} | {_f(e.get('break_even_drafting_ms_copies_hidden_as_psr'), 2)} |")
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
