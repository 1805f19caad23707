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


# ------------------------------------------------------------------ the routing presets (olmoe-routing, moonlight-routing)
def _train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny_moe_train", SCRIPTS / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the full presets are too slow for a test on CPU: --layers 2 (moonlight-routing: the dense layer and one MoE layer)
ROUTING = ("--steps", "6", "--layers", "2", "--seq", "64", "--batch", "2", "--warmup", "2", "--checkpoint-every", "3",
           "--eval-windows", "2", "--device", "cpu")


def test_routing_presets_have_the_real_routing_geometry_and_fit_the_size_limit():
    """The full presets, built on the meta device: the parameter counts the README reports, under each limit."""
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    train = _train_module()
    expected = {"olmoe-routing": (8_528_000, 16, 64, 128), "moonlight-routing": (13_330_144, 26, 64, 128),
                "qwen36-routing": (23_281_592, 40, 256, 64)}
    for arch, (params, moe_layers, experts, hidden) in expected.items():
        args = argparse.Namespace(arch=arch, layers=None, hidden=None, expert_size=None, heads=None, tie=False,
                                  aux=None, bias_gamma=None, seq=512)
        preset = train.apply_preset(args)
        config = train.model_config(8192, 0, 1, args)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        count = sum(p.numel() for p in model.parameters())
        assert count == params and count * 2 / 2**20 <= preset["max_mib"]
        gates = train.routers(model)
        assert len(gates) == moe_layers and all(g.weight.shape == (experts, hidden) for g in gates)
        assert config.tie_word_embeddings and config.hidden_size == hidden and config.max_position_embeddings == 512
    olmoe = train.model_config(8192, 0, 1, argparse.Namespace(
        arch="olmoe-routing", layers=16, hidden=128, expert_size=16, heads=4, tie=True, aux=0.01, seq=512))
    assert (olmoe.num_experts, olmoe.num_experts_per_tok, olmoe.norm_topk_prob, olmoe.intermediate_size,
            olmoe.num_attention_heads, olmoe.num_key_value_heads) == (64, 8, False, 16, 4, 4)
    ds = train.model_config(8192, 0, 1, argparse.Namespace(
        arch="moonlight-routing", layers=27, hidden=128, expert_size=16, heads=4, tie=True, seq=512))
    assert (ds.n_routed_experts, ds.num_experts_per_tok, ds.n_shared_experts, ds.first_k_dense_replace, ds.n_group,
            ds.topk_group, ds.norm_topk_prob, ds.routed_scaling_factor) == (64, 6, 2, 1, 1, 1, True, 2.446)
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim,
            ds.moe_intermediate_size, ds.intermediate_size) == (None, 32, 32, 16, 32, 16, 64)
    with pytest.raises(SystemExit, match="fixes its shape"):
        train.apply_preset(argparse.Namespace(arch="moonlight-routing", layers=None, hidden=64, expert_size=None,
                                              heads=None, tie=False, aux=None, bias_gamma=None))


def test_bias_update_and_balance_loss_follow_deepseek_v3():
    import torch

    train = _train_module()
    # 2 layers, 2 sequences of 3 tokens, 4 experts, top-2
    idx = [torch.tensor([[0, 1], [0, 1], [0, 2], [3, 0], [0, 1], [2, 3]]),
           torch.tensor([[1, 2], [1, 2], [1, 2], [1, 2], [1, 2], [1, 2]])]
    counts = train.expert_counts(idx, rows=2, num_experts=4)
    assert counts.tolist() == [[[3, 2, 1, 0], [2, 1, 1, 2]], [[0, 3, 3, 0], [0, 3, 3, 0]]]
    gates = [torch.nn.Module() for _ in range(2)]
    for g in gates:
        g.register_buffer("e_score_correction_bias", torch.zeros(4))
    train.update_bias(gates, counts.sum(dim=1), 0.001)  # loads [5, 3, 2, 2] (mean 3) and [0, 6, 6, 0]
    assert gates[0].e_score_correction_bias.tolist() == pytest.approx([-0.001, 0.0, 0.001, 0.001])
    assert gates[1].e_score_correction_bias.tolist() == pytest.approx([0.001, -0.001, -0.001, 0.001])
    # equal sigmoid scores and balanced counts: sum_i f_i P_i = 1 per layer
    balanced = [torch.tensor([[0, 1], [2, 3]])]
    loss = train.sequence_balance_loss([torch.zeros(2, 4, requires_grad=True)], train.expert_counts(balanced, 1, 4), 2)
    assert float(loss.detach()) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def moonlight_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("moonlight") / "whole"
    _run("train.py", "--arch", "moonlight-routing", "--shards", shards, "--out", out, *ROUTING)
    return out


