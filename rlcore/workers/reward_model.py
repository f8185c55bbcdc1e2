"""Reward-model worker (role `reward_model`): a sequence classifier on its own ranks that scores
[prompt, response] conversations for RL, and is trained on preference pairs (`algorithm.name: rm`).

Scoring never re-uses the policy's token ids. Each sample's response is decoded with the policy's
tokenizer up to its first end token, and the conversation (the prompt's messages, then the
response as the assistant's turn) is rendered with the reward model's own tokenizer and chat
template (`rlcore.chat.render_conversation`), exactly as its training pairs were. A reward
model with another vocabulary or template than the policy's therefore scores what it learned to.

The model is built in one place (`rlcore.workers.loading.load_sequence_classifier`) and read the
way transformers' own forward reads it: the score head on each sequence's last non-pad token
(`sequence_scores`, packed without padding by default). Training runs the shared update loop
(`rlcore.workers.loops.run_update`) on the Bradley-Terry loss (`rlcore.algos.bradley_terry_loss`).
With `reward_model.lora` the backbone trains a LoRA adapter and the score head trains in full
beside it (`rlcore.workers.lora.apply_lora`); checkpoints hold the two as one peft adapter
(`reward_model_adapter/`), and `merge_reward_model` makes the servable folder of base + adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rlcore.algos import bradley_terry_loss
from rlcore.chat import has_chat_template, render_conversation
from rlcore.config import RewardModelConfig, RoleSpec, require_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.errors import RLCoreError
from rlcore.protocol import Batch
from rlcore.workers.checkpointing import adapter_folder, load_training_state, save_trained
from rlcore.workers.forward import SCORE_FORWARD_METHODS, sequence_scores
from rlcore.workers.loading import compute_precision, load_sequence_classifier, resolve_device, scored_pad_token_id, trained_dtype
from rlcore.workers.loops import (
    GlobalCounts,
    MicroBatching,
    MicroLoss,
    MicroLossFn,
    UpdateSettings,
    budget_tokens,
    forward_no_grad,
    run_update,
    value_stats,
)
from rlcore.workers.lora import Adapter, apply_lora, merge_adapter, parameter_counts
from rlcore.workers.memory import MicroBudget, resolve_budget, role_budget, track_trained
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.packed import forward_token_metrics
from rlcore.workers.parallel.apply import apply_role_layout
from rlcore.workers.ranks import global_sum
from rlcore.workers.tokenizer import cut_at_end, end_token_ids, load_tokenizer
from rlcore.workers.trainable import Trainable

ROLE = "reward_model"


class RewardModelInputError(RLCoreError, ValueError):
    """The reward model cannot render a conversation (no chat template); names the setting."""


def decode_responses(responses: torch.Tensor, response_mask: torch.Tensor, tokenizer: Any, end_ids: list[int]) -> list[str]:
    """Each generated response as text, cut before its first end token (special tokens dropped),
    as the rule scorer reads it (`rlcore.workers.reward`)."""
    lengths = response_mask.sum(-1).long().tolist()
    return [tokenizer.decode(cut_at_end(row[:n], end_ids), skip_special_tokens=True)
            for row, n in zip(responses.tolist(), lengths)]


@dataclass(frozen=True)
class Encoded:
    input_ids: torch.Tensor       # [N, W] right-padded
    attention_mask: torch.Tensor  # [N, W]
    truncated: torch.Tensor       # [N] 1.0 where the conversation lost its start to `max_length`


def encode_conversations(messages: list[list[dict[str, str]]], responses: list[str], tokenizer: Any, max_length: int,
                         pad_token_id: int) -> Encoded:
    """The reward model's own tokens of each conversation, right-padded. A conversation longer
    than `max_length` keeps its last `max_length` tokens: the end, where the score is read."""
    rows, truncated = [], []
    for msgs, response in zip(messages, responses):
        ids = list(tokenizer(render_conversation(list(msgs), response, tokenizer), add_special_tokens=False)["input_ids"])
        truncated.append(float(len(ids) > max_length))
        rows.append(ids[-max_length:])
    w = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), w), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), w), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :len(ids)] = 1
    return Encoded(input_ids, attention_mask, torch.tensor(truncated))


def pair_lengths(mini: Batch) -> torch.Tensor:
    """Tokens per pair (chosen and rejected run in one forward), for micro-batch packing."""
    return mini["chosen_attention_mask"].sum(-1) + mini["rejected_attention_mask"].sum(-1)


@dataclass(frozen=True)
class BradleyTerryObjective:
    """The pairwise loss of one micro-batch: chosen and rejected scored in one (packed) forward,
    `-log sigmoid(r_c - r_r - margin)`, divided by the global number of pairs."""

    model: nn.Module
    margin: float  # `reward_model.margin`, where a row has none of its own
    remove_padding: bool = True

    lengths = staticmethod(pair_lengths)

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        return partial(self.micro_loss, global_pairs=counts.rows)

    def micro_loss(self, mb: Batch, global_pairs: float) -> MicroLoss:
        chosen, rejected = score_pair_sides(self.model, mb, self.remove_padding)
        losses = bradley_terry_loss(chosen, rejected, pair_margins(mb, self.margin))
        stats = value_stats({
            "reward_model/accuracy": (chosen > rejected).float().detach(),
            "reward_model/margin": (chosen - rejected).detach(),
            "reward_model/chosen_score": chosen.detach(),
            "reward_model/rejected_score": rejected.detach(),
        })
        return MicroLoss(losses.sum() / global_pairs, stats=stats)


def score_pair_sides(model: nn.Module, mb: Batch, remove_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores [B] of encoded pairs (both sides one width), in one forward."""
    ids = torch.cat([mb["chosen_input_ids"], mb["rejected_input_ids"]])
    mask = torch.cat([mb["chosen_attention_mask"], mb["rejected_attention_mask"]])
    scores = sequence_scores(model, ids, mask, remove_padding)
    return scores[:len(mb)], scores[len(mb):]


