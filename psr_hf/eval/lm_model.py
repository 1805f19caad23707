"""The lm-evaluation-harness model ``psr_hf``: lm-eval's HF model with cache-aware expert routing (docs/lm-eval.md).

::

    lm-eval --model psr_hf --tasks ... \\
        --model_args pretrained=PATH,policy=psr,lam=0.2,budget=1,residency=0.5,calibration=calib.safetensors

:class:`PSRLM` is lm-eval's ``HFLM`` with the model patched (:func:`psr_hf.patch`) right after it is loaded, in the
shape of lm-eval's own ``steered`` model (``lm_eval/models/hf_steered.py``). Every batch row has its own logical
cache, reset at every request, and padding never touches the routing state, so a request gets the same routing
decisions at every batch size. ``@register_model("psr_hf")`` below registers the class, and the start-up hook
(:mod:`psr_hf.eval.lm_eval_hook`) a lazy placeholder before it, so ``lm-eval --model psr_hf`` finds it and
processes that never use lm-eval import nothing of psr_hf.

With ``engine=true`` the engine (:func:`psr_hf.engine.attach`) serves the ``generate_until`` requests at batch 1
(CUDA graphs on a GPU, the eager decoder on the CPU); the loglikelihood requests stay on the batched transformers
path (docs/lm-eval.md, "Generating on the engine").

With ``speculative=exact|position|confidence`` and ``drafter=MODEL`` the ``generate_until`` requests run at batch 1
through :func:`psr_hf.hf.speculative.speculative_generate` (the drafter proposes, the target verifies a block at a
time with block-level expert selection, greedy acceptance; docs/speculative.md); the loglikelihood requests stay on
the batched path (docs/lm-eval.md, "Speculative decoding").

With ``gate=FILE`` (a saved :class:`psr_hf.gates.MarginHead`) and ``distilled=FOLDER`` (a
:func:`psr_hf.gates.train.distill_routing` result, merged by :func:`psr_hf.gates.train.load_distilled` before the
model is patched; its own margin head, if it has one, is the gate) trained gates run under lm-eval (docs/gates.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..assets import calibration_beside, resolve_model
from ..assets.loading import GROWN
from ..hf.patching import controller, patch
from ..offload.config import OffloadConfig
from ..policy.config import RoutingConfig

# a child of lm-eval's logger: lm-eval's CLI configures "lm_eval" only, and the statistics belong in its output
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


def _hflm_args() -> list[str]:
    """The named parameters of ``HFLM.__init__`` (introspected, so a new lm-eval argument is accepted as is)."""
    params = inspect.signature(HFLM.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def allowed_args() -> str:
    """The accepted model arg names, grouped, for error messages."""
    return (f"routing: {', '.join(ROUTING_ARGS)}; psr_hf: {', '.join(PSR_ARGS)}; "
            f"lm-eval's HF model: {', '.join(_hflm_args())}")


def check_args(names: Any) -> None:
    """Raise ``ValueError`` naming the allowed args if a name in ``names`` is neither a routing field, one of
    psr_hf's own nor a named parameter of ``HFLM.__init__`` (which would pass it on to ``from_pretrained``)."""
    unknown = sorted(set(names) - set(ROUTING_ARGS) - set(PSR_ARGS) - set(_hflm_args()))
    if unknown:
        raise ValueError(f"unknown psr_hf model arg(s) {', '.join(unknown)}; allowed: {allowed_args()}")


# how to make the file or folder a model arg names, for the error of a missing one
_MAKE_HINTS = {
    "calibration": "make one with psr-hf calibrate --model MODEL --text FILE --out FILE",
    "predictor": "train one with psr-hf train-predictor --model MODEL --out FILE",
    "gate": "save a psr_hf.gates.MarginHead (MarginHead.uniform(...).save(FILE), or one psr-hf train-gate trained; "
            "docs/gates.md)",
    "distilled": "train one with psr-hf train-gate --model MODEL --out FOLDER (docs/gates.md)",
}


def _existing_file(name: str, value: Any, *, folder: bool = False) -> str | None:
    """``value`` as a string, None for None; ``ValueError`` naming the arg and how to make one where it is no file
    (``folder``: no directory)."""
    if value is None:
        return None
    exists = Path.is_dir if folder else Path.is_file
    if not isinstance(value, (str, Path)) or not exists(Path(value)):
        hint = f"; {_MAKE_HINTS[name]}" if name in _MAKE_HINTS else ""
        raise ValueError(f"psr_hf model arg {name}={value!r}: no such {'folder' if folder else 'file'}{hint}")
    return str(value)


