"""The tiny example's warm start: a small supervised loop on a model in memory, fixed-size
micro-batches, its own warmup-cosine schedule and AdamW parameter groups.

Not `rlcore sft` (`rlcore.trainer.sft`, on the actor worker through the shared update loop) on
purpose: the example's weights are pinned (`rlcore.example.build`: built in a child process with
portable kernels, their sha256 recorded and equal across x86-64 machines), and they are this
loop's float path: full logits and `cross_entropy` on padded micro-batches, the schedule computed
here. The actor's path (packed sequences, chunked log-probs, `LambdaLR`) computes the same loss to
float tolerance, not to the bit, so moving the warm start onto it would change the example's
hash. Keep this loop as it is.

The loss is taken on response tokens only (prompt and padding are labelled -100), averaged over
all response tokens of the optimizer batch, so splitting a batch into micro-batches gives the same
gradient as one big batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore.data.sft import IGNORE_INDEX, tokenize_prompt_response


@dataclass
class WarmStartSettings:
    """Settings of the example's warm-start loop (`run_warm_start`); the example's build recipe
    (`rlcore.example.build.Recipe`) chooses them."""

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


def lr_at(step: int, total: int, cfg: WarmStartSettings) -> float:
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


def run_warm_start(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    config: WarmStartSettings,
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
        raise ValueError("run_warm_start got no rows")
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

__all__ = ["IGNORE_INDEX", "WarmStartSettings", "backward_batch", "backward_micro_batches", "collate", "lr_at",
           "response_token_loss", "run_warm_start", "save_model", "tokenize_sft_row"]
