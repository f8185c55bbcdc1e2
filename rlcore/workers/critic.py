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
from rlcore.workers.actor import _global_sum, micro_batch_indices
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
        self.optimizer = build_optimizer(self.model, cfg.critic.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.critic.optim, cfg.trainer.total_steps)

    def _micro_batch_indices(self, batch: Batch) -> list[list[int]]:
        cfg = self.config.actor
        return micro_batch_indices(batch, cfg.dynamic_batch_size, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        batch = batch.to(self.device)
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for idx in self._micro_batch_indices(batch):
            values[idx] = response_values(self.model, batch.take(idx)).cpu()
        return Batch(tensors={"values": values * batch["response_mask"].float().cpu()})

    @register(dispatch=Dispatch.DP_COMPUTE)
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
                    mb = mini.take(idx)
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
                    (loss * self.world_size).backward()
                    total += float(loss.detach())
                    metrics["vf_clipfrac"].append(float(clipfrac))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.critic.optim.grad_clip)
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
        state = torch.load(folder / "critic_optim.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
