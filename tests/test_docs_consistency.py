"""The pages and the code say true things about the repository: every file they name exists, every link and
anchor resolves, and every page that says which models are shipped agrees with ``psr_hf.assets``."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_DIRS = ("psr_hf/", "benchmarks/", "docs/", "examples/", "eval_configs/", "tests/", "patches/", "startup/", ".ci/")
TOP_FILES = ("README.md", "ARCHITECTURE.md", "Makefile", "pyproject.toml", "setup.py", "mkdocs.yml")
SCANNED = ("*.md", "*.py", "*.sh", "*.toml", "*.yml", "*.yaml", "Makefile")
# names a page uses for files that are not in the repository on purpose: made by the docs site's hook
GENERATED = {"index.md", "_repo/ARCHITECTURE.md"}
_FENCED = re.compile(r"^( *)```.*?^\1```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?:#(?P<anchor>[^)\s]*))?\)")
_CODE = re.compile(r"``?(?P<path>[^`\s]+)``?")
_BARE_MD = re.compile(r"(?<![\w/.${}-])(?P<path>(?:\.\./|[\w.-]+/)*[\w-]+\.md)\b")


def _files() -> list[Path]:
    found = {p for pattern in SCANNED for p in ROOT.glob(pattern)}
    for folder in TOP_DIRS:
        for pattern in SCANNED:
            found |= set((ROOT / folder).rglob(pattern))
    this = Path(__file__).resolve()  # its own probes name missing files on purpose
    return sorted(p for p in found if "__pycache__" not in p.parts and p.is_file() and p.resolve() != this)


def _expand(path: str) -> list[str]:
    """``a.{json,txt}`` -> ``a.json``, ``a.txt``; ``<name>`` placeholders match any name."""
    brace = re.search(r"\{([^{}]*)\}", path)
    if brace:
        return [x for alt in brace.group(1).split(",") for x in _expand(path[:brace.start()] + alt + path[brace.end():])]
    return [re.sub(r"<[^>]*>", "*", path)]


def _exists(path: str, folder: Path) -> bool:
    if path in GENERATED:
        return True
    for pattern in _expand(path):
        for base in (folder, ROOT, ROOT / "docs"):
            if glob.glob(str(base / pattern)):
                return True
    return False


def _references(path: Path) -> set[str]:
    """The file names a file mentions: links and paths in code spans of a page's prose, names of pages and of
    the repository's files in code and scripts."""
    text = path.read_text(encoding="utf-8", errors="replace")
    in_tests = path.parent == ROOT / "tests"
    if path.suffix == ".md":
        text = _FENCED.sub("", text)
    refs = set()
    for m in _CODE.finditer(text):
        ref = m.group("path").strip("(),:;").split("::")[0]
        if ref.startswith(TOP_DIRS) or ref in TOP_FILES or (ref.endswith(".md") and "/" in ref):
            refs.add(ref)
    if not in_tests:
        refs |= {m.group("path") for m in _BARE_MD.finditer(text)}
    if path.suffix == ".md":
        refs |= {m.group("target") for m in _LINK.finditer(text)
                 if m.group("target") and not re.match(r"^[a-z][a-z0-9+.-]*:", m.group("target"))}
    return refs


def test_every_file_the_pages_and_the_code_name_exists():
    missing = [f"{path.relative_to(ROOT)}: {ref}" for path in _files() for ref in sorted(_references(path))
               if not _exists(ref, path.parent)]
    assert not missing, "references to files that are not in the repository:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs make it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(page: Path) -> set[str]:
    text = _FENCED.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_every_anchor_a_page_links_to_is_a_heading_there():
    broken = []
    for page in (p for p in _files() if p.suffix == ".md"):
        for m in _LINK.finditer(_FENCED.sub("", page.read_text(encoding="utf-8"))):
            if m.group("anchor") is None or re.match(r"^[a-z]+:", m.group("target") or ""):
                continue
            target = (page.parent / m.group("target")).resolve() if m.group("target") else page
            if target.suffix == ".md" and target.is_file() and m.group("anchor") not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert not broken, broken


