"""Training SpecPrefetch's next-layer predictors (docs/prefetch.md; the SpecPrefetch paper, Sections 3.2 and 3.4)
and the baselines trained with the same supervision (the paper's Tables 1-3).

The model is never changed: its router inputs are recorded once (:func:`record_router_inputs`, forward pre-hooks
on the routers, no grad), the frozen router of each next MoE layer gives the targets (:class:`RouterTargets`), and
every predictor trains on the recording to match them by KL (:func:`distillation_loss`). Any module with
``logits(pair, x)`` trains through the one loop :func:`fit`: :class:`LowRankAdapters` (SpecPrefetch, turned into
a :class:`~psr_hf.prefetch.predictor.Predictor` by :func:`train_predictor`), :class:`SingleMLP` (one MLP shared
by all pairs) and :class:`PairMLP` (a larger MLP per pair, "ProMoE-style").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .predictor import Predictor

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- model access
def model_family(model: nn.Module) -> Any:
    """The architecture patch of ``model`` (its text config's family for a composite model)."""
    from ..hf.patching import family_of

    return family_of(model)


def text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def moe_routers(model: nn.Module) -> tuple[Any, list[Any]]:
    """``(family, layers)``: the model's family patch and its MoE layers (``ValueError`` for fewer than two: there
    is no adjacent pair to predict)."""
    family = model_family(model)
    layers = family.moe_layers()
    if len(layers) < 2:
        raise ValueError(f"{type(model).__name__} has {len(layers)} MoE layer(s); next-layer prediction needs at "
                         "least two")
    return family, layers


def model_facts(model: nn.Module) -> dict[str, Any]:
    """``num_layers`` (MoE layers), ``num_experts``, ``hidden_size``, ``model_type`` and ``top_k`` of ``model``:
    the arguments of :meth:`Predictor.check`."""
    family, layers = moe_routers(model)
    E, D = layers[0].router.weight.shape
    config = family.config  # the text config of a composite model, as the runtime's Controller reads it
    return {"num_layers": len(layers), "num_experts": int(E), "hidden_size": int(D),
            "model_type": str(getattr(config, "model_type", "")), "top_k": int(config.num_experts_per_tok)}


def router_weights(model: nn.Module) -> list[torch.Tensor]:
    """``[L]`` of ``[E, D]``: each MoE layer's router weight, float32 on the CPU, detached."""
    _, layers = moe_routers(model)
    return [layer.router.weight.detach().float().cpu() for layer in layers]


class RouterTargets:
    """The supervision: each MoE layer's router on its own input ``x`` as log-probabilities over the experts.

    Softmax routers (OLMoE, Qwen; ``scores`` None): ``log_softmax(W x)``, the paper's target. Routers that select by
    other scores (DeepSeek-V3: ``sigmoid(W x) + e_score_correction_bias``): ``log_softmax(s / tau[l])`` with ``s``
    the family's selection scores and ``tau[l] = std(s) / std(W x)`` over the recorded tokens of layer ``l``, so the
    target ranks the experts as the router selects them (bias included) with the spread of its logits. A
    predictor's ``softmax(B A x)`` (the runtime's prefetch ranking, docs/ALGORITHM.md) then learns the router's
    selection, not the bias-free logits. Experts a group-limited router masks (``-inf``) get ``-1e4``."""

    def __init__(self, weights: Sequence[torch.Tensor], scores: Any = None, scales: Sequence[float] | None = None):
        self.weights = [w.detach().float() for w in weights]
        if (scores is None) != (scales is None):
            raise ValueError("RouterTargets: give both scores and scales (selection-score targets) or neither")
        self.scores, self.scales = scores, None if scales is None else [float(t) for t in scales]

    def __len__(self) -> int:
        return len(self.weights)

    def log_probs(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        z = F.linear(x.float(), self.weights[layer])
        if self.scores is None:
            return F.log_softmax(z, dim=-1)
        s = self.scores(layer, z) / self.scales[layer]
        return F.log_softmax(torch.nan_to_num(s, neginf=-1e4), dim=-1)

    @property
    def description(self) -> str:
        if self.scores is None:
            return "mean over pairs and tokens of KL(softmax(W[l+1] x[l+1]) || softmax(B A x[l]))"
        return ("mean over pairs and tokens of KL(softmax(s[l+1] / tau[l+1]) || softmax(B A x[l])), s = the "
                "router's selection scores of W[l+1] x[l+1] (sigmoid + bias), tau = std(s) / std(W x)")


@torch.no_grad()
def router_targets(model: nn.Module, router_inputs: Sequence[torch.Tensor], *, chunk: int = 8192) -> RouterTargets:
    """:class:`RouterTargets` of ``model``: the plain softmax targets where the family's selection scores are the
    logits, else selection-score targets scaled on ``router_inputs`` (recorded by :func:`record_router_inputs`)."""
    family, layers = moe_routers(model)
    weights = router_weights(model)
    probe = torch.zeros(1, weights[0].shape[0])
    if family.selection_scores(layers[0].router, probe) is probe:  # softmax routers: the scores are the logits
        return RouterTargets(weights)
    _check_inputs(router_inputs, weights)

    def scores(layer: int, z: torch.Tensor) -> torch.Tensor:
        router = layers[layer].router
        return family.selection_scores(router, z.to(router.weight.device)).float().to(z.device)

    scales = []
    for layer, x in enumerate(router_inputs):
        z = torch.cat([F.linear(x[s:s + chunk].float(), weights[layer]) for s in range(0, x.shape[0], chunk)])
        sel = torch.cat([scores(layer, z[s:s + chunk]) for s in range(0, z.shape[0], chunk)])
        finite = sel[torch.isfinite(sel)]
        spread = float(z.std())
        if finite.numel() < 2 or spread == 0.0 or float(finite.std()) == 0.0:
            raise ValueError(f"MoE layer {layer}: the router's scores do not vary over the recorded tokens; record "
                             "router inputs on real text")
        scales.append(float(finite.std()) / spread)
    return RouterTargets(weights, scores, scales)


def _as_targets(targets: Any) -> RouterTargets:
    return targets if isinstance(targets, RouterTargets) else RouterTargets(targets)


# ---------------------------------------------------------------------------------------------------- recording
def _as_windows(windows: Any) -> list[torch.Tensor]:
    if isinstance(windows, torch.Tensor):
        windows = [windows] if windows.ndim == 1 else list(windows)
    out = []
    for i, w in enumerate(windows):
        w = torch.as_tensor(w)
        if w.ndim == 2 and w.shape[0] == 1:
            w = w[0]
        if w.ndim != 1 or w.numel() == 0 or w.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"window {i}: expected a non-empty 1-D (or [1, T]) tensor of token ids; got shape "
                             f"{tuple(w.shape)} dtype {w.dtype}")
        out.append(w.long())
    if not out:
        raise ValueError("no token windows given; cut some with psr_hf.assets.texts.text_windows or the CLI")
    return out


def record_router_inputs_with_positions(model: nn.Module, windows: Any, *, batch_size: int = 8,
                                        progress: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`record_router_inputs` and ``[N]`` int64 positions of each recorded token in its window (0: the first
    token of a window, which has no previous token)."""
    windows = _as_windows(windows)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: give at least 1")
    from ..hf.installation import CONTROLLER_ATTRIBUTE

    if getattr(model, CONTROLLER_ATTRIBUTE, None) is not None:
        raise ValueError("this model is patched by psr_hf, so its routing (and every later layer's router input) is "
                         "not the native one the predictors learn; record on an unpatched model "
                         "(psr_hf.unpatch(model) first)")
    _, layers = moe_routers(model)
    device = next(model.parameters()).device
    captured: list[torch.Tensor | None] = [None] * len(layers)

    def hook_for(i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
            x = args[0] if args else next(iter((kwargs or {}).values()))
            captured[i] = x.detach()
        return hook

    handles = [layer.router.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    per_layer: list[list[torch.Tensor]] = [[] for _ in layers]
    positions = []
    from .._progress import tqdm

    bar = tqdm(total=sum(w.numel() for w in windows), unit="tok", desc="router inputs", disable=not progress)
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                chunk = windows[start:start + batch_size]
                T = max(w.numel() for w in chunk)
                ids = torch.zeros(len(chunk), T, dtype=torch.long)
                mask = torch.zeros(len(chunk), T, dtype=torch.long)
                for j, w in enumerate(chunk):  # right padding: a causal model's valid positions never see it
                    ids[j, :w.numel()], mask[j, :w.numel()] = w, 1
                captured[:] = [None] * len(layers)
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                valid = mask.reshape(-1).bool()
                for i, x in enumerate(captured):
                    if x is None:
                        raise ValueError(f"MoE layer {i}'s router was not called in the forward pass; is the model "
                                         "patched by psr_hf? Record router inputs on an unpatched model")
                    x = x.reshape(-1, x.shape[-1])
                    if x.shape[0] != valid.numel():
                        raise ValueError(f"MoE layer {i}'s router saw {x.shape[0]} rows for {valid.numel()} "
                                         "positions; record router inputs on an unpatched model")
                    per_layer[i].append(x[valid.to(x.device)].float().cpu())
                positions.append(torch.arange(T).expand(len(chunk), T).reshape(-1)[valid])
                bar.update(int(valid.sum()))
    finally:
        for h in handles:
            h.remove()
        bar.close()
    return [torch.cat(xs) for xs in per_layer], torch.cat(positions)


def record_router_inputs(model: nn.Module, windows: Any, *, batch_size: int = 8,
                         progress: bool = False) -> list[torch.Tensor]:
    """``[L]`` of ``[N, D]`` float32 (CPU): the input of each MoE layer's router for every valid token of the
    token-id ``windows`` (1-D or ``[1, T]`` tensors, or a ``[W, T]`` tensor), in window order.

    Runs ``model`` (unpatched) forward without grad, ``batch_size`` windows at a time, right-padded with an
    attention mask; padded positions are excluded."""
    return record_router_inputs_with_positions(model, windows, batch_size=batch_size, progress=progress)[0]


# ---------------------------------------------------------------------------------------------------- predictors
class LowRankAdapters(nn.Module):
    """SpecPrefetch's adapters as a trainable module: per pair ``l`` ``A[l]`` ``[r, D]``, ``B[l]`` ``[E, r]``,
    logits ``B A x``; ``(L - 1) r (D + E)`` parameters.

    Initialisation (``init="svd"``, the default): ``B[l] A[l]`` is the best rank-``r`` approximation of the next
    layer's router weight ``W[l + 1]`` (truncated SVD, ``A = V_r^T``, ``B = U_r S_r``), so training starts from a
    rank-``r`` pre-gate (the router of layer ``l + 1`` applied to ``x[l]``) and learns the cross-layer correction.
    ``init="random"``: ``A`` small random (std ``1/sqrt(D)``), ``B`` zeros (uniform predictions)."""

    def __init__(self, weights: Sequence[torch.Tensor], rank: int, *, init: str = "svd", seed: int = 0):
        super().__init__()
        E, D = weights[0].shape
        if not 1 <= rank <= min(E, D):
            raise ValueError(f"rank {rank} must be between 1 and min(experts, hidden) = {min(E, D)} for this model; "
                             f"give a rank in that range (--rank {min(E, D, 64)})")
        pairs = len(weights) - 1
        gen = torch.Generator().manual_seed(seed)
        if init == "svd":
            A, B = [], []
            for w in weights[1:]:
                U, S, Vh = torch.linalg.svd(w.float(), full_matrices=False)
                A.append(Vh[:rank].clone())
                B.append((U[:, :rank] * S[:rank]).clone())
            A, B = torch.stack(A), torch.stack(B)
        elif init == "random":
            A = torch.randn(pairs, rank, D, generator=gen) / math.sqrt(D)
            B = torch.zeros(pairs, E, rank)
        else:
            raise ValueError(f"init {init!r}: use 'svd' or 'random'")
        self.A, self.B = nn.Parameter(A), nn.Parameter(B)

    def logits(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A[pair].T) @ self.B[pair].T

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def to_predictor(self, metadata: dict[str, Any] | None = None) -> Predictor:
        return Predictor(list(self.A.detach()), list(self.B.detach()), metadata)


class SingleMLP(nn.Module):
    """One MLP shared by every pair (the paper's Single MLP): ``W2 gelu(W1 x + emb[pair]) + b2``, the learned pair
    embedding ``emb`` ``[L - 1, h]`` telling it which layer to predict (a one-hot input through ``W1``, in effect).
    Parameters: ``D h + h + (L - 1) h + h E + E``; the default ``hidden`` matches SpecPrefetch's count at
    ``rank`` (``h = (L - 1) r (D + E) / (D + E + L)``)."""

    def __init__(self, num_layers: int, hidden_size: int, num_experts: int, hidden: int, *, seed: int = 0):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden={hidden}: give at least 1")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(hidden_size, hidden)
            self.embedding = nn.Embedding(num_layers - 1, hidden)
            nn.init.normal_(self.embedding.weight, std=0.02)
            self.fc2 = nn.Linear(hidden, num_experts)

    @staticmethod
    def matched_hidden(num_layers: int, hidden_size: int, num_experts: int, rank: int) -> int:
        return max(1, round((num_layers - 1) * rank * (hidden_size + num_experts)
                            / (hidden_size + num_experts + num_layers)))

    def logits(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x) + self.embedding.weight[pair]))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class PairMLP(nn.Module):
    """A separate MLP per pair, ``D -> h -> E`` with GELU ("ProMoE-style": larger per-layer predictors). The
    default ``hidden = D`` makes it about ``D / r`` times SpecPrefetch's size (the paper's Table 3: 3% at
    ``D = 2048, r = 64``). Parameters: ``(L - 1)(D h + h + h E + E)``."""

    def __init__(self, num_layers: int, hidden_size: int, num_experts: int, hidden: int, *, seed: int = 0):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden={hidden}: give at least 1")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.nets = nn.ModuleList(nn.Sequential(nn.Linear(hidden_size, hidden), nn.GELU(),
                                                    nn.Linear(hidden, num_experts))
                                      for _ in range(num_layers - 1))

    def logits(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        return self.nets[pair](x)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------------------------------- training
def _check_inputs(router_inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    if len(router_inputs) != len(weights):
        raise ValueError(f"{len(router_inputs)} recorded router inputs for a model with {len(weights)} MoE layers; "
                         "record them on this model (record_router_inputs)")
    n = router_inputs[0].shape[0]
    if n == 0 or any(x.shape[0] != n for x in router_inputs):
        raise ValueError("the recorded router inputs must hold the same non-zero number of tokens for every layer")


def _pair_loss(module: Any, pair: int, x: torch.Tensor, target_logp: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Mean over tokens of KL(target || softmax(module.logits(pair, x)))."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = module.logits(pair, x)
    logq = F.log_softmax(logits.float(), dim=-1)
    return F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")


def _targets(targets: RouterTargets, router_inputs: Sequence[torch.Tensor], pair: int,
             idx: torch.Tensor | slice) -> torch.Tensor:
    return targets.log_probs(pair + 1, router_inputs[pair + 1][idx])


@torch.no_grad()
def distillation_loss(model_or_weights: Any, router_inputs: Sequence[torch.Tensor], module: Any, *,
                      chunk: int = 8192) -> dict[str, Any]:
    """The objective ``L_pred`` of ``module`` (anything with ``logits(pair, x)``, a :class:`Predictor` included)
    on recorded router inputs, in float32: ``{"loss": mean over pairs, "per_pair": [...]}`` (nats).
    ``model_or_weights``: the model (its :func:`router_targets`), :class:`RouterTargets`, or router weights.

    For each adjacent MoE-layer pair ``l`` (``0 .. L - 2``) and each valid token, the target is the router of layer
    ``l + 1`` on its own input, ``pi = softmax(W[l + 1] x[l + 1])`` (or the scaled selection scores of
    :class:`RouterTargets`); the predictor sees only layer ``l``'s router input ``x[l]``::

        L_pred = 1 / (L - 1) sum_l  1 / |Omega| sum_tokens  KL(pi || softmax(predicted logits of layer l + 1))
    """
    weights = router_targets(model_or_weights, router_inputs) if isinstance(model_or_weights, nn.Module) else \
        _as_targets(model_or_weights)
    _check_inputs(router_inputs, weights)
    n = router_inputs[0].shape[0]
    per_pair = []
    for pair in range(len(weights) - 1):
        total = 0.0
        for s in range(0, n, chunk):
            idx = slice(s, s + chunk)
            x = router_inputs[pair][idx]
            total += float(_pair_loss(module, pair, x, _targets(weights, router_inputs, pair, idx), False)) * x.shape[0]
        per_pair.append(total / n)
    return {"loss": sum(per_pair) / len(per_pair), "per_pair": per_pair}


def fit(module: nn.Module, weights: Sequence[torch.Tensor], router_inputs: Sequence[torch.Tensor], *,
        epochs: int = 1, lr: float = 1e-4, batch_size: int = 256, warmup: float = 0.03, clip: float = 0.5,
        dtype: torch.dtype = torch.bfloat16, seed: int = 0, progress: bool = False,
        desc: str = "train") -> dict[str, Any]:
    """Train ``module`` (an ``nn.Module`` with ``logits(pair, x)``) in place on the objective of
    :func:`distillation_loss`: each step a minibatch of ``batch_size`` recorded tokens, the loss averaged over all
    pairs.

    Optimisation as the paper's Implementation Details: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), cosine
    schedule after a linear warm-up over the first ``warmup`` (3%) of steps, gradient clipping at norm ``clip``
    (0.5), one epoch, bf16 precision -- here as bf16 autocast of the forward matmuls over float32 master weights
    (the loss, softmaxes and optimiser state stay float32); ``dtype=torch.float32`` trains entirely in float32.

    ``weights``: the supervision, :class:`RouterTargets` (:func:`router_targets`) or the routers' weights (plain
    softmax targets). Returns the training facts: ``steps``, ``tokens``, ``initial_loss`` and ``final_loss`` (the
    objective over all recorded tokens before and after, float32), ``last_step_loss`` and the settings."""
    weights = _as_targets(weights)
    _check_inputs(router_inputs, weights)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {dtype}: use torch.bfloat16 (autocast over float32 master weights) or "
                         "torch.float32")
    if epochs < 1 or batch_size < 1 or lr <= 0 or not 0 <= warmup < 1 or clip <= 0:
        raise ValueError(f"epochs={epochs}, batch_size={batch_size} (>= 1), lr={lr}, clip={clip} (> 0) and "
                         f"warmup={warmup} (in [0, 1)) are out of range")
    n = router_inputs[0].shape[0]
    pairs = len(weights) - 1
    per_epoch = math.ceil(n / batch_size)
    steps = per_epoch * epochs
    warm = math.ceil(warmup * steps)

    def schedule(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress_ = (step - warm) / max(1, steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * progress_))

    initial = distillation_loss(weights, router_inputs, module)["loss"]
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    gen = torch.Generator().manual_seed(seed)
    autocast = dtype == torch.bfloat16
    from .._progress import tqdm

    module.train()
    last = float("nan")
    with tqdm(total=steps, desc=desc, unit="step", disable=not progress) as bar:
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen)
            for s in range(per_epoch):
                idx = order[s * batch_size:(s + 1) * batch_size]
                loss = sum(_pair_loss(module, p, router_inputs[p][idx], _targets(weights, router_inputs, p, idx),
                                      autocast) for p in range(pairs)) / pairs
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                optimizer.step()
                scheduler.step()
                last = float(loss.detach())
                bar.update(1)
                bar.set_postfix(kl=f"{last:.4f}", refresh=False)
    module.eval()
    final = distillation_loss(weights, router_inputs, module)["loss"]
    logger.info("%s: %d steps on %d tokens, KL %.4f -> %.4f", desc, steps, n, initial, final)
    return {"steps": steps, "tokens": n, "epochs": epochs, "lr": lr, "batch_size": batch_size, "warmup": warmup,
            "clip": clip, "precision": "bf16 autocast, float32 master weights" if autocast else "float32",
            "seed": seed, "optimizer": "AdamW(0.9, 0.999, eps 1e-8), cosine", "initial_loss": initial,
            "final_loss": final, "last_step_loss": last}


def _inputs(model: nn.Module, windows: Any, router_inputs: Sequence[torch.Tensor] | None,
            progress: bool) -> Sequence[torch.Tensor]:
    if router_inputs is not None:
        return router_inputs
    if windows is None:
        raise ValueError("give token windows (or router_inputs recorded with record_router_inputs)")
    return record_router_inputs(model, windows, progress=progress)


def train_module(model: nn.Module, module: nn.Module, windows: Any = None, *,
                 router_inputs: Sequence[torch.Tensor] | None = None, **settings: Any) -> dict[str, Any]:
    """Train any predictor module (``logits(pair, x)``) on ``model``'s routing over ``windows`` (or already
    recorded ``router_inputs``) with :func:`fit`'s ``settings``; returns its facts."""
    inputs = _inputs(model, windows, router_inputs, bool(settings.get("progress")))
    return fit(module, router_targets(model, inputs), inputs, **settings)


