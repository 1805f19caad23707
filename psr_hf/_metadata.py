"""The free-form "user" metadata that psr_hf files carry in their safetensors header, read as untrusted input."""

from __future__ import annotations

import json
from typing import Any

MAX_USER_METADATA = 1 << 20  # characters: descriptions of how a file was made, never data


def user_metadata(text: Any, path: Any) -> dict:
    """The header's ``user`` field of the file ``path`` as a dict; ``ValueError`` naming the file when it is not
    a JSON object of at most :data:`MAX_USER_METADATA` characters (nested too deeply to parse counts as not)."""
    if text is None:
        return {}
    if not isinstance(text, str) or len(text) > MAX_USER_METADATA:
        size = len(text) if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{path}: the header's user metadata ({size} characters) is not a JSON text of at most "
                         f"{MAX_USER_METADATA} characters; the file was not written by psr_hf or was altered")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: the header's user metadata is nested too deeply to be psr_hf's") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: the header's user metadata is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: the header's user metadata must be a JSON object, not a {type(value).__name__}")
    return value


def read_file(path: Any, format_name: str, what: str, hint: str) -> tuple[dict, dict, dict]:
    """The header, the user metadata and the tensors (torch) of the psr_hf safetensors file ``path`` whose
    ``format`` is ``format_name``; ``ValueError`` naming the file, ``what`` it should be and ``hint`` (how to make
    one) when it is missing, of another format or unreadable."""
    from pathlib import Path

    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {path} does not exist; {hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != format_name:
                raise ValueError(f"{path} is not a psr_hf {what} (format {meta.get('format')!r}); a calibration or "
                                 f"model file? {hint[:1].upper()}{hint[1:]}")
            user = user_metadata(meta.get("user"), path)
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own errors for a corrupt file
        raise ValueError(f"{path} could not be read as a {what} ({type(exc).__name__}: {exc})") from exc
    return meta, user, tensors
