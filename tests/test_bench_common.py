"""What the benchmarks share (psr_hf.bench.common) and the order of the bench room: public names only."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from psr_hf.bench.common import (
    UNCALIBRATED_LOGGERS,
    graph_replay,
    machine,
    paired_ratio,
    paired_summary,
    quiet_uncalibrated,
    rotated,
    summarize,
    timed_us,
)

ROOT = Path(__file__).resolve().parents[1]
BASE_KEYS = {"platform", "processor", "cpu_count", "python", "numpy", "numba"}


def test_rounds_rotate_by_one_each():
    assert [rotated([1, 2, 3], r) for r in range(4)] == [[1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3]]


def test_summaries_keep_the_records_keys():
    assert list(summarize([1.0, 2.0, 4.0])) == ["median", "mean", "ci95", "rounds"]
    assert list(paired_ratio([2.0, 3.0], [1.0, 1.0])) == ["ratio", "ci95", "rounds"]
    assert list(paired_summary([2.0, 3.0], [1.0, 1.0])) == ["ratio", "ci95", "rounds", "p"]
    one = summarize([5.0])
    assert one["mean"] == one["median"] == 5.0 and all(v != v for v in one["ci95"])  # nan with one round


def test_on_the_cpu_a_call_is_replayed_as_it_is_and_timed_by_the_clock():
    import torch

    calls = []
    run = graph_replay(lambda: calls.append(1), torch.device("cpu"))
    assert len(calls) == 1  # the warm-up call
    assert timed_us(run, 5, torch.device("cpu")) > 0 and len(calls) == 6


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_captured_graph_keeps_the_tensors_it_reads_alive():
    """The graph reads the memory of the tensors ``run`` closes over: the replay keeps them, so that memory is not
    freed and reused under it (replays then read the right values after other allocations)."""
    import gc
    import weakref

    import torch

    def doubling(x: torch.Tensor, out: torch.Tensor):
        # the closure's own cells: `del x` below must not empty them, as it would a lambda's in this scope
        return lambda: out.copy_(x * 2)

    device = torch.device("cuda")
    x = torch.arange(4, dtype=torch.float32, device=device)
    out = torch.zeros(4, device=device)
    kept = weakref.ref(x)
    replay = graph_replay(doubling(x, out), device)
    del x
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.full((1 << 20,), 7.0, device=device)  # would take the freed memory
    replay()
    torch.cuda.synchronize()
    assert kept() is not None and torch.equal(out.cpu(), torch.arange(4, dtype=torch.float32) * 2), junk.shape


def test_machine_describes_the_host_and_with_a_device_the_torch_stack():
    import torch

    assert set(machine()) == BASE_KEYS
    cpu = machine(torch.device("cpu"))
    assert set(cpu) == BASE_KEYS | {"device_type", "device", "torch", "transformers", "torch_threads"}
    assert cpu["device_type"] == "cpu" and cpu["device"] == cpu["processor"]


def test_quiet_uncalibrated_drops_only_the_uncalibrated_warning(caplog):
    log = logging.getLogger(UNCALIBRATED_LOGGERS[0])
    with caplog.at_level(logging.WARNING, logger=log.name):
        with quiet_uncalibrated():
            log.warning("psr_hf.patch without a calibration: ...")
            log.warning("something else")
        log.warning("psr_hf.patch without a calibration: after")
    assert [r.getMessage() for r in caplog.records] == ["something else", "psr_hf.patch without a calibration: after"]
    assert not log.filters  # removed on exit


def test_the_policy_benchmark_and_the_shared_helpers_import_no_torch():
    code = "import sys, psr_hf.bench.common, psr_hf.bench.policy; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("room", ["bench", "eval"])
def test_no_module_imports_another_modules_private_names(room):
    found = []
    for path in sorted((ROOT / "psr_hf" / room).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("psr_hf")):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found