def routing_config(fields: Mapping[str, Any], config: str | None = None) -> RoutingConfig:
    """The :class:`RoutingConfig` of the routing model args ``fields`` (field name -> value as lm-eval parsed it;
    None leaves a field at its default) over the YAML file ``config`` if given. Raises RoutingConfig's
    ``ValueError`` (naming the field) for an invalid value, and ``ValueError`` for a missing file."""
    config_path = _existing_file("config", config)
    if config_path is not None:
        routing = RoutingConfig.load_yaml(config_path)
        return routing.replace(**fields) if fields else routing
    return RoutingConfig(**{name: value for name, value in fields.items() if value is not None})


def offload_config(offload: Any = None, max_in_flight: int | None = None) -> OffloadConfig | None:
    """The :class:`~psr_hf.OffloadConfig` of the model args ``offload=DEVICE`` (``cuda``, ``cuda:N``, ``cpu``;
    True means ``cuda``) and ``max_in_flight=N``; None without ``offload`` (None or False). Raises ``ValueError``
    naming the field."""
    if offload is None or offload is False:
        if max_in_flight is not None:
            raise ValueError("psr_hf model arg max_in_flight is used only with offload= (e.g. offload=cuda:0)")
        return None
    device = "cuda" if offload is True else offload
    if not isinstance(device, str):
        raise ValueError(f"psr_hf model arg offload={offload!r} must be a device: cuda, cuda:N or cpu")
    return OffloadConfig(device=device.strip(),
                         **({} if max_in_flight is None else {"max_in_flight": max_in_flight}))


def model_and_calibration(pretrained: Any, calibration: str | None) -> tuple[Any, str | None]:
    """``pretrained`` resolved by :func:`psr_hf.assets.resolve_model` (``tiny-moe`` is the shipped model's
    directory; a typo, a missing directory or a model psr_hf cannot patch raises ``ValueError`` before anything
    loads; a hub id found in the local cache while offline becomes its snapshot directory), and the calibration
    file: ``calibration`` if given (it must exist), else a ``calibration.safetensors`` saved beside the model, else
    None. A model object (not a name) is passed through."""
    calibration = _existing_file("calibration", calibration)
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


_LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' key for it


@contextlib.contextmanager
def _long_sequences_windowed(tokenizer: Any) -> Iterator[None]:
    """Inside the block, ``tokenizer`` does not warn that a sequence exceeds the model's maximum length (the caller
    windows it); after it, the tokenizer warns as it did before (once, as transformers does)."""
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(shown, dict):
        yield
        return
    before = shown.get(_LONG_SEQUENCE_WARNING)
    shown[_LONG_SEQUENCE_WARNING] = True  # transformers' own "already warned" mark
    try:
        yield
    finally:
        if before is None:
            shown.pop(_LONG_SEQUENCE_WARNING, None)
        else:
            shown[_LONG_SEQUENCE_WARNING] = before


def _key(tokens: list[int]) -> tuple[int, int]:
    """A key of the tokens without trailing pad ids (HFLM right-pads loglikelihood inputs with 0): their length
    and hash (a collision can only add a candidate length, see :meth:`PSRLM._real_lengths`)."""
    end = len(tokens)
    while end and tokens[end - 1] == 0:
        end -= 1
    return end, hash(tuple(tokens[:end]))


def grown_model(name: str, device: Any, dtype: Any, calibration: str | None) -> tuple[Any, Any, str | None]:
    """``(model, tokenizer, calibration file)`` of a grown model's name (``grown-olmoe-routing``,
    :data:`psr_hf.assets.loading.GROWN`): its shipped small trained model grown exactly to the real model's
    dimensions on ``device`` (default: the GPU if there is one) in ``dtype`` (``auto`` or None: bfloat16 on a GPU,
    float32 on the CPU), with the small model's tokenizer and, unless ``calibration`` names one, its calibration
    (growing leaves the routing unchanged). Built in memory, never written to disk."""
    from ..assets.grow import grow, target_by_name
    from ..assets.loading import load_model

    small_name, preset = GROWN[name]
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype in (None, "auto"):
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    elif not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(dtype), None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"psr_hf model arg dtype of pretrained={name}: give float32, bfloat16 or float16 (or auto)")
    small, tokenizer, info = load_model(small_name, "cpu")
    model = grow(small, target_by_name(preset), device=target, dtype=dtype).eval()
    logger.info("psr_hf: %s: %s grown to %s's dimensions on %s (%s)", name, small_name, preset, target, model.dtype)
    return model, tokenizer, calibration or info.get("calibration_file")


