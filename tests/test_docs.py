"""Every Python and shell block of README.md and docs/*.md runs as written, on the shipped models (CPU, offline).

Blocks under one heading build on each other (the ``record()`` example uses the model, batch and config of the
transformers example above it), so a section's blocks run in document order: Python blocks in one namespace,
shell blocks (``bash``) with ``bash -e -o pipefail``, all of them in one scratch folder that sees the
repository's folders (``examples/``, ``eval_configs/``, ...) and with this interpreter's scripts (``psr-hf``,
``lm-eval``, ``jupyter``) first on ``PATH``. Each section starts from an empty namespace and folder.

An HTML comment on the line right before a block says how to treat it:

- ``<!-- docs-test: skip (the reason) -->``: not run here (it needs a GPU, the hub, or is the test suite
  itself); every skip gives its reason, and only a few blocks may be skipped;
- ``<!-- docs-test: fails -->``: a shell block that must exit with an error (an error message shown in the docs);
- ``<!-- docs-test: output -->`` before a ``text`` block: every line of it must appear in what the runnable block
  before it printed.

Every fenced block names its language: ``python`` and ``bash`` run, ``text`` (output), ``yaml`` and ``json``
are shown only, and a ``text`` block may not hold a command a reader would type.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash"}
SHOWN = {"text", "yaml", "json"}
MAX_SKIPPED = 8
SHELL_TIMEOUT_S = 900
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\s*$")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[a-z]+)\b(?P<rest>.*?)-->")
_REASON = re.compile(r"^\s*\((?P<reason>[^)]*)\)\s*$")
# a line a reader types: a command of this project or its tools, not the output line that names one
_COMMAND = re.compile(r"^\s*(\$ |(psr-hf|lm-eval|make|pip|python3?|jupyter|accelerate|export|bash)\s+(?![\w-]+:))")
# what the folder a section's shell blocks run in links to, so that commands written for the repository root run
_REPO_ENTRIES = ("examples", "eval_configs", "benchmarks", "psr_hf", "patches", "docs", "README.md")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    section: str  # the heading it is under
    line: int  # 1-based line of its opening fence
    lang: str
    code: str  # dedented source
    marker: str | None  # "skip", "fails", "output" or None
    reason: str | None  # a skip's reason ("" if none was given)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_blocks(text: str, path: str = "doc.md") -> tuple[list[Block], list[int]]:
    """Every fenced block of ``text`` and the lines of markers that are not right before one."""
    lines = text.splitlines()
    blocks: list[Block] = []
    markers: dict[int, tuple[str, str]] = {}  # line index -> (kind, reason)
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            heading = re.match(r"^#{1,3} (.+)$", line)
            if heading and (line.startswith("## ") or line.startswith("# ") or not section):
                section = heading.group(1).strip()
            marker = _MARKER.search(line)
            if marker:
                reason = _REASON.match(marker.group("rest"))
                markers[i] = (marker.group("kind"), reason.group("reason").strip() if reason else "")
            i += 1
            continue
        indent = fence.group("indent")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == indent + "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        previous = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), None)
        kind, reason = markers.pop(previous) if previous in markers else (None, None)
        code = textwrap.dedent("\n".join(lines[i + 1 : end]))
        blocks.append(Block(path, section, i + 1, fence.group("lang"), code, kind, reason if kind else None))
        i = end + 1
    return blocks, [j + 1 for j in markers]


def _all_blocks() -> tuple[list[Block], list[str]]:
    blocks, stray = [], []
    for file in DOC_FILES:
        rel = file.relative_to(ROOT).as_posix()
        found, lines = doc_blocks(file.read_text(encoding="utf-8"), rel)
        blocks += found
        stray += [f"{rel}:{n}" for n in lines]
    return blocks, stray


BLOCKS, STRAY_MARKERS = _all_blocks()
SECTIONS = list(dict.fromkeys((b.path, b.section) for b in BLOCKS if b.lang in RUNNABLE and b.marker != "skip"))


def test_the_extractor_finds_blocks_markers_and_stray_markers():
    text = textwrap.dedent("""\
        # Page
        ```bash
        psr-hf demo
        ```
        ## A
        ```python
        x = 1
        ```
        - a list item:

          ```python
          y = x + 1
          ```
        ```text
        output
        ```
        <!-- docs-test: skip (needs a CUDA GPU) -->
        ```python
        import nothing_here
        ```
        ## B
        <!-- docs-test: fails -->

        ```bash
        false
        ```
        <!-- docs-test: skip (orphan) -->
        text
        """)
    blocks, stray = doc_blocks(text)
    assert [(b.section, b.line, b.lang, b.code, b.marker, b.reason) for b in blocks] == [
        ("Page", 2, "bash", "psr-hf demo", None, None), ("A", 6, "python", "x = 1", None, None),
        ("A", 11, "python", "y = x + 1", None, None), ("A", 14, "text", "output", None, None),
        ("A", 18, "python", "import nothing_here", "skip", "needs a CUDA GPU"),
        ("B", 24, "bash", "false", "fails", ""),
    ]
    assert stray == [27]


def test_the_readme_opens_with_make_demo_and_make_test():
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:10]
    assert any(line.startswith("make demo") for line in head) and any(line.startswith("make test") for line in head)


def test_the_readme_says_how_to_enter_the_environment_before_its_first_command():
    """`make demo` installs into .venv: without activating it, `psr-hf` and `python3 -c 'import psr_hf'` fail."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in BLOCKS if b.path == "README.md" and b.lang in RUNNABLE and b.marker != "skip"]
    first = min(b.line for b in blocks)
    before = "\n".join(text.splitlines()[: first - 1])
    assert ". .venv/bin/activate" in before, "say how to enter .venv before the README's first command"


