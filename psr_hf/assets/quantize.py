"""Write a bf16 or float32 model folder as the fine-grained FP8 checkpoint that DeepSeek-V3 and Qwen3.6 ship, and
read one back dequantized (docs/quantized.md).

Each quantized ``X.weight`` ([out, in]) becomes ``float8_e4m3fn`` beside ``X.weight_scale_inv`` (float32,
[ceil(out/128), ceil(in/128)]): the multiplier of its 128x128 block, ``amax(|block|) / 448``, so that
``w ~= fp8.float() * scale_inv`` expanded over the block (an all-zero block gets 1 and dequantizes to exact zeros);
the arithmetic is in :mod:`.fp8_blocks`, which the offload's FP8 store shares.
The tensor names are the source's: transformers' ``save_pretrained`` writes one 2-D matrix per expert
(``mlp.experts.{e}.gate_proj.weight``), as the official releases store them. What stays in its own dtype, as those
releases keep it: :func:`kept_reason`. ``config.json`` gains the ``quantization_config`` transformers reads.

On a machine without a GPU, transformers 5 dequantizes such a checkpoint on load but infers each block's size from
the weight's and the scale's shapes, which is wrong for a matrix with a partial block (a dimension above 128 and
not a multiple of it): :func:`load_fp8_dequantized` dequantizes with the checkpoint's own block size instead.
The library logs, never prints.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .fp8_blocks import BLOCK, dequantize_blocks, quantize_blocks
from .grow import _usual_modes

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the dtypes a source tensor may have (safetensors' names); anything else is refused before a byte is written
SOURCE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_DELTANET = ("conv1d", "in_proj_a", "in_proj_b", "in_proj_ba")


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_checkpoint` wrote: ``quantized`` weights (each with its scale tensor), ``kept`` tensors
    by the reason they stayed (:func:`kept_reason`), the tensors' bytes before and after (scales included), and
    the ``modules_to_not_convert`` written to the config."""

    src: Path
    dst: Path
    quantized: int
    kept: Mapping[str, int]
    bytes_before: int
    bytes_after: int
    modules_to_not_convert: tuple[str, ...] = ()


def kept_reason(name: str, ndim: int) -> str | None:
    """Why the tensor ``name`` (a checkpoint name, ``ndim`` dimensions) stays in its own dtype, or None when it is
    quantized: every 2-D linear weight is (attention, dense MLPs, shared and routed experts) except those the
    official FP8 releases keep: embeddings and the output head (the first and last rounding of every token), norms,
    routers and shared-expert gates (small, and routing decisions flip on small changes), Gated DeltaNet's conv1d,
    ``A_log``, ``dt_bias`` and its per-head ``in_proj_a``/``in_proj_b`` (``in_proj_ba``), the vision tower, and
    every bias or other tensor that is not a 2-D weight (DeepSeek-V3's ``e_score_correction_bias`` among them)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    last = parts[-1]
    if "visual" in parts:
        return "vision tower"
    if "embed" in last or last == "lm_head":
        return "embeddings and output head"
    if "norm" in last:
        return "norms"
    if last in ("gate", "shared_expert_gate"):
        return "routers and shared-expert gates"
    if last in _DELTANET or leaf in ("A_log", "dt_bias"):
        return "Gated DeltaNet's conv1d, A_log, dt_bias and a/b projections"
    if leaf != "weight" or ndim != 2:
        return "biases and other tensors that are not 2-D weights"
    return None


def scale_name(name: str) -> str:
    """The scale tensor's name of the quantized weight ``name``: ``X.weight`` -> ``X.weight_scale_inv``."""
    return name + "_scale_inv"


