"""The README's Python examples run as written, on the shipped tiny-moe (CPU, offline).

Every ```python block of README.md is executed. Blocks under one ``## `` heading build on each other (the
``record()`` example uses the model, batch and config of the transformers example above it), so a section's
blocks run in order in one namespace; each section starts from an empty one. A block that cannot run here is
marked by an HTML comment on the line right before it, ``<!-- readme-test: skip (the reason) -->``; every skip
must give its reason, and only a few blocks may be skipped.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_SKIPPED = 3
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\s*$")
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b(?P<rest>.*?)-->")
_REASON = re.compile(r"^\s*\((?P<reason>[^)]*)\)\s*$")


@dataclass(frozen=True)
class Block:
    section: str  # the ``## `` heading it is under
    line: int  # 1-based line of its opening fence
    code: str  # dedented source
    skip: str | None  # None: runs; else the reason given in its skip marker ("" if none was given)


def readme_blocks(text: str) -> tuple[list[Block], list[int]]:
    """Every ```python block of ``text``, and the lines of skip markers that are not right before one."""
    lines = text.splitlines()
    blocks: list[Block] = []
    markers: dict[int, str] = {}  # line index -> reason of a skip marker
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            skip = _SKIP.search(line)
            if skip:
                reason = _REASON.match(skip.group("rest"))
                markers[i] = reason.group("reason").strip() if reason else ""
            i += 1
            continue
        indent = fence.group("indent")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == indent + "```"), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: a code block that is never closed")
        if fence.group("lang") == "python":
            previous = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), None)
            skip_reason = markers.pop(previous) if previous in markers else None
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(section, i + 1, code, skip_reason))
        i = end + 1
    return blocks, [j + 1 for j in markers]


BLOCKS, STRAY_MARKERS = readme_blocks(README.read_text(encoding="utf-8"))
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if b.skip is None))


def test_the_extractor_finds_blocks_skips_and_stray_markers():
    text = textwrap.dedent("""\
        ## A
        ```python
        x = 1
        ```
        - a list item:

          ```python
          y = x + 1
          ```
        ```
        not python
        ```
        <!-- readme-test: skip (needs a CUDA GPU) -->
        ```python
        import nothing_here
        ```
        ## B
        <!-- readme-test: skip -->

        ```python
        z = 3
        ```
        <!-- readme-test: skip (orphan) -->
        text
        """)
    blocks, stray = readme_blocks(text)
    assert [(b.section, b.line, b.code, b.skip) for b in blocks] == [
        ("A", 2, "x = 1", None), ("A", 7, "y = x + 1", None), ("A", 14, "import nothing_here", "needs a CUDA GPU"),
        ("B", 20, "z = 3", ""),
    ]
    assert stray == [23]


def test_the_readme_opens_with_make_demo_and_make_test():
    head = README.read_text(encoding="utf-8").splitlines()[:10]
    assert any(line.startswith("make demo") for line in head) and any(line.startswith("make test") for line in head)


def test_every_skipped_block_says_why_and_few_are_skipped():
    assert len(BLOCKS) >= 5 and len(SECTIONS) >= 3
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert all(b.skip for b in skipped), [f"README.md:{b.line}" for b in skipped if not b.skip]
    assert len(skipped) <= MAX_SKIPPED, [f"README.md:{b.line} ({b.skip})" for b in skipped]
    assert not STRAY_MARKERS, f"skip markers not right before a ```python block: README.md lines {STRAY_MARKERS}"


_namespaces: dict[str, dict] = {}


def _run_section(section: str) -> dict:
    """Run the section's blocks in order in one namespace (once per test session)."""
    if section not in _namespaces:
        namespace: dict = {"__name__": "__readme__"}
        for block in BLOCKS:
            if block.section != section or block.skip is not None:
                continue
            threads = torch.get_num_threads()
            try:
                exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
            finally:
                # replay() runs numba's parallel kernel, whose OpenMP layer resets the process's OpenMP thread
                # count (torch's too); on a crowded 2-core machine that makes the next generate() many times slower
                torch.set_num_threads(threads)
        _namespaces[section] = namespace
    return _namespaces[section]


@pytest.mark.parametrize("section", SECTIONS)
def test_the_readme_python_blocks_run(section, one_torch_thread):
    _run_section(section)


def _continuation(row: torch.Tensor, prompt_len: int, pad: int) -> list[int]:
    """The generated tokens of one output row, without the trailing pad tokens of a row that finished early."""
    tokens = row[prompt_len:].tolist()
    while tokens and tokens[-1] == pad:
        tokens.pop()
    return tokens


@torch.no_grad()
def test_the_readme_batch_generates_what_each_prompt_generates_alone(one_torch_thread):
    """Item 1 of the issue: the README's batched generate() (left padding) gives every row the greedy tokens its
    prompt gives alone, bitwise; with right padding the shorter prompt's continuation went wrong."""
    import psr_hf

    ns = _run_section("Using it with transformers")
    model, tok, config, calibration, batch, out = (ns[k] for k in ("model", "tok", "config", "calibration",
                                                                    "batch", "out"))
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all(), "the README's batch should be padded on the left"
    width, pad = batch["input_ids"].shape[1], tok.pad_token_id
    with psr_hf.patched(model, config, calibration=calibration):  # as the README's example generated
        for i in range(out.shape[0]):
            prompt = batch["input_ids"][i][mask[i].bool()][None]
            alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                                   do_sample=False)
            assert _continuation(out[i], width, pad) == _continuation(alone[0], prompt.shape[1], pad), i
