"""The text a measurement of a model reads, offline and deterministic: the held-out *Persuasion* of the trained
models psr_hf ships (:func:`default_texts`), standard-library sources (:func:`module_sources`; the measured
windows share no module with the calibration or the predictors' training), text files, and the token windows
cut from them (:func:`text_windows`: fixed windows; :func:`token_windows`: a token budget); :func:`measured_texts`
and :func:`training_texts` choose among them as the commands do."""

from __future__ import annotations

import importlib
import inspect
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import HELD_OUT_TEXT, NAMED_MODELS
from .loading import GROWN

# Standard-library modules (offline, deterministic for a given Python). The windows and the calibration never
# share a module, so the warm set and the token prior are not fitted on the timed tokens.
WINDOW_MODULES = ("textwrap", "argparse", "json.decoder", "collections")
CALIBRATION_MODULES = ("functools", "heapq", "string", "contextlib", "dataclasses", "enum")
# the predictors' default training text: standard-library modules other than the windows' (WINDOW_MODULES)
PREDICTOR_MODULES = ("functools", "heapq", "string", "contextlib", "dataclasses", "enum", "typing", "inspect",
                     "pathlib", "tarfile", "zipfile", "subprocess", "pickle", "ast", "difflib", "shutil")


def default_texts(model: str) -> list[tuple[str, str]] | None:
    """``(name, text)`` of the held-out text for a trained model that psr_hf ships (or grows): Volume I of
    *Persuasion*, which none of them saw; None for other models (the caller's own default)."""
    if model in NAMED_MODELS or model in GROWN:
        return [(f"held-out: {HELD_OUT_TEXT.name}", HELD_OUT_TEXT.read_text(encoding="utf-8"))]
    return None


def module_sources(modules: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, text)`` of each standard-library module's source file (``inspect.getsourcefile``); the label is
    ``stdlib:<module>`` (records name the module, not a path on the machine)."""
    out = []
    for name in modules:
        path = inspect.getsourcefile(importlib.import_module(name))
        if path is None:
            raise ValueError(f"module {name!r} has no source file to read")
        out.append((f"stdlib:{name}", Path(path).read_text(encoding="utf-8")))
    return out


def read_texts(option: str, files: Sequence[str]) -> list[str]:
    """The text of each file (UTF-8, undecodable bytes replaced); ``ValueError`` naming ``option`` for a path that
    is not a file."""
    texts = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{option} {name}: no such file")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def text_name(path: str) -> str:
    """How a record names a text file: ``stdlib:<path>`` for a file of Python's standard library (its location is
    the machine's, not the record's), the path as given otherwise."""
    try:
        return "stdlib:" + Path(path).resolve().relative_to(Path(sysconfig.get_paths()["stdlib"]).resolve()).as_posix()
    except ValueError:
        return str(path)


def _token_ids(texts: Sequence[str], tokenizer: Any) -> Iterator[list[int]]:
    """Each text's token ids, tokenised when reached (without special tokens)."""
    for text in texts:
        # verbose=False: long texts are cut into windows, beyond the tokenizer's model_max_length
        yield tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def text_windows(texts: Sequence[str], tokenizer: Any, *, windows: int, tokens: int) -> list[Any]:
    """``windows`` token windows ``[1, tokens + 1]`` (position 0 starts the sequence, ``tokens`` are timed).

    Window ``i`` is cut from text ``i % len(texts)`` at token offset ``(i // len(texts)) * (tokens + 1)`` (texts
    tokenised without special tokens); a text too short for its window raises ``ValueError``."""
    import torch

    if windows < 1 or tokens < 1:
        raise ValueError(f"windows={windows} and tokens={tokens} must be >= 1")
    if not texts:
        raise ValueError("no texts to cut windows from")
    encoded = list(_token_ids(texts, tokenizer))
    out = []
    for i in range(windows):
        source = encoded[i % len(texts)]
        start = (i // len(texts)) * (tokens + 1)
        window = source[start : start + tokens + 1]
        if len(window) < tokens + 1:
            raise ValueError(f"text {i % len(texts)} has {len(source)} tokens; window {i} needs tokens "
                             f"[{start}, {start + tokens + 1}): give fewer --windows or --tokens, or longer --text")
        out.append(torch.tensor([window], dtype=torch.long))
    return out


def token_windows(texts: Sequence[str], tokenizer: Any, *, tokens: int, window: int, option: str) -> list[Any]:
    """1D token-id windows of at most ``window`` tokens cut from each text in turn (never across texts) until
    ``tokens`` tokens; ``ValueError`` naming ``option`` when the texts hold fewer."""
    import torch

    if tokens < 2 or window < 2:
        raise ValueError(f"{option} {tokens} and --window {window} must be at least 2")
    out, total = [], 0
    for ids in _token_ids(texts, tokenizer):
        for start in range(0, len(ids), window):
            piece = ids[start:start + min(window, tokens - total)]
            if len(piece) < 2:  # a window needs a token with a previous one
                continue
            out.append(torch.tensor(piece, dtype=torch.long))
            total += len(piece)
            if total >= tokens:
                return out
    raise ValueError(f"{option} {tokens}: the texts hold only {total} tokens; give fewer tokens or more text")


def measured_texts(model: str, files: Sequence[str], *, option: str,
                   name: Callable[[str], str] = text_name) -> tuple[list[str], list[str]]:
    """``(texts, names)`` that a measurement of ``model`` reads: the ``files`` given (each named by ``name``), else
    the held-out text of a trained model psr_hf ships (:func:`default_texts`), else :data:`WINDOW_MODULES`."""
    if files:
        return read_texts(option, files), [name(f) for f in files]
    sources = default_texts(model) or module_sources(WINDOW_MODULES)
    return [t for _, t in sources], [n for n, _ in sources]


def training_texts(files: Sequence[str], *, option: str = "--text") -> tuple[list[str], list[str]]:
    """``(texts, names)`` a predictor trains on: the ``files`` given, else :data:`PREDICTOR_MODULES`' sources."""
    if files:
        return read_texts(option, files), [text_name(f) for f in files]
    sources = module_sources(PREDICTOR_MODULES)
    return [t for _, t in sources], [n for n, _ in sources]
