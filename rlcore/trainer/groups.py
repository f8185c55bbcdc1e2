"""What the control flow sees of the workers: one typed interface per role, and `WorkerGroups`.

A recipe calls `groups.actor.update_actor(batch, sampling.n)`; at run time that goes through the group's
dispatch (`rlcore.controller.WorkerGroup.__getattr__`: the batch split over ranks, the results
gathered), which no type checker can follow. These Protocols say what each call takes and gives
back *through the group*, so mypy checks the recipe layer against them:

- a data-parallel method returning a Batch gives the whole batch back, in order; one returning
  metrics gives one dict per data-parallel rank (`rlcore.trainer.metrics.mean_over_ranks`); one
  returning both, `(Batch, metrics)`, gives the whole batch and one dict per data-parallel rank;
- a method run on every rank (ONE_TO_ALL) gives one result per rank; a collective or rank-0
  method gives one result;
- a non-blocking method gives a `GroupFuture` of it, and so does `<method>_async` of any method
  (`.result()` waits); an argument may be such a future (`Deferred`): the group waits for it, or
  on Ray hands it from worker to worker without passing through the controller.

`tests/test_group_interfaces.py` derives every signature here from the worker's own method and its
`@register` dispatch, both ways, so an interface cannot drift from its worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypeVar

import torch

from rlcore.algorithms import PreferenceObjective
from rlcore.controller import GroupFuture, RoleView, WorkerGroup
from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.rollout.base import WeightSwitch

T = TypeVar("T")
G = TypeVar("G")
Deferred: TypeAlias = T | GroupFuture[T]  # a value, or a future of it another group is still computing
NamedTensors: TypeAlias = list[tuple[str, torch.Tensor]]
Adapter: TypeAlias = tuple[dict[str, torch.Tensor], dict[str, Any]]  # LoRA tensors (peft's names) and config
Metrics: TypeAlias = dict[str, float]


class ReferenceGroup(Protocol):
    """The frozen starting policy (`workers.actor.ReferenceWorker`)."""

    def compute_ref_log_prob(self, batch: Batch) -> Batch: ...


class ActorGroup(ReferenceGroup, Protocol):
    """The policy being trained (`workers.actor.ActorWorker`); with LoRA also the reference (its base
    with the adapter disabled: `compute_ref_log_prob`)."""

    def compute_log_prob(self, batch: Batch) -> Batch: ...
    def update_actor(self, batch: Batch, samples_per_prompt: int) -> list[Metrics]: ...
    def update_actor_on_policy(self, batch: Batch) -> tuple[Batch, list[Metrics]]: ...
    def update_preference(self, batch: Batch, objective: PreferenceObjective) -> list[Metrics]: ...
    def update_sft(self, batch: Batch) -> list[Metrics]: ...
    def weight_bucket_plan(self) -> list[list[str]]: ...
    def gather_weight_bucket(self, names: list[str], on_device: bool = False) -> NamedTensors: ...
    def gather_weight_bucket_async(self, names: list[str], on_device: bool = False) -> GroupFuture[NamedTensors]: ...
    def weights_for_rollout(self) -> GroupFuture[NamedTensors]: ...
    def adapter_for_rollout(self) -> GroupFuture[Adapter]: ...
    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> list[None]: ...
    def load_checkpoint(self, folder: str) -> list[None]: ...


class CriticGroup(Protocol):
    """PPO's value model (`workers.critic.CriticWorker`)."""

    def compute_values(self, batch: Batch) -> Batch: ...
    def update_critic(self, batch: Batch, samples_per_prompt: int) -> list[Metrics]: ...
    def save_checkpoint(self, folder: str) -> list[None]: ...
    def load_checkpoint(self, folder: str) -> list[None]: ...


class RolloutGroup(Protocol):
    """The generation engine (`workers.rollout.RolloutWorker`)."""

    def generate_sequences(self, batch: Batch, sampling: SamplingParams) -> Batch: ...
    def generate_sequences_async(self, batch: Batch, sampling: SamplingParams) -> GroupFuture[Batch]: ...
    def load_model(self, model_path: str) -> list[None]: ...
    def begin_weight_sync(self, names: list[str]) -> list[None]: ...
    def update_weights(self, named_tensors: Deferred[Iterable[tuple[str, torch.Tensor]]]) -> list[None]: ...
    def set_weight_switch(self, switch: WeightSwitch | None) -> list[None]: ...
    def generate_seconds(self) -> list[float]: ...
    def load_adapter(self, adapter: Deferred[Adapter]) -> list[None]: ...
    def sleep(self) -> list[dict[str, float]]: ...
    def wake(self) -> list[None]: ...


class RewardGroup(Protocol):
    """The rule scorer (`workers.reward.RewardWorker`)."""

    def compute_reward(self, batch: Batch) -> tuple[Batch, dict[str, float | str]]: ...


