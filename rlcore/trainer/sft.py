"""Supervised fine-tuning: `rlcore sft CONFIG` (the recipe, `SFTTrainer`) and the in-memory loop
the tiny example warms its model with (`run_sft`).

Both take the loss on response tokens only (prompt and padding are labelled -100), averaged over
all response tokens of the optimizer batch, so splitting a batch into micro-batches gives the same
gradient as one big batch.

`SFTTrainer` is the whole loop of a run, as the RL recipes are theirs: verl-schema SFT data
(`rlcore.data.sft`: prompt/response columns or chat messages), each optimizer batch packed into
micro-batches of at most `trainer.max_tokens_per_micro_batch` real tokens (`rlcore.packing`, each
micro-batch padded only to its own longest sequence), AdamW and the schedule of the RL actor
(`rlcore.workers.optim`), validation loss, checkpoints that resume exactly (model, optimizer,
schedule, RNG; the data order is a function of the seed and the step), and at the end a Hugging
Face folder `trainer.output_dir/model` (the model, its generation config and the base folder's
tokenizer files as they were) that an RL config's `model.path` starts from. Before anything loads
it checks what the config names and that the data's prompts tokenize as AutoTokenizer does.

`run_sft` is the example's warm start (`rlcore.example.build`): fixed-size micro-batches, its own
warmup-cosine schedule, in place on a model in memory. Its float path is what the example's
pinned weights hash (`055fa45b...`) comes from: keep it as it is.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore.checkpoint import CheckpointError, CheckpointManager, load_trainer_state, rng_state, save_trainer_state, set_rng_state
from rlcore.config import SFTRunConfig, dump_config
from rlcore.data.schema import DatasetError
from rlcore.data.sft import IGNORE_INDEX, SFTDataset, SFTExample, tokenize_prompt_response
from rlcore.packing import pack_token_budget
from rlcore.tracking import Tracker, open_tracker, truncate_jsonl
from rlcore.trainer.run_state import TrainingStopped
from rlcore.workers.checkpointing import load_training_state, save_trained
from rlcore.workers.loading import load_causal_lm, resolve_device, trained_dtype
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.tokenizer import copy_tokenizer, end_token_ids, load_tokenizer, pad_token_id
from rlcore.workers.trainable import Trainable

log = logging.getLogger(__name__)


@dataclass
class SFTConfig:
    """Settings of the in-memory loop `run_sft` (the example's warm start); `rlcore sft` reads an
    `rlcore.config.SFTRunConfig` instead."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 20
    epochs: int = 1
    max_steps: int | None = None  # stop early after this many optimizer steps
    batch_size: int = 64  # sequences per optimizer step
    micro_batch_size: int = 64  # sequences per forward/backward
    max_grad_norm: float = 1.0
    max_length: int = 512  # longer sequences are truncated from the right
    apply_chat_template: bool = True
    seed: int = 0
    log_every: int = 50
    output_dir: str | None = None  # save_pretrained here when set


def tokenize_sft_row(row: dict, tokenizer: Any, apply_chat_template: bool = True, max_length: int = 512) -> tuple[list[int], list[int]]:
    """(input ids, labels) for a {"prompt", "response"} row; labels are -100 on the prompt.

    The response is followed by EOS so the model learns to stop (`rlcore.data.sft`); longer rows
    are cut from the right."""
    ids, labels = tokenize_prompt_response(row["prompt"], row["response"], tokenizer, apply_chat_template)
    return ids[:max_length], labels[:max_length]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of (ids, labels) into input_ids / attention_mask / labels tensors."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def lr_at(step: int, total: int, cfg: SFTConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to cfg.lr * cfg.min_lr_ratio at `total`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def response_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled tokens, and how many there were."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, int((targets != IGNORE_INDEX).sum())


def backward_batch(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], micro_batch_size: int,
                   pad_id: int, device: torch.device | str = "cpu") -> tuple[float, int]:
    """Accumulate the gradient of the batch's mean response-token loss, micro-batch by micro-batch
    of `micro_batch_size` sequences. Returns (mean loss, response tokens)."""
    micro = [collate(examples[m : m + micro_batch_size], pad_id) for m in range(0, len(examples), micro_batch_size)]
    return backward_micro_batches(model, micro, device)


