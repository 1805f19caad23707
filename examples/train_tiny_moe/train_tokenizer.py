"""Train the byte-level BPE tokenizer of the tiny MoE on the corpus's train split only.

    python examples/train_tiny_moe/train_tokenizer.py --corpus CORPUS_DIR --out TOKENIZER_DIR [--vocab 8192]

Writes a tokenizer that ``AutoTokenizer.from_pretrained(TOKENIZER_DIR)`` loads offline (``tokenizer.json`` plus the
config files of ``PreTrainedTokenizerFast``). Special tokens: ``<|endoftext|>`` (bos, eos: separates documents) and
``<|pad|>``. Byte-level: every byte string is encodable, nothing maps to an unknown token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def documents(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train(corpus: Path, vocab_size: int) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD], show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents(corpus / "train.jsonl"), trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size, 8k-16k (default 8192)")
    args = parser.parse_args()
    if not 8192 <= args.vocab <= 16384:
        raise SystemExit(f"--vocab {args.vocab}: the tiny model uses 8k-16k tokens")
    from transformers import PreTrainedTokenizerFast

    tokenizer = train(args.corpus, args.vocab)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=1024, padding_side="left")  # batched generate() needs left
    fast.save_pretrained(args.out)
    sample = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = fast(sample)["input_ids"]
    print(f"tokenizer: {len(fast)} tokens -> {args.out}; {len(sample)} chars of Austen -> {len(ids)} tokens; "
          f"round trip {'ok' if fast.decode(ids) == sample else 'FAILED'}")


if __name__ == "__main__":
    main()
