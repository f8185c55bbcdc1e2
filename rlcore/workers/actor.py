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
from rlcore.workers.fsdp import to_full, equalize_micro_batches, gather_bucket, is_sharded, iter_full_state, plan_buckets, shard_model
from rlcore.workers.modeling import load_causal_lm, resolve_device, response_log_probs
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
        """Per-rank micro-batches; an empty one is a zero-weight pass that keeps FSDP ranks in step."""
        cfg = self.config.actor
        groups = micro_batch_indices(batch, cfg.dynamic_batch_size, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size)
        return equalize_micro_batches(groups, self.model, self.device)

    @torch.no_grad()
    def _log_probs_no_grad(self, batch: Batch, key: str, compute_entropy: bool) -> Batch:
        self.model.eval()
        batch = batch.to(self.device)
        shape = batch["responses"].shape
        logprobs = torch.zeros(shape, dtype=torch.float32)
        entropy = torch.zeros(shape, dtype=torch.float32)
        for idx in self._micro_batch_indices(batch):
            if not idx:  # keeps FSDP ranks in step; result unused
                self._forward_log_probs(batch.take([0]), compute_entropy)
                continue
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
        # FSDP2 when this group has a process group (or, on one rank, when bf16/offload is asked for)
        self.model = shard_model(self.model, self.device, cfg.actor.mixed_precision, cfg.actor.cpu_offload)
        self.optimizer = build_optimizer(self.model, cfg.actor.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.actor.optim, cfg.trainer.total_steps)
        self.policy_loss = get_policy_loss(cfg.actor.policy_loss)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return self._log_probs_no_grad(batch, "old_log_probs", compute_entropy=True)

    @register(dispatch=Dispatch.DP_BALANCED)
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
            weight = 1.0 if idx else 0.0  # an empty micro-batch: zero-weight pass for FSDP
            mb = mini.take(idx or [0])
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
                if weight:
                    metrics["kl_loss"].append(float(kl.detach()) * global_tokens / max(1.0, mb_mask.sum().item()))
            (loss * (scale * weight)).backward()
            if not weight:
                continue
            loss_total += float(loss.detach())
            for k, v in pg_metrics.items():
                metrics[k].append(float(v))
        grad_norm = to_full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip))
        if not (math.isfinite(loss_total) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        metrics["pg_loss"].append(loss_total)
        metrics["grad_norm"].append(float(grad_norm))
        return True

    @register(dispatch=Dispatch.COLLECTIVE, blocking=False)
    def weights_for_rollout(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights (rank 0's result). Sharded: gathered bucket by bucket on every rank.

        Non-blocking: the group returns a future, which `rollout.update_weights(future)` takes as
        it is (on Ray: straight from this worker to the rollout workers, not via the controller).
        `WorkerGroups.sync_weights` streams bucket by bucket instead."""
        keep = self.rank == 0
        return [item for bucket in iter_full_state(self.model, self._bucket_bytes, keep) for item in bucket]

    @register(dispatch=Dispatch.RANK_ZERO)
    def weight_bucket_plan(self) -> list[list[str]]:
        """Parameter names per weight-sync bucket (the same on every rank)."""
        return plan_buckets(self.model, self._bucket_bytes)

    @register(dispatch=Dispatch.COLLECTIVE)
    def gather_weight_bucket(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """One bucket of full weights, for streaming them to the rollout engine."""
        return gather_bucket(self.model, names, keep=self.rank == 0)

    @property
    def _bucket_bytes(self) -> int:
        return int(self.config.actor.weight_sync_bucket_mb * 2**20)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str, tokenizer_dir: str | None = None) -> None:
        folder = Path(folder)
        if is_sharded(self.model):
            _save_sharded(self.model, self.optimizer, self.scheduler, folder, "actor", self.rank, tokenizer_dir)
            return
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
        if (folder / "actor_dcp").is_dir():
            _load_sharded(self.model, self.optimizer, self.scheduler, folder, "actor")
            return
        if is_sharded(self.model):  # a one-process checkpoint resumed on several ranks
            _load_full_optim_into_sharded(self.model, self.optimizer, self.scheduler, folder / "actor_optim.pt")
            return
        state = torch.load(folder / "actor_optim.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _save_sharded(model, optimizer, scheduler, folder: Path, name: str, rank: int, tokenizer_dir: str | None) -> None:
    """HF safetensors of the full model (rank 0) plus a torch distributed checkpoint of the
    sharded model and optimizer, which a run with another number of ranks can load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for alias in _tied_aliases(model):  # as save_pretrained of an unsharded model writes it
        full.pop(alias, None)
    if rank == 0:
        model.save_pretrained(folder / name, state_dict=full, safe_serialization=True)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), folder / name)
        torch.save({"scheduler": scheduler.state_dict()}, folder / f"{name}_scheduler.pt")
    del full
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / f"{name}_dcp"))


def _tied_aliases(model: torch.nn.Module) -> list[str]:
    """Later names of parameters shared under several names (tied embeddings: lm_head.weight)."""
    first: dict[int, str] = {}
    aliases = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append(name)
        else:
            first[id(p)] = name
    return aliases


def _load_full_optim_into_sharded(model, optimizer, scheduler, path: Path) -> None:
    """A plain optimizer state (keyed by parameter position) into a sharded optimizer: re-key it by
    parameter name, the form `set_optimizer_state_dict` shards from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(path, map_location="cpu", weights_only=False)
    osd = state["optimizer"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    by_name = {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])


def _load_sharded(model, optimizer, scheduler, folder: Path, name: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder / f"{name}_dcp"), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched = torch.load(folder / f"{name}_scheduler.pt", weights_only=False)
    scheduler.load_state_dict(sched["scheduler"])


class ReferenceWorker(_PolicyWorker):
    """A frozen copy of the starting policy, for KL."""

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, rank, world_size, role="ref")

    def setup(self, model_path: str | None = None) -> None:
        cfg = self.config
        self.model = load_causal_lm(model_path or cfg.model.path, cfg.model.dtype, self.device)
        self.model.requires_grad_(False)
        self.model = shard_model(self.model, self.device)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self._log_probs_no_grad(batch, "ref_log_probs", compute_entropy=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    import shutil

    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)

