"""The ``--model_args`` of ``lm-eval --model psr_hf``, checked before anything loads (docs/lm-eval.md).

:meth:`ModelArgs.parse` turns the args as lm-eval's parser typed them (``simple_parse_args_string``: ``0.5`` a
float, ``2`` an int, ``true`` True) into one frozen :class:`ModelArgs`: the routing config, where the experts live,
the calibration, predictor and gate files, the engine and speculative settings, and the args left for lm-eval's
``HFLM``. A bad value raises one ``ValueError`` that names the arg and the fix, before the model is loaded, so a
typo costs no model load.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.models.huggingface import HFLM

from ..assets import ModelSource, calibration_beside, resolve_model
from ..assets.loading import GROWN
from ..policy.config import RoutingConfig
from .lm_placement import ExpertPlacement, expert_placement

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..prefetch.predictor import Predictor

logger = logging.getLogger("lm_eval.models.psr_hf")

ROUTING_ARGS = tuple(field.name for field in dataclasses.fields(RoutingConfig))
PSR_ARGS = ("calibration", "config", "offload", "max_in_flight", "predictor", "gate", "distilled", "engine",
            "engine_max_len", "speculative", "drafter", "draft_tokens", "pool", "block_threshold")
# HFLM args the engine cannot serve: it needs the whole model's own weights on one device, computed in their dtype
_ENGINE_EXCLUDES = {
    "parallelize": "the engine runs every layer on one device; drop parallelize=True",
    "tp_plan": "the engine runs every layer on one device; drop tp_plan",
    "peft": "the engine reads the model's own weights and would ignore the adapter; merge it into the weights first",
    "autogptq": "the engine needs unquantized weights",
    "gptqmodel": "the engine needs unquantized weights",
    "mixed_precision_dtype": "the engine computes in the weights' dtype; load them in it with dtype= instead",
}
# how to make the file or folder a model arg names, for the error of a missing one
_MAKE_HINTS = {
    "calibration": "make one with psr-hf calibrate --model MODEL --text FILE --out FILE",
    "predictor": "train one with psr-hf train-predictor --model MODEL --out FILE",
    "gate": "save a psr_hf.gates.MarginHead (MarginHead.uniform(...).save(FILE), or one psr-hf train-gate trained; "
            "docs/gates.md)",
    "distilled": "train one with psr-hf train-gate --model MODEL --out FOLDER (docs/gates.md)",
}


# ---------------------------------------------------------------------------------------------- names
def _hflm_args() -> list[str]:
    """The named parameters of ``HFLM.__init__`` (introspected, so a new lm-eval argument is accepted as is)."""
    params = inspect.signature(HFLM.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def allowed_args() -> str:
    """The accepted model arg names, grouped, for error messages."""
    return (f"routing: {', '.join(ROUTING_ARGS)}; psr_hf: {', '.join(PSR_ARGS)}; "
            f"lm-eval's HF model: {', '.join(_hflm_args())}")


def check_args(names: Iterable[str]) -> None:
    """Raise ``ValueError`` naming the allowed args if a name in ``names`` is neither a routing field, one of
    psr_hf's own nor a named parameter of ``HFLM.__init__`` (which would pass it on to ``from_pretrained``)."""
    unknown = sorted(set(names) - set(ROUTING_ARGS) - set(PSR_ARGS) - set(_hflm_args()))
    if unknown:
        raise ValueError(f"unknown psr_hf model arg(s) {', '.join(unknown)}; allowed: {allowed_args()}")


def _refuse_remote_code(args: Mapping[str, Any]) -> None:
    if args.get("trust_remote_code"):
        raise ValueError("psr_hf model arg trust_remote_code=True: psr_hf patches transformers' native model "
                         "classes only, and the hub's remote code would run before that could be checked; drop "
                         "trust_remote_code (transformers has native OLMoE, DeepSeek-V3/Moonlight, Qwen3.5-MoE "
                         "and Qwen3-Next)")


# ---------------------------------------------------------------------------------------------- values
def existing_file(name: str, value: object, *, folder: bool = False) -> str | None:
    """``value`` as a string, None for None; ``ValueError`` naming the arg and how to make one where it is no file
    (``folder``: no directory)."""
    if value is None:
        return None
    exists = Path.is_dir if folder else Path.is_file
    if not isinstance(value, (str, Path)) or not exists(Path(value)):
        hint = f"; {_MAKE_HINTS[name]}" if name in _MAKE_HINTS else ""
        raise ValueError(f"psr_hf model arg {name}={value!r}: no such {'folder' if folder else 'file'}{hint}")
    return str(value)


