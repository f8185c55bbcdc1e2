"""Advantage estimation: building blocks, and estimators looked up by name.

Semantics follow verl's ``core_algos`` (GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++, REINFORCE++
with baseline, ReMax); deliberate differences are spelled out where they occur.

The building blocks (``gae_raw``, ``group_outcome_advantage``, ``discounted_returns``) take
``backend``: ``"torch"`` is the reference implementation and always available; ``"native"``
calls the Rust extension ``rlcore._native`` (parallel over rows, releases the GIL); ``"auto"``
uses native when the inputs are float32 CPU tensors that don't need grad, else torch; float64
inputs stay on torch under "auto" because the native kernels are float32. Under
``RLCORE_NATIVE=off`` (see :mod:`rlcore.native`) "auto" is torch and "native" raises. Results are
always torch tensors on the input's device and dtype.

Everything here runs under ``torch.no_grad``: advantages are targets, never differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import numpy as np
import torch

from rlcore import native
from rlcore.algos.masked import masked_whiten

__all__ = [
    "Backend",
    "gae_raw",
    "group_outcome_advantage",
    "discounted_returns",
    "group_ids_from_uids",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "advantage_estimator_names",
    "advantage_estimator_inputs",
    "compute_advantage",
    "GROUP_MODES",
]

Backend = Literal["auto", "torch", "native"]
_BACKENDS = ("auto", "torch", "native")
GROUP_MODES = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")


# ----------------------------------------------------------------------------- native dispatch


def _native_fn(name: str) -> Callable[..., Any] | None:
    """The extension's function ``name``; None only under ``RLCORE_NATIVE=off`` (a missing or
    stale extension already failed ``import rlcore``). Tests replace this to fake the extension."""
    return native.function(name)


def _pick_native(backend: str, name: str, *tensors: torch.Tensor) -> Callable[..., Any] | None:
    """Return the native function to use, or None for the torch path.

    The extension is always there (``import rlcore`` checked it) unless ``RLCORE_NATIVE=off``;
    under "auto" torch is used then, or for inputs the kernels don't take (not float32, on a
    GPU, or requiring grad).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return None
    fn = _native_fn(name)
    if backend == "native":
        if fn is None:
            raise RuntimeError(f"backend='native' but the extension is switched off ({native.ENV_VAR}=off)")
        return fn
    ok = all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
    ok = ok and all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())
    return fn if ok else None


def _np_f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(device="cpu", dtype=torch.float32).numpy())


def _back(a: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a)).to(device=like.device, dtype=like.dtype)


def _check_2d(name: str, t: torch.Tensor, shape: torch.Size | None = None) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be [batch, response_len], got shape {tuple(t.shape)}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


# ----------------------------------------------------------------------------- building blocks


