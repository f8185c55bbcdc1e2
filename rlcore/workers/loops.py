"""The two loops every trained role runs, written once: the update and the no-grad forward.

A worker supplies only what is its own: the loss of one micro-batch (an `Objective`) or the
forward of one micro-batch. What must be the same for every role lives here:

- micro-batches by token budget (native packing) or fixed size, made equal in number on every
  FSDP rank; a rank with fewer runs zero-weight passes on one real row, because FSDP gathers
  parameters inside each forward and a missing forward would leave the other ranks waiting;
- losses normalised by global (rank-summed) token and row counts and scaled by the number of
  ranks, because FSDP averages gradients: two ranks take exactly the step one process would;
- gradient clipping, and a step skipped (gradients dropped) when the loss or the gradient
  norm is not finite;
- the reported loss and statistics summed over ranks, so every rank reports the one-process value;
- an `auto` token budget (`rlcore.workers.memory.MicroBudget`) halved once when a pass of the
  role's first step runs out of device memory, and that pass's micro-batches run again: nothing
  of the failed attempt is counted (its gradients are dropped, its statistics never added).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

from rlcore.config import ActorConfig, MicroSpec
from rlcore.packing import pack_token_budget
from rlcore.protocol import Batch
from rlcore.workers.fsdp import drop_compute_copies, equalize_micro_batches
from rlcore.workers.memory import MicroBudget, PeakMeter
from rlcore.workers.packed import prompt_leaders
from rlcore.workers.parallel.tensors import clip_grad_norm
from rlcore.workers.ranks import RankSummedMeans, distributed_world, global_sums
from rlcore.workers.trainable import Trainable
from rlcore.workers.weight_health import weight_health


def attention_lengths(batch: Batch) -> torch.Tensor:
    """Tokens per row (prompt and response), what micro-batch packing budgets."""
    return batch["attention_mask"].sum(-1)


@dataclass(frozen=True)
class MicroBatching:
    """How a (mini-)batch is cut into micro-batches, one forward each."""

    size: int        # rows per micro-batch when not dynamic
    dynamic: bool    # pack rows into micro-batches of at most `max_tokens` tokens
    max_tokens: int
    share_prompts: bool = False  # packed rows hold a prompt once (`model.share_prompt_prefix`): keep its rows together
    budget: MicroBudget | None = field(default=None, compare=False, repr=False)  # `max_tokens` came from `auto`

    @classmethod
    def of(cls, section: ActorConfig, share_prompts: bool = False, budget: MicroBudget | None = None) -> MicroBatching:
        """From a config section with the actor's batch fields (`micro_batch_size`, ...); an
        `auto` token budget is `budget`'s (resolved by the worker)."""
        return cls(section.micro_batch_size, section.dynamic_batch_size,
                   budget_tokens(section.max_tokens_per_micro_batch, budget), share_prompts, budget)

    @classmethod
    def of_spec(cls, micro: MicroSpec, share_prompts: bool = False, budget: MicroBudget | None = None) -> MicroBatching:
        """From a role's `RoleSpec.micro`; an `auto` token budget is `budget`'s (resolved by the worker)."""
        return cls(micro.size, micro.dynamic, budget_tokens(micro.max_tokens, budget), share_prompts, budget)

    def can_shrink(self) -> bool:
        """Whether an out-of-memory error may halve this budget (`MicroBudget.may_halve`)."""
        return self.dynamic and self.budget is not None and self.budget.may_halve()

    def shrunk(self) -> MicroBatching:
        """This micro-batching with its `auto` budget halved (after `can_shrink`)."""
        assert self.budget is not None
        return replace(self, max_tokens=self.budget.halve())

    def first_step_done(self, kind: Literal["update", "forward"]) -> None:
        """A pass of `kind` finished: an `auto` budget is fixed from the end of its role's first
        step (an update; a forward for a forward-only role)."""
        if self.budget is not None and (kind == "update" or self.budget.forward_only):
            self.budget.first_step_done()

    def split(self, lengths: torch.Tensor, model: nn.Module, device: torch.device, batch: Batch | None = None) -> list[list[int]]:
        """Row indices per micro-batch; on FSDP ranks as many on every rank (some maybe empty).

        With `share_prompts` and a `batch` of sequences (`input_ids`, `responses`), the budget
        counts a prompt once for the rows of a micro-batch that share it, and packs those rows
        together (`prompt_units`) as far as the budget lets them be."""
        if self.dynamic:
            if self.share_prompts and batch is not None and "input_ids" in batch and "responses" in batch:
                p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
                real = batch["attention_mask"][:, :p].bool()
                leaders = prompt_leaders(batch["input_ids"][:, :p], real)
                units, tokens = prompt_units(leaders.tolist(), lengths.tolist(), real.sum(1).tolist(), self.max_tokens)
                groups = [sorted(i for u in b for i in units[u]) for b in pack_token_budget(np.asarray(tokens), self.max_tokens)]
            else:
                groups = [list(idx) for idx in pack_token_budget(lengths.cpu().numpy(), self.max_tokens)]
        else:
            n = len(lengths)
            groups = [list(range(i, min(n, i + self.size))) for i in range(0, n, self.size)]
        return equalize_micro_batches(groups, model, device)


