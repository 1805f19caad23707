"""The ``accelerate`` row's model: what a transformers user would pick without psr_hf, a copy of the model
dispatched by ``accelerate.dispatch_model`` with every ``...mlp.experts`` module on the CPU (its weights stream to
the device at every forward).
"""

from __future__ import annotations

import copy
import logging

import torch

from .common import experts_modules


def accelerate_device_map(model: torch.nn.Module, device: torch.device | str) -> dict[str, str]:
    """A flat ``device_map`` for ``accelerate.dispatch_model``: every ``...mlp.experts`` module on ``"cpu"``,
    every other module (the largest subtrees without experts) and the direct parameters and buffers of modules
    above the experts on ``device``. No key is a prefix of another, so no hook places a parent's children."""
    target = str(torch.device(device))
    experts = set(experts_modules(model))
    if not experts:
        raise ValueError(f"{type(model).__name__} has no '...mlp.experts' modules to put on the CPU")
    device_map: dict[str, str] = {}

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for leaf, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            device_map[f"{prefix}.{leaf}" if prefix else leaf] = target
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in experts:
                device_map[name] = "cpu"
            elif any(e.startswith(name + ".") for e in experts):
                walk(child, name)
            else:
                device_map[name] = target

    walk(model, "")
    return device_map


def accelerate_copy(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """A copy of ``model`` dispatched by ``accelerate.dispatch_model`` with its experts on the CPU and everything
    else on ``device`` (the experts' weights are moved to the CPU first, so their weights map is host memory and
    every forward copies them to ``device``). With ``device`` cpu nothing moves: the row then measures only
    accelerate's hooks."""
    try:
        from accelerate import dispatch_model
    except ImportError as exc:
        raise ValueError("the accelerate row needs the accelerate package (pip install accelerate, or psr-hf[eval]); "
                         "or leave the row out (--no-accelerate)") from exc

    device = torch.device(device)
    device_map = accelerate_device_map(model, device)
    dispatched = copy.deepcopy(model)
    for name in experts_modules(dispatched):
        dispatched.get_submodule(name).to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # accelerate warns that "some parameters are on the meta device because they were offloaded": that is the point
    quiet = _QuietAccelerate()
    big_modeling = logging.getLogger("accelerate.big_modeling")
    big_modeling.addFilter(quiet)
    try:
        return dispatch_model(dispatched, device_map=device_map, main_device=device, force_hooks=True).eval()
    finally:
        big_modeling.removeFilter(quiet)


class _QuietAccelerate(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "offloaded to the cpu" not in str(record.msg)
