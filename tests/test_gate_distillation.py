"""psr_hf.training.gate: distilling the routed model to the frozen one through PSR's selection (the paper's Section
6.10, "the same for PSR's own router"), with per-expert LoRA adapters on transformers' fused expert tensors through
peft, on the shipped olmoe-routing (CPU): the routed model's KL to the exact model falls on the training text, the
written result loads into a fresh model with its shape checked, and the paper's ranks scale with the width."""

from __future__ import annotations

import shutil

import pytest
import torch

import psr_hf
from psr_hf.assets import load_shipped
from psr_hf.assets.texts import module_sources, token_windows
from psr_hf.gates import MarginHead
from psr_hf.training.gate import _kl, apply_distilled, distill_routing, load_distilled, scaled_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.375)


def _routed_kl(model, calibration, windows) -> float:
    with torch.no_grad():
        exact = [model(input_ids=w.reshape(1, -1)).logits for w in windows]
        with psr_hf.patched(model, CONFIG, calibration=calibration):
            routed = [model(input_ids=w.reshape(1, -1)).logits for w in windows]
    return float(sum(_kl(r, e, None) for r, e in zip(routed, exact)) / len(windows))


def test_distillation_through_psr_lowers_the_kl_and_its_result_loads_into_a_fresh_model(tmp_path):
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    windows = token_windows([t for _, t in module_sources(["functools", "heapq"])], tokenizer, tokens=768,
                            window=128, option="--text")
    before = _routed_kl(model, calibration, windows)
    result = distill_routing(model, windows, CONFIG, tmp_path / "distilled", calibration=calibration, steps=18,
                             lr=1e-3, router_lr=2e-4, warmup=4, metadata={"text": "stdlib functools, heapq"})
    assert (result.attention_rank, result.expert_rank) == scaled_ranks(model.config.hidden_size) == (1, 1)
    assert len(result.losses) == 18
    experts = [p for n, p in model.named_parameters() if "mlp.experts" in n and "lora_A" in n]
    assert experts and experts[0].shape[0] == 1 * 64  # one rank-1 adapter per expert
    fresh, _, _ = load_shipped("olmoe-routing")
    untouched = fresh.model.layers[0].mlp.gate.weight.clone()
    distilled = apply_distilled(fresh, result.path)
    assert not torch.equal(distilled.model.layers[0].mlp.gate.weight, untouched)
    after = _routed_kl(distilled, calibration, windows)
    assert after < 0.8 * before, (before, after)
    other, _, _ = load_shipped("tiny-moe")
    with pytest.raises(ValueError, match="was trained on a model with"):
        apply_distilled(other, result.path)
    with pytest.raises(ValueError, match="not a distilled routing"):
        apply_distilled(other, tmp_path)


def test_the_papers_ranks_scale_with_the_width_and_bad_arguments_are_refused():
    import peft

    from psr_hf.training.gate import _lora_config

    assert scaled_ranks(2048) == (16, 8) and scaled_ranks(1024) == (8, 4) and scaled_ranks(64) == (1, 1)
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    adapted, _, _ = load_shipped("olmoe-routing")
    peft.get_peft_model(adapted, _lora_config(adapted, 2, 1))  # different ranks: each its own, alpha = 2 r for both
    attention, experts = adapted.model.layers[0].self_attn.q_proj, adapted.model.layers[0].mlp.experts
    assert attention.lora_A["default"].weight.shape[0] == 2 and experts.lora_A["default"].weight.shape[0] == 1 * 64
    assert attention.scaling["default"] == experts.scaling["default"] == 2.0
    with pytest.raises(ValueError, match="at least one optimiser step"):
        distill_routing(model, [torch.arange(8)], CONFIG, "unused", calibration=calibration, steps=0)
    with pytest.raises(ValueError, match="no training windows"):
        distill_routing(model, [], CONFIG, "unused", calibration=calibration, steps=2)


def _gate_args(gated: bool, calibration) -> dict:
    """A fresh untrained margin head and a load penalty (the bounded-bonus variant), or nothing."""
    if not gated:
        return {}
    return {"gate": MarginHead.uniform(CONFIG.lam * calibration.delta, 128), "load_penalty": 0.01, "head_lr": 1e-2}


