"""Which worker groups a run has, and how they are built (in-process backend for now)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcore.config import Config
from rlcore.controller import InProcessWorkerGroup, WorkerGroup
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward import RewardWorker
from rlcore.workers.rollout import RolloutWorker


@dataclass
class WorkerGroups:
    actor: WorkerGroup
    rollout: WorkerGroup
    reward: WorkerGroup
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None

    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> None:
        self.actor.save_checkpoint(folder, tokenizer_dir=tokenizer_dir)
        if self.critic is not None:
            self.critic.save_checkpoint(folder)

    def load_checkpoint(self, folder: str) -> None:
        """Actor and critic from the checkpoint; the rollout engine restarts on the saved policy."""
        self.actor.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder)
        self.rollout.load_model(str(Path(folder) / "actor"))

    def close(self) -> None:
        for group in (self.actor, self.rollout, self.reward, self.ref, self.critic):
            if group is not None:
                group.shutdown()


def _group(factory, role: str) -> WorkerGroup:
    return InProcessWorkerGroup(factory, world_size=1, role=role)


def build_worker_groups(config: Config) -> WorkerGroups:
    return WorkerGroups(
        actor=_group(lambda rank, ws: ActorWorker(config, rank, ws), "actor"),
        rollout=_group(lambda rank, ws: RolloutWorker(config, rank, ws), "rollout"),
        reward=_group(lambda rank, ws: RewardWorker(config, rank, ws), "reward"),
        ref=_group(lambda rank, ws: ReferenceWorker(config, rank, ws), "ref") if config.needs_reference else None,
        critic=_group(lambda rank, ws: CriticWorker(config, rank, ws), "critic") if config.algorithm.name == "ppo" else None,
    )
