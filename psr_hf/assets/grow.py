"""Grow a small trained MoE model to real-size dimensions, exactly: an upcycle that computes the same function.

Latency benchmarks need trained routing *and* real-size experts. :func:`grow` builds a model of a target's
dimensions (:class:`GrowTarget`; presets :data:`OLMOE_1B_7B`, :data:`MOONLIGHT_16B_A3B`,
:data:`QWEN3_6_35B_A3B`) whose every real dimension computes what the small model's did: padded rows and columns
are zero and every norm, scale and rotary frequency is mapped; layers, experts, top-k, router options and
vocabulary are the small model's, so it routes identically (up to floating-point rounding). Linear layers,
embeddings, lm_head and routers: the small block at the mapped positions. Fused experts: gate rows ``i -> i``, up
rows ``I + i -> I' + i`` (a padded unit gives ``act(0) * 0 = 0``). The hidden-size norms read the unscaled
residual stream, so the grown ``rms_norm_eps`` is ``eps / r_hidden`` (the RMSNorm rule:
:meth:`~psr_hf.assets.grow_families.base.Filler.norm`), except for a family whose other norms share that epsilon
(Qwen3.5/3.6), which keeps it and scales the residual stream by ``sqrt(r_hidden)`` instead. Extra query heads
have zero q rows and o_proj columns; only RoPE types whose frequencies do not depend on the head size are mapped.
A family's attention and config fields: its module in :mod:`psr_hf.assets.grow_families`. Anything that cannot
be mapped exactly raises ``ValueError`` naming it. Page: docs/models.md. The library logs, never prints.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .grow_families import grow_family, grow_model_types
from .grow_families.base import DIM_FIELDS, Dims, Filler, GrowFamily, GrowTarget, norm_input_scale
from .grow_families.deepseek_v3 import MOONLIGHT_16B_A3B
from .grow_families.olmoe import OLMOE_1B_7B
from .grow_families.qwen3_5_moe import QWEN3_6_35B_A3B

__all__ = ["GrowTarget", "OLMOE_1B_7B", "MOONLIGHT_16B_A3B", "QWEN3_6_35B_A3B", "PRESETS", "target_by_name", "default_target", "grow",
           "grow_pretrained"]

logger = logging.getLogger(__name__)

# RoPE types whose frequencies do not depend on the size of the head dimension
_ROPE_TYPES = ("default", "linear")
# files beside a model's weights that grow_pretrained copies (the tokenizer's, and a calibration: the grown model
# routes exactly as the small one, so the small model's calibration is the grown model's)
_COPIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
           "tokenizer.model", "spiece.model", "chat_template*", "tokenization_*.py", "calibration.safetensors")


# ---------------------------------------------------------------------------------------------------- targets
class _Presets(Mapping[str, GrowTarget]):
    """Every grow family's preset by name, in listing order, read from the registry on each use (so a family
    module added to the package's path is seen)."""

    def _all(self) -> dict[str, GrowTarget]:
        targets = (grow_family(model_type).preset for model_type in grow_model_types())
        return {t.name: t for t in targets}

    def __getitem__(self, name: str) -> GrowTarget:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


#: the presets by name
PRESETS: Mapping[str, GrowTarget] = _Presets()


def target_by_name(name: str) -> GrowTarget:
    """The preset called ``name`` (``olmoe-1b-7b``, ``moonlight-16b-a3b``; case-insensitive); ``ValueError``
    listing the known names otherwise."""
    key = str(name).strip().lower()
    presets = dict(PRESETS)
    if key in presets:
        return presets[key]
    close = difflib.get_close_matches(key, list(presets), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ValueError(f"no grow target {name!r}; known targets: {', '.join(presets)}{hint}")


def default_target(config: Any) -> GrowTarget:
    """The preset of a model's family: ``olmoe`` -> :data:`OLMOE_1B_7B`, ``deepseek_v3`` ->
    :data:`MOONLIGHT_16B_A3B`, ``qwen3_5_moe_text`` -> :data:`QWEN3_6_35B_A3B`. ``config``: a transformers config, a ``config.json`` dict or a model type."""
    model_type = config if isinstance(config, str) else (
        config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None))
    family = grow_family(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"grow has no target for model type {model_type!r}; it grows "
                         + ", ".join(f"{t} (to {grow_family(t).preset.name})" for t in grow_model_types()))
    return family.preset