def _positive_int(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"psr_hf model arg {name}={value!r} must be a positive int ({what})")
    return value


def routing_config(fields: Mapping[str, Any], config: str | None = None) -> RoutingConfig:
    """The :class:`RoutingConfig` of the routing model args ``fields`` (field name -> value as lm-eval parsed it;
    None leaves a field at its default) over the YAML file ``config`` if given. Raises RoutingConfig's
    ``ValueError`` (naming the field) for an invalid value, and ``ValueError`` for a missing file."""
    config_path = existing_file("config", config)
    if config_path is not None:
        routing = RoutingConfig.load_yaml(config_path)
        return routing.replace(**fields) if fields else routing
    return RoutingConfig(**{name: value for name, value in fields.items() if value is not None})


def predictor_args(predictor: object, routing: RoutingConfig) -> tuple[str | None, Predictor | None]:
    """The ``predictor=FILE`` path and the predictor loaded from it, or ``(None, None)``; ``ValueError`` for a
    missing file, a file that is no predictor, and a predictor without ``prefetch=predictor`` or the other way
    round."""
    path = existing_file("predictor", predictor)
    if (path is None) != (routing.prefetch != "predictor"):
        raise ValueError("psr_hf model args predictor= and prefetch=predictor go together: predictor=FILE (from "
                         "psr-hf train-predictor) ranks the prefetches of prefetch=predictor")
    if path is None:
        return None, None
    from ..prefetch.predictor import Predictor

    return path, Predictor.load(path)  # a file that is no predictor fails before loading


def check_engine_args(engine: object, engine_max_len: object, args: Mapping[str, Any]) -> bool:
    """``engine`` as a bool; ``ValueError`` naming the problem for a value that is not true/false, for
    ``engine_max_len`` that is not a positive int or comes without ``engine=true``, and for an lm-eval arg in
    ``args`` the engine cannot serve (:data:`_ENGINE_EXCLUDES`)."""
    if engine is None:
        engine = False
    if not isinstance(engine, bool):
        raise ValueError(f"psr_hf model arg engine={engine!r} must be true or false")
    if engine_max_len is not None:
        if not engine:
            raise ValueError("psr_hf model arg engine_max_len is used only with engine=true")
        if isinstance(engine_max_len, bool) or not isinstance(engine_max_len, int) or engine_max_len < 1:
            raise ValueError(f"psr_hf model arg engine_max_len={engine_max_len!r} must be a positive int (positions "
                             "of the engine's KV cache: the longest prompt plus its generated tokens)")
    if engine:
        for name, why in _ENGINE_EXCLUDES.items():
            if args.get(name) not in (None, False, ""):
                raise ValueError(f"psr_hf model args engine=true and {name}={args[name]!r} exclude each other: {why}")
    return engine


# ---------------------------------------------------------------------------------------------- speculative decoding
@dataclasses.dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative model args as checked before anything loads: the block ``mode``, the ``drafter``
    (resolved, not loaded), ``draft_tokens``, ``pool`` (None: the routing config's capacity) and ``threshold``."""

    mode: str
    drafter: ModelSource
    draft_tokens: int
    pool: int | None
    threshold: float


def _block_threshold(block_threshold: object) -> float:
    from ..policy.blocks import DEFAULT_THRESHOLD

    threshold = DEFAULT_THRESHOLD if block_threshold is None else block_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"psr_hf model arg block_threshold={block_threshold!r} must be a finite number >= 0 (the "
                         "weighted router mass a missing expert needs to join a block)")
    return float(threshold)


def _check_speculative_mode(speculative: object, drafter: object, engine: bool, offload: object) -> str:
    from ..policy.blocks import BLOCK_MODES

    if not isinstance(speculative, str) or speculative not in BLOCK_MODES:
        raise ValueError(f"psr_hf model arg speculative={speculative!r} must be one of {', '.join(BLOCK_MODES)} "
                         "(docs/speculative.md); leave it out for normal decoding")
    if drafter in (None, ""):
        raise ValueError(f"psr_hf model arg speculative={speculative} needs drafter=MODEL: a small model that "
                         "shares the target's tokenizer (a shipped name such as tiny-moe, or a model directory)")
    if engine:
        raise ValueError("psr_hf model args speculative= and engine=true exclude each other: this speculative "
                         "decoding runs on the transformers path and routes logically (docs/speculative.md); drop "
                         "one of them")
    if offload not in (None, False):
        raise ValueError("psr_hf model args speculative= and offload= exclude each other: the harness routes "
                         "logically and counts the copies the block selection implies; drop offload=")
    return speculative


