"""The decision kernel compiled for an H100 (sm_90) on any machine, GPU or not, and read as machine code: what a
build's kernel issues before its first barrier.

Why: in a decode step the weights a token streams evict the decision state from L2, so every global load of the
kernel misses there, and loads that wait behind a barrier (a reduction across warps, or the part after a store)
wait for their own miss; loads issued before the first barrier overlap. Triton compiles the kernel to a cubin
without a GPU (it bundles the NVIDIA assembler), and the SASS says, per variant of the kernel: its registers and
spills, its instructions, barriers, global loads and stores, how many of the loads come before the first barrier,
and in how many waves the loads are issued (the distinct numbers of barriers before a load). A static reading, not
a timing: `decide_kernel_bench.py --cold` times it on a GPU.

    python benchmarks/engine/decide_kernel_sass.py                                   # this tree's kernel
    python benchmarks/engine/decide_kernel_sass.py --kernel old=OLD_decide_kernel.py --kernel new=psr_hf/engine/decide_kernel.py

(``git show <commit>:psr_hf/engine/decide_kernel.py > OLD_decide_kernel.py`` gives a build's kernel file.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

#: decide_kernel_bench.py's variants this reads (the others differ only by these features)
VARIANTS = ("exact", "cache_prior", "psr_offloaded", "psr_offloaded_prior")
TENSOR_TYPES = {torch.float64: "*fp64", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32"}


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def unavailable() -> str | None:
    """Why the kernel cannot be compiled and read here (None: it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton does not import"
    if not (_tools() / "cuobjdump").exists():
        return "this triton has no bundled cuobjdump"
    return None


def _bench():
    """decide_kernel_bench.py beside this file: its variants and the device state it builds for them."""
    path = Path(__file__).with_name("decide_kernel_bench.py")
    spec = importlib.util.spec_from_file_location("decide_kernel_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_kernel(path: Path, variant: str, *, layers: int = 16, experts: int = 64, top_k: int = 8,
                   vocab: int = 1024, warps: int = 8) -> bytes:
    """The cubin of ``path``'s decision kernel for ``variant`` (OLMoE's routing shape by default), for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from psr_hf.engine.device_decisions import load_triton_file

    fn = load_triton_file(str(path), f"_decide_kernel_{abs(hash(str(path)))}", interpret=False).decide_kernel
    shape = argparse.Namespace(layers=layers, experts=experts, top_k=top_k, vocab=vocab, residency=0.5)
    t, _ = _bench()._state(variant, shape, torch.device("cpu"), warps)
    settings = t.kernel_settings()
    tensors = dict(scores_ptr=t.scores, token_ptr=t.token, position_ptr=t.position, state_ptr=t.state,
                   counters_ptr=t.counters, saved_ptr=t.saved, delta_ptr=t.delta, seen_ptr=t.seen,
                   indptr_ptr=t.indptr, pexp_ptr=t.prior_experts, pval_ptr=t.prior_values, fallback_ptr=t.fallback,
                   ids_ptr=t.ids, slot_ids_ptr=t.slot_ids, slot_of_ptr=t.slot_of, expert_of_ptr=t.expert_of,
                   copies_ptr=t.copies, plans_ptr=t.plans, pplans_ptr=t.pplans, record_ptr=t.record,
                   record_plans_ptr=t.record_plans, error_ptr=t.error, params_ptr=t.params)
    constexprs = settings["constexprs"]
    signature = {}
    for name in fn.arg_names:
        if name in tensors:
            signature[name] = TENSOR_TYPES[tensors[name].dtype]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:  # layer, vocab
            signature[name] = "i32"
    # the JIT's specialization of a launch: tensors 16-byte aligned (what lets it vectorise their loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in tensors and tensors[name].data_ptr() % 16 == 0}
    source = ASTSource(fn, signature, constexprs=dict(constexprs), attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": settings["num_warps"], "enable_fp_fusion": False})
    return compiled.asm["cubin"]


def read_cubin(cubin: bytes) -> dict:
    """Registers, spills and the SASS census of a cubin (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        cuobjdump = str(_tools() / "cuobjdump")
        usage = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops = []
    for text in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass):
        words = text.split()
        ops.append(words[1] if words[0].startswith("@") else words[0])
    bars = [i for i, op in enumerate(ops) if op.startswith("BAR")]
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    waves = sorted({sum(b < i for b in bars) for i in loads})
    first_bar = bars[0] if bars else len(ops)
    return {"registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None,
            "instructions": len(ops), "barriers": len(bars), "global_loads": len(loads),
            "global_stores": sum(op.startswith("STG") for op in ops),
            "loads_before_first_barrier": sum(i < first_bar for i in loads),
            "load_waves": len(waves), "barriers_before_each_wave": waves}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="append", default=None,
                    help="LABEL=FILE of a decide_kernel.py to read (repeatable; default: this tree's, as 'this')")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--warps", type=int, default=8, help="the decision kernel's warps (default 8, the engine's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        raise SystemExit(f"decide_kernel_sass: {why}")
    kernels = args.kernel or [f"this={Path(__file__).resolve().parents[2] / 'psr_hf' / 'engine' / 'decide_kernel.py'}"]
    rows = []
    for entry in kernels:
        label, _, path = entry.partition("=")
        if not path:
            raise SystemExit(f"--kernel {entry!r}: give LABEL=FILE")
        for variant in args.variants:
            row = {"kernel": label, "file": path, "variant": variant, "warps": args.warps,
                   **read_cubin(compile_kernel(Path(path), variant, warps=args.warps))}
            rows.append(row)
            print(f"{label:6s} {variant:20s} {row['registers']} registers, {row['instructions']} instructions, "
                  f"{row['barriers']} barriers, {row['global_loads']} loads ({row['loads_before_first_barrier']} "
                  f"before the first barrier, {row['load_waves']} waves), {row['global_stores']} stores", flush=True)
    record = {"benchmark": "decide_kernel_sass", "target": "sm_90 (compiled without a GPU)", "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