def rm_settings(spec: RoleSpec[RewardModelConfig], budget: MicroBudget | None = None) -> UpdateSettings:
    """The reward model's update: one pass, `reward_model.mini_batch_size` pairs per optimizer step
    (`spec.mini_batch_size`: unset, `data.train_batch_size`)."""
    rm = spec.section
    return UpdateSettings(1, spec.mini_batch_size, rm_micro_batching(rm, budget), rm.optim.grad_clip)


def rm_micro_batching(rm: RewardModelConfig, budget: MicroBudget | None = None) -> MicroBatching:
    """`reward_model`'s micro-batching; an `auto` token budget is `budget`'s (resolved)."""
    return MicroBatching(rm.micro_batch_size, rm.dynamic_batch_size, budget_tokens(rm.max_tokens_per_micro_batch, budget),
                         budget=budget)


def pair_margins(batch: Batch, margin: float) -> torch.Tensor:
    """Each pair's margin as the loss reads it: the row's own (`margin` column), else `margin`
    (`reward_model.margin`)."""
    given, own = batch.tensors["margin_given"], batch.tensors["margin"]
    return torch.where(given > 0, own, torch.full_like(own, margin))


def held_out_pair_metrics(batches: Iterable[Batch], score_pairs: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]],
                          margin: float) -> dict[str, float]:
    """A reward model's numbers over held-out pairs (`collate_rm_pairs` batches scored by
    `score_pairs` into (chosen, rejected) scores): pairwise accuracy (chosen scored strictly above
    rejected), the Bradley-Terry loss with the margins training used (`pair_margins`), the mean
    score gap, the mean scores and the pair count. The one copy behind both training's `val/*`
    and the promotion gate's numbers, so the two agree on one checkpoint."""
    chosen, rejected, margins = [], [], []
    for batch in batches:
        c, r = score_pairs(batch)
        chosen.append(c.float())
        rejected.append(r.float())
        margins.append(pair_margins(batch, margin))
    c, r, m = torch.cat(chosen), torch.cat(rejected), torch.cat(margins)
    return {
        "pairwise_acc": float((c > r).float().mean()),
        "rm_loss": float(bradley_terry_loss(c, r, m).mean()),
        "score_margin": float((c - r).mean()),
        "chosen_score": float(c.mean()),
        "rejected_score": float(r.mean()),
        "num_pairs": float(len(c)),
    }


