"""The patching benchmark (psr-hf bench-patch) end to end on a tiny CPU model: structure, never timings."""

from __future__ import annotations

import json

import pytest
import torch

from psr_hf.bench.patch import DEFAULT_CONFIGS, bench_patch
from psr_hf.bench.workloads import TINY_SHAPE, build_random_model, olmoe_1b_7b_config


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model(olmoe_1b_7b_config(**TINY_SHAPE), device="cpu", dtype=torch.float32, seed=0)


def test_olmoe_1b_7b_config_has_the_published_shape_and_never_stops_early():
    config = olmoe_1b_7b_config()
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (50304, 2048, 1024)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (16, 16, 16)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (64, 8, False)
    assert config.max_position_embeddings == 4096 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.eos_token_id is None
    assert olmoe_1b_7b_config(rope_theta=500000.0).rope_parameters["rope_theta"] == 500000.0
    assert olmoe_1b_7b_config(**TINY_SHAPE).hidden_size == 64


def test_random_model_is_built_on_the_device_in_eval_mode_with_peaked_routers(tiny_model):
    assert not tiny_model.training
    assert next(tiny_model.parameters()).device.type == "cpu"
    assert tiny_model.config._experts_implementation == "grouped_mm"
    gate = tiny_model.model.layers[0].mlp.gate.weight
    assert 0.3 < float(gate.detach().std()) < 0.7  # 0.5 at hidden 64, not transformers' 0.02
    again = build_random_model(olmoe_1b_7b_config(**TINY_SHAPE), device="cpu", dtype=torch.float32, seed=0)
    assert torch.equal(again.model.layers[0].mlp.gate.weight, gate)


def test_tiny_benchmark_reports_every_configuration_and_exact_matches_unpatched(tiny_model):
    new_tokens, rounds = 5, 2
    rows = bench_patch(tiny_model, configs=DEFAULT_CONFIGS, prompt_tokens=6, new_tokens=new_tokens, rounds=rounds,
                       warmup=0)
    assert [row["configuration"] for row in rows] == ["unpatched", "exact", "psr"]
    assert not hasattr(tiny_model, "_psr_hf_controller")  # every run unpatched again
    by_name = {row["configuration"]: row for row in rows}
    for row in rows:
        assert len(row["ms_per_token"]["rounds"]) == rounds and row["ms_per_token"]["mean"] > 0
        assert len(row["ratio"]["rounds"]) == rounds
        assert len(row["tokens"]) == new_tokens
    assert by_name["unpatched"]["baseline"] and by_name["unpatched"]["routing_stats"] is None
    assert by_name["unpatched"]["ratio"]["ratio"] == 1.0
    assert by_name["unpatched"]["baseline_repeatable"]
    exact = by_name["exact"]
    assert exact["tokens_identical_to_baseline"] and exact["rounds_identical_to_baseline"] == rounds
    assert exact["first_divergence"] == [None] * rounds
    assert exact["routing_stats"]["replaced_per_token"] == 0.0
    psr = by_name["psr"]
    assert psr["routing_effective"]["budget"] == 1
    for row in (exact, psr):
        stats = row["routing_stats"]
        assert stats["tokens"] == new_tokens - 1  # decode steps only: the prefill is not counted
        assert stats["copies_per_token"] == pytest.approx(stats["prefetch_per_token"] + stats["demand_per_token"])


def test_cli_bench_patch_tiny_prints_a_table_and_writes_the_json_record(tmp_path, capsys):
    from psr_hf.cli import main

    path = tmp_path / "bench_patch.json"
    assert main(["bench-patch", "--tiny", "--device", "cpu", "--dtype", "fp32", "--rounds", "2", "--new-tokens", "4",
                 "--prompt-tokens", "5", "--warmup", "0", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for name in ("unpatched", "exact", "psr", "ratio vs unpatched", "copies/tok", "tokens = unpatched"):
        assert name in out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "patch"
    assert {"torch", "transformers", "device"} <= set(record["machine"])
    assert record["model"]["config"]["num_experts"] == TINY_SHAPE["num_experts"]
    assert record["settings"]["new_tokens"] == 4 and len(record["settings"]["prompt_ids"]) == 5
    assert [row["configuration"] for row in record["results"]] == ["unpatched", "exact", "psr"]
    assert record["results"][1]["tokens_identical_to_baseline"]


def test_cli_bench_patch_rejects_too_few_tokens(capsys):
    from psr_hf.cli import main

    assert main(["bench-patch", "--tiny", "--device", "cpu", "--new-tokens", "1"]) == 2
    assert "new_tokens" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_tiny_benchmark_runs_on_cuda_in_bf16_and_exact_matches_unpatched():
    model = build_random_model(olmoe_1b_7b_config(**TINY_SHAPE), device="cuda", dtype=torch.bfloat16, seed=0)
    assert next(model.parameters()).device.type == "cuda"
    rows = bench_patch(model, prompt_tokens=8, new_tokens=6, rounds=2, warmup=1)
    by_name = {row["configuration"]: row for row in rows}
    assert by_name["exact"]["tokens_identical_to_baseline"]
    assert by_name["psr"]["routing_stats"]["tokens"] == 5
