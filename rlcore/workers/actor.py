"""Actor and reference workers: log-probs of responses, the PPO-style policy update, the
preference (DPO / KTO) update, the supervised (SFT) update.

A worker method does one thing to the batch it is given and returns a batch (or metrics);
what happens next is the trainer's decision. The loops themselves are `rlcore.workers.loops`;
the actor supplies the loss of one micro-batch (`PolicyObjective`, a preference objective, `SFTObjective`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from rlcore.algorithms import PreferenceObjective
from rlcore.algos import agg_loss, get_policy_loss, kl_loss
from rlcore.algos.policy_loss import PolicyLoss, behaviour_weights
from rlcore.config import ActorConfig, RefConfig, RoleSpec, require_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.protocol import Batch
from rlcore.workers.checkpointing import adapter_folder, load_training_state, save_trained
from rlcore.workers.compile import compile_decoder_layers, compile_wanted
from rlcore.workers.forward import POLICY_FORWARD_METHODS
from rlcore.workers.fsdp import iter_full_state, plan_buckets
from rlcore.workers.liger import apply_liger_kernels
from rlcore.workers.loading import compute_precision, load_causal_lm, resolve_device, trained_dtype
from rlcore.workers.loops import (
    GlobalCounts,
    MicroBatching,
    MicroLoss,
    MicroLossFn,
    UpdateResult,
    UpdateSettings,
    mean_stats,
    run_update,
)
from rlcore.workers.lora import Adapter, apply_lora, parameter_counts
from rlcore.workers.memory import largest_micro_batch, resolve_budget, role_budget, role_cost, track_trained
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.packed import forward_token_metrics
from rlcore.workers.parallel.apply import apply_role_layout
from rlcore.workers.parallel.reshard import gather_to_owner
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.preference import preference_objective
from rlcore.workers.sft import SFTObjective
from rlcore.workers.trainable import Trainable


@dataclass(frozen=True)
class PolicyObjective:
    """The actor's loss on one micro-batch: the policy loss (clipped surrogate, optionally with
    truncated importance weights against the rollout engine), minus the entropy bonus, plus the
    KL loss to the reference.

    `old_from_current`: an exactly on-policy step, whose batch carries no old log-probs: this
    forward's log-probs, detached, stand in for them (ratio 1 at the one optimizer step) and come
    back with their entropy as per-row outputs, in place of the no-grad pass that would have
    computed the same numbers."""

    config: ActorConfig
    policy_loss: PolicyLoss
    log_probs: PolicyLogProbs
    model: nn.Module
    old_from_current: bool = False

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        return partial(self.micro_loss, norm=dict(global_token_count=counts.tokens, global_seq_count=counts.rows))

    def micro_loss(self, mb: Batch, norm: dict[str, float]) -> MicroLoss:
        cfg = self.config
        mask = mb["response_mask"].float()
        logp, entropy = self.log_probs(self.model, mb, compute_entropy=cfg.entropy_coeff != 0 or self.old_from_current)
        old = logp.detach() if self.old_from_current else mb["old_log_probs"]
        is_weights = None
        if "rollout_log_probs" in mb:
            is_weights = behaviour_weights(old, mb["rollout_log_probs"], cfg.behaviour_correction, cfg.tis_cap)
        loss, pg_metrics = self.policy_loss(
            old,
            logp,
            mb["advantages"],
            mask,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            rollout_is_weights=is_weights,
            **norm,
        )
        terms = {}
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, **norm)
        if cfg.use_kl_loss:
            kl = kl_loss(logp, mb["ref_log_probs"], mask, cfg.kl_loss_type, cfg.loss_agg_mode, **norm)
            loss = loss + cfg.kl_loss_coef * kl
            terms["kl_loss"] = float(kl.detach())
        outputs = {"old_log_probs": old, "entropy": entropy.detach()} if self.old_from_current and entropy is not None else {}
        return MicroLoss(loss, terms, mean_stats(pg_metrics, float(mask.sum())), outputs)


class ActorWorker(Worker):
    """The trained policy: log-probs under the current weights, the policy, preference and supervised updates,
    its weights for the rollout engine, checkpoints. FSDP2 when its group has a process group.

    With LoRA (`actor.lora`) only the adapter trains, and this worker also serves the reference
    role: `compute_ref_log_prob` runs its own model with the adapter disabled, the base weights
    it already holds (no second copy). The rollout engine then gets the merged weights of the
    adapted modules only, or the adapter itself (`rollout.lora_sync`)."""

    def __init__(self, spec: RoleSpec[ActorConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="actor")
        self.spec: RoleSpec[ActorConfig] = require_spec(spec, "actor")
        self.ranks_per_shard = self.spec.layout.ranks_per_shard  # a sequence/tensor-parallel group shares its rows
        self.device = resolve_device(self.spec.device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.adapter: Adapter | None = None
        self.budget = role_budget(self.spec)  # `actor.max_tokens_per_micro_batch: auto`, sized on first use

    def setup(self, model_path: str | None = None, adapter_dir: str | None = None) -> None:
        """Load the model (`model.path`, or a checkpoint's); with `actor.lora`, add the adapter
        (restored from `adapter_dir` on resume) before sharding."""
        spec, actor = self.spec, self.spec.section
        model = load_causal_lm(model_path or spec.model_path, trained_dtype(spec.model), self.device, spec.model.gradient_checkpointing,
                               spec.model.use_remove_padding)
        if actor.liger_kernel:
            apply_liger_kernels(model, self.device)
        precision = compute_precision(spec.model, spec.mixed_precision)
        self.adapter = (apply_lora(model, actor.lora, "actor.lora", seed=spec.seed, mixed_precision=precision != "none")
                        if actor.lora.enabled else None)
        if self.adapter is not None and adapter_dir is not None:
            self.adapter.load(Path(adapter_dir))
        self.param_counts = parameter_counts(model)
        # tensor / sequence parallelism, then FSDP2 when this group has a process group (or, on one
        # rank, when bf16/offload is asked for)
        self.model = apply_role_layout(model, spec, self.device, mixed_precision=precision,
                                       cpu_offload=actor.cpu_offload, forward_methods=POLICY_FORWARD_METHODS,
                                       cast_once=actor.cast_once)
        if compile_wanted(actor.compile, self.device, tensor_parallel=spec.layout.tensor_parallel, liger=actor.liger_kernel):
            compile_decoder_layers(self.model, fall_back=actor.compile == "auto")
        self.optimizer = build_optimizer(self.model, actor.optim)
        self.scheduler = build_scheduler(self.optimizer, actor.optim, spec.total_steps)
        self.policy_loss = get_policy_loss(actor.policy_loss)
        track_trained(self.model, self.optimizer)  # other roles' `auto` micro-batches leave room for its first step

    @property
    def trained(self) -> Trainable:
        return Trainable(self.model, self.optimizer, self.scheduler, self.adapter)

    @property
    def log_probs(self) -> PolicyLogProbs:
        return PolicyLogProbs.of(self.spec)  # read per call: the spec is the one source of settings

    @property
    def settings(self) -> UpdateSettings:
        budget = resolve_budget(self.budget, self.spec, self.device, self.model, self.optimizer)
        return UpdateSettings.of(self.spec.section, self.spec.model.shares_prompts, budget)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return self.log_probs.no_grad(self.model, batch, "old_log_probs", self.settings.micro, self.device, compute_entropy=True)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """The reference log-probs under LoRA: this worker's model with the adapter disabled, i.e.
        the base it was loaded from (as `ReferenceWorker` computes them, micro-batched alike)."""
        if self.adapter is None:
            raise RuntimeError("ActorWorker.compute_ref_log_prob needs actor.lora (without it the reference is its own worker)")
        with self.adapter.disabled():
            return self.log_probs.no_grad(self.model, batch, "ref_log_probs", self.settings.micro, self.device)

    @register(dispatch=Dispatch.DP_BALANCED)
    def update_actor(self, batch: Batch, samples_per_prompt: int) -> dict[str, float]:
        """One training step: `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size`
        prompts, with their `samples_per_prompt` responses each (the generation's `SamplingParams.n`)."""
        objective = PolicyObjective(self.spec.section, self.policy_loss, self.log_probs, self.model)
        rows = self.settings.mini_batch_rows(samples_per_prompt, self.data_parallel_size)
        result = run_update(self.trained, batch, objective, self.settings, mini_batch_rows=rows, device=self.device)
        return self._policy_metrics(result, rows)

    @register(dispatch=Dispatch.DP_BALANCED)
    def update_actor_on_policy(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """`update_actor` on an exactly on-policy step (`Config.old_log_probs_from_update`), without
        old log-probs in the batch: one optimizer step on this rank's whole share, whose forward,
        detached, gives the old log-probs (ratio 1). Returns them with their entropy, as
        `compute_log_prob` would have, and the update's metrics."""
        if self.settings.epochs != 1:
            raise ValueError(f"update_actor_on_policy: actor.ppo_epochs={self.settings.epochs}; a second pass would "
                             "need the old log-probs of before the first step (actor.recompute_old_log_prob=always)")
        objective = PolicyObjective(self.spec.section, self.policy_loss, self.log_probs, self.model, old_from_current=True)
        result = run_update(self.trained, batch, objective, self.settings, mini_batch_rows=len(batch), device=self.device)
        return Batch(tensors=result.outputs), self._policy_metrics(result, len(batch))

    def _policy_metrics(self, result: UpdateResult, mini_rows: int) -> dict[str, float]:
        return {**{f"actor/{k}": v for k, v in result.metrics.items()}, "actor/pg_loss": result.loss, **self._step_metrics(result),
                **self._peak_metrics(result, mini_rows), **forward_token_metrics("actor", self.model, self.device)}

    def _peak_metrics(self, result: UpdateResult, mini_rows: int) -> dict[str, float]:
        """The update's device peak (CUDA), and that peak grown to the largest micro-batch a later
        RL step may pack (`largest_micro_batch`): what `rollout.sleep=auto` weighs."""
        if result.device_peak is None:
            return {}
        micro = self.settings.micro
        most = largest_micro_batch(self.spec.longest_sequence, dynamic=micro.dynamic, max_tokens=micro.max_tokens,
                                   rows_per_micro=micro.size, mini_rows=mini_rows)
        return result.peak_metrics("actor", most, role_cost(self.spec).per_token())

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_preference(self, batch: Batch, objective: PreferenceObjective) -> dict[str, float]:
        """One training step on a preference batch with `objective` (the algorithm's `AlgorithmTraits.objective`):
        `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` examples."""
        assert self.spec.preference is not None, "an SFT actor has no preference objective"
        loss = preference_objective(objective, self.spec.preference, self.log_probs, self.model, self.settings.micro, self.device)
        rows = self.settings.mini_batch_rows(1, self.data_parallel_size)
        result = run_update(
            self.trained, batch, loss, self.settings, mini_batch_rows=rows, device=self.device, lengths=loss.lengths
        )
        return {**result.metrics, "pref/loss": result.loss, **self._step_metrics(result),
                **forward_token_metrics("actor", self.model, self.device)}

    @register(dispatch=Dispatch.DP_BALANCED)
    def update_sft(self, batch: Batch) -> dict[str, float]:
        """One supervised optimizer step on the whole batch (`rlcore.data.sft.collate_sft`): its mean
        response-token negative log-likelihood (`SFTObjective`), micro-batched by the actor's token
        budget. `rlcore sft`'s step."""
        settings = UpdateSettings(1, len(batch), self.settings.micro, self.spec.section.optim.grad_clip)
        result = run_update(self.trained, batch, SFTObjective(self.log_probs, self.model), settings,
                            mini_batch_rows=len(batch), device=self.device)
        return {"train/loss": result.loss, "train/micro_batches": result.metrics.get("micro_batches", math.nan),
                **self._step_metrics(result), **forward_token_metrics("actor", self.model, self.device)}

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel shards: ranks over the sequence-parallel size (ranks of a group hold the same rows)."""
        return self.world_size // self.ranks_per_shard

    def _step_metrics(self, result: UpdateResult) -> dict[str, float]:
        return {**result.peak_metrics("actor"),
                "actor/grad_norm": result.grad_norm, "actor/lr": self.trained.lr, "actor/bad_updates": float(result.skipped_steps),
                "actor/param_norm": result.param_norm, "actor/param_norm_growth": result.param_norm_growth,
                "actor/nonfinite_state": result.nonfinite_state,
                "actor/trainable_params": float(self.param_counts[0]), "actor/total_params": float(self.param_counts[1])}

    @register(dispatch=Dispatch.COLLECTIVE, blocking=False)
    def weights_for_rollout(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights (rank 0's result). Sharded: gathered bucket by bucket on every rank.

        Non-blocking: the group returns a future, which `rollout.update_weights(future)` takes as
        it is (on Ray: straight from this worker to the rollout workers, not via the controller).
        `WorkerGroups.sync_weights` streams bucket by bucket instead."""
        keep = self.rank == 0
        if self.adapter is not None:  # the merged model, every tensor
            return self.adapter.merged_weights(list(self.adapter.base_state()), keep)
        return [item for bucket in iter_full_state(self.model, self._bucket_bytes, keep) for item in bucket]

    @register(dispatch=Dispatch.RANK_ZERO)
    def weight_bucket_plan(self) -> list[list[str]]:
        """Parameter names per weight-sync bucket (the same on every rank). With LoRA: only the
        tensors the adapter changes (`Adapter.sync_plan`)."""
        if self.adapter is not None:
            return self.adapter.sync_plan(self._bucket_bytes)
        return plan_buckets(self.model, self._bucket_bytes)

    @register(dispatch=Dispatch.COLLECTIVE)
    def gather_weight_bucket(self, names: list[str], on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """One bucket of full weights, for streaming them to the rollout engine (merged with LoRA).
        `on_device`: the engine shares this process and device, so the bucket stays on the device
        (one device-to-device copy into the engine, no round trip through host memory)."""
        if self.adapter is not None:
            return self.adapter.merged_weights(names, keep=self.rank == 0, on_device=on_device)
        return gather_to_owner(self.model, names, owner=0, on_device=on_device)[0]  # assembled on rank 0 only

    @register(dispatch=Dispatch.COLLECTIVE, blocking=False)
    def adapter_for_rollout(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The LoRA adapter's full tensors (peft's file names) and its config, for an engine that
        applies adapters itself (`rollout.lora_sync=adapter`); rank 0's result."""
        if self.adapter is None:
            raise RuntimeError("ActorWorker.adapter_for_rollout needs actor.lora")
        return self.adapter.state(keep=self.rank == 0), self.adapter.config_dict()

    @property
    def _bucket_bytes(self) -> int:
        return int(self.spec.section.weight_sync_bucket_mb * 2**20)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> None:
        save_trained(self.trained, Path(folder), "actor", self.rank, Path(tokenizer_dir) if tokenizer_dir else None)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        if self.spec.section.lora.enabled:  # the base from model.path, the adapter from the checkpoint
            self.setup(adapter_dir=str(Path(folder) / adapter_folder("actor")))
        else:
            self.setup(model_path=str(Path(folder) / "actor"))
        load_training_state(self.trained, Path(folder), "actor", self.device)


class ReferenceWorker(Worker):
    """A frozen copy of the starting policy, for KL and the preference losses (not started with
    LoRA: the actor serves the reference role from its own base weights)."""

    def __init__(self, spec: RoleSpec[RefConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="ref")
        self.spec: RoleSpec[RefConfig] = require_spec(spec, "ref")
        self.ranks_per_shard = self.spec.layout.ranks_per_shard  # `ref.layout`, else the actor's
        self.device = resolve_device(self.spec.device)
        self.model: nn.Module | None = None
        self.budget = role_budget(self.spec)  # the actor's key; sized for a forward on this worker's device

    def setup(self, model_path: str | None = None) -> None:
        spec = self.spec
        self.model = load_causal_lm(model_path or spec.model_path, spec.model.dtype, self.device,
                                    remove_padding=spec.model.use_remove_padding)
        self.model.requires_grad_(False)
        self.model = apply_role_layout(self.model, spec, self.device, forward_methods=POLICY_FORWARD_METHODS)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        log_probs = PolicyLogProbs.of(self.spec)
        budget = resolve_budget(self.budget, self.spec, self.device, self.model)
        assert self.spec.micro is not None
        micro = MicroBatching.of_spec(self.spec.micro, self.spec.model.shares_prompts, budget)
        return log_probs.no_grad(self.model, batch, "ref_log_probs", micro, self.device)
