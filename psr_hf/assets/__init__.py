"""Files shipped with the package: the small trained OLMoE (``tiny_moe/``), its tokenizer, calibration and card,
and the held-out text ``persuasion_vol1.txt``.

``tiny_moe/`` is a transformers model directory (``AutoModelForCausalLM.from_pretrained(TINY_MOE)`` works offline):
OLMoE's routing shape (64 experts, top-8, softmax, ``norm_topk_prob=False``), 4 MoE layers, 8.7 M parameters,
trained on offline text (``examples/train_tiny_moe/``); ``README.md`` in it is the model card.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

_HERE = Path(__file__).resolve().parent
TINY_MOE = _HERE / "tiny_moe"
TINY_MOE_NAME = "tiny-moe"  # its name wherever a model is named: psr-hf --model, lm-eval pretrained=
# the small trained models with real models' routing geometry (examples/train_tiny_moe, --arch); psr_hf.assets.grow
# grows them exactly to the real models' sizes. olmoe-routing (OLMoE-1B-7B's routing: 16 MoE layers, 64 experts,
# top-8, softmax) is shipped; moonlight-routing (Moonlight-16B-A3B's: 27 layers with a dense first one, 64 experts
# top-6, 2 shared, sigmoid + bias) and qwen36-routing (Qwen3.6-35B-A3B's: 40 hybrid layers, 256 experts top-8, a
# gated shared expert) are built on the user's machine with one command (their 27 and 47 MB would push the
# repository past what a lent GPU machine accepts), into the per-user cache
OLMOE_ROUTING = _HERE / "olmoe_routing"
OLMOE_ROUTING_NAME = "olmoe-routing"
MOONLIGHT_ROUTING_NAME = "moonlight-routing"
QWEN36_ROUTING_NAME = "qwen36-routing"
#: name -> directory of every model shipped in the package
SHIPPED: dict[str, Path] = {TINY_MOE_NAME: TINY_MOE, OLMOE_ROUTING_NAME: OLMOE_ROUTING}
#: name -> the command that builds it (into :func:`built_dir`), for the models built on the user's machine
BUILT: dict[str, str] = {
    MOONLIGHT_ROUTING_NAME: "make moonlight-routing (trains it on a GPU for about 8 minutes: "
                            "examples/train_tiny_moe/build_routing_model.sh)",
    QWEN36_ROUTING_NAME: "make qwen36-routing (trains it on a GPU: examples/train_tiny_moe/build_routing_model.sh)",
}
# Volume I of Jane Austen's *Persuasion* (public domain): the held-out text of the demo, psr-hf kl and the
# psr_heldout_ppl task; the tiny MoE never saw any of it (eval_configs/data/extract_persuasion.py rebuilds it)
HELD_OUT_TEXT = _HERE / "persuasion_vol1.txt"
CALIBRATION = "calibration.safetensors"


def built_dir(name: str) -> Path:
    """Where the model ``name`` of :data:`BUILT` lives once built: ``$PSR_HF_MODELS/<name>``, default the per-user
    cache folder's ``models/<name>`` (``~/.cache/psr_hf/models`` on Linux)."""
    from .._paths import user_cache_dir

    return Path(os.environ.get("PSR_HF_MODELS") or user_cache_dir("models")) / name


def shipped_dir(name: str) -> Path:
    """The directory of the named model ``name`` (a key of :data:`SHIPPED` or :data:`BUILT`); a clear error for
    another name, where the installation lacks a shipped model's files, or where a built one is not built yet
    (naming the command that builds it)."""
    if name in BUILT:
        directory = built_dir(name)
        if not (directory / "config.json").is_file():
            raise ValueError(f"model {name!r} is not built on this machine (looked in {directory}); it is not shipped "
                             f"in the package: build it with {BUILT[name]}, or set PSR_HF_MODELS to the folder "
                             f"that holds {name}/")
        return directory
    if name not in SHIPPED:
        raise ValueError(f"no named model {name!r}; the shipped models are {', '.join(SHIPPED)}, and "
                         f"{', '.join(BUILT)} once built")
    directory = SHIPPED[name]
    weights = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").is_file() or not any(p.name != CALIBRATION for p in weights):
        raise FileNotFoundError(
            f"the shipped model {name} is not installed at {directory} (config.json and weights missing); "
            f"reinstall psr_hf from a complete checkout or wheel (its package data includes "
            f"psr_hf/assets/{directory.name})")
    return directory