def train_predictor(model: nn.Module, windows: Any = None, *, rank: int, epochs: int = 1, lr: float = 1e-4,
                    batch_size: int = 256, warmup: float = 0.03, clip: float = 0.5,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0, init: str = "svd", progress: bool = False,
                    router_inputs: Sequence[torch.Tensor] | None = None) -> Predictor:
    """SpecPrefetch's rank-``rank`` predictor for ``model``, trained on the routing of the token-id ``windows``
    (or on ``router_inputs`` already recorded by :func:`record_router_inputs`).

    Initialisation: :class:`LowRankAdapters` (``init="svd"``: a truncated SVD of the next router's weight;
    ``"random"``: small random ``A``, zero ``B``). Optimisation: :func:`fit`'s (``dtype=torch.bfloat16``:
    bf16 autocast over float32 master weights; ``torch.float32``: float32 throughout). ``batch_size`` counts
    tokens per step. The metadata records ``model_type``, ``top_k``, ``rank``, ``init``, the tokens, steps, KL
    before and after training and the settings."""
    facts = model_facts(model)
    inputs = _inputs(model, windows, router_inputs, progress)
    targets = router_targets(model, inputs)
    module = LowRankAdapters(targets.weights, rank, init=init, seed=seed)
    trained = fit(module, targets, inputs, epochs=epochs, lr=lr, batch_size=batch_size, warmup=warmup, clip=clip,
                  dtype=dtype, seed=seed, progress=progress, desc="SpecPrefetch")
    metadata = {"model_type": facts["model_type"], "top_k": facts["top_k"], "rank": rank, "init": init,
                "objective": targets.description,
                **trained}
    return module.to_predictor(metadata)
