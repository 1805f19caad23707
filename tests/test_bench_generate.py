"""``psr-hf bench-generate`` (psr_hf/bench/generate_latency.py) on the shipped tiny model on the CPU: every setup is
timed, the engine serves every generate() call (no fallback), the batched prefill selects the token-by-token
prefill's expert sets at every prompt token-layer (float32), the ratios and goals are in the record, and bad input
fails before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

import psr_hf
import psr_hf.engine as engine
from psr_hf.bench.generate_latency import SETUPS, GenerateBenchConfig, TokenClock
from psr_hf.bench.generate_sizes import CPU_SIZES, CUDA_SIZES, GenerateSizes, sizes_for
from psr_hf.cli import main
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")


def test_bench_generate_times_every_setup_through_the_engine(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert main(["bench-generate", "--model", "tiny-moe", "--device", "cpu", "--prompt-tokens", "20",
                 "--new-tokens", "4", "--rounds", "2", "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["benchmark"] == "generate" and record["config"]["prompt_tokens"] == 20
    assert list(record["setups"]) == list(SETUPS)
    for name, setup in record["setups"].items():
        assert len(setup["ttft"]["rounds"]) == len(setup["decode"]["rounds"]) == 2, name
        assert name in printed
    for name in ("engine_resident", "engine_offloaded"):
        setup = record["setups"][name]
        assert setup["engine_served"]["served"] > 0 and setup["engine_served"]["fallbacks"] == 0
        assert setup["engine_served"]["engine_loop_calls"] > 0  # generate() decoded in the engine's loop
        assert len(setup["forward"]["rounds"]) == 2 and "function calls" in setup["profile_first_token"][0]
        assert any("Self CPU time total" in line for line in setup["device_profile_first_token"])
        assert setup["prefill"]["identical_expert_sets"] == 1.0  # float32: the same decisions
        assert setup["prefill"]["token_layers"] > 0 and setup["prefill"]["token_layers"] % 20 == 0  # S x layers
        assert len(setup["generate_over_step"]["rounds"]) == 2 and setup["generate_over_step"]["ratio"] > 0
        assert set(setup["ttft_goal"]) == {"goal_ms", "met"} and set(setup["generate_goal"]) == {"goal_ratio", "met"}
        assert set(setup["sampling_goal"]) == {"goal_ratio", "met"}
        assert len(setup["step_sampled"]["rounds"]) == len(setup["sampling_over_step"]["rounds"]) == 2
        assert any("Self CPU time total" in line for line in setup["device_profile_sampling"])
        assert f"goal {name} generate/step (sampling) <= x1.10" in printed
        assert any("moe.py" in line for line in setup["profile"])
        assert not any("/" in line.split()[-1] for line in setup["profile"] if "(" in line)  # no machine paths
    assert record["setups"]["engine_offloaded"]["copies_per_token"] > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(rounds=1), "at least 2 rounds"),
    (dict(new_tokens=0), "--new-tokens"),
    (dict(residency=1.0), "--residency"),
    (dict(routing="psr_fast"), "not a configuration name"),
    (dict(setups=("engine", "transformers")), "choose among transformers, engine_resident"),
])
def test_bench_generate_config_names_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateBenchConfig(**kwargs)


def test_bench_generate_cli_prints_the_error_without_a_traceback(capsys):
    assert main(["bench-generate", "--model", "tiny-moe", "--device", "cpu", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "at least 2 rounds" in err and "Traceback" not in err


def test_bench_generate_times_only_the_setups_asked_for(tmp_path):
    out = tmp_path / "generate.json"
    assert main(["bench-generate", "--model", "tiny-moe", "--device", "cpu", "--prompt-tokens", "12",
                 "--new-tokens", "3", "--rounds", "2", "--threads", "1", "--no-by-token", "--no-profile",
                 "--setups", "engine_offloaded,engine_resident", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert list(record["setups"]) == ["engine_resident", "engine_offloaded"]  # in their fixed order
    assert record["config"]["setups"] == ["engine_offloaded", "engine_resident"]
    assert "ttft_by_token" not in record["setups"]["engine_resident"]


def test_the_token_clock_notes_each_new_token_of_one_generate_call():
    model = tiny_model("olmoe")
    ids = torch.tensor([[3, 5, 7, 9]])
    for attached in (False, True):
        if attached:
            psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", capacity=8))
            engine.attach(model, max_len=16)
        clock = TokenClock()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                       pad_token_id=0, streamer=clock)
        assert len(clock.times) == 5 and clock.times == sorted(clock.times)  # the prompt is not a new token
        assert clock.decode_ms() > 0
    assert engine.attached(model).loop_calls == 1  # the engine's own loop fed the clock
    engine.detach(model)
    psr_hf.unpatch(model)
    with pytest.raises(RuntimeError, match="needs at least 2"):
        TokenClock().decode_ms()


def test_bench_generate_sizes_itself_for_the_device_it_runs_on():
    assert sizes_for("cuda") == sizes_for("cuda:1") == CUDA_SIZES == GenerateSizes(512, 64, 3)
    assert sizes_for("cpu") == CPU_SIZES == GenerateSizes(prompt_tokens=64, new_tokens=16, rounds=2)
    assert sizes_for("cpu", new_tokens=5, rounds=4) == GenerateSizes(64, 5, 4)  # a size given stays as given
    assert sizes_for("cuda:0", prompt_tokens=100) == GenerateSizes(100, 64, 3)
    GenerateBenchConfig(rounds=CPU_SIZES.rounds)  # the fewest rounds the benchmark takes
    assert GenerateBenchConfig().prompt_tokens == CUDA_SIZES.prompt_tokens  # the library's default: CUDA's


def test_bench_generate_help_states_the_sizes_of_both_devices(capsys):
    with pytest.raises(SystemExit):
        main(["bench-generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--prompt-tokens", "--new-tokens", "--rounds"):
        assert option in text
    for cuda, cpu in ((512, 64), (64, 16), (3, 2)):
        assert f"default: {cuda} on CUDA, {cpu} on a CPU" in text


def test_bench_generate_on_the_cpu_runs_the_cpu_sizes_under_one_overall_bar(tmp_path, capsys):
    out = tmp_path / "generate.json"
    # the command of the issue (tiny-moe, no sizes given: the CPU's), without the profiles
    assert main(["bench-generate", "--model", "tiny-moe", "--threads", "1", "--no-profile", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    record = json.loads(out.read_text())
    assert record["machine"]["device_type"] == "cpu"  # a small model's device where --device is left out
    config = record["config"]
    assert GenerateSizes(config["prompt_tokens"], config["new_tokens"], config["rounds"]) == CPU_SIZES
    assert "a 64-token prompt, 16 decoded tokens, 2 interleaved rounds" in captured.out
    rounds = len(SETUPS) * CPU_SIZES.rounds
    assert f"{rounds}/{rounds}" in captured.err  # the bar over every setup's rounds reached its end