def model_dir(name_or_path: str | Path) -> Path:
    """The directory of a model named on a command line: a shipped name (:data:`SHIPPED`) or a path
    (:func:`resolve_model` also checks it and explains what is wrong with a name)."""
    return shipped_dir(str(name_or_path)) if str(name_or_path) in NAMED_MODELS else Path(name_or_path)


def calibration_beside(directory: str | Path) -> Path | None:
    """``DIR/calibration.safetensors`` where a model directory has one (its default calibration), else None."""
    path = Path(directory) / CALIBRATION
    return path if path.is_file() else None


def load_tiny_moe(dtype: Any = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, calibration)`` of the shipped trained tiny OLMoE, in eval mode (``dtype``: default
    float32; the weights are stored in bfloat16). The calibration was computed on the training corpus's
    calibration split."""
    return load_shipped(TINY_MOE_NAME, dtype)


def load_shipped(name: str, dtype: Any = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, calibration)`` of the shipped model ``name`` (:data:`SHIPPED`), in eval mode
    (``dtype``: default float32; the weights are stored in bfloat16). Torch's thread count is the caller's: these
    models are small, so on a busy CPU ``torch.set_num_threads(1)`` runs them faster (:mod:`psr_hf._threads`)."""
    from .. import _progress  # noqa: F401  (before transformers: a notebook without ipywidgets shows no warning)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..policy.calibration import Calibration

    path = shipped_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, Calibration.load(path / CALIBRATION)


# ---------------------------------------------------------------------------------------------------- model names
# One resolver for every place a model is named (the psr-hf commands, the lm-eval model's pretrained=, the
# benchmarks): the shipped name, a local directory, or a hub id (owner/name). The hub is asked only for hub ids,
# and never when offline (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, or the hub's host does not resolve): then an id
# is looked up in the local hub cache only, so a typo fails at once instead of after transformers' retries.
SHIPPED_MODELS = tuple(SHIPPED)
NAMED_MODELS = (*SHIPPED, *BUILT)  # every name the resolver knows besides directories and hub ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}
# config.json fields that name a routed-expert count: a model without any of them is not a Mixture of Experts
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ModelSource:
    """Where a model named on a command line is: ``location`` is what ``from_pretrained`` gets (a directory, or a
    hub id when online), ``kind`` one of ``shipped``, ``built`` (a named model built on this machine), ``directory``, ``hub`` (online) or ``hub-cache`` (a hub id
    found in the local hub cache: ``location`` is then the cached snapshot directory, so nothing asks the hub);
    ``model_type`` and ``hidden_size`` are the config's (None where it was not read); ``from_pretrained_kwargs``
    carries ``local_files_only=True`` for everything but a hub id loaded online."""

    name: str
    location: str
    kind: str
    model_type: str | None = None
    offline: bool = False
    hidden_size: int | None = None  # the config's (or its text config's), where it was read

    @property
    def directory(self) -> Path | None:
        """The local model directory (None for a hub id loaded online)."""
        return None if self.kind == "hub" else Path(self.location)

    @property
    def from_pretrained_kwargs(self) -> dict[str, Any]:
        return {"local_files_only": True} if self.offline or self.kind != "hub" else {}

    def __repr__(self) -> str:
        return f"ModelSource({self.name!r} -> {self.kind} {self.location}, model_type={self.model_type!r})"


def hub_offline() -> bool:
    """True when the hub must not be asked: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set, or (without a
    proxy) the hub's host name does not resolve or does not answer within a second."""
    if any(os.environ.get(v, "").strip().upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # a proxy reaches the hub; a direct probe would not tell
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=1.0).close()
    except OSError:
        return True
    return False


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable transformers config.json ({exc})") from None


def check_supported(name: str, config: dict[str, Any]) -> str:
    """The ``model_type`` of ``config`` (a ``config.json`` as a dict) that psr_hf patches (its own or its text
    config's); ``ValueError`` naming the supported model types when psr_hf does not support it, saying whether the
    model is not a Mixture of Experts at all."""
    from ..patches import supported_model_types

    supported = supported_model_types()
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    types = [t for t in (config.get("model_type"), text.get("model_type")) if t]
    for model_type in types:
        if model_type in supported:
            return model_type
    architecture = ", ".join(config.get("architectures") or []) or "no architectures listed"
    what = types[0] if types else "no model_type"
    if not any(field in config or field in text for field in _EXPERT_FIELDS):
        reason = "not a Mixture-of-Experts model (its config names no routed experts)"
    else:
        reason = "a Mixture-of-Experts architecture psr_hf does not support yet (one module in psr_hf/patches adds it)"
    raise ValueError(f"model {name!r} is {what} ({architecture}): {reason}; psr_hf supports the model types "
                     f"{', '.join(supported)}")


