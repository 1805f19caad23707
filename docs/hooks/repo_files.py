"""mkdocs hook: one set of pages that reads right both in the repository and as a site.

The pages link to files of the repository outside ``docs/`` (README.md, images and records in ``benchmarks/``,
the model cards), as a reader of the repository expects. A site holds only ``docs/``, so this hook publishes the
README as the site's home page and every repository file a page links to (and what those files link to) under
``_repo/``, and rewrites the links to match. A link to a file that does not exist stays as it is, and mkdocs'
link validation reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = "_repo"
_LINK = re.compile(r"(?P<head>!?\[[^\]\n]*\]\()(?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)

# page src_uri on the site -> the file's folder in the repository, relative to ROOT
_origins: dict[str, str] = {}


def _docs_dir(config) -> Path:
    return Path(config["docs_dir"]).resolve()


def _targets(markdown: str) -> list[str]:
    return [m.group("target") for m in _LINK.finditer(markdown) if not _SCHEME.match(m.group("target"))]


def _site_path(repo_path: str, docs: str) -> str:
    """Where a repository file lives on the site: under docs/ as it is, anything else under _repo/."""
    if repo_path == docs or repo_path.startswith(docs + "/"):
        return repo_path[len(docs) + 1:]
    return f"{PUBLISHED}/{repo_path}"


def on_files(files: Files, config) -> Files:
    docs = _docs_dir(config).relative_to(ROOT).as_posix()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=readme))
    _origins.clear()
    _origins["index.md"] = ""
    for file in files.documentation_pages():
        if file.src_uri != "index.md":
            _origins[file.src_uri] = posixpath.dirname(f"{docs}/{file.src_uri}")
    queue = [(uri, origin) for uri, origin in _origins.items()]
    while queue:
        uri, origin = queue.pop()
        file = files.get_file_from_path(uri)
        text = readme if uri == "index.md" else Path(file.abs_src_path).read_text(encoding="utf-8")
        for target in _targets(text):
            repo_path = posixpath.normpath(posixpath.join(origin, target))
            if repo_path.startswith("..") or not (ROOT / repo_path).is_file():
                continue
            site = _site_path(repo_path, docs)
            if files.get_file_from_path(site) is not None:
                continue
            files.append(File.generated(config, site, abs_src_path=str(ROOT / repo_path)))
            if site.endswith(".md"):
                _origins[site] = posixpath.dirname(repo_path)
                queue.append((site, _origins[site]))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    origin = _origins.get(page.file.src_uri)
    if origin is None:
        return markdown
    docs = _docs_dir(config).relative_to(ROOT).as_posix()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group("target")
        if _SCHEME.match(target):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(origin, target))
        if repo_path.startswith("..") or not (ROOT / repo_path).is_file():
            return match.group(0)
        site = posixpath.relpath(_site_path(repo_path, docs), here or ".")
        return f"{match.group('head')}{site}{match.group('anchor') or ''})"

    return _LINK.sub(rewrite, markdown)
