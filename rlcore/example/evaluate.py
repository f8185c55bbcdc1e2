"""Accuracy of a model on a validation file, graded like GSM8K strict (`#### <answer>`).

Plain `model.generate` in batches: this is a yardstick for the example, not the RL rollout path.
It stops on every end token the model declares (the tokenizer's EOS and the generation config's
`eos_token_id` list), as the rollout engines do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from rlcore.chat import prompt_ids
from rlcore.workers.tokenizer import cut_at_end

_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text: str) -> str | None:
    """The first `#### <number>` in `text`, commas removed (GSM8K strict)."""
    m = _ANSWER.search(text)
    return None if m is None else m.group(1).replace(",", "").replace("$", "")


def _load_rows(val_file: str | Path) -> list[dict]:
    # Local import: the dataset module reads parquet/jsonl with the same validation as training.
    from rlcore.data.io import read_rows

    return read_rows(val_file)


def _generation_eos(model: Any) -> list[int]:
    """The model's generation-config end tokens (an id or a list; none when unset): for a model
    loaded from a folder, its generation_config.json's (see rlcore.workers.tokenizer)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def _left_pad(batch_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return ids, mask


@torch.no_grad()
def evaluate_accuracy(
    model_dir_or_model: Any,
    tokenizer: Any,
    val_file: str | Path,
    greedy: bool = True,
    n: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 12,
    batch_size: int = 128,
    seed: int = 0,
    limit: int | None = None,
) -> dict[str, float]:
    """Accuracy (mean over samples) and pass@n (a prompt counts if any of its n samples is right).

    greedy=True uses one greedy sample per prompt (n is ignored). Returns
    {"accuracy", "pass@n", "n", "num_prompts"}.
    """
    if isinstance(model_dir_or_model, (str, Path)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir_or_model)
    else:
        model = model_dir_or_model
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_dir_or_model)
    model.eval()
    end_ids = list(dict.fromkeys([tokenizer.eos_token_id, *_generation_eos(model)]))
    rows = _load_rows(val_file)[:limit]
    n = 1 if greedy else n
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    correct_samples = 0
    solved = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, mask = _left_pad([prompt_ids(r["prompt"], tokenizer)[1] for r in chunk], tokenizer.pad_token_id)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_p=None,
            top_k=None,
            num_return_sequences=n,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=end_ids,
        )
        texts = [tokenizer.decode(cut_at_end(row.tolist(), end_ids), skip_special_tokens=True) for row in out[:, ids.shape[1]:]]
        for i, row in enumerate(chunk):
            truth = str(row["reward_model"]["ground_truth"]).replace(",", "")
            hits = [extract_answer(t) == truth for t in texts[i * n:(i + 1) * n]]
            correct_samples += sum(hits)
            solved += any(hits)
    return {
        "accuracy": correct_samples / (len(rows) * n),
        f"pass@{n}": solved / len(rows),
        "n": n,
        "num_prompts": len(rows),
    }