def test_the_scanner_finds_a_missing_file_and_accepts_real_ones(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `benchmarks/nothing_here.json`, [the models](docs/models.md), `docs/{models,cli}.md`, "
                    "DESIGN.md and `eval_configs/runs/<family>`.\n\n```bash\npsr-hf kl --json out.md\n```\n",
                    encoding="utf-8")
    refs = _references(page)
    assert refs == {"benchmarks/nothing_here.json", "docs/models.md", "docs/{models,cli}.md", "DESIGN.md",
                    "eval_configs/runs/<family>"}
    assert {r for r in refs if not _exists(r, tmp_path)} == {"benchmarks/nothing_here.json", "DESIGN.md"}
    assert _slug("Real-size workloads with trained routing: `olmoe-routing`, `grow`") == \
        "real-size-workloads-with-trained-routing-olmoe-routing-grow"


# ---------------------------------------------------------------------------------------------------- the models
MODEL_PAGES = ("README.md", "ARCHITECTURE.md", "Makefile", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))


def _model_table() -> dict[str, str]:
    """name -> kind, from the table under "Every model psr_hf names" in docs/models.md."""
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    section = text.split("## Every model psr_hf names", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w-]+)` \| (\w+) \|", section, re.MULTILINE)}


def test_the_one_list_of_models_is_what_the_package_names():
    from psr_hf.assets import BUILT, SHIPPED
    from psr_hf.bench.workloads import GROWN, RANDOM_OLMOE, TINY

    table = _model_table()
    assert {n for n, kind in table.items() if kind == "shipped"} == set(SHIPPED)
    assert {n for n, kind in table.items() if kind == "built"} == set(BUILT)
    assert {n for n, kind in table.items() if kind == "grown"} == set(GROWN)
    assert {n for n, kind in table.items() if kind == "random"} == {RANDOM_OLMOE, TINY, "random"}


def _shipped_claims(text: str, names: list[str]) -> list[tuple[str, str]]:
    """(model, sentence) for each model a sentence calls shipped, where the sentence does not also say it is
    built."""
    claims = []
    for sentence in re.split(r"(?<=[.;:])\s+|\n\n", text):
        if not re.search(r"\bship(ped|s)?\b", sentence, re.IGNORECASE):
            continue
        if re.search(r"\bbuilt\b|not shipped|trains it", sentence, re.IGNORECASE):
            continue
        claims += [(name, sentence) for name in names if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", sentence)]
    return claims


@pytest.mark.parametrize("page", MODEL_PAGES)
def test_no_page_calls_a_built_model_shipped(page):
    from psr_hf.assets import BUILT

    text = (ROOT / page).read_text(encoding="utf-8")
    wrong = _shipped_claims(text, list(BUILT))
    assert not wrong, [sentence[:200] for _, sentence in wrong]


def test_the_shipped_claims_check_catches_the_old_architecture_line():
    old = ("| 1 | `psr_hf/assets/` | the shipped trained models `tiny-moe`, `olmoe-routing` and `moonlight-routing` "
           "(weights, tokenizer, calibration, card), the held-out text |")
    assert [name for name, _ in _shipped_claims(old, ["moonlight-routing"])] == ["moonlight-routing"]


def test_make_reports_the_torch_build_it_got_instead_of_promising_the_cpu_build():
    """pip's default index gives the CUDA build of torch on Linux x86_64: make must not call what it installs the
    CPU build; it prints the build torch reports."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    install = [line for line in makefile.splitlines() if "pip install" in line and "TORCH_SPEC" in line]
    assert install and all("TORCH_PIP_ARGS" in line for line in install)
    assert "(the CPU build) into" not in makefile
    assert "torch.version.cuda" in makefile
    for page in ("README.md", "docs/install.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert "Otherwise it installs the CPU build" not in text and "otherwise the CPU build" not in text, page


def test_make_test_says_what_it_runs_how_long_it_takes_and_lists_the_slowest_tests():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "minutes" in recipe and "CI" in recipe, "make test says how long it takes on the CI machine"
    assert "--durations=" in recipe


def test_both_test_commands_run_on_workers_and_say_how_long_they_take():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("test", "test-quick"):
        recipe = makefile.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0]
        assert "-n $(PYTEST_WORKERS)" in recipe, f"make {target} runs on the pytest-xdist workers"
        assert "minutes" in recipe, f"make {target} says how long it takes"
    assert "pytest-xdist" in (ROOT / "pyproject.toml").read_text(encoding="utf-8"), "the dev extra installs xdist"