def test_moonlight_routing_moves_the_bias_and_resumes_bitwise(shards, moonlight_run, tmp_path):
    parts = tmp_path / "parts"
    assert "continue with --resume" in _run("train.py", "--arch", "moonlight-routing", "--shards", shards, "--out",
                                            parts, *ROUTING, "--stop-after", "4")
    # a resumed run takes its preset from the checkpoint
    assert "resumed at step 4 of 6" in _run("train.py", "--shards", shards, "--out", parts, *ROUTING, "--resume")
    whole = safetensors.torch.load_file(moonlight_run / "model" / "model.safetensors")
    resumed = safetensors.torch.load_file(parts / "model" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all((whole[k] == resumed[k]).all() for k in whole)
    log = json.loads((moonlight_run / "train_log.json").read_text())
    assert log["arch"] == "moonlight-routing" and log["moe_layers"] == 1 and log["top_k"] == 6
    bias = whole["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype.is_floating_point and bias.dtype.itemsize == 4  # kept in float32
    steps = (bias / 0.001).double()
    # each step moved every entry by -0.001, 0 or +0.001, and some moved
    assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max() <= log["exported_step"]
    assert (bias != 0).any() and "model.layers.0.mlp.gate.e_score_correction_bias" not in whole  # layer 0 dense
    config = json.loads((moonlight_run / "model" / "config.json").read_text())
    assert (config["model_type"], config["n_routed_experts"], config["num_experts_per_tok"],
            config["n_shared_experts"], config["first_k_dense_replace"], config["routed_scaling_factor"],
            config["tie_word_embeddings"]) == ("deepseek_v3", 64, 6, 2, 1, 2.446, True)


def test_the_card_counts_moe_layers_of_a_model_with_a_dense_first_layer(shards, moonlight_run, tmp_path):
    out = _run("model_card.py", "--model", moonlight_run / "model", "--shards", shards, "--out", tmp_path / "card",
               "--windows", "2", "--tokens", "64", "--calibration-tokens", "1024", "--loss-tokens", "1024")
    assert "top-6 reuse (random 6/64" in out and "| 0 (1) |" in out
    card = json.loads((tmp_path / "card" / "card.json").read_text())
    assert card["moe_decoder_layers"] == [1] and (card["num_experts"], card["top_k"]) == (64, 6)
    assert card["routing"]["pregate_accuracy"] == [None] and len(card["divergence"]) == 14


def test_qwen36_routing_trains_and_grows_exactly_to_a_reduced_qwen36_target(shards, tmp_path):
    """Four layers (three Gated DeltaNet, one gated attention: the real pattern's first block), then grow's exact
    upcycle of the trained model (its head dimensions are the real model's, so the preset's code path applies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from psr_hf.assets.grow import QWEN3_6_35B_A3B, grow

    _run("train.py", "--arch", "qwen36-routing", "--shards", shards, "--out", tmp_path / "run", *ROUTING[:1], "3",
         "--layers", "4", *ROUTING[4:])
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["head_dim"], config["linear_key_head_dim"],
            config["layer_types"]) == (256, 8, 256, 128, ["linear_attention"] * 3 + ["full_attention"])
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["steps"] == 3 and log["moe_layers"] == 4 and log["log"][-1]["aux_loss"] > 0
    out = _run("model_card.py", "--model", tmp_path / "run" / "model", "--shards", shards, "--out", tmp_path / "card",
               "--windows", "2", "--tokens", "64", "--calibration-tokens", "1024", "--loss-tokens", "1024")
    assert "top-8 reuse (random 8/256" in out
    card = json.loads((tmp_path / "card" / "card.json").read_text())
    assert card["moe_decoder_layers"] == [0, 1, 2, 3] and (card["num_experts"], card["top_k"]) == (256, 8)
    accuracy = card["routing"]["pregate_accuracy"]  # of each MoE layer's pre-gate, from the layer before
    assert len(accuracy) == 4 and accuracy[0] is None and all(0 <= a <= 1 for a in accuracy[1:])
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32).eval()
    target = QWEN3_6_35B_A3B.with_dims(hidden_size=256, num_attention_heads=16, num_key_value_heads=2,
                                       expert_intermediate_size=16, shared_expert_intermediate_size=16,
                                       linear_num_key_heads=2, linear_num_value_heads=4)
    big = grow(small, target)
    ids = torch.randint(3, config["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_olmoe_routing_trains(shards, tmp_path):
    _run("train.py", "--arch", "olmoe-routing", "--shards", shards, "--out", tmp_path / "run", *ROUTING[:1], "4",
         *ROUTING[2:])
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"],
            config["intermediate_size"], config["tie_word_embeddings"], config["num_hidden_layers"]) == (
        64, 8, False, 16, True, 2)
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["steps"] == 4 and log["log"][-1]["aux_loss"] > 0 and log["log"][-1]["max_vio"] >= 0


def test_bf16_grouped_mm_computes_what_grouped_mm_does_up_to_bf16():
    """The GPU default of the routing presets: transformers' grouped_mm on bf16 copies of the expert weights."""
    import argparse
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    train = _train_module()
    name = train.register_bf16_grouped_mm()
    args = argparse.Namespace(arch="moonlight-routing", layers=2, hidden=None, expert_size=None, heads=None,
                              tie=False, aux=None, bias_gamma=None, seq=64)
    train.apply_preset(args)
    config = train.model_config(512, 0, 1, args)
    blocks = {}
    for impl in ("grouped_mm", name):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation=impl)
        blocks[impl] = model.model.layers[1].mlp.experts
    hidden = torch.randn(40, 128)
    index = torch.randint(0, 64, (40, 6))
    weights = torch.rand(40, 6)
    ref = blocks["grouped_mm"](hidden, index, weights).detach()
    out = blocks[name](hidden, index, weights)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, rtol=0.05, atol=0.02 * float(ref.abs().max()))
    out.sum().backward()
    assert blocks[name].gate_up_proj.grad.dtype == torch.float32  # the float32 master weights get the gradients