@pytest.mark.parametrize("gated", [False, True], ids=["routers-and-adapters", "with-a-margin-head"])
def test_a_training_cut_short_resumes_where_an_uncut_one_would_be(tmp_path, gated):
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    windows = token_windows([t for _, t in module_sources(["heapq"])], tokenizer, tokens=256, window=64,
                            option="--text")
    whole = distill_routing(model, windows, CONFIG, tmp_path / "whole", calibration=calibration, steps=6, lr=1e-3,
                            router_lr=2e-4, warmup=2, **_gate_args(gated, calibration))
    first, _, _ = load_shipped("olmoe-routing")
    distill_routing(first, windows, CONFIG, tmp_path / "cut", calibration=calibration, steps=3, lr=1e-3,
                    router_lr=2e-4, warmup=2, checkpoint_every=2, **_gate_args(gated, calibration))
    # the 3-step run finished and removed its checkpoint; a 6-step run cut after step 4 leaves one
    assert not (tmp_path / "cut" / "checkpoint.safetensors").exists()
    cut, _, _ = load_shipped("olmoe-routing")
    with pytest.raises(KeyboardInterrupt):
        _interrupted_after(cut, 4, windows, calibration, tmp_path / "cut", **_gate_args(gated, calibration))
    assert (tmp_path / "cut" / "checkpoint.safetensors").exists()
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "cut" / "checkpoint.safetensors", tmp_path / "other" / "checkpoint.safetensors")
    again, _, _ = load_shipped("olmoe-routing")
    resumed = distill_routing(again, windows, CONFIG, tmp_path / "cut", calibration=calibration, steps=6, lr=1e-3,
                              router_lr=2e-4, warmup=2, checkpoint_every=2, resume=True,
                              **_gate_args(gated, calibration))
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    assert resumed.loads == pytest.approx(whole.loads, rel=1e-5) and bool(resumed.loads) == gated
    (a, head_a), (b, head_b) = (load_distilled(load_shipped("olmoe-routing")[0], r.path) for r in (whole, resumed))
    torch.testing.assert_close(a.model.layers[0].mlp.gate.weight, b.model.layers[0].mlp.gate.weight)
    assert (head_a is None) == (head_b is None) == (not gated)
    if gated:
        torch.testing.assert_close(head_a.weight, head_b.weight)
        torch.testing.assert_close(head_a.bias, head_b.bias)
    with pytest.raises(ValueError, match="other windows"):  # a checkpoint continues only its own training
        distill_routing(load_shipped("olmoe-routing")[0], windows[:2], CONFIG, tmp_path / "other",
                        calibration=calibration, steps=6, lr=1e-3, router_lr=2e-4, warmup=2, resume=True)
    with pytest.raises(ValueError, match="does not exist"):
        distill_routing(load_shipped("olmoe-routing")[0], windows, CONFIG, tmp_path / "none",
                        calibration=calibration, steps=6, resume=True)


def _interrupted_after(model, steps, windows, calibration, out, **extra):
    """A training that stops (as a killed run would) right after its step ``steps`` wrote its checkpoint."""
    import psr_hf.training.gate as train

    save = train._save_checkpoint

    def save_then_stop(path, trained, optimiser, step, *rest):
        save(path, trained, optimiser, step, *rest)
        if step == steps:
            raise KeyboardInterrupt

    train._save_checkpoint = save_then_stop
    try:
        distill_routing(model, windows, CONFIG, out, calibration=calibration, steps=6, lr=1e-3, router_lr=2e-4,
                        warmup=2, checkpoint_every=2, **extra)
    finally:
        train._save_checkpoint = save


def test_the_command_writes_what_apply_distilled_loads_and_refuses_what_it_cannot_do(tmp_path, capsys):
    from psr_hf.cli import main

    out = tmp_path / "distilled"
    assert main(["train-gate", "--tokens", "512", "--window", "128", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 steps" in printed and f"distilled routing: {out}" in printed
    model = apply_distilled(load_shipped("olmoe-routing")[0], out)
    assert not any("lora_" in n for n, _ in model.named_parameters())  # the adapters are merged
    assert main(["train-gate", "--out", str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["train-gate", "--steps", "0", "--out", str(tmp_path / "other")]) == 2
    assert "--steps 0" in capsys.readouterr().err
    assert main(["train-gate", "--resume", "--out", str(tmp_path / "other")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_the_former_import_path_is_the_training_module_and_warns(monkeypatch):
    """psr_hf.gates.train moved to psr_hf.training.gate (above hf: it patches the model); the old path is the same
    module object, so callers that import it or set its names keep working, and importing it says where it went."""
    import importlib
    import sys

    import psr_hf.gates
    import psr_hf.training.gate as gate

    monkeypatch.delitem(sys.modules, "psr_hf.gates.train", raising=False)
    with pytest.warns(DeprecationWarning, match="moved to psr_hf.training.gate"):
        old = importlib.import_module("psr_hf.gates.train")
    from psr_hf.gates.train import load_distilled as old_load

    assert old is gate and psr_hf.gates.train is gate and old_load is load_distilled
    assert psr_hf.training.distill_routing is distill_routing
