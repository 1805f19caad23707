"""Two builds' engine speed side by side: reads the `psr-hf bench --engine` records that
benchmarks/engine/gpu_house_round3.sh wrote alternately from the build before a refactor (bench_old_N.json) and the
build after it (bench_new_N.json), pairs the two processes of each block (N = 2k, 2k + 1) as they ran, and prints per row each build's mean ms/token
and new/old as the geometric mean of the pairs' ratios with a 95% t-interval over pairs (a refactor is meant to
change no speed: an interval holding 1 shows no difference). ``--builds A B`` names other pairs of records the same
way (bench_A_N.json, bench_B_N.json: benchmarks/engine/gpu_fp8.sh's bf16 and fp8 checkpoints).
``python benchmarks/engine/old_vs_new.py DIR [--builds old new] [--json OUT]``."""
import argparse, json, math, pathlib, re
import numpy as np
from scipy import stats


def _pairs(folder, builds=("old", "new")):
    """(old, new) records of each block of two consecutive processes (N = 2k and 2k + 1) where both wrote one."""
    found = {}
    for path in folder.glob("bench_*_*.json"):
        match = re.fullmatch(rf"bench_({builds[0]}|{builds[1]})_(\d+)", path.stem)
        if match:
            found.setdefault(int(match.group(2)) // 2, {})[match.group(1)] = json.loads(path.read_text())
    return [(b[builds[0]], b[builds[1]]) for _, b in sorted(found.items()) if len(b) == 2]


def _engine_rows(record):
    return {r["configuration"]: r["ms_per_token"]["mean"] for r in record["results"] if r["kind"].startswith("engine")}


def compare(folder, builds=("old", "new")):
    """One entry per engine row: both builds' mean ms/token and new/old over the pairs both builds completed."""
    pairs = [(_engine_rows(o), _engine_rows(n)) for o, n in _pairs(folder, builds)]
    if len(pairs) < 2:
        raise ValueError(f"{folder} holds {len(pairs)} complete old/new pairs of bench records: at least two are "
                         "needed for an interval; run benchmarks/engine/gpu_house_round3.sh with STAGE=ab")
    rows = []
    for name in pairs[0][0]:
        logs = np.array([math.log(n[name] / o[name]) for o, n in pairs if name in o and name in n])
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
        rows.append({"row": name, "pairs": len(logs),
                     "old_ms_per_token": float(np.mean([o[name] for o, _ in pairs])),
                     "new_ms_per_token": float(np.mean([n[name] for _, n in pairs])),
                     "new_over_old": math.exp(logs.mean()),
                     "ci95": [math.exp(logs.mean() - half), math.exp(logs.mean() + half)]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--builds", nargs=2, default=["old", "new"], metavar=("OLD", "NEW"))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    old, new = args.builds
    rows = compare(args.folder, tuple(args.builds))
    print(f"{'row':<40} {'pairs':>5} {old + ' ms':>8} {new + ' ms':>8}  {new}/{old} [95% CI]")
    for r in rows:
        lo, hi = r["ci95"]
        verdict = "no difference shown" if lo <= 1 <= hi else (f"{new} faster" if hi < 1 else f"{new} slower")
        print(f"{r['row']:<40} {r['pairs']:>5} {r['old_ms_per_token']:>8.3f} {r['new_ms_per_token']:>8.3f}  "
              f"{r['new_over_old']:.3f} [{lo:.3f}, {hi:.3f}] {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "old_vs_new", "builds": args.builds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
