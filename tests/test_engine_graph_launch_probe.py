"""benchmarks/engine/graph_launch_probe.py: the host's cost of one CUDA graph launch by the graph's size and shape.
On the CPU it refuses with the reason; on a GPU (marked cuda) it measures every size of the shapes asked for, the
launches after another operation, with graphs alive and around torch.profiler."""

from __future__ import annotations

import pytest
import torch
from module_files import ROOT, load_module


def _probe():
    return load_module("graph_launch_probe", ROOT / "benchmarks" / "engine" / "graph_launch_probe.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
def test_the_probe_refuses_a_machine_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _probe().main(["--nodes", "4"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_probe_times_every_size_and_shape(tmp_path):
    record = _probe().main(["--nodes", "16", "64", "--shapes", "chain", "forked", "--replays", "20",
                            "--graphs-alive", "1", "2", "--json", str(tmp_path / "probe.json")])
    assert [(r["shape"], r["nodes"]) for r in record["rows"]] == [("chain", 16), ("chain", 64), ("forked", 16),
                                                                   ("forked", 64)]
    assert all(r["host_us_median"] > 0 and r["gpu_us_per_replay"] > 0 for r in record["rows"])
    assert [r["before"] for r in record["before_launch"]] == ["idle", "h2d_copy", "event_record", "kernel"]
    assert [r["graphs_alive"] for r in record["graphs_alive"]] == [1, 2]
    effect = record["profiler_effect"]
    assert effect["before_host_us_median"] > 0 and effect["after_host_us_median"] > 0
