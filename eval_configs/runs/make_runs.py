"""Write the named RoutingConfig files of eval_configs/runs/ from one table (the paper's configurations).

    python eval_configs/runs/make_runs.py            # (re)write every <family>/<name>.yaml
    python eval_configs/runs/make_runs.py --check    # exit 1 if a file is missing, stale or not in the table
    python eval_configs/runs/make_runs.py --model-args eval_configs/runs/olmoe/psr_lam0.3_n1_res50.yaml
                                                     # the file as lm-eval model arguments (key=value,...)

Names follow the paper's Appendix B ("PSR lambda, n", Cache-Prior with top-J protection) and Sections 6.1-6.9,
and are derived from the config's fields by :func:`run_name`, so a name always states what the file holds::

    exact_lru | exact_a[_n<n>]                      exact routing, LRU or A-priority eviction, logical prefetch n
    cp[_a]_lam<lam>[_j<J>][_running]                Cache-Prior (LRU, or A priority), top-J kept, running range
    psr[_lru]_lam<lam>_n<n>[_j<J>][_running]        PSR with the A priority (or LRU) and prefetch budget n
    spec                                            speculative execution (budget = window = K)
    ... then _w<W> when the pre-gate window is not the family's own, and _res<percent> (residency) last.

Every file loads with ``psr_hf.RoutingConfig.load_yaml``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing psr_hf

from psr_hf.policy.config import RoutingConfig  # numpy/torch-free


@dataclass(frozen=True)
class Run:
    """One configuration of the table: RoutingConfig fields (no residency) and where the paper uses it."""

    fields: dict
    note: str
    residencies: tuple[float, ...] | None = None  # None: the family's residencies


@dataclass(frozen=True)
class Family:
    model: str
    window: int  # the family's pre-gate window (patches/<family>.py default_window)
    residencies: tuple[float, ...]
    runs: tuple[Run, ...]


def _cp(lam: float, note: str, **extra) -> Run:
    return Run({"policy": "cache_prior", "lam": lam, **extra}, note)


def _psr(lam: float, n: int, note: str, residencies: tuple[float, ...] | None = None, **extra) -> Run:
    return Run({"policy": "psr", "lam": lam, "budget": n, **extra}, note, residencies)


_OLMOE_RUNS = (
    Run({"policy": "exact", "eviction": "lru"}, "exact routing with LRU eviction (Table 2, Figure 1)"),
    Run({"policy": "exact", "eviction": "score"}, "exact routing with the A priority (Table 2)"),
    *(_cp(lam, "Cache-Prior with LRU, J=0, fixed bonus scale: the lambda sweep (Figure 1, Tables 2-4)")
      for lam in (0.1, 0.15, 0.2, 0.25, 0.3)),
    _cp(0.2, "Cache-Prior with the A priority, no prefetch (Section 6.6, steering and eviction)", eviction="score"),
    *(_cp(lam, "Cache-Prior as published: router's top-J kept, running logit range (Section 6.6)", top_j=j,
          delta_mode="running")
      for lam in (0.2, 0.3) for j in (1, 2)),
    _cp(1.0, "Cache-Prior as published at lambda=1, J=2 (Section 6.6)", top_j=2, delta_mode="running"),
    *(_psr(lam, 1, "PSR lambda, n=1: the lambda sweep; 0.3 and 0.2 at 50%, 0.25 and 0.2 at 25% are the "
               "operating points of Tables 2-4 (Appendix B)")
      for lam in (0.1, 0.15, 0.2, 0.25, 0.3)),
    *(_psr(lam, 2, "PSR lambda, n=2 (Figure 1; Table 4 at 25%; Section 6.6)") for lam in (0.15, 0.2, 0.25)),
    _psr(0.2, 8, "PSR with unbounded prefetch, n=8 = all pre-gate candidates (Section 6.6)"),
    _psr(0.2, 1, "PSR steering with LRU eviction (Section 6.6, steering and eviction)", eviction="lru"),
    _psr(0.2, 8, "PSR unbounded prefetch with LRU eviction (Section 6.6)", eviction="lru"),
    Run({"policy": "spec"}, "speculative execution: executes the pre-gate's top-K (Sections 4.2, 6.7)"),
    _psr(0.25, 1, "AR-PSR at C=24 of 64 (Table 9)", residencies=(0.375,)),
    _psr(0.3, 1, "AR-PSR at C=24 of 64 (Table 9; the training study of Section 6.10)", residencies=(0.375,)),
    Run({"policy": "exact", "eviction": "lru"}, "exact routing at C=24 of 64 (Sections 6.10, 7)", (0.375,)),
)

_MOONLIGHT_RUNS = (
    Run({"policy": "exact", "eviction": "lru"}, "exact routing with LRU eviction (Table 7, Figure 5)"),
    Run({"policy": "exact", "eviction": "score", "budget": 1},
        "exact routing with logical prefetch: PSR's prefetching (A priority, n=1) without the bonus (Table 7)"),
    *(_cp(lam, "Cache-Prior with LRU (Figure 5; lambda=0.4 in Table 7, 0.6 in Section 6.8)")
      for lam in (0.2, 0.3, 0.4, 0.6)),
    _cp(0.2, "Cache-Prior with the A priority, CP-A (Table 7)", eviction="score"),
    *(_psr(lam, 1, "PSR lambda, n=1, window 4 (Table 7, Figure 5)") for lam in (0.2, 0.3)),
    _psr(0.2, 1, "PSR with OLMoE's window of 8 candidates (Section 6.8)", window=8),
    _psr(0.2, 1, "PSR with a window of 2 (Figure 5)", window=2),
    _psr(0.6, 1, "PSR lambda=0.6 with a window of 2 (Section 6.8, against Cache-Prior lambda=0.6)", window=2),
)

_QWEN_RUNS = (
    Run({"policy": "exact", "eviction": "lru"}, "exact routing with LRU eviction (Section 6.9, Figure 6)"),
    _cp(0.2, "Cache-Prior at its operating point (Table 8)"),
    _cp(0.3, "Cache-Prior lambda=0.3, the fastest point of Figure 6"),
    _cp(0.2, "Cache-Prior with the router's top-2 kept (Section 6.9; the paper does not state its lambda or "
             "bonus-scale mode: lambda=0.2 and a fixed scale here)", top_j=2),
    _psr(0.2, 1, "PSR lambda=0.2, n=1, window 4 (Table 8)"),
    _psr(0.2, 1, "PSR with a window of 2 (Section 6.9, Figure 6)", window=2),
)

FAMILIES: dict[str, Family] = {
    "olmoe": Family("OLMoE-1B-7B-0924-Instruct (64 experts, top-8)", 8, (0.5, 0.25), _OLMOE_RUNS),
    "deepseek_v3": Family("Moonlight-16B-A3B-Instruct (DeepSeek-V3 architecture, 64 routed experts, top-6)", 4,
                          (0.5, 0.375, 0.25), _MOONLIGHT_RUNS),
    "qwen3_5_moe": Family("Qwen3.6-35B-A3B (Qwen3.5-MoE architecture, 256 experts, top-8)", 4,
                          (0.5, 0.375, 0.25), _QWEN_RUNS),
    "qwen3_next": Family("Qwen3-Next (not in the paper: the Qwen3.6 settings, window 4)", 4,
                         (0.5, 0.375, 0.25), _QWEN_RUNS),
}


def _num(value: float) -> str:
    return f"{value:g}"


def run_name(config: RoutingConfig, family_window: int) -> str:
    """The file name (without .yaml) of ``config`` in a family whose own pre-gate window is ``family_window``."""
    if config.policy == "exact":
        name = "exact_lru" if config.eviction == "lru" else "exact_a"
        if config.budget:
            name += f"_n{config.budget}"
    elif config.policy == "spec":
        name = "spec"
    else:
        name = "cp" if config.policy == "cache_prior" else "psr"
        default_eviction = "lru" if config.policy == "cache_prior" else "score"
        if config.eviction != default_eviction:
            name += "_a" if config.eviction == "score" else "_lru"
        name += f"_lam{_num(config.lam)}"
        if config.policy == "psr":
            name += f"_n{config.budget}"
        if config.top_j:
            name += f"_j{config.top_j}"
        if config.delta_mode != "fixed":
            name += f"_{config.delta_mode}"
    if config.window is not None and config.window != family_window:
        name += f"_w{config.window}"
    return name + f"_res{_num(config.residency * 100)}"


def _uses_window(fields: dict) -> bool:
    # cache_prior never reads the pre-gate; exact reads it only with a prefetch budget; spec's window is K
    return fields["policy"] == "psr" or (fields["policy"] == "exact" and fields.get("budget", 0) > 0)


def build() -> dict[Path, str]:
    """Every file of the table: ``{path: text}``."""
    files: dict[Path, str] = {}
    for family_name, family in FAMILIES.items():
        for run in family.runs:
            for residency in run.residencies or family.residencies:
                fields = dict(run.fields)
                if _uses_window(fields):
                    fields.setdefault("window", family.window)
                config = RoutingConfig(residency=residency, **fields)
                path = HERE / family_name / f"{run_name(config, family.window)}.yaml"
                if path in files:
                    raise ValueError(f"two rows of the table give {path.relative_to(HERE)}")
                header = (
                    f"# {family.model}, {_num(residency * 100)}% of each layer's experts resident.\n"
                    f"# {run.note}\n"
                    "# Generated by eval_configs/runs/make_runs.py from its table; edit the table, not this file.\n"
                )
                files[path] = header + yaml.safe_dump(config.to_dict(), sort_keys=False)
    return files


def model_args(path: str | Path) -> str:
    """The RoutingConfig in ``path`` as lm-eval ``--model_args`` items (fields left at None are omitted)."""
    config = RoutingConfig.load_yaml(path)
    return ",".join(f"{key}={value}" for key, value in config.to_dict().items() if value is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the files on disk with the table")
    parser.add_argument("--model-args", metavar="YAML", help="print a run file as lm-eval model arguments")
    args = parser.parse_args(argv)
    if args.model_args:
        print(model_args(args.model_args))
        return 0
    files = build()
    on_disk = {p for family in FAMILIES for p in (HERE / family).glob("*.yaml")}
    if args.check:
        problems = [f"missing or stale: {p.relative_to(HERE)}" for p, text in files.items()
                    if not p.is_file() or p.read_text() != text]
        problems += [f"not in the table: {p.relative_to(HERE)}" for p in sorted(on_disk - set(files))]
        for line in problems:
            print(line)
        print(f"{len(files)} run files, {len(problems)} problems")
        return 1 if problems else 0
    for path in sorted(on_disk - set(files)):
        path.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"wrote {len(files)} run files under {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