def test_gpu_script_trains_presets_in_parallel_and_copies_what_each_made(shards, tmp_path):
    """ARCHS mode of gpu_train.sh on CPU with a stand-in nvidia-smi: moonlight-routing fails (--layers 1 leaves it
    no MoE layer), olmoe-routing still comes back, and the script fails loudly."""
    import os

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text('#!/bin/sh\n[ "$1" = "-L" ] && { echo "GPU 0: stub"; echo "GPU 1: stub"; } '
                                     '|| echo "stub, 0 MiB"\n')
    (stub / "nvidia-smi").chmod(0o755)
    (stub / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the script calls python3
    (stub / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = os.environ | {"PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(out), "RUNS": str(tmp_path / "runs"),
                        "ARCHS": "olmoe-routing moonlight-routing", "SHARDS": str(shards), "BATCH": "2"}
    run = subprocess.run(["bash", str(SCRIPTS / "gpu_train.sh"), "--steps", "2", "--layers", "1", "--seq", "64",
                          "--warmup", "1", "--eval-windows", "1", "--device", "cpu"],
                         cwd=SCRIPTS.parents[1], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "FAILED: moonlight-routing" in run.stderr
    assert (out / "olmoe-routing" / "model" / "config.json").is_file()
    assert json.loads((out / "olmoe-routing" / "train_log.json").read_text())["arch"] == "olmoe-routing"
    assert "needs --layers >= 2" in (out / "moonlight-routing" / "train_stdout.log").read_text()
    assert "[olmoe-routing gpu0]" in run.stdout


def test_one_command_builds_moonlight_routing_where_its_name_finds_it(shards, tmp_path, monkeypatch):
    """`make moonlight-routing` (build_routing_model.sh): train, card and calibration into the per-user models folder;
    before, the name says it is not built and how to build it; after, every command loads it by name."""
    import os

    import psr_hf
    from psr_hf.assets import MOONLIGHT_ROUTING_NAME, load_shipped, resolve_model

    monkeypatch.setenv("PSR_HF_MODELS", str(tmp_path / "models"))
    with pytest.raises(ValueError, match=r"'moonlight-routing' is not built on this machine .*make moonlight-routing"):
        resolve_model(MOONLIGHT_ROUTING_NAME)
    env = dict(os.environ, PYTHON=sys.executable, SHARDS=str(shards), STEPS="2", RUN=str(tmp_path / "run"),
               TRAIN_ARGS=" ".join(ROUTING[2:]),
               CARD_ARGS="--windows 1 --tokens 64 --calibration-tokens 1024 --loss-tokens 256")
    run = subprocess.run(["bash", str(SCRIPTS / "build_routing_model.sh"), MOONLIGHT_ROUTING_NAME], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    source = resolve_model(MOONLIGHT_ROUTING_NAME)
    assert (source.kind, source.model_type) == ("built", "deepseek_v3")
    model, tokenizer, calibration = load_shipped(MOONLIGHT_ROUTING_NAME)
    assert (tmp_path / "models" / MOONLIGHT_ROUTING_NAME / "card.json").is_file()
    # patching checks the card's calibration against the model it was made for
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5),
                        calibration=calibration):
        assert model(tokenizer("def f(x):", return_tensors="pt").input_ids).logits.isfinite().all()
    # built once: a second call keeps it
    again = subprocess.run(["bash", str(SCRIPTS / "build_routing_model.sh"), MOONLIGHT_ROUTING_NAME], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already built" in again.stdout
