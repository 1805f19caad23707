"""The documentation builds as a site (mkdocs, strict: every warning is an error, broken links and anchors
included), with the API reference generated from the docstrings and the repository files the pages link to."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(site: Path, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=600)


def test_the_site_builds_with_warnings_as_errors_and_holds_every_page(tmp_path):
    site = tmp_path / "site"
    done = _build(site)
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in site.glob("*/index.html")}
    assert pages <= built, pages - built
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "make demo" in home and 'href="transformers/"' in home  # the README, its links made the site's
    api = re.sub(r"<[^>]+>", "", (site / "api" / "index.html").read_text(encoding="utf-8"))
    for name in ("patch", "RoutingConfig", "OffloadConfig", "attach", "Predictor", "load_shipped"):
        assert re.search(rf"\b{name}\b", api), name
    assert "Make model's MoE routing cache-aware" in api  # patch()'s docstring, rendered
    assert (site / "_repo" / "benchmarks" / "engine" / "h200" / "bench_engine.png").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The same build in a copy of the docs with one page that links to a page that is not there."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    for name in ("README.md", "ARCHITECTURE.md", "benchmarks", "examples", "psr_hf", "patches", "eval_configs"):
        (copy / name).symlink_to(ROOT / name)
    (copy / "docs" / "zz_probe.md").write_text("# Probe\n\nSee [a page that is not there](not_there.md).\n",
                                               encoding="utf-8")
    done = _build(tmp_path / "site", copy)
    assert done.returncode != 0 and "not_there.md" in done.stdout + done.stderr
