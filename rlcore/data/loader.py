"""`PromptLoader`: deterministic, exactly resumable batches of prompts as `Batch`es.

The order of epoch e is a permutation drawn from (seed, e) alone, so the loader's whole state is
(epoch, position): a run resumed from `state_dict()` sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rlcore.data.dataset import PromptItem, RLDataset
from rlcore.data.schema import DatasetError
from rlcore.protocol import Batch


def collate_prompts(items: list[PromptItem], pad_id: int, uids: list[str]) -> Batch:
    """LEFT-padded prompt tensors (generation continues from the right edge) plus metadata."""
    width = max(len(it.input_ids) for it in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it.input_ids)
        input_ids[i, width - n:] = torch.tensor(it.input_ids, dtype=torch.long)
        attention_mask[i, width - n:] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        meta={
            "uid": np.array(uids, dtype=object),
            "index": np.array([it.index for it in items], dtype=np.int64),
            "data_source": [it.data_source for it in items],
            "ground_truth": [it.ground_truth for it in items],
            "extra_info": [dict(it.extra_info) for it in items],
            "raw_prompt": [it.raw_prompt for it in items],
            "prompt_messages": [list(it.messages) for it in items],
        },
    )


class PromptLoader:
    """Batches of `batch_size` prompts; epochs follow each other forever via `next_batch()`."""

    def __init__(self, dataset: RLDataset, batch_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, pad_token_id: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(dataset, "pad_token_id", 0)
        if len(self) == 0:
            raise DatasetError(f"dataset has {len(dataset)} rows, fewer than one batch of {batch_size} (drop_last=True): "
                               "add rows or lower the batch size (data.train_batch_size)")
        self.epoch = 0
        self.position = 0  # batches already handed out in this epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices of `epoch`, a function of (seed, epoch) only."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def batch_at(self, epoch: int, position: int) -> Batch:
        idx = self.order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        items = [self.dataset[int(i)] for i in idx]
        return collate_prompts(items, self.pad_token_id, [f"{epoch}-{it.index}" for it in items])

    def next_batch(self) -> Batch:
        """The next batch, rolling into the next epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        batch = self.batch_at(self.epoch, self.position)
        batch.info["epoch"] = self.epoch
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch (advancing the state)."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        while self.position < len(self):
            yield self.next_batch()

    def epoch_batches(self, epoch: int = 0) -> Iterator[Batch]:
        """One whole epoch without touching the state: what validation iterates."""
        for position in range(len(self)):
            batch = self.batch_at(epoch, position)
            batch.info["epoch"] = epoch
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "num_prompts": len(self.dataset), "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly; refuses a state from a different seed, batch size or dataset size."""
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size),
                          ("num_prompts", len(self.dataset)), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {key}={mine!r}: "
                                 "resuming would not replay the same data order")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