def check_engine_args(engine: Any, engine_max_len: Any, kwargs: Mapping[str, Any]) -> bool:
    """``engine`` as a bool; ``ValueError`` naming the problem for a value that is not true/false, for
    ``engine_max_len`` that is not a positive int or comes without ``engine=true``, and for an lm-eval arg the
    engine cannot serve (:data:`_ENGINE_EXCLUDES`)."""
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
            if kwargs.get(name) not in (None, False, ""):
                raise ValueError(f"psr_hf model args engine=true and {name}={kwargs[name]!r} exclude each other: {why}")
    return engine


@dataclasses.dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative model args as checked before anything loads: the block ``mode``, the ``drafter``
    (resolved, not loaded), ``draft_tokens``, ``pool`` (None: the routing config's capacity) and ``threshold``."""

    mode: str
    drafter: Any  # a ModelSource
    draft_tokens: int
    pool: int | None
    threshold: float


def _positive_int(name: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"psr_hf model arg {name}={value!r} must be a positive int ({what})")
    return value


def speculative_args(speculative: Any, drafter: Any, draft_tokens: Any, pool: Any, block_threshold: Any, *,
                     engine: bool, offload: Any) -> SpeculativeArgs | None:
    """The checked speculative args, None without ``speculative``; ``ValueError`` naming the arg for a mode that
    is not one of :data:`~psr_hf.policy.blocks.BLOCK_MODES`, a missing or unresolvable ``drafter``, a bad number,
    an arg given without ``speculative``, and ``engine=true`` or ``offload`` (the harness routes logically)."""
    from ..hf.speculative import DEFAULT_DRAFT_TOKENS
    from ..policy.blocks import BLOCK_MODES, DEFAULT_THRESHOLD

    if speculative is None:
        given = [name for name, value in (("drafter", drafter), ("draft_tokens", draft_tokens), ("pool", pool),
                                          ("block_threshold", block_threshold)) if value is not None]
        if given:
            raise ValueError(f"psr_hf model arg(s) {', '.join(given)} are used only with speculative= (one of "
                             f"{', '.join(BLOCK_MODES)}); add speculative=MODE or drop them")
        return None
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
    draft_tokens = _positive_int("draft_tokens", DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens,
                                 "drafts per verification block")
    if pool is not None:
        pool = _positive_int("pool", pool, "experts per MoE layer kept between blocks")
    threshold = DEFAULT_THRESHOLD if block_threshold is None else block_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"psr_hf model arg block_threshold={block_threshold!r} must be a finite number >= 0 (the "
                         "weighted router mass a missing expert needs to join a block)")
    try:
        source = resolve_model(drafter, check=False)  # a dense drafter is fine; a typo fails before loading
    except ValueError as exc:
        raise ValueError(f"psr_hf model arg drafter={drafter!r}: {exc}") from None
    return SpeculativeArgs(speculative, source, draft_tokens, pool, float(threshold))


@dataclasses.dataclass(frozen=True)
class GateArgs:
    """The gate model args as checked before anything loads: ``distilled`` (the folder or None), ``path`` (the
    margin head the run routes with: ``gate=FILE``, the folder's own, or None) and ``head`` (``gate=FILE`` loaded;
    the folder's head loads with the folder, checked against the model)."""

    distilled: str | None
    path: str | None
    head: Any


def gate_args(gate: Any, distilled: Any, *, engine: bool, speculative: Any, peft: Any) -> GateArgs:
    """The checked ``gate=FILE`` and ``distilled=FOLDER``; ``ValueError`` naming the arg for a missing file or
    folder, a file that is no margin head, ``gate=`` with a folder that has its own, a gate with ``engine=true``
    (the engine's decode steps do not run gates) or ``speculative=`` (the block selection replaces the routing),
    and ``distilled=`` with ``peft=``. A folder without a gate is a plain model once merged: the engine serves it."""
    gate_path = _existing_file("gate", gate)
    folder = _existing_file("distilled", distilled, folder=True)
    folder_gate = None
    if folder is not None:
        from ..gates.train import GATE_FILE

        if (Path(folder) / GATE_FILE).is_file():
            folder_gate = str(Path(folder) / GATE_FILE)
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