# ---------------------------------------------------------------------------------------------------- checks
def _check_model(model: Any) -> tuple[str, GrowFamily]:
    """The model's family and its mapping; ``ValueError`` for a model grow cannot grow."""
    from . import check_supported

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"grow needs a transformers model (with .config); got {type(model).__name__}")
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    check_supported(name, config.to_dict())  # names a non-MoE model as such
    family = grow_family(config.model_type)
    if family is None:
        types = grow_model_types()
        shapes = " and ".join(grow_family(t).model_name for t in types)
        raise ValueError(f"grow cannot grow model type {config.model_type!r} ({type(model).__name__}); it maps "
                         f"{', '.join(types)} exactly ({shapes} shapes)")
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm")
    if getattr(model, "lm_head", None) is None or not all(hasattr(inner, a) for a in parts):
        raise ValueError(f"grow needs the causal LM class of {config.model_type} (with .model and .lm_head); got "
                         f"{type(model).__name__}: load it with AutoModelForCausalLM")
    return config.model_type, family


def _check_rope(config: Any, rotary_grows: bool) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, Mapping) else None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (config.rope_parameters={params!r}): its frequencies depend on the "
                         f"head dimension's size, so a grown head cannot keep them exactly; grow maps "
                         f"{', '.join(_ROPE_TYPES)} RoPE only")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if rotary_grows and factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={factor}: grow maps RoPE over the whole head dimension only where "
                         "the head dimension grows (keep the model's head dimension in the target)")


def _check_target(family: str, mapping: GrowFamily, small: Dims, big: Dims, target: GrowTarget,
                  config: Any) -> None:
    if target.family != family:
        raise ValueError(f"grow target {target.name!r} is for {target.family} models; this model is {family} "
                         f"(its preset is {default_target(family).name})")
    smaller = [f"{DIM_FIELDS[k]}={getattr(big, k)} < the model's {getattr(small, k)}"
               for k in DIM_FIELDS if getattr(small, k) is not None and getattr(big, k) is not None
               and getattr(big, k) < getattr(small, k)]
    if smaller:
        raise ValueError(f"grow target {target.name!r} is smaller than the model: {'; '.join(smaller)}; a target "
                         "must be at least as large as the model in every dimension")
    if (small.q_lora is None) != (big.q_lora is None):
        raise ValueError(f"grow target {target.name!r} has q_lora_rank={big.q_lora}, the model {small.q_lora}: a "
                         "query LoRA cannot be added or removed exactly (the RMSNorm inside it is not linear); use "
                         f"q_lora_rank={'None' if small.q_lora is None else '>= ' + str(small.q_lora)}")
    mapping.check_model(small)
    mapping.check_growth(small, big)
    rotary, what = (getattr(small, mapping.rotary), getattr(big, mapping.rotary)), DIM_FIELDS[mapping.rotary]
    if rotary[1] % rotary[0]:
        raise ValueError(f"grow target {target.name!r}: {what}={rotary[1]} must be a multiple of the model's "
                         f"{rotary[0]} (each rotary pair moves to a pair of the same frequency)")
    g_small, g_big = small.heads // small.kv_heads, big.heads // big.kv_heads
    if g_small % g_big:
        raise ValueError(f"grow target {target.name!r}: {g_big} query heads per key/value head, the model {g_small}; "
                         "the model's must be a multiple of the target's (key/value heads can be repeated, not merged)")
    _check_rope(config, rotary[1] != rotary[0])


