"""Workloads of the benchmarks: the models they build and the text they decode."""

from __future__ import annotations

from typing import Any


def byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` over exactly 256 ids (one per byte, no merges), so it fits the tiny
    models' vocabulary; eos/pad/bos are the tiny configs' ids 1/0/2 (bytes that never occur in text)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([""], vocab_size=256, show_progress=False, special_tokens=[])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    vocab = tokenizer.convert_ids_to_tokens([0, 1, 2])
    tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token = vocab[0], vocab[1], vocab[2]
    return tokenizer
