"""Rebuild persuasion_vol1.txt from Debian's r-cran-janeaustenr package (provenance of the shipped text).

The shipped file is the output of this script; nothing at evaluation time runs it. To reproduce::

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    pip install rdata    # a reader for R's serialisation format (only for this script)
    python eval_configs/data/extract_persuasion.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata

janeaustenr (MIT, Julia Silge) holds the Project Gutenberg texts of Jane Austen's novels, one line per element of a
character vector in an R lazy-load database (``Rdata.rdx`` index, ``Rdata.rdb`` zlib-compressed objects). The
novel itself (1818) is in the public domain. We keep Volume I (Chapters 1-12), reflow each paragraph onto one
line, collapse runs of spaces and separate paragraphs by a blank line.
"""

from __future__ import annotations

import gzip
import re
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "psr_hf" / "assets" / "persuasion_vol1.txt"
LAST_CHAPTER = 12  # Volume I


def read_lines(rdata_prefix: str) -> list[str]:
    import rdata

    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(Path(rdata_prefix + ".rdx").read_bytes())))
    offset, length = (int(v) for v in index["variables"]["persuasion"])
    blob = Path(rdata_prefix + ".rdb").read_bytes()[offset : offset + length]
    # each object: 4-byte big-endian uncompressed length, then a zlib stream of the serialised object
    values = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
    return ["" if v is None else str(v) for v in values]


def paragraphs(lines: list[str]) -> list[str]:
    paras, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paras.append(re.sub(r" {2,}", " ", " ".join(current)))
            current = []
    return paras


def main(rdata_prefix: str) -> None:
    paras = paragraphs(read_lines(rdata_prefix))
    start = paras.index("Chapter 1")
    end = paras.index(f"Chapter {LAST_CHAPTER + 1}")
    OUT.write_text("\n\n".join(paras[start:end]) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {end - start} paragraphs)")


if __name__ == "__main__":
    main(sys.argv[1])