# ---------------------------------------------------------------------------------------------------- the source
def weight_shards(folder: Path) -> list[str]:
    """The safetensors files of a model folder's weights (from its index where it has one); ``ValueError`` saying
    how to get them where there are none."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    if (folder / SINGLE).is_file():
        return [SINGLE]
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.safetensors"))
    found = f" (found {', '.join(others)})" if others else ""
    raise ValueError(f"{folder}: no safetensors weights ({SINGLE} or {INDEX}){found}; load the model with "
                     "transformers and save it with save_pretrained(), which writes them, then quantize that folder")


def _check_source(folder: Path, config: Mapping[str, Any], shards: Sequence[str]) -> None:
    """Refuse an already quantized model, a dtype quantize does not read and fused 3-D experts, before writing."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method:
        raise ValueError(f"{folder} is already quantized (quantization_config quant_method {method!r}); give the "
                         "bfloat16 or float32 model it was made from")
    for shard in shards:
        with safe_open(folder / shard, framework="pt") as f:
            for name in f.keys():
                info = f.get_slice(name)
                dtype, shape = info.get_dtype(), info.get_shape()
                if dtype not in SOURCE_DTYPES:
                    already = " (an FP8 tensor: the model is already quantized)" if dtype.startswith("F8") else ""
                    raise ValueError(f"{folder}: tensor {name} is {dtype}{already}; quantize reads "
                                     f"{', '.join(SOURCE_DTYPES.values())} weights: give the model in one of those")
                if len(shape) == 3 and ".experts." in f".{name}":
                    raise ValueError(f"{folder}: tensor {name} holds every expert fused ({shape}); the FP8 format "
                                     "stores one 2-D matrix per expert: load the model with transformers and save "
                                     "it with save_pretrained(), which writes one per expert, then quantize that")


# ---------------------------------------------------------------------------------------------------- writing
def _quantize_shard(path: Path, block: Sequence[int], report: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of one shard, quantized or kept; ``report`` gathers counts, bytes and the kept modules."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            report["bytes_before"] += tensor.nbytes
            reason = kept_reason(name, tensor.ndim)
            if reason is None:
                if not torch.isfinite(tensor).all():
                    raise ValueError(f"{path}: tensor {name} holds inf or NaN; FP8 cannot hold it: fix the model")
                out[name], out[scale_name(name)] = quantize_blocks(tensor, block)
                report["quantized"] += 1
            else:
                out[name] = tensor
                report["kept"][reason] += 1
                if name.endswith(".weight") and tensor.ndim == 2:
                    report["modules"].append(_unconverted_module(name))
    report["bytes_after"] += sum(t.nbytes for t in out.values())
    return out


def _unconverted_module(name: str) -> str:
    """The module name ``modules_to_not_convert`` lists for a kept 2-D weight (the vision tower as one prefix)."""
    parts = name.split(".")[:-1]
    return ".".join(parts[: parts.index("visual") + 1]) if "visual" in parts else ".".join(parts)


def quantization_config(block: Sequence[int], modules_to_not_convert: Sequence[str]) -> dict[str, Any]:
    """The ``quantization_config`` of the official fine-grained FP8 releases, with the modules kept unquantized
    (``lm_head`` always: a tied head is no tensor of its own, but still a linear layer transformers would
    convert)."""
    modules = list(dict.fromkeys(["lm_head", *modules_to_not_convert]))
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])], "modules_to_not_convert": modules}


def _check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty folder; choose a new or empty folder (quantize "
                         "overwrites nothing)")


