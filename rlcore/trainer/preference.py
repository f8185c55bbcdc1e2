"""What DPO and KTO share: preference data, reference log-probs (per batch or cached per dataset
fingerprint), held-out preference metrics and task accuracy. The loop, checkpoints, resume,
tracking and health checks are `RLTrainer`'s; the algorithms are `train_step` in dpo.py / kto.py.

Worker groups are the RL ones, except that the actor is a `PreferenceActorWorker` (the RL actor
plus `update_preference`). The rollout and reward groups only serve validation: greedy task
accuracy on `preference.task_val_files`, exactly as an RL run measures `val/acc`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlcore.config import Config
from rlcore.data import PromptLoader, RLDataset
from rlcore.data.preference import (
    PreferenceDataset,
    PreferenceKind,
    PreferenceLoader,
    sequence_log_prob_sums,
    sequence_view,
)
from rlcore.protocol import Batch
from rlcore.trainer.base import RLTrainer, Timer
from rlcore.trainer.roles import WorkerGroups, build_worker_groups
from rlcore.workers.preference import PreferenceActorWorker

log = logging.getLogger(__name__)

SIDES: dict[str, tuple[str, ...]] = {"pairwise": ("chosen_", "rejected_"), "unpaired": ("",)}
REF_CACHE_VERSION = 1


def ref_key(prefix: str) -> str:
    """Batch key of the reference sequence log-probs of the `prefix`ed sequences."""
    return f"ref_{prefix}logps"


def build_preference_worker_groups(config: Config) -> WorkerGroups:
    """The RL worker groups; the actor role is `PreferenceActorWorker` for dpo/kto (see roles.py)."""
    return build_worker_groups(config)


def model_digest(model_dir: str | Path) -> str:
    """A cheap identity of a model folder: config, and each weight file's size, head and tail
    (hashing whole multi-GB checkpoints on every start would cost more than the cache saves)."""
    h = hashlib.sha256()
    folder = Path(model_dir)
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()


class PreferenceTrainer(RLTrainer):
    """Offline preference optimisation on `data.train_files` (rows of `kind`)."""

    kind: PreferenceKind = "pairwise"

    def __init__(self, config: Config, groups: WorkerGroups | None = None,
                 step_hooks: Sequence[Callable[[int, dict[str, Any]], None]] = ()) -> None:
        own = groups is None
        groups = groups or build_preference_worker_groups(config)
        try:
            super().__init__(config, groups, step_hooks)
            pc = config.preference
            self.task_val_loader = (
                PromptLoader(RLDataset(pc.task_val_files, self.tokenizer, max_prompt_length=config.data.max_prompt_length,
                                       apply_chat_template=config.data.apply_chat_template, on_bad_row=config.data.on_bad_row),
                             batch_size=config.data.val_batch_size, seed=config.trainer.seed, shuffle=False, drop_last=False)
                if pc.task_val_files else None
            )
            self._ref_tables: dict[int, torch.Tensor] = {}  # id(dataset) -> [N, sides] cached ref log-probs
        except BaseException:
            if own:
                groups.close()
            raise

    # ------------------------------------------------------------------ data
    def _make_loader(self, files: list[str], batch_size: int, shuffle: bool, drop_last: bool) -> PreferenceLoader:  # type: ignore[override]
        """Training files hold `self.kind` rows; validation files may be either kind (detected)."""
        cfg = self.config.data
        dataset = PreferenceDataset(
            files, self.tokenizer, kind=self.kind if list(files) == list(cfg.train_files) else None,
            max_prompt_length=cfg.max_prompt_length, max_response_length=self.config.preference.max_response_length,
            apply_chat_template=cfg.apply_chat_template, on_bad_row=cfg.on_bad_row,
        )
        return PreferenceLoader(dataset, batch_size=batch_size, seed=self.config.trainer.seed, shuffle=shuffle, drop_last=drop_last)

    @property
    def average_log_probs(self) -> bool:
        """IPO compares length-averaged log-probs (as TRL does); the others use sums."""
        return self.algorithm == "dpo" and self.config.preference.loss_type == "ipo"

    # ------------------------------------------------------------------ log-probs
    def sequence_log_probs(self, batch: Batch, prefixes: Sequence[str], *, reference: bool) -> dict[str, torch.Tensor]:
        """Sequence log-probs [B] of each `prefix`ed sequence set, from the reference group or the
        actor, in ONE group call (the sets are stacked): the chunked per-token path of RL, summed."""
        flat = Batch.concat([sequence_view(batch, p) for p in prefixes])
        flat.info["temperature"] = 1.0
        if reference:
            token_lp = self.groups.ref.compute_ref_log_prob(flat)["ref_log_probs"]
        else:
            token_lp = self.groups.actor.compute_log_prob(flat)["old_log_probs"]
        seq = sequence_log_prob_sums(token_lp, flat["response_mask"], self.average_log_probs)
        return dict(zip(prefixes, seq.split(len(batch))))

    def with_reference(self, batch: Batch, loader: PreferenceLoader, extra_prefixes: Sequence[str] = ()) -> Batch:
        """The batch plus `ref_<prefix>logps` for its sequences: from the per-dataset cache when
        `preference.ref_cache` is on, else computed now. `extra_prefixes` (KTO's mismatched pairs,
        which depend on the batch) are always computed now."""
        sides = SIDES[loader.dataset.kind]  # type: ignore[attr-defined]
        tensors: dict[str, torch.Tensor] = {}
        if self.config.preference.ref_cache:
            table = self._ref_table(loader.dataset)  # type: ignore[arg-type]
            rows = torch.as_tensor(batch.meta["index"].astype(np.int64))
            for k, prefix in enumerate(sides):
                tensors[ref_key(prefix)] = table[rows, k]
            todo = list(extra_prefixes)
        else:
            todo = list(sides) + list(extra_prefixes)
        if todo:
            tensors.update({ref_key(p): v for p, v in self.sequence_log_probs(batch, todo, reference=True).items()})
        return batch.union(Batch(tensors=tensors))

    def _ref_table(self, dataset: PreferenceDataset) -> torch.Tensor:
        """Reference log-probs of every item of `dataset` ([N, sides]), computed once and stored under
        a fingerprint of the tokenized data, the reference model and the reduction."""
        if id(dataset) in self._ref_tables:
            return self._ref_tables[id(dataset)]
        pc = self.config.preference
        fingerprint = hashlib.sha256("|".join([
            f"v{REF_CACHE_VERSION}", dataset.fingerprint(), model_digest(self.config.model.path),
            f"avg={self.average_log_probs}", self.config.model.dtype,
        ]).encode()).hexdigest()
        folder = Path(pc.ref_cache_dir) if pc.ref_cache_dir else self.run_dir / "ref_cache"
        path = folder / f"ref_logps-{fingerprint[:24]}.pt"
        table: torch.Tensor | None = None
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("fingerprint") == fingerprint:
                table = saved["logps"]
        if table is None:
            sides = SIDES[dataset.kind]  # type: ignore[index]
            table = torch.zeros(len(dataset), len(sides))
            size = self.config.data.val_batch_size
            for start in range(0, len(dataset), size):
                items = [dataset[i] for i in range(start, min(len(dataset), start + size))]
                chunk = dataset.collate(items, [str(it.index) for it in items])
                logps = self.sequence_log_probs(chunk, sides, reference=True)
                for k, prefix in enumerate(sides):
                    table[start:start + len(items), k] = logps[prefix]
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            torch.save({"fingerprint": fingerprint, "logps": table}, tmp)
            os.replace(tmp, path)
            log.info("reference log-probs of %d examples cached in %s", len(dataset), path)
        self._ref_tables[id(dataset)] = table
        return table

    # ------------------------------------------------------------------ metrics
    def step_metrics(self, batch: Batch, timer: Timer) -> dict[str, float]:
        m = {f"time/{name}_s": secs for name, secs in timer.seconds.items()}
        tokens = sum(float(batch[k].sum()) for k in batch.keys() if k.endswith("attention_mask") and not k.startswith("kl_"))
        if timer.seconds.get("update_actor"):
            m["throughput/update_tok_s"] = tokens * self.config.actor.ppo_epochs / timer.seconds["update_actor"]
        return m

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Held-out preference metrics (policy vs reference on the validation rows) and, with
        `preference.task_val_files`, greedy task accuracy through the rollout and reward groups."""
        assert self.val_loader is not None
        timer = Timer()
        beta = self.config.preference.beta
        sides = SIDES[self.val_loader.dataset.kind]  # type: ignore[attr-defined]
        policy = {p: [] for p in sides}
        ref = {p: [] for p in sides}
        labels = []
        with timer.phase("validate_pref"):
            for batch in self.val_loader.epoch_batches():
                batch = self.with_reference(batch, self.val_loader)
                for p, v in self.sequence_log_probs(batch, sides, reference=False).items():
                    policy[p].append(v)
                    ref[p].append(batch[ref_key(p)])
                if "label" in batch:
                    labels.append(batch["label"] > 0.5)
        pol = {p: torch.cat(v) for p, v in policy.items()}
        rat = {p: pol[p] - torch.cat(ref[p]) for p in sides}
        out: dict[str, float] = {}
        if sides == SIDES["pairwise"]:
            c, r = "chosen_", "rejected_"
            out["val/pref_acc_logp"] = float((pol[c] > pol[r]).float().mean())  # plain policy log-probs
            out["val/pref_acc_reward"] = float((rat[c] > rat[r]).float().mean())  # implicit reward (ties count as wrong)
            out["val/pref_margin"] = float(beta * (rat[c] - rat[r]).mean())
            out["val/chosen_logps"] = float(pol[c].mean())
            out["val/rejected_logps"] = float(pol[r].mean())
            out["val/chosen_logratio"] = float(rat[c].mean())
            out["val/rejected_logratio"] = float(rat[r].mean())
        else:
            good = torch.cat(labels)
            rewards = beta * rat[""]
            out["val/desirable_reward"] = float(rewards[good].mean()) if good.any() else 0.0
            out["val/undesirable_reward"] = float(rewards[~good].mean()) if (~good).any() else 0.0
            out["val/pref_acc_reward"] = float(((rewards > 0) == good).float().mean())
        if self.task_val_loader is not None:
            self.sync_weights(timer)
            accs, scores = [], []
            for batch in self.task_val_loader.epoch_batches():
                gen, _ = self.generate_and_score(batch, timer, validation=True)
                accs.append(gen["acc"])
                scores.append(gen["scores"])
            out["val/acc"] = float(torch.cat(accs).mean())
            out["val/reward"] = float(torch.cat(scores).mean())
        out["time/validate_s"] = sum(timer.seconds.values())
        return out


__all__ = ["PreferenceTrainer", "build_preference_worker_groups", "model_digest", "ref_key"]
