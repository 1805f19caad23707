"""The shipped table of tiles chosen by measurement (psr_hf.engine.tuned_tiles): every entry is a valid tile for its
kernel with the evidence that chose it, lookups key by GPU model and shape, and off CUDA the kernels keep their
defaults."""

from __future__ import annotations

import json

import pytest
import torch

from psr_hf.engine import tuned_tiles
from psr_hf.engine.moe import check_blocks, chosen_blocks, triton_blocks

GEMV_KEYS = {"block_n", "block_h", "num_warps", "num_stages"}


def test_every_shipped_entry_is_a_valid_tile_with_its_evidence():
    table = json.loads(tuned_tiles.TABLE.read_text())
    assert set(table) <= {"slot_moe", "linear_many"}
    for kernel, by_device in table.items():
        for device, by_shape in by_device.items():
            for shape, entry in by_shape.items():
                assert entry["evidence"]["benchmark"].startswith("benchmarks/engine/"), (kernel, device, shape)
                if kernel == "slot_moe":
                    H, I, _ = (int(part[1:]) for part in shape.split("_"))
                    check_blocks({**triton_blocks(H, I), **entry["tiles"]})
                else:
                    assert set(entry["tiles"]) <= GEMV_KEYS
                    for key in ("block_n", "block_h", "num_warps"):
                        value = entry["tiles"].get(key, 1)
                        assert value >= 1 and value & (value - 1) == 0, (shape, key, value)


def test_lookups_key_by_gpu_model_and_shape(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    monkeypatch.setattr(tuned_tiles, "device_name", lambda device: "Some GPU" if device.type == "cuda" else None)
    tiles = {**triton_blocks(2048, 1024), "BLOCK_I1": 8}
    tuned_tiles.record("slot_moe", torch.device("cuda"), "H2048_I1024_K8", tiles, {"benchmark": "x"}, path)
    assert tuned_tiles.lookup("slot_moe", torch.device("cuda"), "H2048_I1024_K8", path) == tiles
    assert tuned_tiles.lookup("slot_moe", torch.device("cuda"), "H2048_I512_K8", path) is None
    assert tuned_tiles.lookup("slot_moe", torch.device("cpu"), "H2048_I1024_K8", path) is None
    tuned_tiles.record("linear_many", torch.device("cuda"), "H2048_rows2048", {"block_n": 4}, {"benchmark": "y"}, path)
    assert json.loads(path.read_text())["slot_moe"]["Some GPU"]["H2048_I1024_K8"]["tiles"] == tiles  # kept


def test_off_cuda_the_kernels_keep_their_defaults_and_nothing_is_recorded(tmp_path):
    assert chosen_blocks(2048, 1024, 8, torch.device("cpu")) == triton_blocks(2048, 1024)
    with pytest.raises(ValueError, match="CUDA device"):
        tuned_tiles.record("slot_moe", torch.device("cpu"), "H2048_I1024_K8", {}, {}, tmp_path / "t.json")