def _write(src: Path, dst: Path, config: dict[str, Any], shards: Sequence[str],
           block: Sequence[int]) -> dict[str, Any]:
    """Write the shards, the index, the config and the other files into ``dst``; the counts of what was written."""
    report: dict[str, Any] = {"quantized": 0, "kept": Counter(), "bytes_before": 0, "bytes_after": 0, "modules": []}
    weight_map: dict[str, str] = {}
    for shard in shards:
        tensors = _quantize_shard(src / shard, block, report)
        save_file(tensors, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    if (src / INDEX).is_file():
        index = {"metadata": {"total_size": report["bytes_after"]}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = {**config, "quantization_config": quantization_config(block, report["modules"])}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in {*shards, INDEX, "config.json"}:
            shutil.copy2(path, dst / path.name)
    _usual_modes(dst)
    report["modules"] = config["quantization_config"]["modules_to_not_convert"]
    return report


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, block: Sequence[int] = BLOCK) -> QuantizeReport:
    """Write the model folder ``src_dir`` (bf16/fp16/float32 safetensors) to ``dst_dir`` (new or empty) in the
    fine-grained FP8 format with ``block`` (rows, columns) scales: the same shard files and tensor names, a scale
    beside each quantized weight, an updated index where the source had one, ``config.json`` with its
    ``quantization_config`` (its dtype unchanged) and every other file of the folder copied (tokenizer, generation
    config, a calibration measured on the source's weights). ``ValueError`` naming the problem and the fix for a
    folder without safetensors weights, an already quantized model, an unsupported dtype, fused experts or a
    weight holding inf or NaN; the first four before anything is written, the last with the folder removed."""
    src, dst = Path(src_dir).expanduser(), Path(dst_dir).expanduser()
    if len(block) != 2 or any(int(b) != b or b < 1 for b in block):
        raise ValueError(f"block={tuple(block)}: give two positive integers (rows, columns), e.g. (128, 128)")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: not a model folder (no config.json); give a transformers model folder")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    shards = weight_shards(src)
    _check_source(src, config, shards)
    _check_destination(dst)
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        report = _write(src, dst, config, shards, block)
    except BaseException:
        for path in dst.iterdir():  # only files: what _write writes into a folder that was new or empty
            path.unlink()
        if created:
            dst.rmdir()
        raise
    result = QuantizeReport(src, dst, report["quantized"], dict(report["kept"]), report["bytes_before"],
                            report["bytes_after"], tuple(report["modules"]))
    logger.info("quantized %s to %s: %d weights to FP8, %d tensors kept; %d -> %d bytes", src, dst,
                result.quantized, sum(result.kept.values()), result.bytes_before, result.bytes_after)
    return result


# ---------------------------------------------------------------------------------------------------- reading
def is_fp8_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder``'s config.json says fine-grained FP8 (``quantization_config.quant_method == "fp8"``)."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        return False
    quantization = json.loads(path.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == "fp8"


def read_dequantized(folder: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the FP8 checkpoint ``folder`` by its checkpoint name: the quantized weights dequantized to
    ``dtype`` with the config's ``weight_block_size``, the scales dropped, the kept tensors as stored."""
    folder = Path(folder).expanduser()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"{folder}: not a fine-grained FP8 checkpoint (config.json has no quantization_config "
                         "with quant_method 'fp8'); load it with from_pretrained")
    block = tuple(quant.get("weight_block_size") or BLOCK)
    tensors: dict[str, torch.Tensor] = {}
    for shard in weight_shards(folder):
        with safe_open(folder / shard, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(scale_name(name))
        out[name] = tensor if scale is None else dequantize_blocks(tensor, scale, block, dtype)
    return out


def load_fp8_dequantized(folder: str | Path, dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> Any:
    """The model ``AutoModelForCausalLM.from_pretrained(folder)`` gives (the text model of a composite config), with
    every weight of the FP8 checkpoint ``folder`` dequantized (:func:`read_dequantized`) and held in ``dtype``, in
    eval mode, with the folder's generation config and the folder as its ``name_or_path`` (as ``from_pretrained``
    sets it, so that an offload finds the checkpoint: ``OffloadConfig(expert_format="auto")`` keeps the experts in
    FP8); ``kwargs`` go to ``from_pretrained``. Right for every block, where transformers' own CPU load misplaces
    the scales of partial blocks."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, GenerationConfig

    folder = Path(folder).expanduser()
    state = read_dequantized(folder, dtype)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    del config.quantization_config
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{folder}: transformers has no causal LM class for model_type {config.model_type!r}; "
                         "give a checkpoint of a causal language model")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if getattr(cls, "config_class", None) is config.sub_configs.get("text_config"):
        config = config.get_text_config()  # what AutoModelForCausalLM hands the text class of a composite model
    model = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype, **kwargs)
    model.name_or_path = model.config.name_or_path = str(folder)  # from_pretrained(None) leaves "None"
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
