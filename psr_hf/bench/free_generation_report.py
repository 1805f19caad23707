"""The text of a ``psr-hf bench-free-generation`` record (:func:`psr_hf.bench.free_generation.run_free_generation`):
the table of its rows per task, as the paper's Table 6, the table of its ratios, and the lines under them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._text import text_table
from .rows import ENGINE_RESIDENT


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _interval(value: float, ci: list[float], digits: int = 2) -> str:
    lo, hi = ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _fmt(value, digits)
    return f"{value:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _capacity(row: Mapping[str, Any]) -> str:
    if row["kind"] == ENGINE_RESIDENT:
        return "all"
    return f"{row['residency']:.0%}" + ("" if row.get("capacity") is None else f" (C={row['capacity']})")


def format_table(record: Mapping[str, Any]) -> str:
    """One line per configuration and task: ms per generated token with its 95% interval over rounds, p99,
    copies per generated token (demand / prefetch), tokens generated per prompt, prompt time per prompt token."""
    lines = []
    for task, rows in record["results"].items():
        for row in rows:
            c, ms = row["copies"], row["ms_per_token"]
            lines.append([
                row["configuration"], _capacity(row), task, _interval(ms["mean"], ms["ci95"]), _fmt(row["p99_ms"]),
                f"{_fmt(c.get('copies_per_token'))} ({_fmt(c.get('demand_per_token'))} / "
                f"{_fmt(c.get('prefetch_per_token'))})",
                _fmt(row["generated"]["tokens_per_prompt"], 1), str(row["generated"]["tokens_per_round"]),
                _fmt(row["prompt"]["ms_per_prompt_token"]["mean"], 3),
                "yes" if row["continuations_identical_over_rounds"] else "NO",
            ])
    header = ["config", "capacity", "task", "ms/token [95% CI]", "p99", "copies/tok (demand / prefetch)",
              "tok/prompt", "tokens", "prompt ms/tok", "same every round"]
    return text_table(lines, header)


def format_ratios(record: Mapping[str, Any]) -> str:
    """One line per ratio: over rounds with its interval and Holm-adjusted p (``*``: significant after Holm over
    the table's ratios), over prompts, the prompts where the numerator is faster (sign test, Holm over the
    table's sign tests), and the prompt-time ratio."""
    lines = []
    for r in record["ratios"]:
        rounds, prompts, sign, prompt = r["over_rounds"], r["over_prompts"], r["sign_test"], r["prompt_time"]
        compared = sign["faster"] + sign["slower"] + sign["ties"]
        lines.append([
            f"{r['numerator']} / {r['denominator']}", r["task"],
            _interval(rounds["ratio"], rounds["ci95"], 3) + (" *" if rounds["holm_significant"] else ""),
            f"{_p(rounds['p'])} ({_p(rounds['holm_p'])})", _interval(prompts["ratio"], prompts["ci95"], 3),
            f"{sign['faster']} of {compared}" + (" *" if sign["holm_significant"] else ""),
            f"{_p(sign['p'])} ({_p(sign['holm_p'])})", _interval(prompt["ratio"], prompt["ci95"], 3),
        ])
    header = ["ratio (ms per generated token)", "task", "over rounds [95% CI]", "p (Holm)",
              "over prompts [95% CI]", "faster on", "sign p (Holm)", "prompt time [95% CI]"]
    return text_table(lines, header)


def report_lines(record: Mapping[str, Any]) -> list[str]:
    """The protocol, the prompts and their cut, the model and the machine, printed under the tables."""
    s, model, m = record["settings"], record["model"], record["machine"]
    lines = ["", f"greedy free generation in the engine ({'CUDA graphs' if s['engine_graphs'] else 'eager'}), batch 1: "
                 f"up to {s['max_new_tokens']} new tokens per prompt, {s['rounds']} interleaved rounds; a "
                 f"continuation ends at the end-of-sequence token"
                 + (" or the task's stop sequences" if s["stop"] == "task" else ""),
             "ms/token: decode steps only (each generated token after the first, which comes with the prompt), "
             "mean over rounds; p99 over every step; copies per generated token from the controller's statistics "
             "over the decode steps; prompt ms/tok: the prompt (prefill and first token) per prompt token",
             "ratios: over rounds, paired t on per-round log ms/token (* significant after Holm over the table's "
             "ratios); over prompts, a paired bootstrap of the task's prompts "
             f"({s['bootstrap_resamples']} resamples, seed {s['seed']}); faster on: prompts where the numerator "
             "takes less per generated token, binomial sign test (* after Holm over the table's sign tests)"]
    for task, p in record["prompts"].items():
        counts = [q["tokens"] for q in p["prompts"]]
        cut = sum(q["dropped"] > 0 for q in p["prompts"])
        lines.append(f"{task}: {len(counts)} prompts, {min(counts)}-{max(counts)} tokens ({cut} cut from the left "
                     f"to {s['max_prompt_tokens']}); {p['source']}")
    if not record["ratios"]:
        lines.append("no ratios: the table pairs PSR with Cache-Prior rows at the same residency")
    lines.append(f"model: {model['name']} ({model['class']}), {model['dtype']}, {model['moe_layers']} MoE layers x "
                 f"{model['num_experts']} experts, top-{model['top_k']}, experts {model['expert_bytes'] / 1e6:.1f} MB")
    lines.append(f"machine: {m['device']}, torch {m['torch']}, transformers {m['transformers']}")
    return lines