def test_every_block_names_its_language_and_commands_are_runnable_blocks():
    unnamed = [b.where for b in BLOCKS if b.lang not in RUNNABLE | SHOWN]
    assert not unnamed, f"give these blocks a language (python, bash, text, yaml or json): {unnamed}"
    typed = [f"{b.where}: {line.strip()}" for b in BLOCKS if b.lang == "text" and b.marker != "output"
             for line in b.code.splitlines() if _COMMAND.match(line)]
    assert not typed, f"commands in text blocks (make them bash blocks, which the tests run): {typed}"


def test_every_marker_is_known_every_skip_says_why_and_few_are_skipped():
    assert not STRAY_MARKERS, f"docs-test markers not right before a code block: {STRAY_MARKERS}"
    unknown = [b.where for b in BLOCKS if b.marker not in (None, "skip", "fails", "output")]
    assert not unknown, unknown
    skipped = [b for b in BLOCKS if b.marker == "skip"]
    assert all(b.reason for b in skipped), [b.where for b in skipped if not b.reason]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.where} ({b.reason})" for b in skipped]
    misplaced = [b.where for b in BLOCKS if (b.marker == "fails" and b.lang != "bash")
                 or (b.marker == "output" and b.lang != "text")]
    assert not misplaced, misplaced


def test_the_docs_have_many_runnable_blocks():
    runnable = [b for b in BLOCKS if b.lang in RUNNABLE and b.marker != "skip"]
    assert sum(b.lang == "python" for b in runnable) >= 8 and sum(b.lang == "bash" for b in runnable) >= 8
    assert len({path for path, _ in SECTIONS}) >= 8


def _scratch(folder: Path) -> None:
    for name in _REPO_ENTRIES:
        if (ROOT / name).exists() and not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)


def _shell_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def _run_shell(block: Block, folder: Path) -> str:
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=folder, env=_shell_env(),
                          capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    printed = done.stdout + done.stderr
    if block.marker == "fails":
        assert done.returncode != 0, f"{block.where}: the block should fail, and it exited 0:\n{printed[-3000:]}"
    else:
        assert done.returncode == 0, f"{block.where}: exit status {done.returncode}:\n{printed[-6000:]}"
    return printed


