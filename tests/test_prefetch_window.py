"""psr_hf.prefetch.window: the overlap window W_l = t_exec(l + 1) - t_pred(l) from the engine's marks, one
expert's copy time, and the budget M_max = floor(W / t_copy) (CPU: host time, where nothing overlaps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.engine.graphs import GraphDecoder
from psr_hf.prefetch.window import WindowProfile, profile_window, windows_from_marks
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_windows_follow_the_marks_of_each_step():
    L = 3
    marks = []
    for step in range(2):
        t = 10.0 * step
        for m in range(L):
            marks.append(("pred", m, t + m))  # seconds on the CPU
            marks.append(("exec", m, t + m + 0.25))
    w = windows_from_marks(marks, L, cuda=False)
    # W_l = exec(l + 1) - pred(l) = (l + 1 + 0.25) - l = 1.25 s
    np.testing.assert_allclose(w, np.full((2, L - 1), 1250.0))
    with pytest.raises(ValueError, match="not whole steps"):
        windows_from_marks(marks[:-1], L, cuda=False)
    # prefetch distance 2: from layer l's prediction to layer l + 2's experts, (l + 2 + 0.25) - l = 2.25 s
    np.testing.assert_allclose(windows_from_marks(marks, L, cuda=False, distance=2), np.full((2, L - 2), 2250.0))


def test_budget_is_the_copies_that_fit_in_the_window():
    p = WindowProfile(windows_ms=np.array([[1.0, 2.5], [3.0, 0.4]]), copy_ms=np.array([0.5, 0.5, 0.7]),
                      bytes_per_expert=10, device="cpu", top_k=2)
    assert p.copy_time_ms == 0.5
    np.testing.assert_array_equal(p.budgets(), [[2, 5], [6, 0]])
    assert p.budget == 3  # the median of 0, 2, 5, 6 is 3.5, floored
    np.testing.assert_array_equal(p.layer_budgets(), [4, 2])  # medians 2.0 and 1.45 ms
    assert p.exceeding(2) == 0.25 and p.exceeding(4) == 0.5  # 2 copies: only 0.4 ms is shorter than 1 ms
    assert p.to_dict()["budget"] == 3 and set(p.to_dict()["exceeding"]) == {"1", "2", "4"}


def test_profile_on_the_cpu_engine_measures_every_pair_and_leaves_the_decoder_as_it_was():
    model = tiny_model("olmoe")
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=1.0)):
        decoder = GraphDecoder(model, 16, graphs=False)
        tokens = list(range(3, 9))
        profile = profile_window(model, tokens, warmup=2, copies=5, decoder=decoder)
        L = psr_hf.controller(model).num_layers
        assert profile.windows_ms.shape == (len(tokens), L - 1)
        assert (profile.windows_ms > 0).all()  # on the CPU the next layer starts after this one's prediction
        assert profile.copy_ms.shape == (5,) and (profile.copy_ms > 0).all()
        experts = model.model.layers[0].mlp.experts
        assert profile.bytes_per_expert == (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 4
        assert decoder.marks is None
        assert profile.budget == int(np.floor(np.median(profile.budgets())))
        # the decoder still decodes as before
        logits = decoder.prefill(tokens).clone()
        again = GraphDecoder(model, 16, graphs=False).prefill(tokens)
        assert torch.equal(logits, again)


def test_cli_profile_window_prints_the_budget_and_writes_the_record(tmp_path, capsys):
    import json

    from psr_hf.cli import main

    out = tmp_path / "window.json"
    assert main(["profile-window", "--model", "tiny-moe", "--device", "cpu", "--tokens", "6", "--warmup", "2",
                 "--copies", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["pairs"] == 3 and record["positions"] == 7 and len(record["copy_ms"]) == 3  # 6 + the first token
    assert f"M_max = {record['budget']}" in text and "pair l -> l+1" in text
    # per pair: floor(median W_l / t_copy)
    want = np.floor(np.asarray(record["window_ms_per_pair"]) / record["copy_ms_median"]).astype(int).tolist()
    assert record["budget_per_pair"] == want