def backward_micro_batches(model: torch.nn.Module, micro: list[dict[str, torch.Tensor]],
                           device: torch.device | str = "cpu") -> tuple[float, int]:
    """Accumulate the gradient of the mean response-token loss over all `micro` batches.

    Each micro-batch's summed loss is divided by the whole batch's response-token count, so the
    gradient is the same however the batch is split. Returns (mean loss, response tokens).
    """
    denom = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro)
    total = 0.0
    for mb in micro:
        mb = {k: v.to(device) for k, v in mb.items()}
        loss_sum, _ = response_token_loss(model, mb)
        (loss_sum / denom).backward()
        total += loss_sum.item()
    return total / denom, denom


def packed_micro_batches(examples: list[SFTExample], max_tokens: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """The batch as micro-batches of at most `max_tokens` real tokens each (first-fit decreasing,
    `rlcore.packing`; a longer sequence goes alone), each padded to its own longest sequence."""
    bins = pack_token_budget([len(e.input_ids) for e in examples], max_tokens)
    return [collate([(examples[i].input_ids, examples[i].labels) for i in b], pad_id) for b in bins]


def run_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    config: SFTConfig,
    log: Callable[[str], None] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune `model` in place on `rows` ({"prompt": messages|str, "response": str});
    `on_step(step, total)` after each optimizer step (a progress bar).

    Returns metrics: steps, first/last/mean-of-last-10 loss, tokens trained on, wall seconds.
    Saves model and tokenizer with save_pretrained when `config.output_dir` is set.
    """
    if config.batch_size % config.micro_batch_size:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of micro_batch_size {config.micro_batch_size}")
    if not rows:
        raise ValueError("run_sft got no rows")
    torch.manual_seed(config.seed)
    examples = [tokenize_sft_row(r, tokenizer, config.apply_chat_template, config.max_length) for r in rows]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device

    steps_per_epoch = len(examples) // config.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(examples)} rows are fewer than one batch of {config.batch_size}")
    total = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total = min(total, config.max_steps)

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=config.betas,
    )
    gen = torch.Generator().manual_seed(config.seed)
    model.train()
    losses: list[float] = []
    n_tokens = 0
    start = time.perf_counter()
    step = 0
    while step < total:
        order = torch.randperm(len(examples), generator=gen).tolist()
        for b in range(steps_per_epoch):
            if step >= total:
                break
            idx = order[b * config.batch_size : (b + 1) * config.batch_size]
            for group in optim.param_groups:
                group["lr"] = lr_at(step, total, config)
            optim.zero_grad(set_to_none=True)
            loss, denom = backward_batch(model, [examples[i] for i in idx], config.micro_batch_size, pad_id, device)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optim.step()
            losses.append(loss)
            n_tokens += denom
            step += 1
            if on_step is not None:
                on_step(step, total)
            if log and (step % config.log_every == 0 or step == total):
                log(f"sft step {step}/{total} loss {losses[-1]:.4f} lr {optim.param_groups[0]['lr']:.2e}")
    model.eval()
    metrics = {
        "steps": step,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "tokens": n_tokens,
        "time_s": time.perf_counter() - start,
        "losses": losses,
    }
    if config.output_dir:
        save_model(model, tokenizer, config.output_dir)
    return metrics


def save_model(model: torch.nn.Module, tokenizer: Any, output_dir: str | Path) -> None:
    """HF format (safetensors) that transformers and vLLM load directly."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)


# ----------------------------------------------------------------------------- the recipe
MODEL = "model"  # the model's name in a checkpoint (step_XXXXXXXX/model/) and in the output folder
MAX_BAD_STEPS = 3  # non-finite gradients in a row before the run stops


class SFTTrainer:
    """`rlcore sft`: the whole supervised run, from the config to `trainer.output_dir/model`."""

    algorithm = "sft"

    def __init__(self, config: SFTRunConfig) -> None:
        from rlcore.trainer.preflight import sft_preflight
        from rlcore.trainer.tokenizer_check import check_tokenization, sample_prompts

        sft_preflight(config)  # before anything loads: every path the config names
        data, cfg = config.data, config.trainer
        if data.tokenizer_check_rows:
            keyed = [(f"data.train_files[{i}]", f) for i, f in enumerate(data.train_files)]
            keyed += [(f"data.val_files[{i}]", f) for i, f in enumerate(data.val_files)]
            check_tokenization(config.model.path, sample_prompts(keyed, data.tokenizer_check_rows, data.prompt_key),
                               data.apply_chat_template)
        self.config = config
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(config))
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        path = config.model.path
        self.tokenizer = load_tokenizer(path)
        self.pad_id = pad_token_id(path)
        datasets = {key: SFTDataset(files, self.tokenizer, max_length=data.max_length, prompt_key=data.prompt_key,
                                    response_key=data.response_key, messages_key=data.messages_key,
                                    truncation=data.truncation, apply_chat_template=data.apply_chat_template,
                                    on_bad_row=data.on_bad_row, end_ids=end_token_ids(path))
                    for key, files in (("train", data.train_files), ("val", data.val_files)) if files}
        self.train_set, self.val_set = datasets["train"], datasets.get("val")
        self.steps_per_epoch = len(self.train_set) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise DatasetError(f"data.train_files: {len(self.train_set)} usable rows, fewer than one batch of "
                               f"trainer.batch_size={cfg.batch_size}")
        self.total_steps = cfg.total_steps or cfg.epochs * self.steps_per_epoch
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=cfg.keep_last)
        self.resume_from = self._resume_point()
        start = self.resume_from / MODEL if self.resume_from is not None else Path(path)
        model = load_causal_lm(start, trained_dtype(config.model), self.device, config.model.gradient_checkpointing)
        optimizer = build_optimizer(model, config.optim)
        self.trained = Trainable(model, optimizer, build_scheduler(optimizer, config.optim, self.total_steps))
        self.autocast = config.model.dtype == "bfloat16" and not config.model.pure_bf16
        self.step = 0
        self.bad_in_a_row = 0
        self.history: list[dict[str, Any]] = []

    # -------------------------------------------------------------- the loop
    def fit(self) -> list[dict[str, Any]]:
        cfg = self.config.trainer
        self.step = self._resume()
        tracker = self._open_tracker()
        try:
            if self.step == 0 and cfg.val_before_train and self.val_set is not None:
                self._log(tracker, 0, self.validate())
            while self.step < self.total_steps:
                self.step += 1
                last = self.step == self.total_steps
                metrics = self.train_step(self.batch(self.step))
                if self.val_set is not None and (self.step % cfg.val_every == 0 or last):
                    metrics.update(self.validate())
                self._log(tracker, self.step, metrics)
                if self.step % cfg.save_every == 0 or last:
                    self.save(self.step)
            self.export()
        finally:
            tracker.close()
        return self.history

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
        model, optimizer, scheduler = self.trained.model, self.trained.optimizer, self.trained.scheduler
        model.train()
        micro = packed_micro_batches(examples, self.config.trainer.max_tokens_per_micro_batch, self.pad_id)
        optimizer.zero_grad(set_to_none=True)
        lr = self.trained.lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, targets = backward_micro_batches(model, micro, self.device)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.config.optim.grad_clip))
        if math.isfinite(grad_norm) and math.isfinite(loss):
            optimizer.step()
            self.bad_in_a_row = 0
        else:  # skipped: the weights never see a non-finite update
            optimizer.zero_grad(set_to_none=True)
            self.bad_in_a_row += 1
            if self.bad_in_a_row >= MAX_BAD_STEPS:
                raise TrainingStopped(f"{self.bad_in_a_row} SFT steps in a row had a non-finite loss or gradient; the "
                                      f"last checkpoint is kept in {self.checkpoints.root}")
        scheduler.step()
        seconds = time.perf_counter() - start
        tokens = sum(len(e.input_ids) for e in examples)
        return {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/target_tokens": float(targets),
                "train/tokens": float(tokens), "train/micro_batches": float(len(micro)),
                "train/bad_updates": float(self.bad_in_a_row > 0), "time/step_s": seconds,
                "throughput/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "train/epoch": (self.step - 1) / self.steps_per_epoch}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean response-token loss on the validation rows (their per-token mean, as in training)."""
        assert self.val_set is not None
        model = self.trained.model
        model.eval()
        total, targets = 0.0, 0
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for mb in packed_micro_batches(self.val_set.examples, self.config.trainer.max_tokens_per_micro_batch, self.pad_id):
                loss_sum, n = response_token_loss(model, {k: v.to(self.device) for k, v in mb.items()})
                total, targets = total + float(loss_sum), targets + n
        return {"val/loss": total / max(1, targets)}

    # -------------------------------------------------------------- checkpoints and output
    def save(self, step: int) -> Path:
        def write(folder: Path) -> None:
            save_trained(self.trained, folder, MODEL, rank=0, tokenizer_dir=Path(self.config.model.path))
            save_trainer_state(folder, {"step": step, "rng": rng_state(), "bad_in_a_row": self.bad_in_a_row})

        return self.checkpoints.save(step, write, extra={"algorithm": self.algorithm})

    def export(self) -> Path:
        """`trainer.output_dir/model`: the trained model as a Hugging Face folder (replaced whole)."""
        final = self.run_dir / MODEL
        tmp = self.run_dir / f".{MODEL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.trained.model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(Path(self.config.model.path), tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def _resume_point(self) -> Path | None:
        mode = self.config.trainer.resume
        if mode == "disable":
            return None
        path = self.checkpoints.latest() if mode == "auto" else Path(mode)
        if path is None:
            return None
        manifest = self.checkpoints.verify(path)
        if manifest.get("algorithm") != self.algorithm:
            raise CheckpointError(f"{path}: a {manifest.get('algorithm')} checkpoint, not an SFT one (trainer.resume)")
        return path

    def _resume(self) -> int:
        """The optimizer, schedule, counters and RNG of `resume_from` (the model loaded from it
        already); 0 and empty logs for a fresh start."""
        if self.resume_from is None:
            truncate_jsonl(self.run_dir / "metrics.jsonl", -1)
            return 0
        load_training_state(self.trained, self.resume_from, MODEL, self.device)
        state = load_trainer_state(self.resume_from)
        set_rng_state(state["rng"])
        self.bad_in_a_row = int(state.get("bad_in_a_row", 0))
        step = int(state["step"])
        truncate_jsonl(self.run_dir / "metrics.jsonl", step)
        log.info("resumed SFT from %s (step %d)", self.resume_from, step)
        return step

    def _open_tracker(self) -> Tracker:
        c = self.config
        return open_tracker(c.trainer.loggers, self.run_dir, self.total_steps, mlflow_uri=c.tracking.mlflow_uri,
                            experiment=c.tracking.experiment, config_tree=c.model_dump(mode="json"),
                            tags={"rlcore.algorithm": self.algorithm}, run_id=c.tracking.run_id)

    def _log(self, tracker: Tracker, step: int, metrics: dict[str, Any]) -> None:
        tracker.log(step, metrics)
        self.history.append({"step": step, **metrics})


def run_sft_config(config: SFTRunConfig) -> tuple[Path, list[dict[str, Any]]]:
    """Train per `config`; returns the output model folder and each step's metrics."""
    trainer = SFTTrainer(config)
    history = trainer.fit()
    return trainer.run_dir / MODEL, history


__all__ = ["IGNORE_INDEX", "SFTConfig", "SFTTrainer", "backward_batch", "backward_micro_batches", "collate", "lr_at",
           "packed_micro_batches", "response_token_loss", "run_sft", "run_sft_config", "save_model", "tokenize_sft_row"]
