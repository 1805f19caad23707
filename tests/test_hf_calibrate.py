"""calibrate(), the calibration patch() and reconfigure() use, and the psr-hf calibrate / demo commands on tiny
models (CPU, offline)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

import psr_hf
import transformers
from psr_hf import RoutingConfig
from psr_hf.cli import main
from psr_hf.testing import tiny_model
from test_offload import _ids
from test_offload_faults import _generate as _generate_tokens

RNG = np.random.default_rng(7)
DOCS = [RNG.integers(3, 256, size=n) for n in (300, 170, 90)]
_generate = functools.partial(_generate_tokens, new=6)  # (tokens, step logits) of six new tokens unless told


@pytest.fixture(scope="module")
def deepseek():
    return tiny_model("deepseek_v3")


def _own_topk_and_ranges(model, docs, max_length):
    """Reference statistics straight from the unpatched routers, one window at a time."""
    ctl_family = psr_hf.hf.patching.family_of(model)
    layers = ctl_family.moe_layers()
    captured = {}
    handles = [layer.router.register_forward_hook(
        lambda mod, args, out, i=layer.index: captured.__setitem__(i, out[0])) for layer in layers]
    tokens, selected, ranges = [], [], []
    try:
        with torch.no_grad():
            for doc in docs:
                for start in range(0, doc.size, max_length):
                    window = torch.from_numpy(doc[start:start + max_length]).long()[None]
                    model(window, use_cache=False)
                    zs = [ctl_family.selection_scores(layer.router, captured[layer.index]) for layer in layers]
                    selected.append(torch.stack([torch.topk(z, layer.router.top_k).indices
                                                 for z, layer in zip(zs, layers)], 1))
                    finite = [z.masked_fill(~torch.isfinite(z), float("nan")) for z in zs]
                    ranges.append(torch.stack([torch.from_numpy(
                        np.nanmax(f.numpy(), -1) - np.nanmin(f.numpy(), -1)) for f in finite], 1))
                    tokens.append(window[0])
    finally:
        for h in handles:
            h.remove()
    return torch.cat(tokens).numpy(), torch.cat(selected).numpy(), torch.cat(ranges).numpy()


def test_calibration_matches_the_routers_own_top_k(deepseek):
    cal = psr_hf.calibrate(deepseek, DOCS, max_length=128, batch_size=3, progress=False)
    tokens, selected, ranges = _own_topk_and_ranges(deepseek, DOCS, 128)
    L, E = cal.num_layers, cal.num_experts
    assert (L, E) == (3, 16) and cal.vocab_size == 256
    counts = np.zeros((L, E))
    for layer in range(L):
        np.add.at(counts[layer], selected[:, layer].reshape(-1), 1)
    np.testing.assert_array_equal(cal.expert_counts, counts)
    np.testing.assert_allclose(cal.delta, ranges.mean(axis=0), rtol=1e-5)
    # the token prior of a frequent token is the fraction of its occurrences whose top-K held each expert
    token = int(np.bincount(tokens).argmax())
    hits = np.zeros((L, E))
    for layer in range(L):
        np.add.at(hits[layer], selected[tokens == token, layer].reshape(-1), 1)
    np.testing.assert_allclose(cal.dense_prior()[token], hits / (tokens == token).sum(), rtol=1e-6)


def test_calibration_does_not_depend_on_batching_or_patching(deepseek):
    a = psr_hf.calibrate(deepseek, DOCS, max_length=100, batch_size=1, progress=False)
    b = psr_hf.calibrate(deepseek, DOCS, max_length=100, batch_size=4, progress=False)
    np.testing.assert_array_equal(a.expert_counts, b.expert_counts)
    np.testing.assert_allclose(a.delta, b.delta, rtol=1e-5)
    with psr_hf.patched(deepseek, psr_hf.RoutingConfig(policy="psr", residency=0.25), calibration=a):
        ctl = psr_hf.controller(deepseek)
        state = ctl.cache.state.copy()
        c = psr_hf.calibrate(deepseek, DOCS, max_length=100, batch_size=4, progress=False)
        np.testing.assert_array_equal(ctl.cache.state, state)  # the routing state was not touched
    np.testing.assert_array_equal(a.expert_counts, c.expert_counts)


def test_calibration_limits_and_bad_input(deepseek):
    cal = psr_hf.calibrate(deepseek, DOCS, max_length=64, max_tokens=100, progress=False)
    assert cal.expert_counts[0].sum() == 100 * 4
    with pytest.raises(ValueError, match="no tokenizer"):
        psr_hf.calibrate(deepseek, ["some text"], progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        psr_hf.calibrate(deepseek, [np.array([5, 300])], progress=False)
    with pytest.raises(ValueError, match="no tokens"):
        psr_hf.calibrate(deepseek, [], progress=False)


def test_calibrated_patch_warm_set_is_the_most_used_experts(deepseek):
    cal = psr_hf.calibrate(deepseek, DOCS, max_length=128, progress=False)
    with psr_hf.patched(deepseek, psr_hf.RoutingConfig(policy="exact", residency=0.25), calibration=cal):
        ctl = psr_hf.controller(deepseek)
        ctl.reset()
        for layer in range(ctl.num_layers):
            np.testing.assert_array_equal(ctl.cache.resident(layer), np.sort(cal.warm_set(layer, ctl.capacity)))


def test_patch_uses_the_calibration_beside_a_model_loaded_from_its_folder(caplog):
    import logging

    import psr_hf
    from psr_hf.assets import TINY_MOE, load_shipped

    model, _, shipped = load_shipped("tiny-moe")
    assert model.config._name_or_path and psr_hf.Calibration.load(TINY_MOE / "calibration.safetensors")
    with caplog.at_level(logging.INFO, logger="psr_hf"):
        psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5))
    ctl = psr_hf.controller(model)
    assert (ctl.calibration.expert_counts == shipped.expert_counts).all()
    assert "using the calibration beside the model" in caplog.text and "no calibration" not in caplog.text
    psr_hf.unpatch(model)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5), calibration=False)
    assert not (psr_hf.controller(model).calibration.expert_counts == shipped.expert_counts).all()
    psr_hf.unpatch(model)


def test_reconfigure_without_a_calibration_keeps_the_models_and_false_drops_it():
    model = tiny_model("olmoe")
    calibration = psr_hf.calibrate(model, _ids(0, 4, 24), progress=False)
    psr = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
    exact = RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.25)
    ids = _ids(1, 1, 5)
    with psr_hf.patched(model, exact, calibration=calibration):
        want = _generate(model, ids), psr_hf.controller(model).stats().total
    with psr_hf.patched(model, psr, calibration=calibration):
        ctl = psr_hf.controller(model)
        ctl.reconfigure(exact)  # no calibration=: the model's own
        assert ctl.calibration is not None and np.array_equal(ctl.calibration.expert_counts,
                                                              calibration.expert_counts)
        got = _generate(model, ids), ctl.stats().total
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])
        assert got[1] == want[1]
        ctl.reconfigure(exact, calibration=False)  # explicitly uncalibrated
        assert not np.array_equal(ctl.calibration.expert_counts, calibration.expert_counts)
        ctl.reconfigure(exact)  # uncalibrated stays uncalibrated
        assert not np.array_equal(ctl.calibration.expert_counts, calibration.expert_counts)


def _byte_tokenizer(path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["x"], vocab_size=256, show_progress=False, special_tokens=[])
    PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer).save_pretrained(path)


def test_calibrate_command_writes_a_calibration_that_patches(tmp_path, capsys):
    model = tiny_model("olmoe")
    model.save_pretrained(tmp_path / "model")
    _byte_tokenizer(tmp_path / "model")
    text = tmp_path / "held_out.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.\n" * 8)
    out = tmp_path / "cal.safetensors"
    assert main(["calibrate", "--model", str(tmp_path / "model"), "--text", str(text), "--out", str(out),
                 "--max-length", "64"]) == 0
    assert "delta per layer" in capsys.readouterr().out
    cal = psr_hf.Calibration.load(out)
    assert (cal.num_layers, cal.num_experts, cal.vocab_size) == (3, 16, 256)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", residency=0.5), calibration=str(out))
    psr_hf.unpatch(model)
    assert main(["calibrate", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "missing.txt"),
                 "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("model", [None, "random"])
def test_demo_generates_and_reports_copies(capsys, model):
    assert main(["demo", "--new-tokens", "6"] + (["--model", model] if model else [])) == 0
    out = capsys.readouterr().out
    if model is None:  # the default: the shipped trained model, with its own calibration
        assert "the shipped trained tiny MoE" in out and "calibrated on 484352 tokens" in out
    else:
        assert "random weights (seeded)" in out and "Random weights: the continuations are noise" in out
    for fragment in ("exact + LRU", "psr lam 0.2 n=1", "50% (C=32)", "25% (C=16)", "demand/tok", "prompt 3"):
        assert fragment in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    columns = re.split(r"\s{2,}", header.strip())
    table = [dict(zip(columns, re.split(r"\s{2,}", line.strip()))) for line in out.splitlines()
             if line.startswith(("exact + LRU", "cache_prior lam", "psr lam"))]
    assert len(table) == 6
    for row in table:
        if row["policy"].startswith("exact"):
            # exact routing replaces no router slot, gives the exact tokens and has no excess NLL
            assert float(row["replaced/tok"]) == 0 and row["tokens = exact"] == "100%"
            assert float(row["excess NLL"]) == 0
        else:
            assert float(row["replaced/tok"]) > 0
            assert float(row["demand/tok"]) < float(next(r["demand/tok"] for r in table if r["policy"].startswith(
                "exact") and r["residency"] == row["residency"]))


def test_demo_runs_a_saved_model_with_its_tokenizer_and_calibration(tmp_path, capsys):
    from psr_hf.testing import save_tiny

    path = save_tiny("olmoe", tmp_path / "model")
    assert main(["demo", "--model", str(path), "--new-tokens", "4"]) == 0
    first = capsys.readouterr().out
    assert "model: OlmoeForCausalLM, 3 layers x 16 experts, top-4" in first and "excess NLL" in first
    # a calibration beside the model is used as it is
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    psr_hf.calibrate(model, [list(range(3, 200))], progress=False).save(path / "calibration.safetensors")
    assert main(["demo", "--model", str(path), "--new-tokens", "4"]) == 0
    assert "calibrated on 197 tokens" in capsys.readouterr().out


def test_demo_names_a_model_it_cannot_load(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert f"no model '{tmp_path / 'missing'}': no such local directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["demo", "--model", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_calibration_made_at_another_top_k_is_refused_by_patch(tmp_path, quiet_psr_hf):
    """The warm set, prior and delta count the router's own top-K: a top-4 calibration must not steer a top-2
    model of the same shape (it used to load silently)."""
    model = tiny_model("olmoe")
    calibration = psr_hf.calibrate(model, DOCS, max_length=64)
    assert calibration.top_k == model.config.num_experts_per_tok == 4
    path = tmp_path / "calibration.safetensors"
    calibration.save(path)
    other = tiny_model("olmoe", num_experts_per_tok=2)
    for given in (calibration, path, str(path)):
        with pytest.raises(ValueError, match=r"made with top-k 4.*routes to 2 experts per token"):
            psr_hf.patch(other, psr_hf.RoutingConfig(policy="psr", capacity=8), calibration=given)
        assert not hasattr(other, "_psr_hf_controller")
    psr_hf.unpatch(psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", capacity=8), calibration=path))