def _hidden_size(config: dict[str, Any]) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("hidden_size", text.get("hidden_size"))
    return int(value) if isinstance(value, int) else None


def _source(name: str, location: str, kind: str, config: dict[str, Any], check: bool,
            offline: bool = False) -> ModelSource:
    model_type = check_supported(name, config) if check else config.get("model_type")
    return ModelSource(name, location, kind, model_type, offline, _hidden_size(config))


def _suggest(name: str, names: Sequence[str]) -> str:
    candidates = list(names)
    parent = Path(name).expanduser().parent
    if str(parent) not in ("", ".") or "/" in name:  # a path: its parent's subdirectories too
        try:
            candidates += [str(parent / p.name) for p in parent.iterdir() if p.is_dir()] if parent.is_dir() else []
        except OSError:
            pass
    else:
        try:
            candidates += [p.name for p in Path.cwd().iterdir() if p.is_dir() and (p / "config.json").is_file()]
        except OSError:
            pass
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def resolve_model(name: str | Path, *, also: Sequence[str] = (), check: bool = True) -> ModelSource:
    """Where the model ``name`` is, without loading it: ``tiny-moe`` (the shipped model), a local model directory,
    or a hub id ``owner/name`` (looked up in the local hub cache only when offline, see :func:`hub_offline`).

    ``also``: other names the caller builds itself (e.g. the benchmarks' random models); they are only offered as
    suggestions here, the caller handles them before calling. ``check``: refuse a model that psr_hf cannot patch
    (:func:`check_supported`) before anything is loaded.

    Raises ``ValueError`` naming what was looked for (and the nearest known name), ``FileNotFoundError`` where
    the installation lacks the shipped model's files."""
    text = str(name)
    if text in NAMED_MODELS:
        directory = shipped_dir(text)
        kind = "shipped" if text in SHIPPED else "built"
        return _source(text, str(directory), kind, _read_config(directory / "config.json"), check)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {text!r}: the directory {path} has no config.json; give a transformers model "
                             f"directory (save_pretrained writes one) or a named model ({', '.join(NAMED_MODELS)})")
        return _source(text, str(path), "directory", _read_config(path / "config.json"), check)
    known = [*NAMED_MODELS, *also]
    if path.exists():
        raise ValueError(f"model {text!r} is a file; give a model directory (with config.json) or one of "
                         f"{', '.join(known)}")
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or os.sep in text.replace("/", ""):
        raise ValueError(f"no model {text!r}: no such local directory (and not a shipped model: "
                         f"{', '.join(known)}){_suggest(text, known)}")
    if not _HUB_ID.match(text):
        raise ValueError(f"no model {text!r}: not a named model ({', '.join(NAMED_MODELS)}), "
                         + (f"not one of {', '.join(also)}, " if also else "")
                         + f"not a local directory, not a hub id (owner/name){_suggest(text, known)}")
    return _resolve_hub_id(text, known, check)


def _resolve_hub_id(repo_id: str, known: Sequence[str], check: bool) -> ModelSource:
    offline = hub_offline()
    if offline:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
        if not isinstance(cached, str):
            raise ValueError(
                f"no model {repo_id!r}: not a local directory, and the hub is offline (HF_HUB_OFFLINE=1 or no "
                f"network) and it is not in the local hub cache; download it where there is network "
                f"(huggingface-cli download {repo_id}), or give a local directory or a shipped model "
                f"({', '.join(NAMED_MODELS)}){_suggest(repo_id, known)}")
        return _source(repo_id, str(Path(cached).parent), "hub-cache", _read_config(Path(cached)), check,
                       offline=True)
    from huggingface_hub import hf_hub_download

    try:  # one file, so a model psr_hf cannot patch is refused before its weights download
        config = _read_config(Path(hf_hub_download(repo_id, "config.json")))
    except Exception as exc:  # the hub's own errors (not found, gated, network) say what happened
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"model {repo_id!r}: not a local directory, and the hub gave no config.json for it "
                         f"({type(exc).__name__}: {first})") from None
    return _source(repo_id, repo_id, "hub", config, check)
