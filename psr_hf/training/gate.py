"""Distilling the routed model to the frozen one (the paper's Section 6.10, "the same for PSR's own router"): the
router of every MoE layer and LoRA adapters on attention and on each expert (through peft: transformers' fused
expert tensors by parameter targeting, one rank-``r`` adapter per expert) are trained so that the model *routed by
the logical cache* (any :class:`~psr_hf.RoutingConfig`, e.g. PSR at 37.5% residency) matches the exact model's
next-token distribution (KL). The selection stays the kernels' and discrete; the gradients reach the router through
the executed experts' weights and the adapters through the computation.

The result is a folder: ``routing.safetensors`` (the trained routers, the model's shape and the training facts)
and ``adapter/`` (peft's own format); :func:`apply_distilled` puts both into a model of the same shape.

This module sits in the training room (rank 4, ARCHITECTURE.md): it patches the model (``hf``) and reads peft, and
what it trains lives below it (:mod:`psr_hf.gates`: the margin head and the relaxation). ``psr_hf.gates.train`` is
its former import path, an alias of this module.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .._metadata import read_file

logger = logging.getLogger(__name__)

FORMAT_NAME = "psr_hf.distilled_routing"
FORMAT_VERSION = 1
PAPER_WIDTH = 2048  # OLMoE's hidden size, where the paper used rank 16 on attention and 8 per expert
PAPER_RANKS = (16, 8)
ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
CHECKPOINT = "checkpoint.safetensors"
GATE_FILE = "gate.safetensors"  # the trained margin head, when a gate was trained


def scaled_ranks(hidden_size: int) -> tuple[int, int]:
    """The paper's ranks (16 on attention, 8 per expert at width 2048) at the same rank-to-width ratio for a model
    of ``hidden_size``, at least 1."""
    attention, expert = (max(1, round(r * hidden_size / PAPER_WIDTH)) for r in PAPER_RANKS)
    return attention, expert


@dataclass
class DistillationResult:
    """What :func:`distill_routing` did: the KL of each optimiser step (mean per token), the ranks, and where
    the result was written."""

    losses: list[float]
    attention_rank: int
    expert_rank: int
    path: Path
    loads: list[float]  # smooth host loads per token of each step (empty without a gate or load penalty)


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ..hf.patching import family_of

    return [layer.router for layer in family_of(model).moe_layers()]


def _expert_parameters(model: torch.nn.Module) -> list[str]:
    """peft ``target_parameters``: the fused expert tensors of the MoE layers, by their name within a decoder layer
    (``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` on OLMoE)."""
    names = sorted({".".join(name.split(".")[-3:]) for name, p in model.named_parameters()
                    if p.ndim == 3 and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")})
    if not names:
        raise ValueError("the model has no fused expert tensors (gate_up_proj / down_proj [E, ., .]) for per-expert "
                         "adapters; give expert_rank=0")
    return names


def _kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real positions of KL(teacher || student) of the next-token distributions."""
    kl = F.kl_div(student.float().log_softmax(-1), teacher.float().log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def distill_routing(model: torch.nn.Module, windows: Sequence[torch.Tensor], config: Any, out: str | Path, *,
                    calibration: Any, steps: int, attention_rank: int | None = None, expert_rank: int | None = None,
                    lr: float = 1e-4, router_lr: float = 2e-5, warmup: int = 20, seed: int = 0,
                    metadata: Mapping[str, Any] | None = None, progress: bool = False,
                    checkpoint_every: int = 0, resume: bool = False, gate: Any = None, load_penalty: float = 0.0,
                    temperature: float = 0.5, head_lr: float | None = None) -> DistillationResult:
    """Train the routers and the adapters of ``model`` in place (afterwards it carries peft's adapter wrappers and
    the trained routers; :func:`apply_distilled` puts the written result into a fresh model) on ``windows``
    (``[T]`` or ``[1, T]`` token ids, cycled) for ``steps`` steps, routed by ``config`` with ``calibration``;
    AdamW with betas (0.9, 0.95), no weight decay, ``lr`` for the adapters and ``router_lr`` for the routers,
    linear warm-up over ``warmup`` steps (the paper's Appendix A).
    Ranks default to :func:`scaled_ranks`; 0 leaves that part out. Writes the folder ``out``.

    ``checkpoint_every``: every so many steps the training state (routers, adapters, optimiser, step, losses) goes
    to ``out/checkpoint.safetensors``; ``resume``: continue from it (the same windows, config, ranks and rates,
    else ``ValueError``), so a cut run ends where an uncut one would.

    ``gate``: a :class:`~psr_hf.gates.MarginHead` (e.g. ``MarginHead.uniform``) trained with them at ``head_lr``
    (default ``lr``) and given the trained values in place (it stays on its device), written as
    ``out/gate.safetensors``; ``load_penalty``: the weight of the smooth host loads
    per token beside the KL. Either runs the relaxation of :mod:`psr_hf.gates.relaxation` (``temperature`` in
    units of ``lam * delta[l]``): the forward stays the hard routing, the gradients reach the margins.

    The steps: the arguments checked (:func:`_checked_ranks`), the exact model's distributions computed
    (:func:`_teacher_logits`), the trained parts made trainable (:func:`_trainable_parts`) with their optimiser
    (:func:`_optimiser`), the steps run on the patched model (:func:`_train`), the result written (:func:`_save`,
    :func:`_save_gate`)."""
    _peft()  # before anything changes: ImportError without peft
    from .. import RoutingConfig

    config = RoutingConfig.coerce(config)
    attention_rank, expert_rank = _checked_ranks(model, config, windows, steps, attention_rank, expert_rank,
                                                 load_penalty, temperature, gate)
    relaxed = gate is not None or load_penalty > 0
    if gate is not None:
        from ..gates.margin_head import MarginHead

        gate = MarginHead.coerce(gate)
    windows = [w.reshape(1, -1) if w.ndim == 1 else w for w in windows]
    torch.manual_seed(seed)  # before peft draws the adapters' initial values
    teachers = _teacher_logits(model, windows)
    parts = _trainable_parts(model, gate, attention_rank, expert_rank)
    optimiser, schedule = _optimiser(parts, lr, router_lr, head_lr, warmup)
    out = Path(out)
    identity = _identity(windows, config, attention_rank, expert_rank, lr, router_lr, warmup, seed,
                         gate is not None, load_penalty, temperature, head_lr)
    run = _Run(optimiser, schedule, identity, out / CHECKPOINT, checkpoint_every)
    if resume:
        run.start, run.losses, run.loads = _load_checkpoint(run.checkpoint, parts.trained, optimiser, schedule,
                                                            identity)
    _train(model, parts, run, windows, teachers, steps, config, calibration,
           temperature if relaxed else None, load_penalty, progress)
    path = _save(parts.tuned, parts.routers, out, model, config, attention_rank, expert_rank, steps, metadata)
    if gate is not None:
        _save_gate(gate, parts.head, out / GATE_FILE, model, config, steps, load_penalty, temperature)
    run.checkpoint.unlink(missing_ok=True)
    for router in parts.routers:
        router.weight.requires_grad_(False)
    return DistillationResult(run.losses, attention_rank, expert_rank, path, run.loads)


def _checked_ranks(model: torch.nn.Module, config: Any, windows: Sequence[torch.Tensor], steps: int,
                   attention_rank: int | None, expert_rank: int | None, load_penalty: float, temperature: float,
                   gate: Any) -> tuple[int, int]:
    """:func:`distill_routing`'s arguments checked (``ValueError`` naming the one refused); returns the ranks,
    :func:`scaled_ranks` where not given."""
    if steps < 1:
        raise ValueError(f"steps={steps}: give at least one optimiser step")
    if not windows:
        raise ValueError("no training windows: give token windows of held-out-free training text")
    default_attention, default_expert = scaled_ranks(int(model.config.hidden_size))
    attention_rank = default_attention if attention_rank is None else int(attention_rank)
    expert_rank = default_expert if expert_rank is None else int(expert_rank)
    if attention_rank < 0 or expert_rank < 0:
        raise ValueError(f"ranks must be >= 0; got attention {attention_rank}, expert {expert_rank}")
    if not (load_penalty >= 0 and temperature > 0):
        raise ValueError(f"load_penalty={load_penalty} must be >= 0 and temperature={temperature} > 0")
    if (gate is not None or load_penalty > 0) and not config.takes_gate:
        raise ValueError(f"a gate or a load penalty trains the bonus of cache_prior or psr with delta_mode='fixed'; "
                         f"got policy={config.policy!r}, delta_mode={config.delta_mode!r}")
    return attention_rank, expert_rank


def _teacher_logits(model: torch.nn.Module, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The targets: the frozen exact model's next-token logits on every window (before anything is patched)."""
    model.eval()
    with torch.no_grad():
        return [model(input_ids=w).logits.detach() for w in windows]


@dataclass
class _TrainableParts:
    """What a distillation trains: the model with its adapters (``tuned``: peft's wrapper, or the model itself
    without adapters), the routers, the margin head trained beside them (on the routers' device) or None, and every
    trained tensor by the name a checkpoint gives it."""

    tuned: Any
    routers: list[torch.nn.Module]
    head: Any
    trained: dict[str, torch.Tensor]

    def groups(self, lr: float, router_lr: float, head_lr: float | None) -> list[dict]:
        """The optimiser's parameter groups: the routers, then the adapters, then the head."""
        groups = [{"params": [r.weight for r in self.routers], "lr": router_lr}]
        adapters = [p for n, p in self.tuned.named_parameters() if p.requires_grad and "lora_" in n]
        if adapters:
            groups.append({"params": adapters, "lr": lr})
        if self.head is not None:
            groups.append({"params": list(self.head.parameters()), "lr": lr if head_lr is None else head_lr})
        return groups


def _trainable_parts(model: torch.nn.Module, gate: Any, attention_rank: int, expert_rank: int) -> _TrainableParts:
    """Freeze the model, wrap it with peft's adapters of the given ranks (none where both are 0), make its router
    weights trainable, and put the head to train beside them (a copy of ``gate`` where it lives on another
    device)."""
    for p in model.parameters():
        p.requires_grad_(False)
    tuned = model
    if attention_rank or expert_rank:
        tuned = _peft().get_peft_model(model, _lora_config(model, attention_rank, expert_rank))
    routers = _routers(model)
    for router in routers:
        router.weight.requires_grad_(True)
    head = gate  # the head trained, beside the routers: the one the patched model routes with
    if gate is not None and gate.weight.device != routers[0].weight.device:
        head = copy.deepcopy(gate).to(routers[0].weight.device)
    trained = {f"router.{i}": r.weight for i, r in enumerate(routers)} | {
        n: p for n, p in tuned.named_parameters() if p.requires_grad and "lora_" in n}
    if head is not None:
        trained |= {f"gate.{n}": p for n, p in head.named_parameters()}
    return _TrainableParts(tuned, routers, head, trained)


def _optimiser(parts: _TrainableParts, lr: float, router_lr: float, head_lr: float | None,
               warmup: int) -> tuple[Any, Any]:
    """AdamW with betas (0.9, 0.95) and no weight decay over ``parts``, and its linear warm-up over ``warmup``
    steps."""
    optimiser = torch.optim.AdamW(parts.groups(lr, router_lr, head_lr), betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    return optimiser, schedule


@dataclass
class _Run:
    """A training run's optimiser and schedule, what its checkpoints must match and where they go (every
    ``checkpoint_every`` steps, 0: never), the step it starts from and the losses and loads of its steps so far."""

    optimiser: Any
    schedule: Any
    identity: str
    checkpoint: Path
    checkpoint_every: int
    start: int = 0
    losses: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)


def _train(model: torch.nn.Module, parts: _TrainableParts, run: _Run, windows: Sequence[torch.Tensor],
           teachers: Sequence[torch.Tensor], steps: int, config: Any, calibration: Any, temperature: float | None,
           load_penalty: float, progress: bool) -> None:
    """Steps ``run.start .. steps - 1`` on ``model`` patched with ``config`` (the head routing it), through the
    relaxation when ``temperature`` is given: each the KL to the teacher on the step's window (plus
    ``load_penalty`` times the smooth host loads per token, relaxed), one optimiser step, a checkpoint when due.
    The model is unpatched and in eval mode afterwards, whatever happens."""
    from .. import patch, unpatch
    from .._progress import tqdm

    patch(model, config, calibration=calibration, gate=parts.head)
    if temperature is not None:
        _relax(model, config, temperature)
    try:
        model.train()
        bar = tqdm(range(run.start, steps), desc="distil routing", disable=not progress, unit="step",
                   initial=run.start, total=steps)
        for step in bar:
            i = step % len(windows)
            kl = _kl(model(input_ids=windows[i]).logits, teachers[i], None)
            loss = kl
            if temperature is not None:
                smooth = _routing(model).relaxation.loads / windows[i].numel()
                loss = kl + load_penalty * smooth
                run.loads.append(float(smooth.detach()))
            run.optimiser.zero_grad(set_to_none=True)
            loss.backward()
            run.optimiser.step()
            run.schedule.step()
            run.losses.append(float(kl.detach()))
            if run.checkpoint_every and (step + 1) % run.checkpoint_every == 0 and step + 1 < steps:
                _save_checkpoint(run.checkpoint, parts.trained, run.optimiser, step + 1, run.losses, run.loads,
                                 run.identity)
    finally:
        model.eval()
        unpatch(model)


def _save_gate(gate: Any, head: Any, file: Path, model: torch.nn.Module, config: Any, steps: int,
               load_penalty: float, temperature: float) -> None:
    """Give the caller's ``gate`` the trained values of ``head`` (it stays on its device), freeze it, record how it
    was trained in its metadata and write it to ``file``."""
    if head is not gate:
        gate.load_state_dict(head.state_dict())
    gate.requires_grad_(False)
    gate.metadata |= {"model_type": str(getattr(model.config, "model_type", "")),
                      "routing": json.dumps(config.to_dict()), "steps": str(steps),
                      "load_penalty": str(load_penalty), "temperature": str(temperature)}
    gate.save(file)


def _routing(model: torch.nn.Module) -> Any:
    from ..hf.patching import controller

    return controller(model).routing


def _relax(model: torch.nn.Module, config: Any, temperature: float) -> None:
    """Route the training forward through the relaxation (unit ``lam * delta[l]`` from the patched calibration)."""
    import numpy as np

    from ..policy.margins import margin_scale
    from ..gates.relaxation import GateRelaxation

    routing = _routing(model)
    unit = margin_scale(np.ones(routing.num_layers), float(config.lam), routing.cache.calibration.delta)
    routing.relaxation = GateRelaxation(torch.as_tensor(unit, dtype=torch.float32), temperature, config.top_j)


def _identity(windows: Sequence[torch.Tensor], config: Any, *numbers: Any) -> str:
    """What a checkpoint must match to be continued: the windows' tokens, the routing and the training numbers."""
    import hashlib

    digest = hashlib.sha256()
    for w in windows:
        digest.update(w.detach().to(device="cpu", dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return json.dumps({"windows": digest.hexdigest(), "routing": config.to_dict(),
                       "numbers": [str(n) for n in numbers]}, sort_keys=True)


def _save_checkpoint(path: Path, trained: dict, optimiser: Any, step: int, losses: list[float], loads: list[float],
                     identity: str) -> None:
    from safetensors.torch import save_file

    state = optimiser.state_dict()
    tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in trained.items()}
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"optimiser.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"format": FORMAT_NAME + ".checkpoint", "step": str(step),
                                               "losses": json.dumps(losses), "loads": json.dumps(loads),
                                               "identity": identity,
                                               "groups": json.dumps(state["param_groups"])})
    partial.replace(path)  # a run cut while writing keeps the previous checkpoint


def _load_checkpoint(path: Path, trained: dict, optimiser: Any, schedule: Any,
                     identity: str) -> tuple[int, list[float], list[float]]:
    meta, _, tensors = read_file(path, FORMAT_NAME + ".checkpoint", "training checkpoint",
                                 "start the training without resume")
    if meta.get("identity") != identity:
        raise ValueError(f"resume: {path} was written by a training with other windows, routing, ranks or rates; "
                         "give the same ones, or start afresh without resume")
    with torch.no_grad():
        for name, param in trained.items():
            param.copy_(tensors[f"param.{name}"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimiser."):
            _, index, field = key.split(".", 2)
            state.setdefault(int(index), {})[field] = value
    optimiser.load_state_dict({"state": state, "param_groups": json.loads(meta["groups"])})
    step = int(meta["step"])
    schedule.last_epoch = step  # the rates themselves came back with the optimiser's groups
    schedule._last_lr = [group["lr"] for group in optimiser.param_groups]
    return step, [float(x) for x in json.loads(meta["losses"])], [float(x) for x in json.loads(meta["loads"])]


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("distilled routing trains LoRA adapters with peft, which is not installed: pip install "
                          "'psr-hf[train]' (or peft>=0.17)") from None
    return peft


def _lora_config(model: torch.nn.Module, attention_rank: int, expert_rank: int) -> Any:
    """One rank for the attention modules, another for the expert tensors, alpha = 2 r for both. The expert tensors
    take the config's own ``r`` and ``lora_alpha`` (peft 0.21 ignores ``alpha_pattern`` keys of target parameters);
    the attention modules take theirs from the patterns."""
    peft = _peft()
    experts = _expert_parameters(model) if expert_rank else []
    base = expert_rank or attention_rank
    modules = ATTENTION_MODULES if attention_rank else []
    return peft.LoraConfig(r=base, lora_alpha=2 * base, target_modules=modules, target_parameters=experts or None,
                           rank_pattern={m: attention_rank for m in modules},
                           alpha_pattern={m: 2 * attention_rank for m in modules}, lora_dropout=0.0, bias="none")


def _save(tuned: Any, routers: list, out: Path, model: torch.nn.Module, config: Any, attention_rank: int,
          expert_rank: int, steps: int, metadata: Mapping[str, Any] | None) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"router.{i}": r.weight.detach().float().cpu().contiguous() for i, r in enumerate(routers)}
    facts = {"model_type": str(getattr(model.config, "model_type", "")), "num_layers": str(len(routers)),
             "num_experts": str(int(routers[0].weight.shape[0])), "hidden_size": str(int(model.config.hidden_size))}
    user = {str(k): str(v) for k, v in dict(metadata or {}).items()} | {
        "routing": json.dumps(config.to_dict()),
        "attention_rank": str(attention_rank), "expert_rank": str(expert_rank), "steps": str(steps)}
    save_file(tensors, str(out / "routing.safetensors"),
              metadata={"format": FORMAT_NAME, "version": str(FORMAT_VERSION), **facts, "user": json.dumps(user)})
    if tuned is not model:
        tuned.save_pretrained(str(out / "adapter"))
    return out


def apply_distilled(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Put a :func:`distill_routing` result into ``model`` (unpatched, the same shape as the one trained): its
    routers' weights, and its adapters merged into the weights. Returns the model (with the adapters, a new object
    from peft's ``merge_and_unload``). ``ValueError`` for a folder that is not one, a model of another shape or a
    router tensor that is missing, not finite or of another shape than the model's (naming the file and the
    tensor); every router is checked before any is changed."""
    path = Path(path)
    file = path / "routing.safetensors"
    if not file.is_file():
        raise ValueError(f"{path} holds no routing.safetensors: not a distilled routing (psr_hf.training.gate)")
    meta, _, tensors = read_file(file, FORMAT_NAME, "distilled routing", "train one with psr-hf train-gate")
    routers = _routers(model)
    want = {"model_type": str(getattr(model.config, "model_type", "")), "num_layers": str(len(routers)),
            "num_experts": str(int(routers[0].weight.shape[0])), "hidden_size": str(int(model.config.hidden_size))}
    have = {k: meta.get(k) for k in want}
    if have != want:
        raise ValueError(f"{path} was trained on a model with {have}, this one has {want}")
    weights = _router_weights(file, tensors, routers)
    with torch.no_grad():
        for router, w in zip(routers, weights):
            router.weight.copy_(w.to(router.weight.dtype))
    if (path / "adapter").is_dir():
        model = _peft().PeftModel.from_pretrained(model, str(path / "adapter")).merge_and_unload()
    return model


def _router_weights(file: Path, tensors: Mapping[str, torch.Tensor], routers: list) -> list[torch.Tensor]:
    """The trained router weight of every MoE layer in ``file``'s ``tensors``; ``ValueError`` naming the file and
    the tensor for one that is missing, not finite or not exactly the shape of the model's router weight (a
    broadcastable ``[H]`` row would give every expert the same router)."""
    weights = []
    for i, router in enumerate(routers):
        name, want = f"router.{i}", tuple(router.weight.shape)
        weight = tensors.get(name)
        if weight is None:
            raise ValueError(f"{file}: tensor {name} is missing (expected MoE layer {i}'s router weight {want}); a "
                             "truncated or altered file? Train it again with psr-hf train-gate")
        if tuple(weight.shape) != want:
            raise ValueError(f"{file}: tensor {name} has shape {tuple(weight.shape)}, expected {want} (MoE layer "
                             f"{i}'s router weight); an altered file? Train it again with psr-hf train-gate")
        if not torch.isfinite(weight).all():
            raise ValueError(f"{file}: tensor {name} holds values that are not finite (NaN or infinity); a diverged "
                             "training? Train it again, e.g. with lower rates")
        weights.append(weight)
    return weights


def load_distilled(model: torch.nn.Module, path: str | Path) -> tuple[torch.nn.Module, Any]:
    """:func:`apply_distilled`, and the folder's trained margin head (``gate.safetensors``, written when a gate was
    trained; checked against the model) or None: what ``psr_hf.patch(model, config, gate=...)`` takes. A gate or
    router tensor refused (``ValueError``) leaves the model as it was."""
    from ..gates.margin_head import MarginHead

    file = Path(path) / GATE_FILE
    head = None
    if file.is_file():  # checked before apply_distilled changes the model
        head = MarginHead.load(file)
        head.check(num_layers=len(_routers(model)), hidden_size=int(model.config.hidden_size),
                   model_type=str(getattr(model.config, "model_type", "")) or None, source=str(file))
    return apply_distilled(model, path), head