class RewardModelGroup(Protocol):
    """A reward model (`workers.reward_model.RewardModelWorker`): scoring RL samples, or trained on pairs."""

    def compute_rm_score(self, batch: Batch) -> Batch: ...
    def compute_rm_score_async(self, batch: Batch) -> GroupFuture[Batch]: ...
    def update_reward_model(self, batch: Batch) -> list[Metrics]: ...
    def score_pairs(self, batch: Batch) -> Batch: ...
    def save_checkpoint(self, folder: str) -> list[None]: ...
    def load_checkpoint(self, folder: str) -> list[None]: ...


# role -> its interface (the test above checks each against the worker classes that serve the role)
INTERFACES: dict[str, type] = {"actor": ActorGroup, "ref": ReferenceGroup, "critic": CriticGroup, "rollout": RolloutGroup,
                               "reward": RewardGroup, "reward_model": RewardModelGroup}


@dataclass
class WorkerGroups:
    """The groups of a run (`Config.present_roles`). Policy runs have actor, rollout and reward (and
    ref, critic, reward_model as configured); a reward-model training run has only reward_model,
    which is then the trained role. Built by `rlcore.trainer.roles.build_worker_groups`."""

    actor: ActorGroup | None = None
    rollout: RolloutGroup | None = None
    reward: RewardGroup | None = None
    ref: ReferenceGroup | None = None
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)  # pools, a Ray we started
    weight_sync: str = "full"  # `Config.lora_sync`: every tensor, LoRA's merged modules, or the adapter
    # the rollout engine lives in the actor's process (one rank each, in process): buckets stay on the
    # device and are copied device to device, never through host memory
    same_process_sync: bool = False

    @classmethod
    def of(cls, handles: dict[str, WorkerGroup | RoleView], **kwargs: Any) -> WorkerGroups:
        """The typed view of groups built by role name: where the dynamic dispatch meets the interfaces."""
        unknown = set(handles) - set(INTERFACES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; roles: {list(INTERFACES)}")
        typed: dict[str, Any] = dict(handles)  # each handle answers its role's interface through its dispatch
        return cls(**typed, **kwargs)

    @property
    def trains_reward_model(self) -> bool:
        return self.actor is None and self.reward_model is not None

    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> None:
        if self.trains_reward_model:
            required(self.reward_model, "reward_model").save_checkpoint(folder)
            return
        required(self.actor, "actor").save_checkpoint(folder, tokenizer_dir=tokenizer_dir)
        if self.critic is not None:
            self.critic.save_checkpoint(folder)

    def load_checkpoint(self, folder: str) -> None:
        """The trained roles from the checkpoint (actor and critic; or the reward model being
        trained); the rollout engine restarts on the saved policy (with LoRA: keeps the base it
        started on and gets the restored adapter's weights)."""
        if self.trains_reward_model:
            required(self.reward_model, "reward_model").load_checkpoint(folder)
            return
        required(self.actor, "actor").load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder)
        if self.rollout is None:  # a supervised run: nothing generates
            return
        if self.weight_sync == "full":
            self.rollout.load_model(str(Path(folder) / "actor"))
        else:
            self.sync_weights()

    def sync_weights(self) -> None:
        """Actor -> rollout, one bucket at a time (`actor.weight_sync_bucket_mb`): on Ray each bucket
        goes worker to worker through the object store, never through the controller. With LoRA
        only what the adapter changes: the merged adapted modules, or the adapter itself."""
        actor, rollout = required(self.actor, "actor"), required(self.rollout, "rollout")
        if self.weight_sync == "adapter":
            rollout.load_adapter(actor.adapter_for_rollout())
            return
        plan = actor.weight_bucket_plan()
        if self.weight_sync == "merged":  # only part of the model: the engine can finish when it is in
            rollout.begin_weight_sync([name for names in plan for name in names])
        for names in plan:
            rollout.update_weights(actor.gather_weight_bucket_async(names, on_device=self.same_process_sync))

    def close(self) -> None:
        seen: set[int] = set()
        try:
            for handle in (self.actor, self.rollout, self.reward, self.ref, self.critic, self.reward_model):
                group: object = handle.group if isinstance(handle, RoleView) else handle  # a colocated role's own group
                shutdown = getattr(group, "shutdown", None)
                if callable(shutdown) and id(group) not in seen:
                    seen.add(id(group))
                    shutdown()
        finally:
            for fn in reversed(self.on_close):
                fn()
            self.on_close.clear()


def required(group: G | None, role: str) -> G:
    """`group`, which this run must have: a missing one is an error naming the role."""
    if group is None:
        raise RuntimeError(f"this run has no {role} worker group")
    return group


__all__ = [
    "ActorGroup", "Adapter", "CriticGroup", "Deferred", "INTERFACES", "Metrics", "NamedTensors", "ReferenceGroup",
    "RewardGroup", "RewardModelGroup", "RolloutGroup", "WorkerGroups", "required",
]