def _run_python(block: Block, namespace: dict) -> str:
    threads = torch.get_num_threads()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, block.where, "exec"), namespace)
    finally:
        # replay() runs numba's parallel kernel, whose OpenMP layer resets the process's OpenMP thread
        # count (torch's too); on a crowded 2-core machine that makes the next generate() many times slower
        torch.set_num_threads(threads)
    return printed.getvalue()


def _expect_printed(block: Block, printed: str) -> None:
    said = " ".join(printed.split())
    missing = [line for line in block.code.splitlines() if line.strip() and " ".join(line.split()) not in said]
    assert not missing, f"{block.where}: not printed by the block before it: {missing}\nprinted:\n{printed[-3000:]}"


_namespaces: dict[tuple[str, str], dict] = {}


def _run_section(key: tuple[str, str], folder: Path) -> dict:
    """Run a section's blocks in document order (once per test session); its Python namespace."""
    if key not in _namespaces:
        _scratch(folder)
        namespace: dict = {"__name__": "__docs__"}
        printed = ""
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            for block in BLOCKS:
                if (block.path, block.section) != key or block.marker == "skip":
                    continue
                if block.lang == "python":
                    printed = _run_python(block, namespace)
                elif block.lang == "bash":
                    printed = _run_shell(block, folder)
                elif block.marker == "output":
                    _expect_printed(block, printed)
        finally:
            os.chdir(cwd)
        _namespaces[key] = namespace
    return _namespaces[key]


#: seconds a page states for a section's commands, measured on the quiet 2-core CI machine; the test allows ten times
#: as much (a generous bound: a busy machine was seen 7x slower), so a statement that drifts far from the truth fails
STATED_SECONDS = {
    ("README.md", "Quickstart"): 5.5,
    ("docs/lm-eval.md", "Two policies, one paired comparison (runs offline on the shipped model)"): 36,
}


@pytest.mark.parametrize("key", SECTIONS, ids=[f"{p}::{s}" for p, s in SECTIONS])
def test_the_docs_blocks_run(key, tmp_path, one_torch_thread):
    start = time.perf_counter()
    _run_section(key, tmp_path)
    if key in STATED_SECONDS:
        spent = time.perf_counter() - start
        assert spent < 10 * STATED_SECONDS[key], f"{key} took {spent:.0f} s; the page states {STATED_SECONDS[key]} s"


def test_the_stated_times_are_on_their_pages():
    for (page, section), seconds in STATED_SECONDS.items():
        assert (page, section) in SECTIONS, (page, section)
        text = (ROOT / page).read_text(encoding="utf-8")
        assert f"{seconds:g} s" in text, f"{page} should state {seconds:g} s, as measured"


def _continuation(row: torch.Tensor, prompt_len: int, pad: int) -> list[int]:
    """The generated tokens of one output row, without the trailing pad tokens of a row that finished early."""
    tokens = row[prompt_len:].tolist()
    while tokens and tokens[-1] == pad:
        tokens.pop()
    return tokens


@torch.no_grad()
def test_the_docs_batch_generates_what_each_prompt_generates_alone(tmp_path, one_torch_thread):
    """The docs' batched generate() (left padding) gives every row the greedy tokens its prompt gives alone,
    bitwise; with right padding the shorter prompt's continuation went wrong."""
    import psr_hf

    ns = _run_section(("docs/transformers.md", "Using it with transformers"), tmp_path)
    model, tok, config, calibration, batch, out = (ns[k] for k in ("model", "tok", "config", "calibration",
                                                                    "batch", "out"))
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all(), "the docs' batch should be padded on the left"
    width, pad = batch["input_ids"].shape[1], tok.pad_token_id
    with psr_hf.patched(model, config, calibration=calibration):  # as the docs' example generated
        for i in range(out.shape[0]):
            prompt = batch["input_ids"][i][mask[i].bool()][None]
            alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                                   do_sample=False)
            assert _continuation(out[i], width, pad) == _continuation(alone[0], prompt.shape[1], pad), i
