"""Data loaders of a run, built from its config: prompts for RL and validation, preference rows
for DPO/KTO. Shuffled training loaders keep their position in checkpoints (exact resume)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.config import Config
from rlcore.data import PromptLoader, RLDataset
from rlcore.data.preference import PreferenceDataset, PreferenceItem, PreferenceKind, PreferenceLoader
from rlcore.protocol import Batch
from rlcore.rewards.tools import tool_schemas


def prompt_loader(config: Config, tokenizer: Any, files: list[str], *, train: bool) -> PromptLoader:
    """RL prompts: training batches of `data.train_batch_size` (shuffled, full batches only), or
    validation batches of `data.val_batch_size` in file order. An agent run's tool schemas go to
    the chat template with every prompt (`rlcore.chat.render_prompt`), as SFT's `data.tools` do."""
    cfg = config.data
    tools = tool_schemas(config.rollout.agent.tools) or None
    dataset = RLDataset(files, tokenizer, max_prompt_length=cfg.max_prompt_length,
                        apply_chat_template=cfg.apply_chat_template, on_bad_row=cfg.on_bad_row, tools=tools)
    return PromptLoader(dataset, batch_size=cfg.train_batch_size if train else cfg.val_batch_size,
                        seed=config.trainer.seed, shuffle=cfg.shuffle and train, drop_last=train)


def preference_loader(config: Config, tokenizer: Any, files: list[str], kind: PreferenceKind | None, *,
                      train: bool, collate: Callable[[list[PreferenceItem], list[str]], Batch] | None = None) -> PreferenceLoader:
    """Preference rows of `kind` (None: detected from the files, as validation files may be either);
    batches collated by the dataset, or by `collate` (`collate_rm_pairs` for a reward model)."""
    cfg = config.data
    # a reward model reads whole conversations up to reward_model.max_length tokens (longer ones keep their end)
    rm = "reward_model" in config.traits.trains
    dataset = PreferenceDataset(files, tokenizer, kind=kind,
                                max_prompt_length=config.reward_model.max_length if rm else cfg.max_prompt_length,
                                max_response_length=config.reward_model.max_length if rm else config.preference.max_response_length,
                                apply_chat_template=cfg.apply_chat_template, on_bad_row=cfg.on_bad_row)
    return PreferenceLoader(dataset, batch_size=cfg.train_batch_size if train else cfg.val_batch_size,
                            seed=config.trainer.seed, shuffle=cfg.shuffle and train, drop_last=train, collate=collate)


__all__ = ["preference_loader", "prompt_loader"]
