"""Critic worker (PPO): values of the states before each response token, and the value update.

The loops are `rlcore.workers.loops`; the critic supplies the value loss of one micro-batch
(`ValueObjective`) and its own batch settings (`critic.*`, each defaulting to the actor's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from rlcore.algos import compute_value_loss
from rlcore.config import CriticConfig, RoleSpec, require_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.protocol import Batch
from rlcore.workers.checkpointing import adapter_folder, load_training_state, save_trained
from rlcore.workers.forward import response_values
from rlcore.workers.loading import compute_precision, load_value_model, resolve_device, trained_dtype
from rlcore.workers.loops import (
    GlobalCounts,
    MicroBatching,
    MicroLoss,
    MicroLossFn,
    UpdateSettings,
    forward_no_grad,
    mean_stats,
    run_update,
)
from rlcore.workers.lora import Adapter, apply_lora, parameter_counts
from rlcore.workers.memory import MicroBudget, largest_micro_batch, resolve_budget, role_budget, role_cost, track_trained
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.packed import forward_token_metrics
from rlcore.workers.parallel.apply import apply_role_layout
from rlcore.workers.trainable import Trainable


def critic_settings(spec: RoleSpec[CriticConfig], budget: MicroBudget | None = None) -> UpdateSettings:
    """The critic's update settings; a batch field left unset (None) is the actor's, as in verl
    (`role_spec` resolves them into `spec.micro` and `spec.mini_batch_size`). An `auto` token
    budget is `budget`'s (resolved by the worker)."""
    assert spec.micro is not None
    micro = MicroBatching.of_spec(spec.micro, spec.model.shares_prompts, budget)
    return UpdateSettings(spec.section.ppo_epochs, spec.mini_batch_size, micro, spec.section.optim.grad_clip)


@dataclass(frozen=True)
class ValueObjective:
    """The clipped value loss of one micro-batch (returns against the rollout-time values)."""

    config: CriticConfig
    model: nn.Module
    remove_padding: bool = True  # packed sequences (`model.use_remove_padding`)
    share_prompts: bool = False  # a packed row holds each prompt once (`model.share_prompt_prefix`)

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        return partial(self.micro_loss, norm=dict(global_token_count=counts.tokens, global_seq_count=counts.rows))

    def micro_loss(self, mb: Batch, norm: dict[str, float]) -> MicroLoss:
        mask = mb["response_mask"].float()
        loss, clipfrac = compute_value_loss(
            response_values(self.model, mb, self.remove_padding, self.share_prompts),
            mb["returns"],
            mb["values"],
            mask,
            cliprange_value=self.config.cliprange_value,
            loss_agg_mode=self.config.loss_agg_mode,
            **norm,
        )
        return MicroLoss(loss, stats=mean_stats({"vf_clipfrac": clipfrac}, float(mask.sum())))


class CriticWorker(Worker):
    """The value model (PPO): values for GAE, the clipped value update, checkpoints. FSDP2 when
    its group has a process group. With `critic.lora`, the backbone's adapter and the value head train."""

    def __init__(self, spec: RoleSpec[CriticConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="critic")
        self.spec: RoleSpec[CriticConfig] = require_spec(spec, "critic")
        self.ranks_per_shard = self.spec.layout.ranks_per_shard  # a sequence/tensor-parallel group shares its rows
        self.device = resolve_device(self.spec.device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.adapter: Adapter | None = None
        self.budget = role_budget(self.spec)  # an `auto` token budget, sized on first use

    def setup(self, model_path: str | None = None, adapter_dir: str | None = None) -> None:
        spec, critic = self.spec, self.spec.section
        path = model_path or spec.model_path
        model = load_value_model(path, trained_dtype(spec.model), self.device, spec.model.gradient_checkpointing,
                                 spec.model.use_remove_padding, seed=spec.seed)
        precision = compute_precision(spec.model)
        self.adapter = (apply_lora(model, critic.lora, "critic.lora", task="token_cls", seed=spec.seed,
                                   mixed_precision=precision != "none") if critic.lora.enabled else None)
        if self.adapter is not None and adapter_dir is not None:
            self.adapter.load(Path(adapter_dir))
        self.param_counts = parameter_counts(model)
        self.model = apply_role_layout(model, spec, self.device, mixed_precision=precision)  # TP / SP, FSDP2
        self.optimizer = build_optimizer(self.model, critic.optim)
        self.scheduler = build_scheduler(self.optimizer, critic.optim, spec.total_steps)
        track_trained(self.model, self.optimizer)  # other roles' `auto` micro-batches leave room for its first step

    @property
    def trained(self) -> Trainable:
        return Trainable(self.model, self.optimizer, self.scheduler, self.adapter)

    @property
    def settings(self) -> UpdateSettings:
        return critic_settings(self.spec, resolve_budget(self.budget, self.spec, self.device, self.model, self.optimizer))

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_values(self, batch: Batch) -> Batch:
        packed, share = self.spec.model.use_remove_padding, self.spec.model.shares_prompts
        out = forward_no_grad(self.model, batch, lambda mb: {"values": response_values(self.model, mb, packed, share)},
                              self.settings.micro, self.device)
        return Batch(tensors={"values": out["values"] * batch["response_mask"].float().cpu()})

    @register(dispatch=Dispatch.DP_BALANCED)
    def update_critic(self, batch: Batch, samples_per_prompt: int) -> dict[str, float]:
        """One training step: `critic.ppo_epochs` passes over mini-batches of `critic.ppo_mini_batch_size`
        prompts, with their `samples_per_prompt` responses each (the generation's `SamplingParams.n`)."""
        rows = self.settings.mini_batch_rows(samples_per_prompt, self.world_size // self.ranks_per_shard)
        objective = ValueObjective(self.spec.section, self.model, self.spec.model.use_remove_padding,
                                   self.spec.model.shares_prompts)
        result = run_update(self.trained, batch, objective, self.settings, mini_batch_rows=rows, device=self.device)
        out = {f"critic/{k}": v for k, v in result.metrics.items()}
        out.update({"critic/vf_loss": result.loss, "critic/grad_norm": result.grad_norm, "critic/bad_updates": float(result.skipped_steps),
                    "critic/trainable_params": float(self.param_counts[0]), "critic/total_params": float(self.param_counts[1])})
        if result.device_peak is not None:  # CUDA: what `rollout.sleep=auto` weighs (see ActorWorker._peak_metrics)
            micro = self.settings.micro
            most = largest_micro_batch(self.spec.longest_sequence, dynamic=micro.dynamic, max_tokens=micro.max_tokens,
                                       rows_per_micro=micro.size, mini_rows=rows)
            out.update(result.peak_metrics("critic", most, role_cost(self.spec).per_token()))
        out.update(forward_token_metrics("critic", self.model, self.device))
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        save_trained(self.trained, Path(folder), "critic", self.rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        if self.spec.section.lora.enabled:  # the base as at the start, the adapter and head from the checkpoint
            self.setup(adapter_dir=str(Path(folder) / adapter_folder("critic")))
        else:
            self.setup(model_path=str(Path(folder) / "critic"))
        load_training_state(self.trained, Path(folder), "critic", self.device)
