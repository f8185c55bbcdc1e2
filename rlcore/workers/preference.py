"""The actor for offline preference optimisation: one new method on top of `ActorWorker`.

Everything else (model, FSDP, optimizer, log-probs, checkpoints, weight sync) is the RL actor's.
`update_preference` computes sequence log-probs through the same chunked per-token path as RL
(`response_log_probs`), the DPO or KTO loss against reference log-probs the controller put in the
batch, and takes optimizer steps with gradient clipping, skipping a step whose loss or gradient
is not finite.

Losses are divided by the *global* number of examples (summed over data-parallel ranks) and
scaled by the world size, because FSDP averages gradients over ranks: two ranks then take
exactly the step one rank would. KTO's reference point z0 is likewise a global mean.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from rlcore.algos.preference import dpo_loss, kto_loss, kto_reference_point_from_sums
from rlcore.controller import Dispatch, register
from rlcore.data.preference import sequence_log_prob_sums, sequence_view
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker, _global_sum
from rlcore.workers.fsdp import to_full


class PreferenceActorWorker(ActorWorker):
    """`ActorWorker` plus `update_preference` (DPO / KTO)."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_preference(self, batch: Batch) -> dict[str, float]:
        """One training step on a preference batch (`batch.info["algorithm"]`: "dpo" or "kto"):
        `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` examples."""
        cfg = self.config.actor
        algorithm = batch.info["algorithm"]
        self.model.train()
        batch = batch.to(self.device)
        mini_size = max(1, cfg.ppo_mini_batch_size // self.world_size)
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, float] = defaultdict(float)
        losses, grad_norms, bad = [], [], 0
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(mini_size):
                step = self._dpo_step if algorithm == "dpo" else self._kto_step
                loss, grad_norm = step(mini, sums, counts)
                if loss is None:
                    bad += 1
                else:
                    losses.append(loss)
                    grad_norms.append(grad_norm)
        self.scheduler.step()
        out = {k: sums[k] / counts[k] for k in sums if counts[k]}
        out["pref/loss"] = sum(losses) / len(losses) if losses else float("nan")
        out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/bad_updates"] = float(bad)
        return out

    # ------------------------------------------------------------------ DPO
    def _dpo_step(self, mini: Batch, sums: dict[str, float], counts: dict[str, float]) -> tuple[float | None, float]:
        p = self.config.preference
        average = p.loss_type == "ipo"
        global_pairs = _global_sum(float(len(mini)), self.device)
        both_masks = torch.cat([mini["chosen_attention_mask"], mini["rejected_attention_mask"]], dim=-1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for idx in self._micro_batch_indices(Batch(tensors={"attention_mask": both_masks})):
            weight = 1.0 if idx else 0.0  # an empty micro-batch: zero-weight pass for FSDP
            mb = mini.take(idx or [0])
            n = len(mb)
            both = Batch.concat([sequence_view(mb, "chosen_"), sequence_view(mb, "rejected_")])
            logp, _ = self._forward_log_probs(both, compute_entropy=False)
            seq = sequence_log_prob_sums(logp, both["response_mask"], average)
            out = dpo_loss(seq[:n], seq[n:], mb["ref_chosen_logps"], mb["ref_rejected_logps"],
                           beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing)
            loss = out.losses.sum() / global_pairs
            (loss * (float(self.world_size) * weight)).backward()
            if not weight:
                continue
            loss_total += float(loss.detach())
            lengths = both["response_mask"].sum(-1)
            ref = torch.cat([mb["ref_chosen_logps"], mb["ref_rejected_logps"]])
            per_token = (seq.detach() - ref) / (1.0 if average else lengths)
            _add(sums, counts, {
                "pref/reward_accuracy": (out.chosen_rewards > out.rejected_rewards).float(),
                "pref/margin": out.chosen_rewards - out.rejected_rewards,
                "pref/chosen_reward": out.chosen_rewards,
                "pref/rejected_reward": out.rejected_rewards,
                "pref/chosen_logps": seq[:n].detach(),
                "pref/rejected_logps": seq[n:].detach(),
                "actor/kl": per_token,
            })
        return self._optimizer_step(loss_total)

    # ------------------------------------------------------------------ KTO
    def _kto_step(self, mini: Batch, sums: dict[str, float], counts: dict[str, float]) -> tuple[float | None, float]:
        p = self.config.preference
        # z0 from the mismatched pairs (prompt i, completion i-1): no gradient flows through it.
        kl_logps = self._sequence_logps_no_grad(sequence_view(mini, "kl_"))
        logratio_sum = _global_sum(float((kl_logps - mini["ref_kl_logps"].cpu()).sum()), self.device)
        z0 = kto_reference_point_from_sums(logratio_sum, _global_sum(float(len(mini)), self.device))
        global_rows = _global_sum(float(len(mini)), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for idx in self._micro_batch_indices(mini):
            weight = 1.0 if idx else 0.0
            mb = mini.take(idx or [0])
            view = sequence_view(mb)
            logp, _ = self._forward_log_probs(view, compute_entropy=False)
            seq = sequence_log_prob_sums(logp, view["response_mask"])
            good = mb["label"] > 0.5
            out = kto_loss(seq, mb["ref_logps"], good, z0, beta=p.beta,
                           desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
            loss = out.losses.sum() / global_rows
            (loss * (float(self.world_size) * weight)).backward()
            if not weight:
                continue
            loss_total += float(loss.detach())
            rewards = out.chosen_rewards
            _add(sums, counts, {
                "pref/reward_accuracy": ((rewards > 0) == good).float(),
                "pref/desirable_reward": rewards[good],
                "pref/undesirable_reward": rewards[~good],
                "pref/desirable_logps": seq.detach()[good],
                "pref/undesirable_logps": seq.detach()[~good],
                "actor/kl": (seq.detach() - mb["ref_logps"]) / view["response_mask"].sum(-1),
            })
        sums["pref/kl_z0"] += float(z0)
        counts["pref/kl_z0"] += 1.0
        return self._optimizer_step(loss_total)

    # ------------------------------------------------------------------ shared
    @torch.no_grad()
    def _sequence_logps_no_grad(self, view: Batch) -> torch.Tensor:
        out = torch.zeros(len(view), dtype=torch.float32)
        for idx in self._micro_batch_indices(view):
            if not idx:  # keeps FSDP ranks in step; result unused
                self._forward_log_probs(view.take([0]), compute_entropy=False)
                continue
            mb = view.take(idx)
            logp, _ = self._forward_log_probs(mb, compute_entropy=False)
            out[idx] = sequence_log_prob_sums(logp, mb["response_mask"]).float().cpu()
        return out

    def _optimizer_step(self, loss_total: float) -> tuple[float | None, float]:
        """Clip and step; a non-finite loss or gradient norm skips the step (returns None).

        The loss is summed over ranks (each holds its share of the global loss), so every rank
        reports the one-rank value and all ranks agree on skipping."""
        loss_total = _global_sum(loss_total, self.device)
        grad_norm = to_full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.actor.optim.grad_clip))
        if not (math.isfinite(loss_total) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return None, float("nan")
        self.optimizer.step()
        return loss_total, float(grad_norm)


def _add(sums: dict[str, float], counts: dict[str, float], values: dict[str, torch.Tensor]) -> None:
    for k, v in values.items():
        sums[k] += float(v.float().sum())
        counts[k] += float(v.numel())


__all__ = ["PreferenceActorWorker"]
