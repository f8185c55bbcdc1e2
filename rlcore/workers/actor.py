"""Actor and reference workers: log-probs of responses, and the PPO-style policy update.

A worker method does one thing to the batch it is given and returns a batch (or metrics);
what happens next is the trainer's decision.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlcore.algos import agg_loss, get_policy_loss, kl_loss
from rlcore.config import Config
from rlcore.controller import Dispatch, Worker, register
from rlcore.packing import pack_token_budget
from rlcore.protocol import Batch
from rlcore.workers.modeling import load_causal_lm, named_weights_for_sync, resolve_device, response_log_probs
from rlcore.workers.optim import build_optimizer, build_scheduler


def _global_sum(value: float, device: torch.device) -> float:
    """Sum over data-parallel ranks (a no-op in one process)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item())
    return float(value)


def micro_batch_indices(batch: Batch, dynamic: bool, max_tokens: int, micro_batch_size: int) -> list[list[int]]:
    """Sample indices per micro-batch: token-budget packing (native) when dynamic, else fixed slices."""
    n = len(batch)
    if not dynamic:
        return [list(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)]
    lengths = batch["attention_mask"].sum(-1).cpu().numpy()
    return [list(idx) for idx in pack_token_budget(lengths, max_tokens)]


class _PolicyWorker(Worker):
    """Shared by actor and reference: one causal LM and its log-prob forward."""

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1, role: str = "actor") -> None:
        super().__init__(rank=rank, world_size=world_size, role=role)
        self.config = config
        self.device = resolve_device(config.trainer.device)
        self.model: torch.nn.Module | None = None

    def _forward_log_probs(self, batch: Batch, compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        temperature = float(batch.info.get("temperature", self.config.rollout.temperature))
        return response_log_probs(
            self.model,
            batch,
            temperature,
            chunk_tokens=self.config.actor.logprob_chunk_tokens,
            compute_entropy=compute_entropy,
            backend="auto" if self.config.actor.fused_kernels else "torch",
        )

    def _micro_batch_indices(self, batch: Batch) -> list[list[int]]:
        cfg = self.config.actor
        return micro_batch_indices(batch, cfg.dynamic_batch_size, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size)

    @torch.no_grad()
    def _log_probs_no_grad(self, batch: Batch, key: str, compute_entropy: bool) -> Batch:
        self.model.eval()
        batch = batch.to(self.device)
        shape = batch["responses"].shape
        logprobs = torch.zeros(shape, dtype=torch.float32)
        entropy = torch.zeros(shape, dtype=torch.float32)
        for idx in self._micro_batch_indices(batch):
            lp, ent = self._forward_log_probs(batch.take(idx), compute_entropy)
            logprobs[idx] = lp.float().cpu()
            if ent is not None:
                entropy[idx] = ent.float().cpu()
        tensors = {key: logprobs}
        if compute_entropy:
            tensors["entropy"] = entropy
        return Batch(tensors=tensors)


class ActorWorker(_PolicyWorker):
    """The trained policy: log-probs under the current weights, the clipped policy update."""

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, rank, world_size, role="actor")

    def setup(self, model_path: str | None = None) -> None:
        cfg = self.config
        self.model = load_causal_lm(model_path or cfg.model.path, cfg.model.dtype, self.device, cfg.model.gradient_checkpointing)
        self.optimizer = build_optimizer(self.model, cfg.actor.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.actor.optim, cfg.trainer.total_steps)
        self.policy_loss = get_policy_loss(cfg.actor.policy_loss)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return self._log_probs_no_grad(batch, "old_log_probs", compute_entropy=True)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        cfg = self.config.actor
        self.model.train()
        batch = batch.to(self.device)
        n_per_prompt = int(batch.info.get("n", self.config.rollout.n))
        mini_size = cfg.ppo_mini_batch_size * n_per_prompt // self.world_size
        metrics: dict[str, list[float]] = defaultdict(list)
        bad_updates = 0
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(max(1, mini_size)):
                ok = self._update_mini_batch(mini, metrics)
                bad_updates += 0 if ok else 1
        self.scheduler.step()
        out = {f"actor/{k}": sum(v) / len(v) for k, v in metrics.items() if v}
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/bad_updates"] = float(bad_updates)
        return out

    def _update_mini_batch(self, mini: Batch, metrics: dict[str, list[float]]) -> bool:
        cfg = self.config.actor
        mask = mini["response_mask"].float()
        global_tokens = _global_sum(mask.sum().item(), self.device)
        global_seqs = _global_sum(float(len(mini)), self.device)
        # FSDP/DDP average gradients over ranks; the shares below sum to the global loss.
        scale = float(self.world_size)
        norm = dict(global_token_count=global_tokens, global_seq_count=global_seqs)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for idx in self._micro_batch_indices(mini):
            mb = mini.take(idx)
            mb_mask = mb["response_mask"].float()
            logp, entropy = self._forward_log_probs(mb, compute_entropy=cfg.entropy_coeff != 0)
            is_weights = None
            if cfg.tis_cap is not None and "rollout_log_probs" in mb:
                is_weights = torch.exp(mb["old_log_probs"] - mb["rollout_log_probs"]).clamp(max=cfg.tis_cap).detach()
            pg_loss, pg_metrics = self.policy_loss(
                mb["old_log_probs"],
                logp,
                mb["advantages"],
                mb_mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode,
                rollout_is_weights=is_weights,
                **norm,
            )
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                ent = agg_loss(entropy, mb_mask, cfg.loss_agg_mode, **norm)
                loss = loss - cfg.entropy_coeff * ent
            if cfg.use_kl_loss:
                kl = kl_loss(logp, mb["ref_log_probs"], mb_mask, cfg.kl_loss_type, cfg.loss_agg_mode, **norm)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["kl_loss"].append(float(kl) * global_tokens / max(1.0, mb_mask.sum().item()))
            (loss * scale).backward()
            loss_total += float(loss.detach())
            for k, v in pg_metrics.items():
                metrics[k].append(float(v))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        if not (math.isfinite(loss_total) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        metrics["pg_loss"].append(loss_total)
        metrics["grad_norm"].append(float(grad_norm))
        return True

    @register(dispatch=Dispatch.RANK_ZERO)
    def weights_for_rollout(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, v.cpu()) for k, v in named_weights_for_sync(self.model)]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> None:
        folder = Path(folder)
        if self.rank == 0:
            self.model.save_pretrained(folder / "actor", safe_serialization=True)
            if tokenizer_dir is not None:
                _copy_tokenizer(Path(tokenizer_dir), folder / "actor")
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                folder / "actor_optim.pt",
            )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        folder = Path(folder)
        self.setup(model_path=str(folder / "actor"))
        state = torch.load(folder / "actor_optim.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class ReferenceWorker(_PolicyWorker):
    """A frozen copy of the starting policy, for KL."""

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, rank, world_size, role="ref")

    def setup(self, model_path: str | None = None) -> None:
        cfg = self.config
        self.model = load_causal_lm(model_path or cfg.model.path, cfg.model.dtype, self.device)
        self.model.requires_grad_(False)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self._log_probs_no_grad(batch, "ref_log_probs", compute_entropy=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    import shutil

    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)

