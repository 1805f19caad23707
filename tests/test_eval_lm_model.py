"""lm-eval integration: ``--model psr_hf`` (psr_hf/eval/lm_model.py) and its registration at interpreter start.

A tiny random OLMoE saved with the byte tokenizer, three local tasks (multiple choice, rolling perplexity,
generation) over jsonl files written here, offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE). The three command
lines (lm-eval's console script, ``python -m lm_eval``, ``psr-hf eval``) run as concurrent subprocesses, since
most of their time is lm-eval indexing its own task catalogue; the per-sample comparisons run in process.
In the byte tokenizer ``!`` is token 0, lm-eval's loglikelihood pad id, so some inputs end in a real 0.
"""

from __future__ import annotations


import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.testing import byte_tokenizer, save_tiny, tiny_model

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")
ROUTING = dict(policy="psr", lam=0.2, budget=1, residency=0.5)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

_WORDS = "the a cat dog sat on mat ran far blue red tree river stone cloud wow yes".split()


pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


# ---------------------------------------------------------------------------------------------- fixtures
def _sentence(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS, size=int(rng.integers(low, high + 1))))


def _write_tasks(root: Path) -> Path:
    rng = np.random.default_rng(0)
    tasks = root / "tasks"
    tasks.mkdir()
    with open(tasks / "mc.jsonl", "w") as f:
        for i in range(6):
            # choices ending in "!!": the loglikelihood input (context + choice minus its last token) ends in a
            # real token 0, which a padded row must not lose
            choices = [_sentence(rng, 1, 4) for _ in range(3)]
            choices[i % 3] += "!!"
            f.write(json.dumps({"question": _sentence(rng, 3, 12), "choices": choices, "answer": i % 3}) + "\n")
    with open(tasks / "ppl.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"text": _sentence(rng, 5, 30)}) + "\n")
    with open(tasks / "gen.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"prompt": _sentence(rng, 2, 10), "target": _sentence(rng, 1, 2)}) + "\n")
    source = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (tasks / "mc.yaml").write_text("task: tiny_mc\n" + source.format(path=tasks / "mc.jsonl") + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    (tasks / "ppl.yaml").write_text("task: tiny_ppl\n" + source.format(path=tasks / "ppl.jsonl") + textwrap.dedent("""\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: byte_perplexity
            aggregation: weighted_perplexity
            higher_is_better: false
        """))
    (tasks / "gen.yaml").write_text("task: tiny_gen\n" + source.format(path=tasks / "gen.jsonl") + textwrap.dedent("""\
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{target}}"
        generation_kwargs:
          until: ["."]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """))
    return tasks


def _compile_kernels(model, calibration) -> None:
    # the policy kernels compile on first use (seconds) and are cached on disk: compile them here once rather
    # than in each of the concurrent command lines
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    for routing, calib in ((ROUTING, calibration), (ROUTING, None), (dict(policy="exact", capacity=6), None),
                           (dict(policy="exact", residency=0.5, budget=1, eviction="score"), None)):
        with psr_hf.patched(model, RoutingConfig(**routing), calibration=calib), torch.no_grad():
            with psr_hf.controller(model).right_padded([6, 4]):
                model(ids)
            model.generate(ids, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]), max_new_tokens=2,
                           do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Paths of the saved tiny model, its calibration, a RoutingConfig YAML and the task folder."""
    root = tmp_path_factory.mktemp("lm_eval")
    model_dir = save_tiny("olmoe", root / "model")
    calibration = root / "calib.safetensors"
    model = tiny_model("olmoe")
    texts = [_sentence(np.random.default_rng(seed), 20, 60) for seed in range(8)]
    psr_hf.calibrate(model, texts, tokenizer=byte_tokenizer(), progress=False).save(calibration)
    config = root / "routing.yaml"
    RoutingConfig(policy="psr", residency=0.25, lam=0.3).save_yaml(config)
    _compile_kernels(model, str(calibration))
    return {"model": str(model_dir), "calibration": str(calibration), "config": str(config),
            "tasks": _write_tasks(root), "root": root}


def _command_lines(tiny: dict) -> dict[str, list[str]]:
    args = ",".join(f"{k}={v}" for k, v in {**ROUTING, "calibration": tiny["calibration"]}.items())
    common = ["--device", "cpu", "--include_path", str(tiny["tasks"]), "--limit", "2", "--log_samples",
              "--batch_size", "2"]
    return {
        # the issue's command line, through lm-eval's own console script
        "console": [str(BIN / "lm-eval"), "--model", "psr_hf", "--model_args", f"pretrained={tiny['model']},{args}",
                    "--tasks", ",".join(TASKS), *common],
        "module": [sys.executable, "-m", "lm_eval", "run", "--model", "psr_hf", "--model_args",
                   f"pretrained={tiny['model']},policy=exact,capacity=6", "--tasks", "tiny_ppl", *common],
        # a RoutingConfig file, one field overridden
        "psr-hf": [str(BIN / "psr-hf"), "eval", "--model", "psr_hf", "--model_args",
                   f"pretrained={tiny['model']},config={tiny['config']},residency=0.5", "--tasks", "tiny_mc", *common],
    }


@pytest.fixture(scope="module")
def console_runs(tiny):
    """The three command lines, started together in a foreign working directory; name -> (returncode, output,
    output folder)."""
    for script in ("lm-eval", "psr-hf"):
        assert (BIN / script).exists(), f"{BIN / script} is not installed (make install installs the eval extra)"
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tiny["root"] / "datasets")}
    env.pop("PYTHONPATH", None)
    work = tiny["root"] / "cwd"
    work.mkdir(exist_ok=True)
    procs = {}
    try:
        for name, argv in _command_lines(tiny).items():
            out, log = tiny["root"] / f"out-{name}", tiny["root"] / f"{name}.log"
            with open(log, "w") as stdout:  # files, not pipes: a full pipe would stall a run until it is read
                procs[name] = (subprocess.Popen([*argv, "--output_path", str(out)], cwd=work, env=env,
                                                stdout=stdout, stderr=subprocess.STDOUT), out, log)
        for proc, _, _ in procs.values():
            proc.wait(timeout=600)
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: (proc.returncode, log.read_text(), out) for name, (proc, out, log) in procs.items()}


def _saved(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    results = sorted(out.glob("*/results_*.json"))
    assert len(results) == 1, sorted(out.rglob("*"))
    samples = {}
    for path in out.glob("*/samples_*.jsonl"):
        task = re.match(r"samples_(.+)_\d{4}-\d\d-\d\dT", path.name).group(1)
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(results[0].read_text()), samples


def _check_run(run: tuple, tasks: tuple[str, ...], routing: dict) -> dict:
    returncode, output, out = run
    assert returncode == 0, output[-6000:]
    results, samples = _saved(out)
    assert sorted(samples) == sorted(tasks)
    assert all(len(docs) == 2 for docs in samples.values())  # --limit 2
    saved = results["config"]["psr_hf"]
    for name, value in routing.items():
        assert saved["routing"][name] == value, (name, saved["routing"])
    stats = saved["stats"]
    assert stats["tokens"] > 0 and stats["sequences"] > 0
    assert stats["copies_per_token"] == pytest.approx(stats["demand_per_token"] + stats["prefetch_per_token"])
    assert "psr_hf routing stats:" in output and "copies per token" in output  # and in lm-eval's log
    return saved


# ---------------------------------------------------------------------------------------------- (a) command lines
def test_lm_eval_console_script_runs_psr_hf_and_saves_the_routing_stats(console_runs, tiny):
    saved = _check_run(console_runs["console"], TASKS, ROUTING)
    assert saved["calibration"] == tiny["calibration"]
    assert saved["capacity"] == 8 and saved["num_experts"] == 16 and saved["top_k"] == 4
    assert saved["stats"]["prefetch_per_token"] > 0  # psr with budget 1 inserts predicted experts


def test_python_dash_m_lm_eval_runs_psr_hf(console_runs):
    saved = _check_run(console_runs["module"], ("tiny_ppl",), {"policy": "exact", "capacity": 6})
    assert saved["stats"]["replaced_per_token"] == 0.0


def test_psr_hf_eval_forwards_to_lm_eval_with_a_routing_config_file(console_runs):
    # routing.yaml says residency 0.25 and lam 0.3; residency=0.5 on the command line overrides the first only
    _check_run(console_runs["psr-hf"], ("tiny_mc",), {"policy": "psr", "residency": 0.5, "lam": 0.3})


# ---------------------------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def lm_eval_api():
    import lm_eval
    from lm_eval.tasks import TaskManager

    from psr_hf.eval.lm_model import PSRLM

    return lm_eval, TaskManager, PSRLM


@pytest.fixture(scope="module")
def evaluate(lm_eval_api, tiny):
    lm_eval, TaskManager, _ = lm_eval_api
    manager = TaskManager(include_path=str(tiny["tasks"]), include_defaults=False)

    def run(model, tasks=TASKS, **kwargs) -> dict:
        out = lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, log_samples=True,
                                      bootstrap_iters=0, **kwargs)
        return {task: [s["resps"] for s in out["samples"][task]] for task in tasks}

    return run


def _model(lm_eval_api, tiny, batch_size: int, **routing):
    _, _, PSRLM = lm_eval_api
    return PSRLM(pretrained=tiny["model"], device="cpu", dtype="float32", batch_size=batch_size, **routing)


def _by_tokens(recordings) -> dict[tuple, list]:
    grouped: dict[tuple, list] = {}
    for r in recordings:
        grouped.setdefault(tuple(r.tokens.tolist()), []).append(r)
    return grouped


def _assert_same_responses(a: dict, b: dict, rel: float = 0.0) -> None:
    for task in a:
        assert len(a[task]) == len(b[task])
        for x, y in zip(a[task], b[task]):
            if isinstance(x[0][0], str):  # generate_until
                assert x == y, task
            else:  # [[(loglikelihood, is_greedy)]] per choice, or [[loglikelihood]] (rolling)
                for cx, cy in zip(x, y):
                    vx, vy = (np.atleast_1d(np.asarray(c[0], dtype=float)) for c in (cx, cy))
                    assert vx == pytest.approx(vy, rel=rel, abs=0), task
                    if len(vx) == 2:
                        assert vx[1] == vy[1], task


def test_batch_size_4_makes_the_decisions_and_outputs_of_batch_size_1(lm_eval_api, evaluate, tiny):
    runs = {}
    for batch_size in (1, 4):
        lm = _model(lm_eval_api, tiny, batch_size, **ROUTING, calibration=tiny["calibration"])
        with psr_hf.controller(lm.model).record() as recorder:
            responses = evaluate(lm)
        runs[batch_size] = (responses, recorder.recordings, lm.routing_stats()["stats"])
    (one, rec_one, _), (four, rec_four, _) = runs[1], runs[4]
    # HF's logits differ in the last bits between batch shapes (lm-eval's hf model too); decisions do not
    _assert_same_responses(one, four, rel=1e-5)
    # loglikelihood rows: identical tokens (pads and nothing else dropped, real trailing 0 kept), identical
    # selections; generation rows of a batch may run past their stop string, so a batch-1 row is their prefix
    grouped = _by_tokens(rec_four)
    assert any(r.tokens[-1] == 0 for r in rec_one)  # the "!" rows are there
    unmatched = []
    for r in rec_one:
        same = grouped.get(tuple(r.tokens.tolist()))
        if same:
            assert any((s.selected == r.selected).all() for s in same)
        else:
            unmatched.append(r)
    assert len(unmatched) <= 4  # the generation rows at most (4 docs)
    for r in unmatched:
        n = len(r.tokens)
        longer = [s for s in rec_four if len(s.tokens) > n and (s.tokens[:n] == r.tokens).all()]
        assert longer and any((s.selected[:n] == r.selected).all() for s in longer)


def test_padding_never_reaches_the_routing_statistics(lm_eval_api, evaluate, tiny):
    stats = {}
    for batch_size in (1, 4):
        lm = _model(lm_eval_api, tiny, batch_size, **ROUTING)
        evaluate(lm, tasks=("tiny_mc", "tiny_ppl"))
        stats[batch_size] = lm.routing_stats()["stats"]
    assert stats[1]["tokens"] == stats[4]["tokens"] and stats[1]["sequences"] == stats[4]["sequences"]
    for name in ("prefetch_per_token", "demand_per_token", "replaced_per_token", "displaced_mass"):
        assert stats[1][name] == pytest.approx(stats[4][name], rel=1e-6), name


def test_exact_policy_gives_lm_evals_hf_model_per_sample_results(lm_eval_api, evaluate, tiny):
    args = dict(pretrained=tiny["model"], device="cpu", dtype="float32")
    plain = evaluate("hf", model_args=args, batch_size=4)
    exact = evaluate("psr_hf", model_args={**args, "policy": "exact", "residency": 0.5, "eviction": "score",
                                           "budget": 1}, batch_size=4)
    _assert_same_responses(plain, exact, rel=0.0)  # bitwise


def _random_predictor(model_dir: str, path: Path, rank: int = 2) -> str:
    """A rank-r predictor of random factors for the saved model (the ranking it gives differs from the pre-gate's)."""
    from transformers import AutoConfig

    from psr_hf.prefetch import Predictor

    config = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    pairs, D, E = config.num_hidden_layers - 1, config.hidden_size, config.num_experts
    Predictor([torch.randn(rank, D, generator=g) for _ in range(pairs)],
              [torch.randn(E, rank, generator=g) for _ in range(pairs)],
              {"model_type": config.model_type, "top_k": config.num_experts_per_tok}).save(path)
    return str(path)


def test_exact_routing_with_a_predictor_gives_lm_evals_hf_model_per_sample_results(lm_eval_api, evaluate, tiny):
    """SpecPrefetch is router-preserving: prefetch=predictor with exact routing changes copies, never outputs."""
    predictor = _random_predictor(tiny["model"], tiny["root"] / "predictor.safetensors")
    args = dict(pretrained=tiny["model"], device="cpu", dtype="float32")
    plain = evaluate("hf", model_args=args, batch_size=4)
    spec = dict(policy="exact", residency=0.5, eviction="score", budget=2)
    lm = _model(lm_eval_api, tiny, 4, **spec, prefetch="predictor", predictor=predictor)
    _assert_same_responses(plain, evaluate(lm), rel=0.0)  # bitwise
    stats = lm.routing_stats()
    assert stats["predictor"] == predictor and stats["routing"]["prefetch"] == "predictor"
    pregate = _model(lm_eval_api, tiny, 4, **spec)
    evaluate(pregate)
    assert stats["stats"]["prefetch_per_token"] != pregate.routing_stats()["stats"]["prefetch_per_token"]
    cls = lm_eval_api[2]
    with pytest.raises(ValueError, match="predictor= and prefetch=predictor go together"):
        cls.create_from_arg_string(f"pretrained={tiny['model']},policy=exact,budget=2,residency=0.5,"
                                   f"predictor={predictor}")
    with pytest.raises(ValueError, match="predictor= and prefetch=predictor go together"):
        cls.create_from_arg_string(f"pretrained={tiny['model']},policy=exact,budget=2,residency=0.5,"
                                   "prefetch=predictor")
    with pytest.raises(ValueError, match="is not a psr_hf predictor"):
        cls.create_from_arg_string(f"pretrained={tiny['model']},policy=exact,budget=2,residency=0.5,"
                                   f"prefetch=predictor,predictor={tiny['calibration']}")


def test_a_shipped_offline_task_runs_under_psr_hf(lm_eval_api, tiny):
    shipped = REPO / "eval_configs" / "tasks"
    lm_eval, TaskManager, _ = lm_eval_api
    lm = _model(lm_eval_api, tiny, 2, **ROUTING, max_length=1024)
    out = lm_eval.simple_evaluate(model=lm, tasks=["psr_mmlu_exemplars"], limit=2, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(shipped), include_defaults=False))
    assert out["results"]["psr_mmlu_exemplars"]["sample_len"] == 2
    assert out["config"]["psr_hf"]["stats"]["tokens"] > 0


@pytest.fixture
def transformers_log(caplog):
    """transformers' log records in caplog (its library logger does not propagate by default)."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="transformers")
    yield caplog
    hf_logging.disable_propagation()


def test_pretrained_olmoe_routing_loads_the_shipped_model_with_its_calibration(lm_eval_api):
    from psr_hf.assets import OLMOE_ROUTING

    _, _, PSRLM = lm_eval_api
    lm = PSRLM(pretrained="olmoe-routing", device="cpu", dtype="float32", batch_size=2, policy="psr", lam=0.3,
               budget=1, residency=0.5)
    assert lm.calibration_path == str(OLMOE_ROUTING / "calibration.safetensors")
    assert psr_hf.controller(lm.model).capacity == 32 and lm.model.config.num_hidden_layers == 16


def test_pretrained_tiny_moe_runs_the_shipped_model_with_its_calibration(lm_eval_api, transformers_log):
    from psr_hf.assets import TINY_MOE

    lm_eval, TaskManager, PSRLM = lm_eval_api
    lm = PSRLM(pretrained="tiny-moe", device="cpu", dtype="float32", batch_size=4, policy="psr", lam=0.3, budget=1,
               residency=0.25)
    assert lm.calibration_path == str(TINY_MOE / "calibration.safetensors")  # beside the model: used
    assert psr_hf.controller(lm.model).capacity == 16
    manager = TaskManager(include_path=str(REPO / "eval_configs" / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["psr_heldout_ppl"], limit=2, bootstrap_iters=0,
                                  task_manager=manager)
    # a trained model on held-out prose: far below the byte-level perplexity of a uniform guess (8192 tokens)
    assert 1.0 < out["results"]["psr_heldout_ppl"]["byte_perplexity,none"] < 5.0
    assert out["config"]["psr_hf"]["stats"]["replaced_per_token"] > 0  # psr steered the routing
    # the held-out chapters are far longer than the model's 512 tokens, and lm-eval windows them itself: no warning
    # of indexing errors (transformers' "Token indices sequence length is longer ...")
    assert "sequence length is longer" not in transformers_log.text


def test_the_long_sequence_warning_is_silenced_only_where_the_text_is_windowed(transformers_log):
    from psr_hf.assets import TINY_MOE
    from psr_hf.eval.lm_inputs import long_sequences_windowed
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MOE)
    long_text = "It was the best of times, it was the worst of times. " * 400
    with long_sequences_windowed(tokenizer):
        assert len(tokenizer(long_text)["input_ids"]) > tokenizer.model_max_length
    assert "sequence length is longer" not in transformers_log.text
    tokenizer(long_text)  # elsewhere it warns as before
    assert "sequence length is longer" in transformers_log.text


def test_trust_remote_code_is_refused_before_the_remote_code_runs(lm_eval_api, tmp_path):
    """A model directory whose config names its own code: with trust_remote_code=True transformers would import
    that code while loading; psr_hf refuses first, so the code never runs."""
    PSRLM = lm_eval_api[2]
    path = save_tiny("olmoe", tmp_path / "remote")
    marker = tmp_path / "remote_code_ran"
    (path / "configuration_remote.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import OlmoeConfig\n\n\nclass RemoteConfig(OlmoeConfig):\n    pass\n")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_remote.RemoteConfig"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True: psr_hf patches transformers' native model "
                                         "classes only"):
        PSRLM(pretrained=str(path), trust_remote_code=True, device="cpu", residency=0.5)
    assert not marker.exists()


def test_a_misspelt_pretrained_names_the_shipped_model_without_asking_the_hub(lm_eval_api):
    PSRLM = lm_eval_api[2]
    with pytest.raises(ValueError, match=r"no model 'tiny_moe': not a named model \(tiny-moe, olmoe-routing, moonlight-routing, qwen36-routing\).*did you mean "
                                         r"tiny-moe\?"):
        PSRLM(pretrained="tiny_moe", device="cpu", residency=0.5)


# ---------------------------------------------------------------------------------------------- model args
def test_unknown_model_args_fail_with_the_allowed_names(lm_eval_api, tiny):
    from lm_eval.api.registry import get_model

    cls = get_model("psr_hf")
    assert cls is lm_eval_api[2]
    with pytest.raises(ValueError, match=r"unknown psr_hf model arg\(s\) polcy.*allowed: routing: policy, "
                                         r"capacity.*psr_hf: calibration, config, offload.*HF model: pretrained"):
        cls.create_from_arg_string(f"pretrained={tiny['model']},polcy=psr,residency=0.5")


@pytest.mark.parametrize("arg, message", [
    ("policy=fast", r"policy='fast' is not supported; allowed: exact, cache_prior, psr, spec"),
    ("budget=abc", r"budget='abc' must be an int >= 0"),
    ("residency=2", r"residency=2 must be a number in \(0, 1\]"),
    ("lam=true", r"lam=True must be a finite number >= 0"),
    ("eviction=fifo", r"eviction='fifo' is not supported; allowed: score, lru"),
    ("calibration=/no/such.safetensors", r"calibration='/no/such.safetensors': no such file"),
])
def test_invalid_model_args_fail_naming_the_field(lm_eval_api, tiny, arg, message):
    cls = lm_eval_api[2]
    base = f"pretrained={tiny['model']}" + ("" if arg.startswith("residency") else ",residency=0.5")
    with pytest.raises(ValueError, match=message):
        cls.create_from_arg_string(f"{base},{arg}")


def test_offloaded_experts_give_the_same_samples_and_report_their_copies(lm_eval_api, evaluate, tiny):
    plain = _model(lm_eval_api, tiny, 4, **ROUTING, calibration=tiny["calibration"])
    offloaded = _model(lm_eval_api, tiny, 4, **ROUTING, calibration=tiny["calibration"], offload="cpu",
                       max_in_flight=1)
    assert psr_hf.controller(offloaded.model).memory().capacity == psr_hf.controller(plain.model).capacity
    # prompts whose experts exceed the slots run in groups of experts: equal to rounding
    _assert_same_responses(evaluate(plain), evaluate(offloaded), rel=1e-5)
    stats, reference = offloaded.routing_stats(), plain.routing_stats()["stats"]
    # the same decisions (the displaced mass is computed from the scores, equal to rounding)
    assert stats["stats"] == pytest.approx(reference, rel=1e-6)
    assert {k: v for k, v in stats["stats"].items() if k != "displaced_mass"} == \
        {k: v for k, v in reference.items() if k != "displaced_mass"}
    assert stats["offload"]["tokens"] == stats["stats"]["tokens"] and stats["offload"]["bytes"] > 0
    assert stats["memory"]["capacity"] == stats["capacity"]


@pytest.mark.parametrize("args, message", [
    ("offload=gpu", r"device='gpu' must be 'cuda', 'cuda:N' or 'cpu'"),
    ("max_in_flight=2", r"max_in_flight is used only with offload="),
    ("offload=cpu,max_in_flight=0", r"max_in_flight=0 must be an int >= 1"),
    ("offload=cpu,parallelize=True", r"offload= and parallelize=True exclude each other"),
])
def test_invalid_offload_args_fail_naming_the_field(lm_eval_api, tiny, args, message):
    with pytest.raises(ValueError, match=message):
        lm_eval_api[2].create_from_arg_string(f"pretrained={tiny['model']},residency=0.5,{args}")


def test_model_args_become_a_routing_config(lm_eval_api, tiny):
    import dataclasses

    from lm_eval.utils import simple_parse_args_string

    from psr_hf.eval.lm_args import ROUTING_ARGS, model_and_calibration, routing_config

    assert set(ROUTING_ARGS) == {f.name for f in dataclasses.fields(RoutingConfig)}  # every field, no other

    # typed as lm-eval's parser types --model_args; None leaves a field at its default
    args = simple_parse_args_string("policy=psr,lam=0.25,budget=2,residency=0.5,window=None,top_j=1")
    assert routing_config(args) == RoutingConfig(policy="psr", lam=0.25, budget=2, residency=0.5, top_j=1)
    # a config file, explicit fields over it: capacity replaces the file's residency, a new policy its defaults
    assert routing_config({"capacity": 6}, tiny["config"]) == RoutingConfig(policy="psr", capacity=6, lam=0.3)
    assert routing_config({"policy": "exact"}, tiny["config"]) == RoutingConfig(policy="exact", residency=0.25)
    with pytest.raises(ValueError, match="config='/no/such.yaml': no such file"):
        routing_config({}, "/no/such.yaml")
    # the calibration given, else the one saved beside the model; tiny-moe is the shipped model's directory
    assert model_and_calibration(tiny["model"], tiny["calibration"]) == (tiny["model"], tiny["calibration"])
    assert model_and_calibration(tiny["model"], None) == (tiny["model"], None)
    path, calibration = model_and_calibration("tiny-moe", None)
    assert calibration == str(Path(path) / "calibration.safetensors")


@pytest.mark.parametrize("name, hint", [("calibration", "make one with psr-hf calibrate"),
                                        ("predictor", "train one with psr-hf train-predictor")])
def test_a_missing_lm_eval_file_says_how_to_make_one(name, hint):
    from psr_hf.eval.lm_args import existing_file

    with pytest.raises(ValueError, match=rf"{name}='nowhere.safetensors': no such file; {hint}"):
        existing_file(name, "nowhere.safetensors")


# ---------------------------------------------------------------------------------------------- the controller API
def test_right_padded_rows_route_like_the_unpadded_rows():
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(**ROUTING))
    ctl = psr_hf.controller(model)
    rows = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 7)]
    rows[1][-1] = 0  # a real token 0 at the end of a row, as lm-eval's pad id
    with ctl.record() as alone, torch.no_grad():
        for row in rows:
            model(row[None])
    ctl.reset_stats()
    padded = torch.zeros((3, 9), dtype=torch.long)  # right padding with 0, no attention mask (lm-eval)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    with ctl.record() as batch, torch.no_grad(), ctl.right_padded([len(r) for r in rows]):
        model(padded)
    assert ctl.stats().total["tokens"] == sum(len(r) for r in rows)
    for a, b in zip(alone.recordings, batch.recordings):
        assert (a.tokens == b.tokens).all() and (a.selected == b.selected).all()
    with pytest.raises(ValueError, match="right_padded\\(\\) got 2 lengths for a batch of 3 rows"), \
            ctl.right_padded([9, 5]), torch.no_grad():
        model(padded)


# ---------------------------------------------------------------------------------------------- registration
def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).parent), env=env)


def test_startup_hook_is_installed_and_imports_nothing_else():
    code = ("import sys, json; print(json.dumps({'modules': sorted(sys.modules), "
            "'first_finder': getattr(sys.meta_path[0], '__module__', '')}))")
    proc = _python(code, "-X", "importtime")
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert "_psr_hf_lm_eval" in state["modules"], (
        "psr_hf_lm_eval.pth is not installed in site-packages: reinstall psr_hf (pip install -e .[dev,eval])")
    assert state["first_finder"] == "_psr_hf_lm_eval"
    for heavy in ("torch", "numpy", "lm_eval", "psr_hf", "transformers"):
        assert heavy not in state["modules"], heavy
    # -X importtime lists what an import imported right above it, indented deeper: nothing
    lines = [line for line in proc.stderr.splitlines() if line.startswith("import time:") and "|" in line]
    names = [line.rsplit("|", 1)[1] for line in lines]
    at = next(i for i, name in enumerate(names) if name.strip() == "_psr_hf_lm_eval")
    depth = len(names[at]) - len(names[at].lstrip())
    assert at == 0 or len(names[at - 1]) - len(names[at - 1].lstrip()) <= depth, names[max(0, at - 3): at + 1]


def test_lm_eval_finds_psr_hf_lazily_through_the_hook():
    code = textwrap.dedent("""
        import sys
        import lm_eval.models
        from lm_eval.api.registry import get_model, model_registry
        print("placeholder", model_registry._objs["psr_hf"])
        print("imported", [m for m in ("torch", "numpy", "psr_hf.eval.lm_model", "psr_hf.hf") if m in sys.modules])
        print("finder", any(getattr(f, "__module__", "") == "_psr_hf_lm_eval" for f in sys.meta_path))
        print("hf", "hf" in model_registry)
        cls = get_model("psr_hf")
        print("class", cls.__module__, cls.__name__, model_registry._objs["psr_hf"] is cls)
    """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines() == [
        "placeholder psr_hf.eval.lm_model:PSRLM", "imported []", "finder False", "hf True",
        "class psr_hf.eval.lm_model PSRLM True",
    ]


def test_the_wheel_ships_the_startup_hook(tmp_path):
    """setup.py's build_py writes psr_hf_lm_eval.pth into the wheel root, beside the module it imports."""
    import build  # noqa: F401  (the dev extra must be installed)
    import zipfile

    created = [REPO / "build", REPO / "psr_hf.egg-info"]
    existed = {path: path.exists() for path in created}
    try:
        proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        import shutil

        for path, was_there in existed.items():
            if not was_there and path.exists():
                shutil.rmtree(path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = tmp_path.glob("psr_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        line = archive.read("psr_hf_lm_eval.pth").decode()
        # one import line (Python runs .pth lines that start with "import"), guarded so that a partial uninstall
        # leaves it silent (tests/test_package_wheel.py runs it with the module removed)
        assert line.startswith("import ") and line.count("\n") == 1 and "_psr_hf_lm_eval" in line, line
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert "psr_hf_lm_eval.pth," in archive.read(record).decode()  # so pip uninstall removes it
    assert {"_psr_hf_lm_eval.py", "psr_hf/eval/lm_model.py"} <= names
    assert not any(name.startswith("startup/") for name in names)


@pytest.mark.parametrize("build", ["arg_obj", "arg_string"])
def test_a_bad_model_argument_is_logged_as_one_line_before_lm_evals_traceback(lm_eval_api, build, caplog):
    _, _, PSRLM = lm_eval_api
    with caplog.at_level(logging.ERROR, logger="lm_eval.models.psr_hf"), pytest.raises(ValueError, match="tiny-moe"):
        if build == "arg_obj":
            PSRLM.create_from_arg_obj({"pretrained": "tiny-mo", "residency": 0.5})
        else:
            PSRLM.create_from_arg_string("pretrained=tiny-mo,residency=0.5")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "no model 'tiny-mo'" in errors[0] and "\n" not in errors[0]