# ---------------------------------------------------------------------------------------------------- filling
def _experts(fill: Filler, big: Any, small: Any, I_small: int, I_big: int, hid: Any) -> None:
    """Fused experts ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]`` (stored
    transposed where the experts class says ``is_transposed``)."""
    if getattr(small, "has_gate", True) is False:
        raise ValueError(f"grow: {type(small).__name__} has no gate projection; grow maps gated experts only")
    transposed = bool(getattr(small, "is_transposed", False))
    gate_up = torch.cat((torch.arange(I_small), I_big + torch.arange(I_small)))
    rows_cols = lambda rows, cols: (None, cols, rows) if transposed else (None, rows, cols)  # noqa: E731
    fill.put(big.gate_up_proj, small.gate_up_proj, rows_cols(gate_up, hid))
    fill.put(big.down_proj, small.down_proj, rows_cols(hid, None), fill.stream_scale)
    for name, rows in (("gate_up_proj_bias", gate_up), ("down_proj_bias", hid)):
        if getattr(small, name, None) is not None:
            fill.put(getattr(big, name), getattr(small, name), (None, rows),
                     fill.stream_scale if name == "down_proj_bias" else 1.0)



def _grown_config(small_config: Any, mapping: GrowFamily, s: Dims, b: Dims, r_hidden: float,
                  dtype: torch.dtype) -> Any:
    """The grown model's config: the small one's with the target's dimensions, the norms' epsilon of the family
    (:meth:`GrowFamily.grown_epsilon`: the small one's divided by the hidden ratio by default), and the family's
    fields (:meth:`GrowFamily.update_config`)."""
    data = small_config.to_dict()
    data.update(hidden_size=b.hidden, num_attention_heads=b.heads, num_key_value_heads=b.kv_heads,
                rms_norm_eps=mapping.grown_epsilon(small_config.rms_norm_eps, r_hidden),
                dtype=str(dtype).removeprefix("torch."))
    mapping.update_config(data, s, b)
    return type(small_config).from_dict(data)


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _expert_bytes(model: torch.nn.Module) -> tuple[int, str]:
    """Bytes of one routed expert (gate, up, down) and the experts' dtype."""
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            E = experts.gate_up_proj.shape[0]
            total = experts.gate_up_proj.numel() + experts.down_proj.numel()
            dtype = str(experts.gate_up_proj.dtype).removeprefix("torch.")
            return total // E * experts.gate_up_proj.element_size(), dtype
    return 0, "?"