@torch.no_grad()
def gae_raw(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, unwhitened: ``(advantages, returns)``, both [B, T].

    Per row, backwards from the end with ``nextvalue = lastgae = 0``::

        delta    = r[t] + gamma * nextvalue - v[t]
        g        = delta + gamma * lam * lastgae
        nextvalue = v[t] if m[t] else nextvalue      (masked tokens are skipped: they
        lastgae   = g    if m[t] else lastgae         neither bootstrap nor accumulate)
        adv[t]    = g
    and ``returns = adv + values``. On valid tokens this is exactly verl's GAE before whitening.
    At masked positions we store ``g`` where verl stores the carried ``lastgae``; nothing reads
    those positions (losses and whitening are masked), and ``g`` is what the native kernel writes.
    """
    _check_2d("rewards", rewards)
    _check_2d("values", values, rewards.shape)
    _check_2d("mask", mask, rewards.shape)
    fn = _pick_native(backend, "gae", rewards, values, mask)
    if fn is not None:
        adv, ret = fn(_np_f32(rewards), _np_f32(values), _np_f32(mask), float(gamma), float(lam))
        return _back(adv, rewards), _back(ret, rewards)

    m = mask.to(dtype=rewards.dtype)
    batch, length = rewards.shape
    adv = torch.empty_like(rewards)
    nextvalue = rewards.new_zeros(batch)
    lastgae = rewards.new_zeros(batch)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * nextvalue - values[:, t]
        g = delta + gamma * lam * lastgae
        nextvalue = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalue
        lastgae = g * m[:, t] + (1 - m[:, t]) * lastgae
        adv[:, t] = g
    return adv, adv + values


@torch.no_grad()
def group_outcome_advantage(
    scores: torch.Tensor,
    group_ids: torch.Tensor | np.ndarray,
    mode: str,
    eps: float = 1e-6,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Per-sample advantage of a scalar score relative to its group (the n samples of a prompt).

    ``scores`` [B]; ``group_ids`` [B] int64 (any values; samples with equal id form a group).
    With mean and unbiased std taken within the group of size n:

    - ``"grpo"``: (s - mean) / (std + eps)
    - ``"drgrpo"``: s - mean (Dr.GRPO drops the std normalisation)
    - ``"rloo"``: s * n/(n-1) - mean * n/(n-1), i.e. s minus the mean of the *other* samples
    - ``"reinforce_plus_plus_baseline"``: s - mean

    A group of one sample keeps its raw score in every mode. verl does the same by setting the
    singleton mean to 0 and std to 1 (for grpo that gives s/(1+eps), which we round to s so the
    rule is the same for every mode and the native kernel).

    Vectorised with ``index_add`` over compacted group ids; no Python loop over groups.
    Statistics are computed in float64 and cast back to the scores' dtype.
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"unknown group advantage mode {mode!r}; choose one of {list(GROUP_MODES)}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [batch], got shape {tuple(scores.shape)}")
    gid = torch.as_tensor(np.asarray(group_ids) if not torch.is_tensor(group_ids) else group_ids)
    if gid.dim() != 1 or gid.shape[0] != scores.shape[0]:
        raise ValueError(f"group_ids must be 1-D with {scores.shape[0]} entries, got shape {tuple(gid.shape)}")
    if gid.is_floating_point() or gid.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got dtype {gid.dtype}")
    gid = gid.to(dtype=torch.int64)

    fn = _pick_native(backend, "group_advantages", scores)
    if fn is not None:
        out = fn(_np_f32(scores), np.ascontiguousarray(gid.cpu().numpy()), mode, float(eps))
        return _back(out, scores)

    if scores.numel() == 0:
        return scores.detach().clone()
    s = scores.detach().to(dtype=torch.float64)
    _, inv = torch.unique(gid.to(s.device), return_inverse=True)
    n_groups = int(inv.max()) + 1
    count = s.new_zeros(n_groups).index_add_(0, inv, torch.ones_like(s))
    mean = s.new_zeros(n_groups).index_add_(0, inv, s) / count
    n_i, mean_i = count[inv], mean[inv]
    if mode == "grpo":
        sq = s.new_zeros(n_groups).index_add_(0, inv, (s - mean_i) ** 2)
        std_i = torch.sqrt(sq / (count - 1).clamp(min=1))[inv]
        out = (s - mean_i) / (std_i + eps)
    elif mode == "rloo":
        k = n_i / (n_i - 1).clamp(min=1)
        out = s * k - mean_i * k
    else:  # drgrpo, reinforce_plus_plus_baseline
        out = s - mean_i
    out = torch.where(n_i > 1, out, s)
    return out.to(dtype=scores.dtype)


@torch.no_grad()
def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, backend: Backend = "auto"
) -> torch.Tensor:
    """REINFORCE++ discounted return-to-go, [B, T], as verl computes it.

    Backwards per row from ``running = 0``: ``running = r[t] + gamma * running``;
    ``out[t] = running``; then ``running *= m[t]``, so a masked token cuts the sum
    (the return does not flow back across padding or observation tokens).
    """
    _check_2d("rewards", rewards)
    _check_2d("mask", mask, rewards.shape)
    fn = _pick_native(backend, "discounted_returns", rewards, mask)
    if fn is not None:
        return _back(fn(_np_f32(rewards), _np_f32(mask), float(gamma)), rewards)

    m = mask.to(dtype=rewards.dtype)
    out = torch.empty_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
        running = running * m[:, t]
    return out


def group_ids_from_uids(uids: Sequence[str] | np.ndarray) -> np.ndarray:
    """Map prompt uids to int64 group ids 0, 1, 2, ... in order of first appearance."""
    arr = np.asarray(uids)
    if arr.ndim != 1:
        raise ValueError(f"uids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    _, first, inv = np.unique(arr, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
    return rank[inv.reshape(-1)]


# ----------------------------------------------------------------------------- estimator registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# What an estimator reads beyond the rewards and the response mask (keywords of compute_advantage):
# a run must supply them (the critic's values, ReMax's greedy baseline, the prompt of each sample).
EstimatorInput = Literal["values", "group_ids", "reward_baselines"]
_ESTIMATORS: dict[str, AdvantageEstimator] = {}
_INPUTS: dict[str, frozenset[str]] = {}


def register_advantage_estimator(
    name: str, *, overwrite: bool = False, reads: Sequence[EstimatorInput] = ()
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register ``fn(**kwargs) -> (advantages, returns)`` under ``name``.

    The function receives every keyword of :func:`compute_advantage` plus ``name`` (take
    ``**_`` for the ones you don't use). ``reads``: the inputs it needs beyond the rewards
    ("values": only a run with a critic has them; "reward_baselines": ReMax's greedy baseline,
    which the recipe then generates; "group_ids"). Registering a taken name raises unless
    ``overwrite=True``.
    """
    unknown = set(reads) - set(get_args(EstimatorInput))
    if unknown:
        raise ValueError(f"advantage estimator {name!r}: unknown inputs {sorted(unknown)}; known: {get_args(EstimatorInput)}")

    def deco(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _ESTIMATORS and _ESTIMATORS[name] is not fn and not overwrite:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        _INPUTS[name] = frozenset(reads)
        return fn

    return deco


def advantage_estimator_names() -> list[str]:
    return sorted(_ESTIMATORS)


def advantage_estimator_inputs(name: str) -> frozenset[str]:
    """What estimator ``name`` reads beyond the rewards (see `register_advantage_estimator`)."""
    get_advantage_estimator(name)
    return _INPUTS[name]


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    try:
        return _ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {advantage_estimator_names()}"
        ) from None


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_ids: torch.Tensor | np.ndarray | Sequence[str] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    reward_baselines: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator ``name``: returns ``(advantages, returns)``, each [B, T].

    ``group_ids`` may be int ids or the per-sample uid strings (mapped with
    :func:`group_ids_from_uids`). Outcome estimators use the scalar score
    ``token_level_rewards.sum(-1)`` and broadcast the advantage over the response mask.
    """
    _check_2d("token_level_rewards", token_level_rewards)
    _check_2d("response_mask", response_mask, token_level_rewards.shape)
    fn = get_advantage_estimator(name)
    return fn(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        values=values,
        group_ids=group_ids,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std=norm_adv_by_std,
        epsilon=epsilon,
        reward_baselines=reward_baselines,
        backend=backend,
        name=name,
    )


def _group_ids(group_ids: Any, batch: int, name: str) -> torch.Tensor:
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (the prompt uid of each sample)")
    if torch.is_tensor(group_ids):
        gid: torch.Tensor = group_ids
    else:
        arr = np.asarray(group_ids)
        if arr.dtype.kind not in "iu":
            arr = group_ids_from_uids(arr)
        gid = torch.from_numpy(arr.astype(np.int64, copy=False))
    if gid.shape != (batch,):
        raise ValueError(f"group_ids must have shape ({batch},), got {tuple(gid.shape)}")
    return gid


def _outcome(scores_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores_adv.unsqueeze(-1) * mask.to(dtype=scores_adv.dtype)


@register_advantage_estimator("gae", reads=("values",))
@torch.no_grad()
def _gae(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None,
    gamma: float,
    lam: float,
    backend: Backend = "auto",
    name: str = "gae",
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE. Advantages whitened over all valid tokens of the batch; returns raw (adv + V).

    Differs from verl only at padding: we zero the whitened advantages outside the mask
    (verl leaves -mean/std there); losses never read those positions.
    """
    if values is None:
        raise ValueError(f"advantage estimator {name!r} needs values (the critic's predictions)")
    _check_2d("values", values, token_level_rewards.shape)
    adv, returns = gae_raw(token_level_rewards, values, response_mask, gamma, lam, backend=backend)
    m = response_mask.to(dtype=adv.dtype)
    return masked_whiten(adv, m) * m, returns


def _group_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Any,
    mode: str,
    epsilon: float,
    backend: Backend,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    gid = _group_ids(group_ids, token_level_rewards.shape[0], name)
    scores = token_level_rewards.sum(dim=-1)
    adv = _outcome(group_outcome_advantage(scores, gid, mode, epsilon, backend=backend), response_mask)
    return adv, adv


@register_advantage_estimator("grpo", reads=("group_ids",))
@torch.no_grad()
def _grpo(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: Any,
          norm_adv_by_std: bool = True, epsilon: float = 1e-6, backend: Backend = "auto", name: str = "grpo",
          **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage; ``norm_adv_by_std=False`` is Dr.GRPO. Returns == advantages."""
    mode = "grpo" if norm_adv_by_std else "drgrpo"
    return _group_estimator(token_level_rewards, response_mask, group_ids, mode, epsilon, backend, name)


@register_advantage_estimator("drgrpo", reads=("group_ids",))
@torch.no_grad()
def _drgrpo(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: Any,
            epsilon: float = 1e-6, backend: Backend = "auto", name: str = "drgrpo",
            **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: group mean subtracted, no std normalisation (whatever ``norm_adv_by_std`` says)."""
    return _group_estimator(token_level_rewards, response_mask, group_ids, "drgrpo", epsilon, backend, name)


@register_advantage_estimator("rloo", reads=("group_ids",))
@torch.no_grad()
def _rloo(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: Any,
          epsilon: float = 1e-6, backend: Backend = "auto", name: str = "rloo",
          **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean score of the other samples of the prompt."""
    return _group_estimator(token_level_rewards, response_mask, group_ids, "rloo", epsilon, backend, name)


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def _reinforce_pp(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
                  backend: Backend = "auto", **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the batch's valid tokens (zero on padding)."""
    returns = discounted_returns(token_level_rewards, response_mask, gamma, backend=backend)
    m = response_mask.to(dtype=returns.dtype)
    return masked_whiten(returns, m) * m, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", reads=("group_ids",))
@torch.no_grad()
def _reinforce_pp_baseline(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: Any,
                           epsilon: float = 1e-6, backend: Backend = "auto",
                           name: str = "reinforce_plus_plus_baseline",
                           **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline: group mean subtracted from the score, broadcast over the
    response, then whitened over all valid tokens of the batch (as verl). Returns == advantages."""
    gid = _group_ids(group_ids, token_level_rewards.shape[0], name)
    scores = token_level_rewards.sum(dim=-1)
    centred = group_outcome_advantage(scores, gid, "reinforce_plus_plus_baseline", epsilon, backend=backend)
    m = response_mask.to(dtype=centred.dtype)
    adv = masked_whiten(_outcome(centred, m), m) * m
    return adv, adv


@register_advantage_estimator("remax", reads=("reward_baselines",))
@torch.no_grad()
def _remax(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
           reward_baselines: torch.Tensor | None, name: str = "remax",
           **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return-to-go (undiscounted) minus the greedy rollout's reward, per token."""
    if reward_baselines is None:
        raise ValueError(f"advantage estimator {name!r} needs reward_baselines (the greedy sample's score, [B])")
    batch = token_level_rewards.shape[0]
    if reward_baselines.shape != (batch,):
        raise ValueError(f"reward_baselines must have shape ({batch},), got {tuple(reward_baselines.shape)}")
    m = response_mask.to(dtype=token_level_rewards.dtype)
    returns = (token_level_rewards * m).flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * m
    return adv, returns