def speculative_args(speculative: object, drafter: object, draft_tokens: object, pool: object,
                     block_threshold: object, *, engine: bool, offload: object) -> SpeculativeArgs | None:
    """The checked speculative args, None without ``speculative``; ``ValueError`` naming the arg for a mode that
    is not one of :data:`~psr_hf.policy.blocks.BLOCK_MODES`, a missing or unresolvable ``drafter``, a bad number,
    an arg given without ``speculative``, and ``engine=true`` or ``offload`` (the harness routes logically)."""
    from ..hf.speculative import DEFAULT_DRAFT_TOKENS
    from ..policy.blocks import BLOCK_MODES

    if speculative is None:
        given = [name for name, value in (("drafter", drafter), ("draft_tokens", draft_tokens), ("pool", pool),
                                          ("block_threshold", block_threshold)) if value is not None]
        if given:
            raise ValueError(f"psr_hf model arg(s) {', '.join(given)} are used only with speculative= (one of "
                             f"{', '.join(BLOCK_MODES)}); add speculative=MODE or drop them")
        return None
    mode = _check_speculative_mode(speculative, drafter, engine, offload)
    draft_tokens = _positive_int("draft_tokens", DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens,
                                 "drafts per verification block")
    if pool is not None:
        pool = _positive_int("pool", pool, "experts per MoE layer kept between blocks")
    threshold = _block_threshold(block_threshold)
    try:
        source = resolve_model(drafter, check=False)  # a dense drafter is fine; a typo fails before loading
    except ValueError as exc:
        raise ValueError(f"psr_hf model arg drafter={drafter!r}: {exc}") from None
    return SpeculativeArgs(mode, source, draft_tokens, pool, threshold)


# ---------------------------------------------------------------------------------------------- trained gates
@dataclasses.dataclass(frozen=True)
class GateArgs:
    """The gate model args as checked before anything loads: ``distilled`` (the folder or None), ``path`` (the
    margin head the run routes with: ``gate=FILE``, the folder's own, or None) and ``head`` (``gate=FILE`` loaded;
    the folder's head loads with the folder, checked against the model)."""

    distilled: str | None = None
    path: str | None = None
    head: MarginHead | None = None


def _folder_gate(folder: str | None) -> str | None:
    """The margin head a distilled folder holds, or None."""
    if folder is None:
        return None
    from ..training.gate import GATE_FILE

    return str(Path(folder) / GATE_FILE) if (Path(folder) / GATE_FILE).is_file() else None


def gate_args(gate: object, distilled: object, *, engine: bool, speculative: object, peft: object) -> GateArgs:
    """The checked ``gate=FILE`` and ``distilled=FOLDER``; ``ValueError`` naming the arg for a missing file or
    folder, a file that is no margin head, ``gate=`` with a folder that has its own, a gate with ``engine=true``
    (the engine's decode steps do not run gates) or ``speculative=`` (the block selection replaces the routing),
    and ``distilled=`` with ``peft=``. A folder without a gate is a plain model once merged: the engine serves it."""
    gate_path = existing_file("gate", gate)
    folder = existing_file("distilled", distilled, folder=True)
    folder_gate = _folder_gate(folder)
    if gate_path is not None and folder_gate is not None:
        raise ValueError(f"psr_hf model args gate={gate_path} and distilled={folder} both give a gate: the folder "
                         f"holds its own ({folder_gate}, trained with its routing); drop gate= or give a folder "
                         "without one")
    if folder is not None and peft not in (None, False, ""):
        raise ValueError(f"psr_hf model args distilled= and peft={peft!r} exclude each other: distilled= merges "
                         "its own adapters into the model's weights; merge the other adapter first")
    path = gate_path or folder_gate
    if path is not None:
        given = f"gate={path}" if gate_path is not None else f"distilled={folder} (it holds a gate, {path})"
        if engine:
            raise ValueError(f"psr_hf model args engine=true and {given} exclude each other: the engine's decode "
                             "steps do not run gates (docs/gates.md); drop engine=true, and the generations run on "
                             "the transformers path with the gate")
        if speculative is not None:
            raise ValueError(f"psr_hf model args speculative= and {given} exclude each other: the block selection "
                             "replaces the gated routing during a generation (docs/speculative.md); drop one of them")
    head = None
    if gate_path is not None:
        from ..gates.margin_head import MarginHead

        head = MarginHead.load(gate_path)  # a file that is no margin head fails before loading
    return GateArgs(folder, path, head)


# ---------------------------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class GrownModel:
    """A grown model's name (:data:`psr_hf.assets.loading.GROWN`) and where it is built: on ``device`` in
    ``dtype``."""

    name: str
    device: torch.device
    dtype: torch.dtype