@register_model("psr_hf")
class PSRLM(HFLM):
    """lm-eval's HF model with the model patched by :func:`psr_hf.patch` after loading (docs/lm-eval.md).

    Attributes: ``routing`` (the :class:`RoutingConfig`), ``calibration_path``, ``gate_path`` and
    ``distilled_path`` (the margin head and the distilled folder, or None), ``engine`` (the attached engine
    with ``engine=true``, else None), ``block_config`` (the :class:`~psr_hf.policy.blocks.BlockConfig` with
    ``speculative=``, else None) and ``drafter`` (its model); :meth:`routing_stats` gives the statistics so far.
    """

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "PSRLM":
        """lm-eval's constructor; a bad argument's ``ValueError`` is also logged as one line, so that the message
        comes before the traceback lm-eval's command line prints."""
        try:
            return super().create_from_arg_obj(arg_dict, additional_config)
        except ValueError as error:
            logger.error("psr_hf model: %s", error)
            raise

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "PSRLM":
        """As :meth:`create_from_arg_obj`, from ``--model_args``' string."""
        try:
            return super().create_from_arg_string(arg_string, additional_config)
        except ValueError as error:
            logger.error("psr_hf model: %s", error)
            raise

    def __init__(self, pretrained: Any, calibration: str | None = None, config: str | None = None,
                 offload: str | bool | None = None, max_in_flight: int | None = None, predictor: str | None = None,
                 gate: str | None = None, distilled: str | None = None, engine: bool = False,
                 engine_max_len: int | None = None, speculative: str | None = None, drafter: str | None = None,
                 draft_tokens: int | None = None, pool: int | None = None, block_threshold: float | None = None,
                 **kwargs: Any) -> None:
        """``pretrained`` and psr_hf's own args (:data:`PSR_ARGS`, docs/lm-eval.md); ``kwargs``: the routing fields,
        and the rest goes to ``HFLM.__init__``. As in lm-eval's ``steered`` model, the values arrive already typed
        by lm-eval's parser of ``--model_args`` (``simple_parse_args_string``: ``0.5`` a float, ``2`` an int,
        ``true`` True, ``None`` None). Any other name, and ``trust_remote_code=True``, raise ``ValueError`` before
        the model is loaded."""
        check_args(kwargs)  # before anything loads
        if kwargs.get("trust_remote_code"):
            raise ValueError("psr_hf model arg trust_remote_code=True: psr_hf patches transformers' native model "
                             "classes only, and the hub's remote code would run before that could be checked; drop "
                             "trust_remote_code (transformers has native OLMoE, DeepSeek-V3/Moonlight, Qwen3.5-MoE "
                             "and Qwen3-Next)")
        use_engine = check_engine_args(engine, engine_max_len, kwargs)
        spec = speculative_args(speculative, drafter, draft_tokens, pool, block_threshold, engine=use_engine,
                                offload=offload)
        gating = gate_args(gate, distilled, engine=use_engine, speculative=speculative, peft=kwargs.get("peft"))
        fields = {name: kwargs.pop(name) for name in ROUTING_ARGS if name in kwargs}
        routing = routing_config(fields, config)
        predictor_path = _existing_file("predictor", predictor)
        if (predictor_path is None) != (routing.prefetch != "predictor"):
            raise ValueError("psr_hf model args predictor= and prefetch=predictor go together: predictor=FILE (from "
                             "psr-hf train-predictor) ranks the prefetches of prefetch=predictor")
        loaded_predictor = None
        if predictor_path is not None:
            from ..prefetch.predictor import Predictor

            loaded_predictor = Predictor.load(predictor_path)  # a file that is no predictor fails before loading
        offload = offload_config(offload, max_in_flight)
        if isinstance(pretrained, str) and pretrained in GROWN:
            if kwargs.get("tokenizer") is not None or kwargs.get("parallelize"):
                raise ValueError(f"psr_hf model arg pretrained={pretrained} (built in memory, with its own "
                                 "tokenizer on one device) takes neither tokenizer= nor parallelize=True")
            calibration = _existing_file("calibration", calibration)
            device = offload.device if offload is not None else kwargs.get("device")
            pretrained, kwargs["tokenizer"], calibration = grown_model(pretrained, device, kwargs.pop("dtype", None),
                                                                       calibration)
        else:
            pretrained, calibration = model_and_calibration(pretrained, calibration)
        self._psr_offload = offload
        if offload is not None:
            if kwargs.get("parallelize"):
                raise ValueError("psr_hf model args offload= and parallelize=True exclude each other: the offload "
                                 "puts every non-expert weight on one device and the experts in host memory")
            kwargs["device"] = "cpu"  # load on the host; the offload moves everything but the experts
        super().__init__(pretrained=pretrained, **kwargs)
        self.routing = routing
        self.calibration_path = calibration
        # real input lengths of the current loglikelihood requests, by their tokens without trailing zeros
        self._input_lengths: dict[tuple[int, int], set[int]] | None = None
        if offload is not None and getattr(self, "accelerator", None) is not None:
            # data parallel (accelerate launch): every process offloads to its own device
            offload = dataclasses.replace(offload, device=str(self.accelerator.device))
        head = gating.head
        if gating.distilled is not None:
            from ..gates.train import load_distilled

            # merging the adapters may return a new module: HFLM's model becomes it
            self._model, folder_head = load_distilled(self.model, gating.distilled)
            head = folder_head if folder_head is not None else head
            logger.info("psr_hf: distilled routing %s merged into the model%s", gating.distilled,
                        "" if folder_head is None else ", with its gate")
        patch(self.model, routing, calibration=calibration, offload=offload, predictor=loaded_predictor, gate=head)
        self.predictor_path = predictor_path
        self.gate_path, self.distilled_path = gating.path, gating.distilled
        ctl = controller(self.model)
        if ctl.offload is not None:
            self._device = ctl.offload.device
            logger.info("psr_hf: %s", ctl.memory())
        logger.info("psr_hf: %s routing, capacity %d of %d experts in %d MoE layers (top-%d), calibration %s%s",
                    routing.policy, ctl.capacity, ctl.num_experts, ctl.num_layers, ctl.top_k, calibration,
                    "" if self.gate_path is None else f", gate {self.gate_path}")
        self.engine = self._attach_engine(engine_max_len) if use_engine else None
        self._engine_generations = 0  # generate() calls of generate_until
        self._engine_generation_fallbacks = 0  # their forward calls that ran on the transformers path
        self._engine_fallback_reported = False
        self.block_config = self.drafter = None
        if spec is not None:
            self._attach_drafter(spec)

    # ------------------------------------------------------------------ speculative decoding
    def _attach_drafter(self, spec: SpeculativeArgs) -> None:
        """Load the drafter on the target's device in its dtype and fix the block selection: ``ValueError`` for a
        target whose routers block selection does not cover, a drafter of another vocabulary and a pool outside
        ``top_k .. num_experts``."""
        from transformers import AutoModelForCausalLM

        from ..hf.speculative import moe_routers
        from ..policy.blocks import BlockConfig
        from ..policy.calibration import Calibration

        ctl = controller(self.model)
        try:
            moe_routers(self.model)
        except ValueError as exc:
            raise ValueError(f"psr_hf model arg speculative={spec.mode}: {exc}") from None
        pool = ctl.capacity if spec.pool is None else spec.pool
        if not ctl.top_k <= pool <= ctl.num_experts:
            raise ValueError(f"psr_hf model arg pool={pool} must be between the model's top-K ({ctl.top_k}) and its "
                             f"{ctl.num_experts} experts per MoE layer")
        self.block_config = BlockConfig(mode=spec.mode, pool=pool, top_k=ctl.top_k, threshold=spec.threshold)
        device = next(self.model.parameters()).device
        self.drafter = AutoModelForCausalLM.from_pretrained(
            spec.drafter.location, dtype=self.model.dtype, **spec.drafter.from_pretrained_kwargs).to(device).eval()
        vocab = self.model.config.get_text_config().vocab_size
        drafter_vocab = self.drafter.config.get_text_config().vocab_size
        if drafter_vocab != vocab:
            raise ValueError(f"psr_hf model arg drafter={spec.drafter.name}: its vocabulary has {drafter_vocab} "
                             f"tokens, the target's {vocab}; a drafter must share the target's tokenizer")
        self.drafter_name = spec.drafter.name
        self.draft_tokens = spec.draft_tokens
        self._block_calibration = None if self.calibration_path is None else Calibration.load(
            self.calibration_path, num_layers=ctl.num_layers, num_experts=ctl.num_experts)
        self._speculative_counts = dict(generations=0, verifications=0, accepted=0, tokens=0, copies=0,
                                        prompt_copies=0)
        self._speculative_ignored: set[str] = set()
        logger.info("psr_hf: speculative decoding (%s blocks, pool %d of %d experts, %d drafts from %s) serves the "
                    "generate_until requests at batch 1", spec.mode, pool, ctl.num_experts, spec.draft_tokens,
                    spec.drafter.name)

    def _speculative_generate(self, context: torch.Tensor, max_length: int, stop: list[str] | None,
                              **generation_kwargs: Any) -> torch.Tensor:
        """HFLM's ``_model_generate`` contract on one row: ``[1, S + new]``, greedy; stops at the tokenizer's
        end-of-sequence token, after ``max_length - S`` new tokens, or after a block whose new text holds a stop
        string (HFLM cuts the text at the first one)."""
        from ..hf.speculative import speculative_generate

        mode = self.block_config.mode
        temperature = generation_kwargs.get("temperature") or 0.0
        if generation_kwargs.get("do_sample") or float(temperature) > 0:
            raise ValueError(f"psr_hf model arg speculative={mode} accepts drafts greedily; this task samples "
                             f"(do_sample={generation_kwargs.get('do_sample')}, temperature={temperature}): run it "
                             "without speculative= or with do_sample: false")
        mask = generation_kwargs.get("attention_mask")
        if context.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            raise ValueError(f"psr_hf speculative={mode} generates one unpadded row per call; got a batch of shape "
                             f"{tuple(context.shape)} (generate_until serves one request at a time)")
        ignored = set(generation_kwargs) - {"attention_mask", "do_sample", "temperature"} - self._speculative_ignored
        if ignored:
            self._speculative_ignored |= ignored
            logger.warning("psr_hf: speculative decoding is greedy and ignores the generation kwargs %s",
                           ", ".join(sorted(ignored)))
        strings = [s for s in (stop or []) if s]

        def stopped(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
            return any(s in text for s in strings)

        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            result = speculative_generate(
                self.model, self.drafter, context, self.block_config,
                max_new_tokens=int(max_length) - context.shape[1], draft_tokens=self.draft_tokens,
                calibration=self._block_calibration, eos_token_id=self.tokenizer.eos_token_id,
                stop=stopped if strings else None)
        counts = self._speculative_counts
        counts["generations"] += 1
        counts["verifications"] += result.verifications
        counts["accepted"] += sum(result.accepted)
        counts["tokens"] += len(result.tokens)
        counts["copies"] += sum(result.copies)
        counts["prompt_copies"] += result.prompt_copies
        new = torch.tensor([result.tokens], dtype=context.dtype, device=context.device)
        return torch.cat([context, new], dim=1)

    def speculative_stats(self) -> dict[str, Any] | None:
        """None without ``speculative=``; else the block selection (``mode``, ``pool``, ``threshold``), the
        ``drafter`` and ``draft_tokens``, and over every generation so far: ``generations``, ``verifications``
        (target forward passes of draft blocks), ``accepted`` drafts, committed ``tokens``, ``copies`` (host
        loads of the verifications over every layer), ``prompt_copies``, ``tau`` (tokens per verification
        before a stop cut a block short: ``accepted / verifications + 1``) and ``copies_per_token``."""
        if self.block_config is None:
            return None
        c = self._speculative_counts
        return {"mode": self.block_config.mode, "pool": self.block_config.pool,
                "threshold": self.block_config.threshold, "drafter": self.drafter_name,
                "draft_tokens": self.draft_tokens, **c,
                "tau": c["accepted"] / c["verifications"] + 1 if c["verifications"] else None,
                "copies_per_token": c["copies"] / c["tokens"] if c["tokens"] else None}

    # ------------------------------------------------------------------ the engine
    def _attach_engine(self, max_len: int | None) -> Any:
        """Attach the engine to the patched model: its KV cache holds ``max_len`` positions, default the harness's
        ``max_length`` (every generation request fits: lm-eval cuts the prompt to ``max_length - max_gen_toks``)
        capped at the engine's default of 4096; a longer sequence continues on the transformers path, which
        :meth:`generate_until` reports."""
        from ..engine.generate import DEFAULT_MAX_LEN, attach, attached

        if max_len is None:
            max_len = min(int(self.max_length), DEFAULT_MAX_LEN)
        try:
            attach(self.model, max_len=max_len)
        except ValueError as exc:
            raise ValueError(f"psr_hf model arg engine=true: {exc}") from None
        state = attached(self.model)
        if max_len < self.max_length:
            logger.warning("psr_hf: the engine's KV cache holds %d positions, the harness's max_length is %d: a "
                           "generation longer than %d tokens (prompt and new tokens) continues on the transformers "
                           "path (engine_max_len= raises it)", max_len, self.max_length, max_len)
        if self.batch_size_per_gpu != 1:
            logger.info("psr_hf: engine=true generates at batch 1; batch_size=%s applies to the loglikelihood "
                        "requests", self.batch_size_per_gpu)
        logger.info("psr_hf: the engine (%s, KV cache of %d positions) serves the generate_until requests",
                    type(state.decoder).__name__, max_len)
        return state

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
        if self.engine is None and self.block_config is None:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        # one request per generate() call: a single row without padding, which the engine and
        # speculative_generate serve
        batch_size, self.batch_size_per_gpu = self.batch_size_per_gpu, 1
        if self.engine is None:
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm)
            finally:
                self.batch_size_per_gpu = batch_size
        fallbacks, reasons = self.engine.fallbacks, set(self.engine.logged)
        try:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = batch_size
            missed = self.engine.fallbacks - fallbacks
            self._engine_generation_fallbacks += missed
            if missed and not self._engine_fallback_reported:
                self._engine_fallback_reported = True
                logger.warning("psr_hf: %d forward calls of the generations ran on the transformers path instead of "
                               "the engine (%s); the results count them in config.psr_hf.engine.generation_fallbacks",
                               missed, "; ".join(sorted(f"{what}: {why}" for what, why in self.engine.logged - reasons)) or "see the log of "
                               "psr_hf.engine.generate")

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
                        ) -> torch.Tensor:
        if self.block_config is not None:
            return self._speculative_generate(context, max_length, stop, **generation_kwargs)
        if self.engine is not None:
            self._engine_generations += 1
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _get_accelerate_args(self, *args: Any, **kwargs: Any) -> dict:
        if self._psr_offload is not None:  # the model loads on the host (data parallel included)
            return {"device_map": {"": "cpu"}, "max_memory": None}
        return super()._get_accelerate_args(*args, **kwargs)

    # ------------------------------------------------------------------ rolling loglikelihood
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        # lm-eval tokenizes each whole document and cuts it into windows of max_length itself, so transformers'
        # warning that a sequence is longer than the model's maximum length (indexing errors) does not apply here
        with _long_sequences_windowed(self.tokenizer):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    # ------------------------------------------------------------------ padding
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None) -> list:
        # HFLM builds each row as (context + continuation)[-(max_length + 1):][:-1], right-pads the batch with 0
        # and passes no attention mask; index those inputs so _model_call can tell pads from real zeros
        lengths: dict[tuple[int, int], set[int]] = {}
        for _, context, continuation in requests:
            inp = (context + continuation)[-(self.max_length + 1):][:-1]
            lengths.setdefault(_key(inp), set()).add(len(inp))
        self._input_lengths = lengths
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._input_lengths = None

    def _real_lengths(self, inps: torch.Tensor) -> list[int] | None:
        """Per row of a right-padded batch, its real length: the longest request input that the row's tokens
        match up to trailing zeros, or the whole row where no request matches; None when no row is padded. The
        row's own input is always a candidate, so a real token is never taken for padding (a real trailing 0
        stays real); at worst, where two inputs differ only in trailing zeros, a pad counts as real, which
        cannot change the row's decisions (they run in position order)."""
        if self._input_lengths is None or inps.ndim != 2:
            return None
        width = int(inps.shape[1])
        result = []
        for row in inps.tolist():
            candidates = [n for n in self._input_lengths.get(_key(row), ()) if n <= width]
            result.append(max(candidates) if candidates else width)
        return None if min(result) == width else result

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        lengths = self._real_lengths(inps) if attn_mask is None else None
        with contextlib.nullcontext() if lengths is None else controller(self.model).right_padded(lengths):
            if self.engine is None or attn_mask is not None:
                return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            return self._harness_call(inps)

    def _harness_call(self, inps: torch.Tensor) -> torch.Tensor:
        """HFLM's forward of the loglikelihood requests, with ``use_cache=False``: they need every position's logits
        and no cache, so the engine serves none of them, a one-token row included (the engine's wrapper passes the
        call to the patched transformers forward and drops the sequence it held)."""
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return self.model(inps, use_cache=False).logits

    def _detect_batch_size(self, requests: Any = None, pos: int = 0) -> int:
        # batch_size=auto probes memory with batches of ones: route them with the model's own routers, so the
        # probes never reach the routing state or the statistics
        with controller(self.model).bypassed():
            return super()._detect_batch_size(requests, pos)

    # ------------------------------------------------------------------ results
    def routing_stats(self) -> dict[str, Any]:
        """The routing config, the cache geometry and the statistics over every request so far."""
        ctl = controller(self.model)
        return {
            "routing": self.routing.to_dict(),
            "calibration": self.calibration_path,
            "predictor": self.predictor_path,
            "gate": self.gate_path,
            "distilled": self.distilled_path,
            "capacity": ctl.capacity,
            "num_experts": ctl.num_experts,
            "top_k": ctl.top_k,
            "moe_layers": ctl.num_layers,
            "stats": ctl.stats().total,
            **({} if ctl.offload is None else {"offload": ctl.stats().offload.to_dict(),
                                                "memory": ctl.memory().to_dict()}),
            "engine": self.engine_stats(),
            "speculative": self.speculative_stats(),
        }

    def engine_stats(self) -> dict[str, Any] | None:
        """None without ``engine=true``; else which implementation generated: the decoder (``Decoder``: eager,
        ``GraphDecoder``: CUDA graphs) and its KV cache positions (``max_len``), the ``generate()`` calls of the
        generation requests, those the engine's own decoding loop ran (``loop_calls``), the forward calls the engine
        ``served`` (its loop's prompts and tokens included), every forward that ran on the transformers
        path (``fallbacks``: the loglikelihood batches too), those of the generations (``generation_fallbacks``:
        0 when the engine generated everything) and the engine's reasons for them."""
        if self.engine is None:
            return None
        return {"decoder": type(self.engine.decoder).__name__, "max_len": self.engine.max_len,
                "generate_calls": self._engine_generations, "loop_calls": self.engine.loop_calls,
                "served": self.engine.served,
                "fallbacks": self.engine.fallbacks, "generation_fallbacks": self._engine_generation_fallbacks,
                "fallback_reasons": sorted(self.engine.logged)}

    def get_model_info(self) -> dict:
        """HFLM's model info plus ``psr_hf``: :meth:`routing_stats` (lm-eval stores it in the results JSON under
        ``config``, after the evaluation)."""
        info = super().get_model_info()
        info["psr_hf"] = self.routing_stats()
        s = info["psr_hf"]["stats"]
        logger.info("psr_hf routing stats: %d tokens in %d sequences, %.3f copies per token (%.3f demand, %.3f "
                    "prefetch), %.3f replaced per token, displaced mass %.4f", s["tokens"], s["sequences"],
                    s["copies_per_token"], s["demand_per_token"], s["prefetch_per_token"],
                    s["replaced_per_token"], s["displaced_mass"])
        e = info["psr_hf"]["engine"]
        if e is not None:
            logger.info("psr_hf engine: %d generate() calls, %d forward calls served by the engine (%s), %d of the "
                        "generations' forward calls on the transformers path", e["generate_calls"], e["served"],
                        e["decoder"], e["generation_fallbacks"])
        sp = info["psr_hf"]["speculative"]
        if sp is not None and sp["verifications"]:
            logger.info("psr_hf speculative (%s, pool %d): %d tokens in %d generations, %d verifications (tau "
                        "%.2f), %.3f copies per token, %d prompt copies", sp["mode"], sp["pool"], sp["tokens"],
                        sp["generations"], sp["verifications"], sp["tau"], sp["copies_per_token"],
                        sp["prompt_copies"])
        return info
