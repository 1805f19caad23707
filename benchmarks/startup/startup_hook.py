"""What psr_hf_lm_eval.pth costs every Python process: interpreter start-up with and without it.

    python benchmarks/startup/startup_hook.py [--python PY] [--runs 300] [--json FILE]

Times ``PY -c pass`` (PY: this interpreter by default) alternately with the .pth in PY's site-packages and with
it renamed away (restored afterwards, also on error or Ctrl-C), in interleaved pairs so drifts in machine load
hit both sides; prints medians, percentiles and the paired difference with a 95% t-interval of its mean. Then
``PY -X importtime -c pass``: the hook module's own import time, and that it imports nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scipy import stats

PTH = "psr_hf_lm_eval.pth"


def _site_packages(python: str) -> Path:
    code = (f"import os, site; "
            f"print(next(p for p in site.getsitepackages() if os.path.exists(os.path.join(p, {PTH!r}))))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{PTH} is not installed for {python} (pip install psr-hf, or pip install -e .)")
    return Path(out.stdout.strip())


def _start(python: str) -> float:
    t = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True)
    return time.perf_counter() - t


def _importtime(python: str) -> tuple[float, list[str]]:
    """Median self time (ms) of the hook module over 20 runs, and what it imported (nothing, hopefully)."""
    selfs, children = [], []
    for _ in range(20):
        err = subprocess.run([python, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr
        lines = [line for line in err.splitlines() if line.startswith("import time:") and "|" in line]
        names = [line.rsplit("|", 1)[1] for line in lines]
        at = next(i for i, name in enumerate(names) if name.strip() == "_psr_hf_lm_eval")
        selfs.append(int(lines[at].split("|")[0].split(":")[1]) / 1000)
        depth = len(names[at]) - len(names[at].lstrip())
        i = at - 1
        while i >= 0 and len(names[i]) - len(names[i].lstrip()) > depth:
            children.append(names[i].strip())
            i -= 1
    return statistics.median(selfs), sorted(set(children))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--runs", type=int, default=300, help="interleaved pairs (default 300)")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    site = _site_packages(args.python)
    pth, away = site / PTH, site / (PTH + ".away")
    hook_ms, imported = _importtime(args.python)
    times: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for i in range(args.runs):
            for mode in (("with", "without") if i % 2 else ("without", "with")):
                if mode == "without":
                    pth.rename(away)
                try:
                    times[mode].append(_start(args.python) * 1e3)
                finally:
                    if away.exists():
                        away.rename(pth)
    finally:
        if away.exists():
            away.rename(pth)
    diff = [a - b for a, b in zip(times["with"], times["without"])]
    mean, sem = statistics.fmean(diff), statistics.stdev(diff) / len(diff) ** 0.5
    half = stats.t.ppf(0.975, len(diff) - 1) * sem
    print(f"{args.python}: {PTH} in {site}; {args.runs} interleaved pairs of `python -c pass`\n")
    print(f"{'':8}  {'median ms':>9}  {'p10':>6}  {'p90':>6}")
    for mode, t in times.items():
        q = statistics.quantiles(t, n=10)
        print(f"{mode:8}  {statistics.median(t):9.2f}  {q[0]:6.2f}  {q[-1]:6.2f}")
    print(f"\nadded by the hook: median of pair differences {statistics.median(diff):.3f} ms, "
          f"mean {mean:.3f} ms [{mean - half:.3f}, {mean + half:.3f}] (95% t-interval)")
    print(f"-X importtime: _psr_hf_lm_eval {hook_ms:.3f} ms (median self time); imports under it: {imported or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "python": args.python, "runs": args.runs, "times_ms": times, "hook_import_ms": hook_ms,
            "hook_imports": imported, "difference_ms": {"median": statistics.median(diff), "mean": mean,
                                                        "ci95": [mean - half, mean + half]}}, indent=2))


if __name__ == "__main__":
    main()
