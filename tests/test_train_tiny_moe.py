"""The tiny-MoE pipeline of examples/train_tiny_moe (tokenizer, token files, training, model card) end to end on a
small corpus of standard-library source (CPU, offline): training is seeded and resumable, the card is complete."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_moe"
pytestmark = pytest.mark.slow


def _run(script: str, *args: object) -> str:
    run = subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A three-split corpus in build_corpus.py's format (two sources, in its order), tokenised."""
    import argparse
    import ast
    import csv
    import json as json_module
    import textwrap

    root = tmp_path_factory.mktemp("tiny_moe")
    corpus = root / "corpus"
    corpus.mkdir()
    modules = {"train": [argparse, ast, csv, inspect], "calib": [textwrap], "heldout": [json_module.decoder]}
    for split, mods in modules.items():
        with (corpus / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for source in ("prose", "code"):
                for m in mods:
                    code = inspect.getsource(m)
                    text = code if source == "code" else ((inspect.getdoc(m) or "") + "\n") * 4 + code[:6000]
                    f.write(json.dumps({"source": source, "doc": f"{source}/{m.__name__}", "text": text}) + "\n")
    _run("train_tokenizer.py", "--corpus", corpus, "--out", root / "tok", "--vocab", 8192)
    _run("make_shards.py", "--corpus", corpus, "--tokenizer", root / "tok", "--out", root / "shards")
    return root / "shards"


TRAIN = ("--minutes", "1", "--steps", "6", "--layers", "4", "--hidden", "32", "--expert-size", "16", "--heads", "2",
         "--seq", "64", "--batch", "2", "--warmup", "2", "--checkpoint-every", "3", "--eval-windows", "2",
         "--device", "cpu")


def test_training_is_seeded_and_resumable_and_the_card_is_complete(shards, tmp_path):
    meta = json.loads((shards / "meta.json").read_text())
    assert list(meta["splits"]["heldout"]["by_source"]) == ["prose", "code"]  # the split's order, kept
    _run("train.py", "--shards", shards, "--out", tmp_path / "whole", *TRAIN)
    # the same run stopped after 4 steps and resumed: bitwise the same exported weights
    assert "continue with --resume" in _run("train.py", "--shards", shards, "--out", tmp_path / "parts", *TRAIN,
                                            "--stop-after", "4")
    assert "resumed at step 4 of 6" in _run("train.py", "--shards", shards, "--out", tmp_path / "parts", *TRAIN,
                                            "--resume")
    whole = safetensors.torch.load_file(tmp_path / "whole" / "model" / "model.safetensors")
    parts = safetensors.torch.load_file(tmp_path / "parts" / "model" / "model.safetensors")
    assert whole.keys() == parts.keys() and all((whole[k] == parts[k]).all() for k in whole)
    log = json.loads((tmp_path / "whole" / "train_log.json").read_text())
    assert log["steps"] == 6 and log["tokens_seen"] == 6 * 2 * 64
    assert log["exported_step"] in (3, 6) and log["calib_loss"] == min(
        e["calib_loss"] for e in log["log"] if "calib_loss" in e)  # the calib split picks the weights
    config = json.loads((tmp_path / "whole" / "model" / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (64, 8, False)

    card_dir = tmp_path / "card"
    out = _run("model_card.py", "--model", tmp_path / "whole" / "model", "--shards", shards, "--out", card_dir,
               "--windows", "2", "--tokens", "64", "--calibration-tokens", "1024",
               "--train-log", tmp_path / "whole" / "train_log.json")
    assert "I(expert; source)" in out and "paired by window" in out
    card = json.loads((card_dir / "card.json").read_text())
    assert set(card["heldout_loss"]) == {"prose", "code", "all"}
    assert card["window_sources"] == ["prose", "code"]  # windows spread over the split reach every source
    assert len(card["routing"]["usage_entropy"]) == 4 and card["routing"]["pregate_accuracy"][0] is None
    assert [r["name"] for r in card["divergence"]][:2] == ["exact_lru_res50", "cp_lam0.1_res50"]
    assert len(card["divergence"]) == 14 and len(card["ordering"]) == 6
    assert all(len(r["window_excess"]) == 2 for r in card["divergence"])
    assert (card_dir / "calibration.safetensors").is_file()
    assert (card_dir / "card.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
