"""Tokenise the corpus into uint16 token files that travel to the GPU machine (at most 64 MiB with the repo).

    python examples/train_tiny_moe/make_shards.py --corpus CORPUS_DIR --tokenizer TOKENIZER_DIR --out SHARDS_DIR \
        [--max-train-mb 48]

Writes ``train.bin``, ``calib.bin`` and ``heldout.bin`` (flat little-endian uint16 token ids, every document followed
by ``<|endoftext|>``), the tokenizer (copied beside them, so the training run needs only this folder) and
``meta.json`` (tokens and documents per split and source, sha256 of each file). The train split is capped at
``--max-train-mb`` (the transfer limit): documents are taken in the corpus's order, interleaved across sources, and
what is left out is counted in ``meta.json`` and printed (nothing is dropped silently).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np


def _docs(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _interleave(docs: list[dict]) -> list[dict]:
    """Round-robin over sources (each source in its own order), so a cap keeps every source's share."""
    by_source: dict[str, list[dict]] = defaultdict(list)
    for d in docs:
        by_source[d["source"]].append(d)
    queues = [list(reversed(v)) for _, v in sorted(by_source.items())]
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


def encode_split(docs: list[dict], tokenizer, eos: int, cap_tokens: int | None) -> tuple[np.ndarray, dict]:
    pieces, stats = [], defaultdict(lambda: {"documents": 0, "tokens": 0, "left_out_documents": 0,
                                            "left_out_tokens": 0})
    total = 0
    encoded = tokenizer([d["text"] for d in docs], add_special_tokens=False)["input_ids"]
    for d, ids in zip(docs, encoded):
        n = len(ids) + 1
        s = stats[d["source"]]
        if cap_tokens is not None and total + n > cap_tokens:
            s["left_out_documents"] += 1
            s["left_out_tokens"] += n
            continue
        pieces.append(np.asarray(ids + [eos], dtype=np.uint16))
        s["documents"] += 1
        s["tokens"] += n
        total += n
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)), dict(stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-train-mb", type=float, default=48.0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if len(tokenizer) > 65535:
        raise SystemExit(f"{len(tokenizer)} tokens do not fit in uint16")
    eos = tokenizer.eos_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict = {"tokenizer_tokens": len(tokenizer), "eos": eos, "dtype": "uint16", "splits": {}}
    for split in ("train", "calib", "heldout"):
        docs = _docs(args.corpus / f"{split}.jsonl")
        cap = int(args.max_train_mb * 2**20 / 2) if split == "train" else None
        tokens, stats = encode_split(_interleave(docs) if split == "train" else docs, tokenizer, eos, cap)
        path = args.out / f"{split}.bin"
        tokens.tofile(path)
        meta["splits"][split] = {"tokens": int(tokens.size), "bytes": path.stat().st_size, "by_source": stats,
                                 "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        left = sum(s["left_out_tokens"] for s in stats.values())
        print(f"{split}: {tokens.size:,} tokens ({path.stat().st_size / 2**20:.1f} MiB)"
              + (f", {left:,} tokens left out by the cap" if left else ""))
    tok_dir = args.out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    tokenizer.save_pretrained(tok_dir)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
