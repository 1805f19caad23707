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