def grown_model_args(name: str, device: str | None, dtype: object) -> GrownModel:
    """The grown model ``name`` on ``device`` (default: the GPU if there is one) in ``dtype`` (``auto`` or None:
    bfloat16 on a GPU, float32 on the CPU); ``ValueError`` for another dtype."""
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype in (None, "auto"):
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    elif not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(dtype), None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"psr_hf model arg dtype of pretrained={name}: give float32, bfloat16 or float16 (or auto)")
    return GrownModel(name, target, dtype)


def model_and_calibration(pretrained: str | Path | torch.nn.Module, calibration: str | None
                          ) -> tuple[str | torch.nn.Module, str | None]:
    """``pretrained`` resolved by :func:`psr_hf.assets.resolve_model` (``tiny-moe`` is the shipped model's
    directory; a typo, a missing directory or a model psr_hf cannot patch raises ``ValueError`` before anything
    loads; a hub id found in the local cache while offline becomes its snapshot directory), and the calibration
    file: ``calibration`` if given (it must exist), else a ``calibration.safetensors`` saved beside the model, else
    None. A model object (not a name) is passed through."""
    calibration = existing_file("calibration", calibration)
    directory = None
    if isinstance(pretrained, (str, Path)):
        source = resolve_model(pretrained)
        pretrained, directory = source.location, source.directory
    if calibration is None and directory is not None:
        beside = calibration_beside(directory)
        if beside is not None:
            calibration = str(beside)
            logger.info("psr_hf: calibration %s (saved beside the model; calibration= overrides it)", beside)
    return pretrained, calibration


# ---------------------------------------------------------------------------------------------- all of them
@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Every model arg of ``--model psr_hf``, checked. ``pretrained`` is what HFLM loads (a resolved location or
    a model object); ``grown`` the grown model to build instead, or None; ``hflm``: the args left for
    ``HFLM.__init__``, with the device the model loads on; ``experts``: where the experts live; ``engine`` and
    ``speculative`` choose how the ``generate_until`` requests run (at most one of them)."""

    pretrained: str | torch.nn.Module
    grown: GrownModel | None
    calibration: str | None
    routing: RoutingConfig
    predictor_path: str | None
    predictor: Predictor | None
    experts: ExpertPlacement
    gate: GateArgs
    engine: bool
    engine_max_len: int | None
    speculative: SpeculativeArgs | None
    hflm: Mapping[str, Any]

    @classmethod
    def parse(cls, pretrained: str | Path | torch.nn.Module, model_args: Mapping[str, Any]) -> ModelArgs:
        """The checked args of ``pretrained`` and ``model_args`` (psr_hf's own, :data:`PSR_ARGS`; the routing
        fields, :data:`ROUTING_ARGS`; and HFLM's). Any other name, and ``trust_remote_code=True``, raise
        ``ValueError``, as does every bad value, each naming the arg."""
        hflm = dict(model_args)
        own = {name: hflm.pop(name, None) for name in PSR_ARGS}
        check_args(hflm)
        _refuse_remote_code(hflm)
        engine = check_engine_args(own["engine"], own["engine_max_len"], hflm)
        speculative = speculative_args(own["speculative"], own["drafter"], own["draft_tokens"], own["pool"],
                                       own["block_threshold"], engine=engine, offload=own["offload"])
        gate = gate_args(own["gate"], own["distilled"], engine=engine, speculative=own["speculative"],
                         peft=hflm.get("peft"))
        routing = routing_config({name: hflm.pop(name) for name in ROUTING_ARGS if name in hflm}, own["config"])
        predictor_path, predictor = predictor_args(own["predictor"], routing)
        experts = expert_placement(own["offload"], own["max_in_flight"])
        grown = None
        if isinstance(pretrained, str) and pretrained in GROWN:
            if hflm.get("tokenizer") is not None or hflm.get("parallelize"):
                raise ValueError(f"psr_hf model arg pretrained={pretrained} (built in memory, with its own "
                                 "tokenizer on one device) takes neither tokenizer= nor parallelize=True")
            calibration = existing_file("calibration", own["calibration"])
            grown = grown_model_args(pretrained, experts.load_device(hflm.get("device")), hflm.pop("dtype", None))
        else:
            pretrained, calibration = model_and_calibration(pretrained, own["calibration"])
        return cls(pretrained=pretrained, grown=grown, calibration=calibration, routing=routing,
                   predictor_path=predictor_path, predictor=predictor, experts=experts, gate=gate, engine=engine,
                   engine_max_len=own["engine_max_len"], speculative=speculative, hflm=experts.hflm_args(hflm))