@dataclass
class RewardModelReader:
    """A loaded reward model and how to feed it: its own tokenizer and chat template, its pad
    token, the length limit and the micro-batching of its no-grad forwards."""

    model: nn.Module
    tokenizer: Any
    pad_token_id: int
    max_length: int
    micro: MicroBatching
    device: torch.device
    remove_padding: bool = True

    def encode(self, messages: list[list[dict[str, str]]], responses: list[str]) -> Encoded:
        return encode_conversations(messages, responses, self.tokenizer, self.max_length, self.pad_token_id)

    def scores(self, enc: Encoded) -> torch.Tensor:
        """[N] float32 scores of encoded conversations, no gradient, micro-batch by micro-batch."""
        batch = Batch(tensors={"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})

        def forward(mb: Batch) -> dict[str, torch.Tensor]:
            return {"score": sequence_scores(self.model, mb["input_ids"], mb["attention_mask"], self.remove_padding)}

        return forward_no_grad(self.model, batch, forward, self.micro, self.device)["score"]

    def encode_pairs(self, batch: Batch) -> tuple[Batch, Encoded]:
        """A batch of `collate_rm_pairs` with this model's tokens of both sides (one width), and
        those tokens as one encoding (chosen rows, then rejected)."""
        messages = list(batch.meta["prompt_messages"])
        enc = self.encode(messages + messages, list(batch.meta["chosen_text"]) + list(batch.meta["rejected_text"]))
        n = len(batch)
        pairs = Batch(tensors={
            "chosen_input_ids": enc.input_ids[:n], "chosen_attention_mask": enc.attention_mask[:n],
            "rejected_input_ids": enc.input_ids[n:], "rejected_attention_mask": enc.attention_mask[n:],
            "margin": batch["margin"], "margin_given": batch["margin_given"],
            "truncated": torch.maximum(enc.truncated[:n], enc.truncated[n:])})
        return pairs, enc

    def pair_scores(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores [B] of a `collate_rm_pairs` batch, no gradient."""
        _, enc = self.encode_pairs(batch)
        scores = self.scores(enc)
        return scores[:len(batch)], scores[len(batch):]


def open_reward_model(path: str | Path, *, key: str, spec: RoleSpec[RewardModelConfig], device: torch.device,
                      training: bool = False, budget: MicroBudget | None = None) -> RewardModelReader:
    """The reward model at `path` (its tokenizer and chat template from the same folder), read
    with the reward model's limits (its `RoleSpec`). `training`: a backbone without a score head is allowed
    (a fresh head is made), in float32 master weights. Errors name `key`. An `auto` micro-batch
    budget (`budget`, else a new one) is sized for the model as loaded, before any sharding (an
    upper bound on what a sharded rank holds)."""
    require_spec(spec, ROLE)
    tokenizer = load_tokenizer(str(path))
    if not has_chat_template(tokenizer):
        raise RewardModelInputError(
            f"{key}: the tokenizer of {path} has no chat template; a reward model scores whole conversations "
            "rendered with its own template (add one: chat_template.jinja, or chat_template in tokenizer_config.json)")
    model = load_sequence_classifier(
        path, trained_dtype(spec.model) if training else spec.model.dtype, device, key=key, new_head_ok=training,
        pad_token_id=tokenizer.pad_token_id, seed=spec.seed,
        gradient_checkpointing=training and spec.model.gradient_checkpointing, remove_padding=spec.model.use_remove_padding)
    pad = model.config.pad_token_id
    budget = resolve_budget(budget or role_budget(spec), spec, device, model)
    return RewardModelReader(model, tokenizer, int(pad) if pad is not None else int(tokenizer.pad_token_id),
                             spec.section.max_length, rm_micro_batching(spec.section, budget), device,
                             spec.model.use_remove_padding)


def merge_reward_model(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The servable folder of a reward model trained with LoRA: `base_dir` (the run's `model.path`)
    and its adapter folder merged, the trained score head from the adapter, the pad token training
    read scores at: what `AutoModelForSequenceClassification` loads and `reward_model.path` takes."""
    pad = scored_pad_token_id(base_dir, load_tokenizer(str(base_dir)).pad_token_id)
    return merge_adapter(base_dir, adapter_dir, out_dir, task="seq_cls", num_labels=1, pad_token_id=pad)


class RewardModelWorker(Worker):
    """The reward model: scores for RL samples (`compute_rm_score`), and, in a reward-model
    training run (`algorithm.name: rm`), the Bradley-Terry update, held-out pair scores and
    checkpoints. FSDP2 when its group has a process group. With `reward_model.lora` (training),
    the backbone's adapter and the score head train."""

    def __init__(self, spec: RoleSpec[RewardModelConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role=ROLE)
        self.spec: RoleSpec[RewardModelConfig] = require_spec(spec, ROLE)
        self.ranks_per_shard = self.spec.layout.ranks_per_shard  # a tensor-parallel group shares its rows
        self.device = resolve_device(self.spec.device)
        self.training = self.spec.trains
        self.budget = role_budget(self.spec)  # an `auto` token budget, sized when the model loads
        self.reader: RewardModelReader | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.adapter: Adapter | None = None

    def setup(self, model_path: str | None = None, adapter_dir: str | None = None) -> None:
        """Load the model (`model.path` to train, `reward_model.path` to score, or a checkpoint's);
        training with `reward_model.lora`, add the adapter (restored from `adapter_dir` on resume)
        before sharding."""
        spec = self.spec
        key = "model.path" if self.training else "reward_model.path"
        path = model_path or (spec.model.path if self.training else spec.section.path)
        assert path is not None
        self.reader = open_reward_model(path, key=key, spec=spec, device=self.device, training=self.training, budget=self.budget)
        model = self.reader.model
        if self.training:
            precision = compute_precision(spec.model)
            lora = spec.section.lora
            self.adapter = (apply_lora(model, lora, "reward_model.lora", task="seq_cls", seed=spec.seed,
                                       mixed_precision=precision != "none") if lora.enabled else None)
            if self.adapter is not None and adapter_dir is not None:
                self.adapter.load(Path(adapter_dir))
            self.param_counts = parameter_counts(model)
            model = apply_role_layout(model, spec, self.device, mixed_precision=precision,
                                      forward_methods=SCORE_FORWARD_METHODS)
            self.optimizer = build_optimizer(model, spec.section.optim)
            self.scheduler = build_scheduler(self.optimizer, spec.section.optim, spec.total_steps)
            track_trained(model, self.optimizer)
        else:
            model.requires_grad_(False)
            model = apply_role_layout(model, spec, self.device, forward_methods=SCORE_FORWARD_METHODS)
            self.policy_tokenizer = load_tokenizer(spec.model.path)
            self.end_ids = end_token_ids(spec.model.path)
        self.reader.model = model

    @property
    def model(self) -> nn.Module:
        assert self.reader is not None
        return self.reader.model

    @property
    def trained(self) -> Trainable:
        return Trainable(self.model, self.optimizer, self.scheduler, self.adapter)

    @register(dispatch=Dispatch.DP_BALANCED)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` [N] of generated samples, `rm_truncated` [N], and the response texts scored.
        NaN/inf scores are passed on as they are: the controller counts them (`reward_model.on_nonfinite`)."""
        assert self.reader is not None
        texts = decode_responses(batch["responses"], batch["response_mask"], self.policy_tokenizer, self.end_ids)
        enc = self.reader.encode(list(batch.meta["prompt_messages"]), texts)
        return Batch(tensors={"rm_scores": self.reader.scores(enc), "rm_truncated": enc.truncated},
                     meta={"rm_response_text": np.array(texts, dtype=object)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_reward_model(self, batch: Batch) -> dict[str, float]:
        """One training step on a `collate_rm_pairs` batch: the Bradley-Terry loss,
        `reward_model.mini_batch_size` pairs per optimizer step."""
        assert self.reader is not None
        settings = rm_settings(self.spec, self.budget)
        pairs, _ = self.reader.encode_pairs(batch)
        objective = BradleyTerryObjective(self.model, self.spec.section.margin, self.spec.model.use_remove_padding)
        shards = self.world_size // self.ranks_per_shard
        result = run_update(self.trained, pairs, objective, settings, mini_batch_rows=settings.mini_batch_rows(1, shards),
                            device=self.device, lengths=objective.lengths)
        return {**result.metrics, "reward_model/loss": result.loss, "reward_model/grad_norm": result.grad_norm,
                "reward_model/lr": self.trained.lr, "reward_model/bad_updates": float(result.skipped_steps),
                "reward_model/param_norm": result.param_norm, "reward_model/param_norm_growth": result.param_norm_growth,
                "reward_model/nonfinite_state": result.nonfinite_state,
                "reward_model/truncated": global_sum(float(pairs["truncated"].sum()), self.device) / self.ranks_per_shard,
                "reward_model/trainable_params": float(self.param_counts[0]), "reward_model/total_params": float(self.param_counts[1]),
                **result.peak_metrics(ROLE),
                **forward_token_metrics(ROLE, self.model, self.device)}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score_pairs(self, batch: Batch) -> Batch:
        """`chosen_scores` and `rejected_scores` [B] of a `collate_rm_pairs` batch, no gradient."""
        assert self.reader is not None
        chosen, rejected = self.reader.pair_scores(batch)
        return Batch(tensors={"chosen_scores": chosen, "rejected_scores": rejected})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        save_trained(self.trained, Path(folder), ROLE, self.rank, Path(self.spec.model.path))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        if self.spec.section.lora.enabled:  # the base from model.path, the adapter and head from the checkpoint
            self.setup(adapter_dir=str(Path(folder) / adapter_folder(ROLE)))
        else:
            self.setup(model_path=str(Path(folder) / ROLE))
        load_training_state(self.trained, Path(folder), ROLE, self.device)


__all__ = [
    "BradleyTerryObjective", "Encoded", "RewardModelInputError", "RewardModelReader", "RewardModelWorker",
    "decode_responses", "encode_conversations", "held_out_pair_metrics", "merge_reward_model", "open_reward_model",
    "pair_margins", "rm_settings",
]
