"""Do two lm-eval runs (``--log_samples``) give the same per-sample results? Prints a table, writes JSON.

Used for the data-parallel check of ``accelerate launch -m lm_eval --model psr_hf`` against a single-process run
(``benchmarks/eval/dp_check.sh``): per task, the samples are matched by ``doc_id`` and compared: generated texts
and multiple-choice decisions exactly, log-likelihoods to a relative tolerance (batch composition changes the
last bits of a forward pass, as with lm-eval's ``hf`` model).

    python benchmarks/eval/dp_equivalence.py RUN_A RUN_B [--json OUT] [--rel 1e-5]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def _samples(run: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for path in sorted(run.rglob("samples_*.jsonl")):
        task = path.stem[len("samples_"):].rsplit("_", 1)[0]
        with path.open() as f:
            out[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    if not out:
        raise SystemExit(f"{run}: no samples_*.jsonl (run lm-eval with --log_samples --output_path)")
    return out


def _numbers(resps) -> list[float] | None:
    """Log-likelihoods of a loglikelihood sample (lm-eval logs each response as a string: ``"-3.2"`` or
    ``["-3.2", "False"]``); None for generated text."""
    flat = []
    for r in resps:
        value = r[0] if isinstance(r, list) else r
        if isinstance(value, list):  # multiple choice: [loglikelihood, is_greedy]
            value = value[0]
        try:
            parsed = ast.literal_eval(value) if isinstance(value, str) else value
        except (ValueError, SyntaxError):
            return None
        if isinstance(parsed, tuple):
            parsed = parsed[0]
        if not isinstance(parsed, (int, float)):
            return None
        flat.append(float(parsed))
    return flat


def compare(a: Path, b: Path, rel: float) -> dict:
    sa, sb = _samples(a), _samples(b)
    tasks = {}
    for task in sorted(set(sa) | set(sb)):
        da, db = sa.get(task, {}), sb.get(task, {})
        docs = sorted(set(da) & set(db))
        texts_differ = decisions_differ = 0
        worst = 0.0
        for d in docs:
            x, y = da[d], db[d]
            nx, ny = _numbers(x["resps"]), _numbers(y["resps"])
            if nx is None or ny is None:  # generation: the texts
                texts_differ += x["filtered_resps"] != y["filtered_resps"]
            else:
                for u, v in zip(nx, ny):
                    worst = max(worst, abs(u - v) / max(abs(v), 1e-30))
            decisions_differ += any(x[k] != y[k] for k in ("acc", "acc_norm", "pass@1", "exact_match") if k in x)
        tasks[task] = {"docs_a": len(da), "docs_b": len(db), "matched": len(docs), "texts_differ": texts_differ,
                       "decisions_differ": decisions_differ, "max_rel_loglikelihood_diff": worst,
                       "equal": len(da) == len(db) == len(docs) and texts_differ == 0 and decisions_differ == 0
                       and worst <= rel}
    return {"run_a": str(a), "run_b": str(b), "rel_tolerance": rel, "tasks": tasks,
            "equal": all(t["equal"] for t in tasks.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--rel", type=float, default=1e-5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = compare(args.run_a, args.run_b, args.rel)
    print(f"{'task':24} {'docs a':>6} {'docs b':>6} {'texts differ':>12} {'decisions differ':>16} {'max rel ll diff':>15}")
    for task, t in result["tasks"].items():
        print(f"{task:24} {t['docs_a']:6d} {t['docs_b']:6d} {t['texts_differ']:12d} {t['decisions_differ']:16d} "
              f"{t['max_rel_loglikelihood_diff']:15.2e}")
    print(f"{args.run_a} vs {args.run_b}: {'EQUAL' if result['equal'] else 'DIFFERENT'} (rel tolerance {args.rel})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
