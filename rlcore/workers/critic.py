"""Critic worker (PPO): values of the states before each response token, and the value update."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch

from rlcore.algos import compute_value_loss
from rlcore.config import Config
from rlcore.controller import Dispatch, Worker, register
from rlcore.protocol import Batch
from rlcore.workers.actor import _global_sum, _load_full_optim_into_sharded, _load_sharded, _save_sharded, micro_batch_indices
from rlcore.workers.fsdp import to_full, equalize_micro_batches, is_sharded, shard_model
from rlcore.workers.modeling import load_value_model, resolve_device, response_values
from rlcore.workers.optim import build_optimizer, build_scheduler


class CriticWorker(Worker):
    def __init__(self, config: Config, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="critic")
        self.config = config
        self.device = resolve_device(config.trainer.device)

    def setup(self, model_path: str | None = None) -> None:
        cfg = self.config
        path = model_path or cfg.critic.model_path or cfg.model.path
        self.model = load_value_model(path, cfg.model.dtype, self.device, cfg.model.gradient_checkpointing)
        self.model = shard_model(self.model, self.device)  # FSDP2 when this group has a process group
        self.optimizer = build_optimizer(self.model, cfg.critic.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.critic.optim, cfg.trainer.total_steps)

    def _micro_batch_indices(self, batch: Batch) -> list[list[int]]:
        cfg = self.config.actor
        groups = micro_batch_indices(batch, cfg.dynamic_batch_size, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size)
        return equalize_micro_batches(groups, self.model, self.device)

    @register(dispatch=Dispatch.DP_BALANCED)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        batch = batch.to(self.device)
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for idx in self._micro_batch_indices(batch):
            if not idx:  # keeps FSDP ranks in step; result unused
                response_values(self.model, batch.take([0]))
                continue
            values[idx] = response_values(self.model, batch.take(idx)).cpu()
        return Batch(tensors={"values": values * batch["response_mask"].float().cpu()})

    @register(dispatch=Dispatch.DP_BALANCED)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        batch = batch.to(self.device)
        n_per_prompt = int(batch.info.get("n", cfg.rollout.n))
        mini_size = max(1, cfg.actor.ppo_mini_batch_size * n_per_prompt // self.world_size)
        metrics: dict[str, list[float]] = defaultdict(list)
        bad = 0
        for _ in range(cfg.critic.ppo_epochs):
            for mini in batch.split(mini_size):
                mask = mini["response_mask"].float()
                norm = dict(
                    global_token_count=_global_sum(mask.sum().item(), self.device),
                    global_seq_count=_global_sum(float(len(mini)), self.device),
                )
                self.optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for idx in self._micro_batch_indices(mini):
                    weight = 1.0 if idx else 0.0  # an empty micro-batch: zero-weight pass for FSDP
                    mb = mini.take(idx or [0])
                    vpreds = response_values(self.model, mb)
                    loss, clipfrac = compute_value_loss(
                        vpreds,
                        mb["returns"],
                        mb["values"],
                        mb["response_mask"].float(),
                        cliprange_value=cfg.critic.cliprange_value,
                        loss_agg_mode=cfg.critic.loss_agg_mode,
                        **norm,
                    )
                    (loss * (self.world_size * weight)).backward()
                    if not weight:
                        continue
                    total += float(loss.detach())
                    metrics["vf_clipfrac"].append(float(clipfrac))
                grad_norm = to_full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.critic.optim.grad_clip))
                if not (math.isfinite(total) and torch.isfinite(grad_norm)):
                    self.optimizer.zero_grad(set_to_none=True)
                    bad += 1
                    continue
                self.optimizer.step()
                metrics["vf_loss"].append(total)
                metrics["grad_norm"].append(float(grad_norm))
        self.scheduler.step()
        out = {f"critic/{k}": sum(v) / len(v) for k, v in metrics.items() if v}
        out["critic/bad_updates"] = float(bad)
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        folder = Path(folder)
        if is_sharded(self.model):
            _save_sharded(self.model, self.optimizer, self.scheduler, folder, "critic", self.rank, None)
            return
        if self.rank == 0:
            self.model.save_pretrained(folder / "critic", safe_serialization=True)
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                folder / "critic_optim.pt",
            )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        folder = Path(folder)
        self.setup(model_path=str(folder / "critic"))
        if (folder / "critic_dcp").is_dir():
            _load_sharded(self.model, self.optimizer, self.scheduler, folder, "critic")
            return
        if is_sharded(self.model):
            _load_full_optim_into_sharded(self.model, self.optimizer, self.scheduler, folder / "critic_optim.pt")
            return
        state = torch.load(folder / "critic_optim.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