@torch.no_grad()
def grow(model: torch.nn.Module, target: GrowTarget | str | None = None, *, device: Any = None,
         dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A new model of ``target``'s dimensions that computes ``model``'s function (module docstring); ``model``
    is not changed.

    Args:
        model: the small model: the causal LM of a family with a grow mapping (``OlmoeForCausalLM``,
            ``DeepseekV3ForCausalLM``: native classes).
        target: a :class:`GrowTarget`, a preset's name, or None: the preset of the model's family
            (:func:`default_target`).
        device: where to build the grown model (default: the small model's, read from its embedding). It is
            built directly there with no random initialisation, so a real-size bfloat16 model can be built on a
            GPU.
        dtype: the grown model's dtype (default: the small model's). Values are computed in float32 per tensor
            and cast.

    Returns the grown model in eval mode. ``ValueError`` naming the problem for a model or target that cannot be
    grown exactly (not a Mixture of Experts, another family, a target smaller in some dimension, a head
    dimension that is not a multiple, a RoPE type whose frequencies depend on the head size, ...).

    Precision: in float32 the grown model reproduces the small one up to rounding (tiny-moe grown to
    OLMoE-1B-7B's dimensions on an H200: logits within 1.2e-5 of logits up to 20, every selected expert the
    same). In bfloat16 the two models round their activations differently (other matrix shapes): about 3% of
    token-layer selections differed there, as many as between the small model in bfloat16 and in float32.
    Compare routing decisions of a grown model with its small model's in float32.
    """
    from transformers.initialization import no_init_weights

    family, mapping = _check_model(model)
    if target is None:
        target = default_target(family)
    elif isinstance(target, str):
        target = target_by_name(target)
    elif not isinstance(target, GrowTarget):
        raise ValueError(f"target must be a GrowTarget, a preset name ({', '.join(PRESETS)}) or None; got "
                         f"{type(target).__name__}")
    config = model.config
    s, b = mapping.dims(config), Dims.of_target(target)
    _check_target(family, mapping, s, b, target, config)
    embed = model.model.embed_tokens.weight
    device = torch.device(device) if device is not None else embed.device
    dtype = dtype or embed.dtype
    r_hidden = b.hidden / s.hidden

    big_config = _grown_config(config, mapping, s, b, r_hidden, dtype)
    with torch.device(device), no_init_weights():
        big = type(model)._from_config(big_config, dtype=dtype,
                                       attn_implementation=getattr(config, "_attn_implementation", None))
    if getattr(model, "generation_config", None) is not None:
        big.generation_config = copy.deepcopy(model.generation_config)

    # the residual stream's scale: 1 where the hidden norms' epsilon shrank with the hidden ratio, sqrt(ratio)
    # where the family kept it (the norms over the hidden size then read a stream scaled to match)
    fill = Filler(norm_input_scale(r_hidden, config.rms_norm_eps, big_config.rms_norm_eps))
    hid = None  # hidden dimensions keep their positions: the first s.hidden of b.hidden
    if big.lm_head.weight is big.model.embed_tokens.weight and fill.stream_scale != 1.0:
        raise ValueError("grow: tied embeddings with a scaled residual stream cannot be mapped exactly (the "
                         "embeddings write the stream, lm_head reads the normed output)")
    fill.put(big.model.embed_tokens.weight, model.model.embed_tokens.weight, (None, hid), fill.stream_scale)
    if big.lm_head.weight is not big.model.embed_tokens.weight:
        fill.put(big.lm_head.weight, model.lm_head.weight, (None, hid))

    def hidden_norm(big_norm: Any, small_norm: Any) -> None:
        if fill.norm(big_norm, small_norm, hid, r_hidden, zero_centred=mapping.zero_centred_norms) != \
                fill.stream_scale:
            raise ValueError(f"grow: {type(small_norm).__name__} over the hidden size does not use "
                             "config.rms_norm_eps; its epsilon cannot be matched without scaling the residual stream")

    hidden_norm(big.model.norm, model.model.norm)
    for index, (bl, sl) in enumerate(zip(big.model.layers, model.model.layers, strict=True)):
        hidden_norm(bl.input_layernorm, sl.input_layernorm)
        hidden_norm(bl.post_attention_layernorm, sl.post_attention_layernorm)
        mapping.token_mixer(fill, bl, sl, s, b, config)
        big_mlp, small_mlp = bl.mlp, sl.mlp
        if hasattr(small_mlp, "experts"):
            router_small, router_big = small_mlp.gate, big_mlp.gate
            fill.put(router_big.weight, router_small.weight, (None, hid))
            for name in ("bias", "e_score_correction_bias"):
                if getattr(router_small, name, None) is not None:
                    fill.put(getattr(router_big, name), getattr(router_small, name), (None,))
            _experts(fill, big_mlp.experts, small_mlp.experts, s.expert, b.expert, hid)
            shared = getattr(small_mlp, "shared_experts", None)
            if shared is not None:
                fill.mlp(big_mlp.shared_experts, shared, hid)
            else:
                mapping.shared_expert(fill, big_mlp, small_mlp, hid)
        elif hasattr(small_mlp, "gate_proj"):
            fill.mlp(big_mlp, small_mlp, hid)
        else:
            raise ValueError(f"grow: decoder layer {index}'s {type(small_mlp).__name__} is neither an MoE block "
                             "nor a gate/up/down MLP")

    # every parameter and saved buffer was written (a new tensor in another transformers version is named here)
    persistent = set(big.state_dict(keep_vars=True))
    missed = [name for name, t in [*big.named_parameters(), *big.named_buffers()]
              if name in persistent and id(t) not in fill.filled]
    if missed:
        raise ValueError(f"grow does not know how to map {', '.join(missed[:5])}"
                         f"{' ...' if len(missed) > 5 else ''} ({type(model).__name__} of this transformers version)")
    _check_rotary(big, model, b, s, mapping.rotary)

    before, after = _param_count(model), _param_count(big)
    small_bytes, _ = _expert_bytes(model)
    big_bytes, expert_dtype = _expert_bytes(big)
    logger.info("grew %s %s -> %s: %s -> %s parameters; one routed expert %.3f MB -> %.2f MB (%s); hidden norms' "
                "eps %.3g -> %.3g", family, type(model).__name__, target.name, f"{before:,}", f"{after:,}",
                small_bytes / 1e6, big_bytes / 1e6, expert_dtype, config.rms_norm_eps, big_config.rms_norm_eps)
    return big.eval()


def _check_rotary(big: Any, small: Any, b: Dims, s: Dims, rotary: str) -> None:
    """The grown model's rotary frequencies at the mapped pairs are the small model's (a backstop for the RoPE
    rules: a rope type whose frequencies depend on the head size fails here)."""
    small_rot, big_rot = small.model.rotary_emb, big.model.rotary_emb
    f = getattr(b, rotary) // getattr(s, rotary)
    ours = big_rot.inv_freq.detach().float().cpu()[::f]
    theirs = small_rot.inv_freq.detach().float().cpu()
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-6, atol=0) or \
            float(getattr(big_rot, "attention_scaling", 1.0)) != float(getattr(small_rot, "attention_scaling", 1.0)):
        raise ValueError("grow: the grown model's rotary frequencies are not the small model's at the mapped pairs "
                         f"(rope parameters {big.config.rope_parameters!r})")


# ---------------------------------------------------------------------------------------------------- on disk
def _usual_modes(folder: Path) -> None:
    """Give the files in ``folder`` the mode a new file gets under the user's umask (safetensors writes its file
    through a private temporary file, mode 0600, which other users of a shared model folder could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def grow_pretrained(src_dir: str | Path, out_dir: str | Path, target: GrowTarget | str | None = None, *,
                    dtype: torch.dtype = torch.bfloat16, device: Any = "cpu") -> Path:
    """Load the model directory ``src_dir``, grow it to ``target`` (default: its family's preset) and save it to
    ``out_dir`` (``save_pretrained``: safetensors), with the tokenizer's files, the calibration
    (``calibration.safetensors``, where there is one: routing is unchanged, so it applies) and
    ``grown_from.json`` (the source, the target and both models' dimensions). Returns ``out_dir``.

    ``out_dir`` must be new or empty (nothing is overwritten)."""
    from transformers import AutoModelForCausalLM

    src, out = Path(src_dir).expanduser(), Path(out_dir).expanduser()
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a model directory (no config.json); give a transformers model directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new or empty directory "
                         "(grow overwrites nothing)")
    if isinstance(target, str):
        target = target_by_name(target)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", local_files_only=True).eval()
    target = target or default_target(model.config)
    big = grow(model, target, device=device, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    big.save_pretrained(out)
    copied = []
    for pattern in _COPIED:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)
                copied.append(path.name)
    record = {
        "source": str(src.resolve()),
        "target": target.name,
        "target_dims": target.dims(),
        "source_dims": dataclasses.asdict(grow_family(model.config.model_type).dims(model.config)),
        "model_type": model.config.model_type,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters_before": _param_count(model),
        "parameters_after": _param_count(big),
        "copied": copied,
        "rms_norm_eps": {"source": model.config.rms_norm_eps, "grown": big.config.rms_norm_eps},
    }
    (out / "grown_from.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    _usual_modes(out)
    logger.info("saved the grown model to %s (copied %s)", out, ", ".join(copied) or "no tokenizer files")
    return out
