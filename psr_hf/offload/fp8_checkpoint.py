"""The fine-grained FP8 checkpoint a model was loaded from (transformers' ``quant_method: fp8``, the format of
DeepSeek-V3's and Qwen3.6's FP8 releases and of ``psr-hf quantize``): whether an offload reads its routed experts
(:func:`fp8_checkpoint_for`, the one decision of ``OffloadConfig.expert_format``), and those experts as stored,
e4m3 weights with their block scales, read from the safetensors files themselves (:class:`Fp8Checkpoint`).

The files, not the model, because transformers dequantizes an FP8 checkpoint to bf16 when it loads it on a CPU
(and drops ``quantization_config`` from the model's config): the FP8 bytes exist only on disk. The routed experts
are stored one tensor per expert and projection, as transformers' ``save_pretrained`` and the releases write them:
``<prefix>.experts.<e>.{gate,up,down}_proj.weight`` (float8_e4m3fn) with ``...weight_scale_inv`` (float32). They are
read into transformers' fused layout, the names and shapes of its FP8 experts modules (:func:`fused_parts`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..assets.fp8_blocks import BLOCK, FP8_DTYPE, scale_shape

if TYPE_CHECKING:
    from torch import nn

    from .config import OffloadConfig

logger = logging.getLogger(__name__)

QUANT_METHOD = "fp8"
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<kind>weight|weight_scale_inv)$")
_LAYER_TAIL = re.compile(r"(?:^|\.)(layers\.\d+\..+)$")
_FALLBACK = ("or offload the model's own (dequantized) weights with OffloadConfig(expert_format='model')")
_FALLBACK_DENSE = "or let the engine compute with the model's own weights (dense_fp8=False)"


def _plain(config: Any) -> dict | None:
    """A quantization config as a dict (transformers keeps an object on a loaded model, a dict in config.json)."""
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {"quant_method": getattr(config, "quant_method", None)}


def _method(config: dict | None) -> str | None:
    method = None if config is None else config.get("quant_method")
    return None if method is None else str(getattr(method, "value", method)).lower()


def checkpoint_folder(model: nn.Module, explicit: str | None) -> Path | None:
    """The folder of the checkpoint ``model`` was loaded from: ``explicit`` (``OffloadConfig.checkpoint``, which
    must exist), else the model's ``name_or_path`` where it is a folder or a hub id already in the local hub cache
    (nothing is downloaded); None where none is found."""
    if explicit is not None:
        folder = Path(explicit).expanduser()
        if not folder.is_dir():
            raise ValueError(f"OffloadConfig(checkpoint={explicit!r}): no such folder; name the folder of the FP8 "
                             "checkpoint the model was loaded from (its config.json and *.safetensors)")
        return folder
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not isinstance(source, str) or not source:
        return None
    if os.path.isdir(source):
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # not a hub id, or not in the cache: the caller says what to pass
        return None


def _folder_quantization(folder: Path | None) -> dict | None:
    path = None if folder is None else folder / "config.json"
    if path is None or not path.is_file():
        return None
    with open(path) as f:
        return _plain(json.load(f).get("quantization_config"))


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A fine-grained FP8 checkpoint on disk: ``folder``, its tiles ``block`` (rows, columns), the file of each
    tensor name (``files``) and the key prefixes (``...experts``) under which it stores per-expert tensors."""

    folder: Path
    block: tuple[int, int]
    files: dict[str, Path]
    prefixes: frozenset[str]

    @classmethod
    def open(cls, folder: Path, quantization: dict) -> Fp8Checkpoint:
        """The checkpoint in ``folder`` whose ``quantization_config`` is ``quantization``; ``ValueError`` for an
        FP8 variant psr_hf does not read (another fmt, ue8m0 scales, per-tensor scales) or no safetensors."""
        fmt, scale_fmt = quantization.get("fmt", "e4m3"), quantization.get("scale_fmt", "float")
        block = quantization.get("weight_block_size", list(BLOCK))
        if fmt != "e4m3" or scale_fmt not in (None, "float"):
            raise ValueError(f"the FP8 checkpoint {folder} has fmt={fmt!r}, scale_fmt={scale_fmt!r}; psr_hf reads "
                             f"e4m3 weights with float32 scales; {_FALLBACK}")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"the FP8 checkpoint {folder} has weight_block_size={block!r}; psr_hf reads block-wise "
                             f"scales (two positive ints, e.g. [128, 128]); {_FALLBACK}")
        files = _tensor_files(folder)
        prefixes = frozenset(m["prefix"] for m in map(_EXPERT_KEY.match, files) if m is not None)
        return cls(folder, (int(block[0]), int(block[1])), files, prefixes)

    def experts_prefix(self, module_name: str) -> str | None:
        """The key prefix (``...experts``) of the experts module named ``module_name`` in the model: the same
        name, or the one that ends in the same ``layers.<i>...`` (a text model loaded from a composite
        checkpoint); None where the checkpoint stores no per-expert tensors for it."""
        if module_name in self.prefixes:
            return module_name
        tail = _LAYER_TAIL.search(module_name)
        matches = [p for p in self.prefixes if tail is not None and p.endswith("." + tail.group(1))]
        return matches[0] if len(matches) == 1 else None

    def linear_key(self, module_name: str) -> str | None:
        """The key prefix under which the checkpoint stores the FP8 weight of the linear layer named
        ``module_name`` in the model (its ``.weight`` and ``.weight_scale_inv``): the same name, or the one that
        ends in the same ``layers.<i>...``; None where it stores no FP8 weight with scales for it (a layer left in
        bf16, or none such)."""
        if f"{module_name}.weight_scale_inv" in self.files:
            return module_name
        tail = _LAYER_TAIL.search(module_name)
        if tail is None:
            return None
        end = f".{tail.group(1)}.weight_scale_inv"
        matches = [k for k in self.files if k.endswith(end) or k == end[1:]]
        return matches[0][:-len(".weight_scale_inv")] if len(matches) == 1 else None

    def read_linear(self, key: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight, scale_inv)`` stored under ``key`` (:meth:`linear_key`): float8_e4m3fn ``shape`` and float32
        ``[ceil(out/bm), ceil(in/bn)]``; ``ValueError`` naming the tensor where one is missing or of another dtype
        or shape."""
        from safetensors import safe_open

        tensors = []
        for kind, want in (("weight", (tuple(shape), FP8_DTYPE)),
                           ("weight_scale_inv", (scale_shape(shape, self.block), torch.float32))):
            name = f"{key}.{kind}"
            path = self.files.get(name)
            if path is None:
                raise ValueError(f"the FP8 checkpoint {self.folder} has no tensor {name}; {_FALLBACK_DENSE}")
            with safe_open(str(path), framework="pt") as handle:
                tensor = handle.get_tensor(name)
            if (tuple(tensor.shape), tensor.dtype) != want:
                raise ValueError(f"{name} in {path} is {tuple(tensor.shape)} {tensor.dtype}; psr_hf expects "
                                 f"{want[0]} {want[1]} (block-wise e4m3 with {self.block[0]}x{self.block[1]} "
                                 f"tiles, as config.json says); {_FALLBACK_DENSE}")
            tensors.append(tensor)
        return tensors[0], tensors[1]

    def is_quantized(self, prefix: str) -> bool:
        """Whether the experts under ``prefix`` are stored in FP8 (not left in bf16 by ``modules_to_not_convert``)."""
        return f"{prefix}.0.gate_proj.weight_scale_inv" in self.files

    def read_experts(self, prefix: str, views: dict[str, torch.Tensor]) -> None:
        """Read every expert under ``prefix`` into ``views``, the fused layout of :func:`fused_shapes` with ``E``
        experts first; ``ValueError`` naming the tensor where one is missing or of another dtype or shape."""
        from safetensors import safe_open

        handles: dict[Path, Any] = {}  # one open file each, closed when the reads are done
        intermediate = views["down_proj"].shape[-1]
        for proj, (name, rows, scale_rows) in fused_parts(intermediate, self.block).items():
            for kind, target, part in (("weight", name, rows), ("weight_scale_inv", f"{name}_scale_inv", scale_rows)):
                view = views[target]
                for expert in range(view.shape[0]):
                    key = f"{prefix}.{expert}.{proj}.{kind}"
                    path = self.files.get(key)
                    if path is None:
                        raise ValueError(f"the FP8 checkpoint {self.folder} has no tensor {key}; {_FALLBACK}")
                    if path not in handles:
                        handles[path] = safe_open(str(path), framework="pt")
                    tensor, into = handles[path].get_tensor(key), view[expert, part]
                    if tensor.dtype != into.dtype or tensor.shape != into.shape:
                        raise ValueError(
                            f"{key} in {path} is {tuple(tensor.shape)} {tensor.dtype}; psr_hf expects "
                            f"{tuple(into.shape)} {into.dtype} (block-wise e4m3 with {self.block[0]}x"
                            f"{self.block[1]} tiles, as config.json says); {_FALLBACK}")
                    into.copy_(tensor)


def fused_parts(intermediate: int, block: tuple[int, int]) -> dict[str, tuple[str, slice, slice]]:
    """Where each per-expert projection of the checkpoint goes in the fused layout: ``{proj: (fused name, its
    rows, its scales' rows)}``. Gate and up are quantized as separate ``[I, H]`` matrices, so ``gate_up_proj``
    holds gate's rows then up's, and its scales gate's ``ceil(I/bm)`` block rows then up's."""
    I, rows = intermediate, -(-intermediate // block[0])
    return {"gate_proj": ("gate_up_proj", slice(0, I), slice(0, rows)),
            "up_proj": ("gate_up_proj", slice(I, 2 * I), slice(rows, 2 * rows)),
            "down_proj": ("down_proj", slice(None), slice(None))}


def fused_shapes(intermediate: int, hidden: int, block: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per expert, the store's tensors in transformers' fused layout, as its FP8 experts modules name them:
    ``gate_up_proj`` ``[2I, H]`` and ``down_proj`` ``[H, I]`` (float8_e4m3fn), each with its float32
    ``..._scale_inv`` (``[2 ceil(I/bm), ceil(H/bn)]``, ``[ceil(H/bm), ceil(I/bn)]``)."""
    gate = scale_shape((intermediate, hidden), block)
    return {"gate_up_proj": ((2 * intermediate, hidden), FP8_DTYPE),
            "gate_up_proj_scale_inv": ((2 * gate[0], gate[1]), torch.float32),
            "down_proj": ((hidden, intermediate), FP8_DTYPE),
            "down_proj_scale_inv": (scale_shape((hidden, intermediate), block), torch.float32)}


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file in ``folder`` (through ``model.safetensors.index.json`` where there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            return {key: folder / name for key, name in json.load(f)["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"the FP8 checkpoint {folder} has no *.safetensors files to read the experts from; pass "
                         f"OffloadConfig(checkpoint=<the folder that has them>), {_FALLBACK}")
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update({key: path for key in handle.keys()})
    return names


def fp8_checkpoint_for(model: nn.Module, config: OffloadConfig) -> Fp8Checkpoint | None:
    """The FP8 checkpoint whose experts an offload of ``model`` reads, or None for the model's own weights.

    ``config.expert_format``: ``"model"`` never reads one; ``"auto"`` reads one where the model's config, or
    the config.json of the checkpoint it was loaded from, says ``quant_method: fp8``; ``"fp8"`` requires it.
    ``ValueError`` with the fix for another quantization method (psr_hf offloads float and FP8 experts only),
    for an FP8 model whose files cannot be found, and for ``"fp8"`` without an FP8 checkpoint."""
    own = _plain(getattr(model.config, "quantization_config", None))
    if own is not None and _method(own) != QUANT_METHOD:
        raise ValueError(
            f"psr_hf offload: the model is quantized with {_method(own)!r}; psr_hf offloads bf16/float32 experts "
            "and fine-grained FP8 checkpoints (quant_method 'fp8', e.g. written by psr-hf quantize). Load the "
            "unquantized model, or patch without offload= (the experts then compute where the model put them)")
    if config.expert_format == "model":
        return None
    folder = checkpoint_folder(model, config.checkpoint)
    on_disk = _folder_quantization(folder)
    if on_disk is not None and _method(on_disk) != QUANT_METHOD:
        raise ValueError(f"psr_hf offload: the checkpoint {folder} is quantized with {_method(on_disk)!r}; psr_hf "
                         "offloads bf16/float32 experts and fine-grained FP8 checkpoints (quant_method 'fp8')")
    if on_disk is None and own is not None:
        raise ValueError(
            f"psr_hf offload: the model's config says FP8 (quant_method 'fp8') but psr_hf finds no checkpoint "
            f"files to read its FP8 experts from (name_or_path {getattr(model.config, '_name_or_path', None)!r} "
            f"{'has no config.json saying fp8' if folder else 'is not a folder or a cached hub model'}); pass "
            f"OffloadConfig(checkpoint='<the checkpoint folder>'), {_FALLBACK}")
    if on_disk is None:
        if config.expert_format == "fp8":
            raise ValueError(
                f"OffloadConfig(expert_format='fp8'): the model was not loaded from an FP8 checkpoint (no "
                f"quantization_config with quant_method 'fp8' in {folder or 'its config'}); write one with "
                "psr-hf quantize and load the model from it, or pass OffloadConfig(checkpoint='<its folder>')")
        return None
    assert folder is not None
    return Fp8Checkpoint.open(folder, on_disk)