def budget_tokens(value: int | str, budget: MicroBudget | None) -> int:
    """A `max_tokens_per_micro_batch` setting as tokens: a number as it is, `auto` as `budget`'s."""
    if value != "auto":
        return int(value)
    if budget is None or budget.tokens is None:
        raise ValueError("max_tokens_per_micro_batch=auto needs the worker's resolved budget (MicroBudget.resolve)")
    return budget.tokens


def prompt_units(leaders: list[int], lengths: list[int], prompt_lengths: list[int], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Rows cut into packing units and each unit's tokens: the rows of one prompt (same leader) in
    row order, a unit closed when the next row would take its tokens (the prompt once, plus each
    row's own) past `max_tokens`; a row alone may exceed it."""
    rows_of: dict[int, list[int]] = {}
    for i, lead in enumerate(leaders):
        rows_of.setdefault(lead, []).append(i)
    units: list[list[int]] = []
    tokens: list[int] = []
    for rows in rows_of.values():
        prompt, first = prompt_lengths[rows[0]], len(units)
        for i in rows:
            own = lengths[i] - prompt
            if len(units) > first and tokens[-1] + own <= max_tokens:
                units[-1].append(i)
                tokens[-1] += own
            else:
                units.append([i])
                tokens.append(lengths[i])
    return units, tokens


@dataclass(frozen=True)
class UpdateSettings:
    """A role's update: passes over the batch, examples per optimizer step, micro-batching, clip."""

    epochs: int
    mini_batch_size: int  # examples per optimizer step, over all ranks
    micro: MicroBatching
    grad_clip: float

    @classmethod
    def of(cls, section: ActorConfig, share_prompts: bool = False, budget: MicroBudget | None = None) -> UpdateSettings:
        """From a config section with the actor's batch fields (`ppo_epochs`, `ppo_mini_batch_size`, ...)."""
        return cls(section.ppo_epochs, section.ppo_mini_batch_size, MicroBatching.of(section, share_prompts, budget),
                   section.optim.grad_clip)

    def mini_batch_rows(self, rows_per_example: int, world_size: int) -> int:
        """Rows of one rank's mini-batch (an RL example is a prompt with `rollout.n` responses)."""
        return max(1, self.mini_batch_size * rows_per_example // world_size)


@dataclass(frozen=True)
class GlobalCounts:
    """Normalisers of one mini-batch, summed over ranks. The ranks of a sequence-parallel group
    hold the same rows and each counts them, so each one's share is 1/size of its group's loss and
    the shares still sum to the one-process loss (`rlcore.workers.ulysses`)."""

    tokens: float  # response tokens (`response_mask`); 0 for a batch without one
    rows: float


@dataclass
class MicroLoss:
    """What an objective returns for one micro-batch."""

    loss: torch.Tensor  # this micro-batch's share: shares sum to the mini-batch loss over micro-batches and ranks
    terms: dict[str, float] = field(default_factory=dict)  # further detached shares (a KL term), summed alike
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (sum, count), reported as means
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # detached per-row results, returned by the update


MicroLossFn = Callable[[Batch], MicroLoss]


class Objective(Protocol):
    """A role's loss: given one mini-batch and its global counts, the loss of each micro-batch."""

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn: ...


def value_stats(values: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per-element values (one per sequence, say) as (sum, count) statistics."""
    return {k: (float(v.float().sum()), float(v.numel())) for k, v in values.items()}


def mean_stats(means: dict[str, torch.Tensor], count: float) -> dict[str, tuple[float, float]]:
    """Means over `count` elements (masked token means) as (sum, count): pooled by element, not by micro-batch."""
    if not count:
        return {}
    return {k: (float(v) * count, count) for k, v in means.items()}


@dataclass(frozen=True)
class UpdateResult:
    loss: float         # mean over the steps taken of the (rank-summed) mini-batch loss; nan if none was
    grad_norm: float    # mean over the steps taken; nan if none was
    skipped_steps: int  # steps dropped for a non-finite loss or gradient norm
    metrics: dict[str, float]  # `terms` (mean over steps taken) and `stats` (pooled means)
    param_norm: float = math.nan   # L2 norm of all parameters after the update (over ranks)
    param_norm_growth: float = 1.0  # that norm after / before this update
    nonfinite_state: float = 0.0   # non-finite elements in parameters and optimizer state (over ranks)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # `MicroLoss.outputs` by batch row (last epoch's)
    device_peak: int | None = None  # CUDA: the update's device-wide peak bytes (`PeakMeter`); None elsewhere

    largest_micro_tokens: int = 0  # the most tokens one micro-batch of this update held

    def peak_metrics(self, role: str, most_tokens: int = 0, per_token: float = 0.0) -> dict[str, float]:
        """On CUDA (nothing elsewhere): `memory/<role>_update_device_peak_gib`, the measured peak, and
        `memory/<role>_update_device_bound_gib`, that peak grown to a micro-batch of `most_tokens`
        (the most a later step's micro-batch may hold) at `per_token` bytes each: what
        `rollout.sleep=auto` weighs, as responses grow after the step it measured."""
        if self.device_peak is None:
            return {}
        growth = max(0, most_tokens - self.largest_micro_tokens) * per_token
        return {f"memory/{role}_update_device_peak_gib": self.device_peak / 2**30,
                f"memory/{role}_update_device_bound_gib": (self.device_peak + growth) / 2**30}


def run_update(
    trained: Trainable,
    batch: Batch,
    objective: Objective,
    settings: UpdateSettings,
    *,
    mini_batch_rows: int,
    device: torch.device,
    lengths: Callable[[Batch], torch.Tensor] = attention_lengths,
) -> UpdateResult:
    """`settings.epochs` passes over `batch` in mini-batches of `mini_batch_rows`, one optimizer
    step each, then one scheduler step. `lengths` gives the tokens of each row for packing."""
    trained.model.train()
    batch = batch.to(device)
    norm_before, _ = weight_health(trained, device)
    stats = RankSummedMeans()
    outputs: dict[str, torch.Tensor] = {}
    taken: list[dict[str, float]] = []
    skipped = largest = 0
    with PeakMeter(device) as meter:
        for _ in range(settings.epochs):
            first = 0
            for mini in batch.split(mini_batch_rows):
                step, micro, tokens = _step_on(trained, mini, objective, settings, device, lengths, stats,
                                               RowSink(outputs, first, len(batch)))
                settings = replace(settings, micro=micro)  # halved after an out-of-memory error in the first step
                largest = max(largest, tokens)
                first += len(mini)
                if step is None:
                    skipped += 1
                else:
                    taken.append(step)
    settings.micro.first_step_done("update")
    trained.scheduler.step()
    means = {k: sum(s[k] for s in taken) / len(taken) for k in taken[0]} if taken else {}
    param_norm, nonfinite = weight_health(trained, device)
    return UpdateResult(
        loss=means.pop("loss", math.nan),
        grad_norm=means.pop("grad_norm", math.nan),
        skipped_steps=skipped,
        metrics={**means, **stats.means(device)},
        param_norm=param_norm,
        param_norm_growth=param_norm / norm_before if norm_before > 0 else 1.0,
        nonfinite_state=nonfinite,
        outputs=outputs,
        device_peak=meter.peak,
        largest_micro_tokens=largest,
    )


def _step_on(
    trained: Trainable,
    mini: Batch,
    objective: Objective,
    settings: UpdateSettings,
    device: torch.device,
    lengths: Callable[[Batch], torch.Tensor],
    stats: RankSummedMeans,
    sink: RowSink,
) -> tuple[dict[str, float] | None, MicroBatching, int]:
    """Accumulate the gradient of one mini-batch, clip, step. Returns its rank-summed loss, terms
    and gradient norm, or None when the step was skipped (every rank decides alike), the
    micro-batching it ran with (halved when the first attempt ran out of device memory), and the
    most tokens one of its micro-batches held."""
    tokens = float(mini["response_mask"].float().sum()) if "response_mask" in mini else 0.0
    counts = GlobalCounts(*global_sums([tokens, float(len(mini))], device))
    micro_loss = objective(mini, counts)
    micro = settings.micro
    while True:
        try:
            totals, counted, largest = _accumulate(trained, mini, micro_loss, micro, device, lengths, sink)
            break
        except torch.cuda.OutOfMemoryError:
            if not micro.can_shrink():
                drop_compute_copies(trained.model)
                raise
        trained.optimizer.zero_grad(set_to_none=True)  # outside the handler: the failed pass's tensors are freed
        drop_compute_copies(trained.model)  # and the compute copies it kept (`actor.cast_once`)
        micro = micro.shrunk()
    drop_compute_copies(trained.model)  # kept across the micro-batches (`actor.cast_once`); the step changes the masters
    for name, total, count in counted:
        stats.add(name, total, count)
    names = sorted(totals)
    summed = dict(zip(names, global_sums([totals[n] for n in names], device)))
    grad_norm = clip_grad_norm(trained.model.parameters(), settings.grad_clip)
    if not (math.isfinite(summed["loss"]) and torch.isfinite(grad_norm)):
        trained.optimizer.zero_grad(set_to_none=True)
        return None, micro, largest
    trained.optimizer.step()
    return {**summed, "grad_norm": float(grad_norm)}, micro, largest


def _accumulate(
    trained: Trainable,
    mini: Batch,
    micro_loss: MicroLossFn,
    micro: MicroBatching,
    device: torch.device,
    lengths: Callable[[Batch], torch.Tensor],
    sink: RowSink,
) -> tuple[dict[str, float], list[tuple[str, float, float]], int]:
    """One mini-batch's gradient, from dropped gradients, micro-batch by micro-batch: its summed
    loss and terms, the statistics to count (added by the caller once the pass succeeded), and the
    most tokens one micro-batch held."""
    scale = float(distributed_world())  # FSDP averages gradients over ranks; the shares sum to the loss
    trained.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = defaultdict(float)
    counted: list[tuple[str, float, float]] = []
    row_tokens = lengths(mini)
    largest = 0
    for idx in micro.split(row_tokens, trained.model, device, mini):
        out = micro_loss(mini.take(idx or [0]))
        (out.loss * (scale if idx else 0.0)).backward()  # empty share: zero-weight pass for FSDP
        if not idx:
            continue
        largest = max(largest, int(row_tokens[idx].sum()))
        totals["loss"] += float(out.loss.detach())
        for name, value in out.terms.items():
            totals[name] += value
        counted += [(name, total, count) for name, (total, count) in out.stats.items()]
        sink.write(out.outputs, idx)  # rows written again by a retried pass are overwritten
    return totals, counted, largest


@dataclass(frozen=True)
class RowSink:
    """Where per-row results of micro-batches go: float32 CPU tensors of `total` rows, a
    micro-batch's row i landing at row `first + idx[i]` (`first`: its mini-batch's first row)."""

    out: dict[str, torch.Tensor]
    first: int
    total: int

    def write(self, values: dict[str, torch.Tensor], idx: list[int]) -> None:
        rows = [self.first + i for i in idx]
        for key, value in values.items():
            if key not in self.out:
                self.out[key] = torch.zeros((self.total, *value.shape[1:]), dtype=torch.float32)
            self.out[key][rows] = value.detach().float().cpu()


@torch.no_grad()
def forward_no_grad(
    model: nn.Module,
    batch: Batch,
    forward: Callable[[Batch], dict[str, torch.Tensor]],
    micro: MicroBatching,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """`forward` over the micro-batches of `batch` in eval mode, each result (rows first) written
    back to its rows: float32 CPU tensors of `len(batch)` rows. The model's mode is restored."""
    was_training = model.training
    model.eval()
    batch = batch.to(device)
    out: dict[str, torch.Tensor] = {}
    sink = RowSink(out, 0, len(batch))
    try:
        while True:
            try:
                for idx in micro.split(attention_lengths(batch), model, device, batch):
                    if not idx:  # keeps FSDP ranks in step; result unused
                        forward(batch.take([0]))
                        continue
                    sink.write(forward(batch.take(idx)), idx)
                break
            except torch.cuda.OutOfMemoryError:
                if not micro.can_shrink():
                    raise
            micro = micro.shrunk()  # every row is written again
    finally:
        drop_compute_copies(model)
        model.train(was_training)
    micro.first_step_done("forward")
    return out

