"""Supervised fine-tuning, `rlcore sft CONFIG`: the whole loop (`SFTTrainer`).

One step, as data flows: the step's rows (epoch e's order a permutation drawn from (seed, e)
alone, so a resumed run sees the batches an uninterrupted one would) become one right-padded
`Batch` (`rlcore.data.sft.collate_sft`: every token after the first is a response token, the
labelled ones masked in), and the actor group takes one optimizer step on their mean negative
log-likelihood (`ActorWorker.update_sft`: the shared update loop, micro-batches packed to
`actor.max_tokens_per_micro_batch` tokens; FSDP2 over `actor.world_size` Ray ranks, LoRA, sequence
parallelism and precision as the actor's config says). The validation loss is the same mean over
the validation rows under the current weights. The run folder, checkpoints that resume exactly
(`RunCheckpoints`), the non-finite-step guard (`actor.max_consecutive_bad_steps`), run health and
the tracker are the RL recipes' parts; this process never holds the model.

At the end, `trainer.output_dir/model`: the last checkpoint's model as a Hugging Face folder (with
LoRA the base with the adapter merged in) with the base folder's tokenizer and generation files,
what an RL config's `model.path` starts from. Before anything loads, the config's paths are checked
and the data's prompts must tokenize as AutoTokenizer tokenizes them.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.config import SFTConfig, sft_actor_spec
from rlcore.data.schema import DatasetError
from rlcore.data.sft import SFTDataset, SFTExample, collate_sft
from rlcore.rewards.tools import tool_schemas
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.health import HealthGuard
from rlcore.trainer.metrics import mean_over_ranks
from rlcore.trainer.roles import Placement, RoleGroup, build_worker_groups, section_size_key
from rlcore.trainer.run_state import BadStepGuard, CheckpointPolicy, RunCheckpoints, TrainedModel, prepare_run_dir
from rlcore.trainer.step_log import LogSettings, StepHook, StepLog
from rlcore.workers.actor import ActorWorker
from rlcore.workers.checkpointing import adapter_folder
from rlcore.workers.lora import merge_adapter
from rlcore.workers.tokenizer import end_token_ids, load_tokenizer, pad_token_id

log = logging.getLogger(__name__)

MODEL = "model"  # the output folder's name in trainer.output_dir


class SFTTrainer:
    """`rlcore sft`: the whole supervised run, from the config to `trainer.output_dir/model`."""

    algorithm = "sft"

    def __init__(self, config: SFTConfig, groups: WorkerGroups | None = None, step_hooks: Sequence[StepHook] = ()) -> None:
        from rlcore.trainer.preflight import sft_preflight
        from rlcore.trainer.tokenizer_check import check_tokenization, sample_prompts

        sft_preflight(config)  # before anything loads: every path the config names
        data = config.data
        if data.tokenizer_check_rows:
            keyed = [(f"data.train_files[{i}]", f) for i, f in enumerate(data.train_files)]
            keyed += [(f"data.val_files[{i}]", f) for i, f in enumerate(data.val_files)]
            check_tokenization(config.model.path, sample_prompts(keyed, data.tokenizer_check_rows, data.prompt_key),
                               data.apply_chat_template)
        self.config = config
        self.run_dir = prepare_run_dir(config)
        path = config.model.path
        self.pad_id = pad_token_id(path)
        tokenizer = load_tokenizer(path)
        tools = tool_schemas(data.tools) or None  # rendered as RL renders rollout.agent.tools
        datasets = {key: SFTDataset(files, tokenizer, max_length=data.max_length, prompt_key=data.prompt_key,
                                    response_key=data.response_key, messages_key=data.messages_key,
                                    truncation=data.truncation, apply_chat_template=data.apply_chat_template,
                                    on_bad_row=data.on_bad_row, end_ids=end_token_ids(path), tools=tools,
                                    tools_key=data.tools_key)
                    for key, files in (("train", data.train_files), ("val", data.val_files)) if files}
        self.train_set, self.val_set = datasets["train"], datasets.get("val")
        batch_size = config.trainer.batch_size
        self.steps_per_epoch = len(self.train_set) // batch_size
        if self.steps_per_epoch == 0:
            raise DatasetError(f"data.train_files: {len(self.train_set)} usable rows, fewer than one batch of "
                               f"trainer.batch_size={batch_size}")
        self.total_steps = total = config.trainer.total_steps or config.trainer.epochs * self.steps_per_epoch
        # the run parts get what they read of this config: no RL config is made of it
        self.groups = groups or build_worker_groups(actor_placement(config, total))
        self.guard = BadStepGuard(config.actor.max_consecutive_bad_steps, self.run_dir / "checkpoints")
        self.health = HealthGuard.from_config(config.health)
        self.checkpoints = RunCheckpoints(actor_checkpoints(config), self.run_dir, self.groups, self.algorithm,
                                          {"guard": self.guard, "health": self.health})
        t = config.trainer
        self.log = StepLog(LogSettings(t.loggers, total, config.tracking, config.model_dump(mode="json")), self.run_dir,
                           self.algorithm, self.groups, [self.health, *step_hooks])
        self.step = 0

    def fit(self) -> list[dict[str, Any]]:
        cfg = self.config.trainer
        try:
            self.step = first = self.checkpoints.resume()
            with self.log:
                if self.step == 0 and cfg.val_before_train and self.val_set is not None:
                    self.log.validation(0, self.validate())
                while self.step < self.total_steps:
                    self.step += 1
                    last = self.step == self.total_steps
                    metrics = self.train_step(self.batch(self.step))
                    self.guard.check(metrics)
                    if self.val_set is not None and (self.step % cfg.val_every == 0 or last):
                        metrics.update(self.validate())
                    self.log.step(self.step, metrics)
                    if self.step % cfg.save_every == 0 or last:
                        self.checkpoints.save(self.step)
            self.export()
        finally:
            self.groups.close()
        return [{"step": first + i, **metrics} for i, metrics in enumerate(self.log.history, start=1)]

    def batch(self, step: int) -> list[SFTExample]:
        """Step `step`'s examples: epoch e's order is a permutation drawn from (seed, e) alone, so a
        resumed run sees exactly the batches an uninterrupted one would."""
        size = self.config.trainer.batch_size
        epoch, position = divmod(step - 1, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.train_set), generator=generator).tolist()
        return [self.train_set[i] for i in order[position * size:(position + 1) * size]]

    def train_step(self, examples: list[SFTExample]) -> dict[str, Any]:
        start = time.perf_counter()
        actor = mean_over_ranks(required(self.groups.actor, "actor").update_sft(collate_sft(examples, self.pad_id)))
        seconds = time.perf_counter() - start
        tokens = sum(len(e.input_ids) for e in examples)
        return {**actor, "train/target_tokens": float(sum(e.num_targets for e in examples)), "train/tokens": float(tokens),
                "time/step_s": seconds, "throughput/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "train/epoch": (self.step - 1) / self.steps_per_epoch}

    def validate(self) -> dict[str, float]:
        """Mean response-token loss on the validation rows (their per-token mean, as in training):
        the actor's log-probs under the current weights (`compute_log_prob`, named for RL's old policy)."""
        assert self.val_set is not None
        batch = collate_sft(self.val_set.examples, self.pad_id)
        log_probs = required(self.groups.actor, "actor").compute_log_prob(batch).tensors["old_log_probs"]
        mask = batch.tensors["response_mask"]
        return {"val/loss": float(-(log_probs * mask).sum() / mask.sum().clamp(min=1))}

    def export(self) -> Path:
        """`trainer.output_dir/model` from the last checkpoint (replaced whole): its model folder as
        the actor saved it, or with LoRA the base with the adapter merged in."""
        checkpoint = self.checkpoints.manager.latest()
        assert checkpoint is not None, "the last step always saves a checkpoint"
        final, tmp = self.run_dir / MODEL, self.run_dir / f".{MODEL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        adapter = checkpoint / adapter_folder("actor")
        if adapter.is_dir():
            merge_adapter(self.config.model.path, adapter, tmp)
        else:
            shutil.copytree(checkpoint / "actor", tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        log.info("SFT model written to %s", final)
        return final


def actor_placement(config: SFTConfig, total_steps: int) -> Placement:
    """The actor group alone, its workers handed `sft_actor_spec` (in process, or Ray ranks on its pool)."""
    spec = sft_actor_spec(config, total_steps)
    group = RoleGroup(ActorWorker, spec, config.actor.world_size, section_size_key("actor", config.actor))
    return Placement({"actor": group}, config.trainer.backend, config.ray)


def actor_checkpoints(config: SFTConfig) -> CheckpointPolicy:
    """Checkpoints of the actor alone: its full model holds the start model's tensors, its adapter the LoRA rank."""
    t = config.trainer
    return CheckpointPolicy(t.keep_last, t.resume, config.model.path, config.health.enabled,
                            {"actor": TrainedModel.of(config.model.path, config.actor.lora, same_model=True)})


def run_sft_config(config: SFTConfig) -> tuple[Path, list[dict[str, Any]]]:
    """Train per `config`; returns the output model folder and each step's metrics."""
    trainer = SFTTrainer(config)
    history = trainer.fit()
    return trainer.run_dir / MODEL, history


__all__ = ["MODEL", "SFTTrainer", "run_sft_config"]
