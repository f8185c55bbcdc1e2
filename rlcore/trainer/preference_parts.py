"""The parts of the preference recipe (DPO, KTO; `rlcore.trainer.preference`): sequence log-probs
of preference rows from the actor or the reference group, the reference log-probs cached per
dataset fingerprint, and held-out preference metrics (policy vs reference on the validation rows)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch

from rlcore.algorithms import DataKind
from rlcore.config import Config
from rlcore.data.preference import (
    PreferenceDataset,
    PreferenceKind,
    PreferenceLoader,
    sequence_log_prob_sums,
    sequence_view,
)
from rlcore.protocol import Batch
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.metrics import Timer

log = logging.getLogger(__name__)

SIDES: dict[str, tuple[str, ...]] = {"pairwise": ("chosen_", "rejected_"), "unpaired": ("",)}
# Sequences whose reference log-probs depend on the batch, so no per-dataset cache holds them:
# unpaired rows' mismatched pairs (`kl_`: each prompt with the previous row's completion, KTO's z0).
BATCH_DEPENDENT: dict[PreferenceKind, tuple[str, ...]] = {"pairwise": (), "unpaired": ("kl_",)}
REF_CACHE_VERSION = 1


def preference_kind(data: DataKind) -> PreferenceKind:
    """The preference rows of an algorithm's training data (`AlgorithmTraits.data`)."""
    if data == "pairwise" or data == "unpaired":
        return data
    raise ValueError(f"{data!r} rows are not preference rows")


def dataset_of(loader: PreferenceLoader) -> PreferenceDataset:
    """The loader's rows (`PromptLoader` types its dataset as prompts; a `PreferenceLoader`'s are preference rows)."""
    return cast(PreferenceDataset, loader.dataset)


def sides_of(dataset: PreferenceDataset) -> tuple[str, ...]:
    """The sequence prefixes of each row of `dataset`: chosen_ and rejected_ of a pair, or the one completion."""
    if dataset.kind is None:
        raise ValueError("a preference dataset without rows has no kind")
    return SIDES[dataset.kind]


def ref_key(prefix: str) -> str:
    """Batch key of the reference sequence log-probs of the `prefix`ed sequences."""
    return f"ref_{prefix}logps"


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


class SequenceLogProbs:
    """Sequence log-probs [B] of preference rows, from the actor or the reference group, in ONE
    group call per batch (the sides are stacked): the chunked per-token path of RL, summed (or
    length-averaged for IPO, as TRL does)."""

    def __init__(self, groups: WorkerGroups, *, average: bool) -> None:
        self.groups = groups
        self.average = average

    def __call__(self, batch: Batch, prefixes: Sequence[str], *, reference: bool) -> dict[str, torch.Tensor]:
        flat = Batch.concat([sequence_view(batch, p) for p in prefixes])
        if reference:
            token_lp = required(self.groups.ref, "ref").compute_ref_log_prob(flat).tensors["ref_log_probs"]
        else:
            token_lp = required(self.groups.actor, "actor").compute_log_prob(flat).tensors["old_log_probs"]
        seq = sequence_log_prob_sums(token_lp, flat.tensors["response_mask"], self.average)
        return dict(zip(prefixes, torch.split(seq, len(batch))))


class ReferenceLogProbs:
    """Attaches `ref_<prefix>logps` to preference batches: from a per-dataset table computed once and
    stored under a fingerprint of the tokenized data, the reference model and the reduction
    (`preference.ref_cache`), or computed now."""

    def __init__(self, config: Config, run_dir: Path, logps: SequenceLogProbs) -> None:
        self.config = config
        self.logps = logps
        pc = config.preference
        self.cache_dir = Path(pc.ref_cache_dir) if pc.ref_cache_dir else run_dir / "ref_cache"
        self.tables: dict[int, torch.Tensor] = {}  # id(dataset) -> [N, sides]

    def attach(self, batch: Batch, loader: PreferenceLoader, extra_prefixes: Sequence[str] = ()) -> Batch:
        """`extra_prefixes` (KTO's mismatched pairs, which depend on the batch) are always computed now."""
        dataset = dataset_of(loader)
        sides = sides_of(dataset)
        tensors: dict[str, torch.Tensor] = {}
        todo = list(sides) + list(extra_prefixes)
        if self.config.preference.ref_cache:
            table = self.table(dataset)
            rows = torch.as_tensor(batch.meta["index"].astype(np.int64))
            for k, prefix in enumerate(sides):
                tensors[ref_key(prefix)] = table[rows, k]
            todo = list(extra_prefixes)
        if todo:
            tensors.update({ref_key(p): v for p, v in self.logps(batch, todo, reference=True).items()})
        return batch.union(Batch(tensors=tensors))

    def table(self, dataset: PreferenceDataset) -> torch.Tensor:
        if id(dataset) in self.tables:
            return self.tables[id(dataset)]
        fingerprint = hashlib.sha256("|".join([
            f"v{REF_CACHE_VERSION}", dataset.fingerprint(), model_digest(self.config.model.path),
            f"avg={self.logps.average}", self.config.model.dtype,
        ]).encode()).hexdigest()
        path = self.cache_dir / f"ref_logps-{fingerprint[:24]}.pt"
        table: torch.Tensor | None = None
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("fingerprint") == fingerprint:
                table = saved["logps"]
        if table is None:
            table = self._compute(dataset)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            torch.save({"fingerprint": fingerprint, "logps": table}, tmp)
            os.replace(tmp, path)
            log.info("reference log-probs of %d examples cached in %s", len(dataset), path)
        self.tables[id(dataset)] = table
        return table

    def _compute(self, dataset: PreferenceDataset) -> torch.Tensor:
        sides = sides_of(dataset)
        table = torch.zeros(len(dataset), len(sides))
        size = self.config.data.val_batch_size
        for start in range(0, len(dataset), size):
            items = [dataset[i] for i in range(start, min(len(dataset), start + size))]
            chunk = dataset.collate(items, [str(it.index) for it in items])
            logps = self.logps(chunk, sides, reference=True)
            for k, prefix in enumerate(sides):
                table[start:start + len(items), k] = logps[prefix]
        return table


def preference_validation(loader: PreferenceLoader, reference: ReferenceLogProbs, logps: SequenceLogProbs,
                          beta: float, timer: Timer) -> dict[str, float]:
    """Held-out preference metrics: pairwise rows give preference accuracy by plain log-probs and by
    implicit reward, margins and log-ratios; unpaired rows give the rewards of desirable and
    undesirable completions and how often their sign is right."""
    sides = sides_of(dataset_of(loader))
    policy: dict[str, list[torch.Tensor]] = {p: [] for p in sides}
    ref: dict[str, list[torch.Tensor]] = {p: [] for p in sides}
    labels = []
    with timer.phase("validate_pref"):
        for batch in loader.epoch_batches():
            batch = reference.attach(batch, loader)
            for p, v in logps(batch, sides, reference=False).items():
                policy[p].append(v)
                ref[p].append(batch.tensors[ref_key(p)])
            if "label" in batch:
                labels.append(batch.tensors["label"] > 0.5)
    pol = {p: torch.cat(v) for p, v in policy.items()}
    rat = {p: pol[p] - torch.cat(ref[p]) for p in sides}
    if sides == SIDES["pairwise"]:
        c, r = "chosen_", "rejected_"
        return {
            "val/pref_acc_logp": float((pol[c] > pol[r]).float().mean()),  # plain policy log-probs
            "val/pref_acc_reward": float((rat[c] > rat[r]).float().mean()),  # implicit reward (ties count as wrong)
            "val/pref_margin": float(beta * (rat[c] - rat[r]).mean()),
            "val/chosen_logps": float(pol[c].mean()),
            "val/rejected_logps": float(pol[r].mean()),
            "val/chosen_logratio": float(rat[c].mean()),
            "val/rejected_logratio": float(rat[r].mean()),
        }
    good = torch.cat(labels)
    rewards = beta * rat[""]
    return {
        "val/desirable_reward": float(rewards[good].mean()) if good.any() else 0.0,
        "val/undesirable_reward": float(rewards[~good].mean()) if (~good).any() else 0.0,
        "val/pref_acc_reward": float(((rewards > 0) == good).float().mean()),
    }


def preference_step_metrics(batch: Batch, timer: Timer, ppo_epochs: int) -> dict[str, float]:
    """Phase times and update throughput (tokens of every sequence the update saw)."""
    m = timer.metrics()
    tokens = sum(float(t.sum()) for k, t in batch.tensors.items() if k.endswith("attention_mask") and not k.startswith("kl_"))
    if timer.seconds.get("update_actor"):
        m["throughput/update_actor_tok_s"] = tokens * ppo_epochs / timer.seconds["update_actor"]
    return m


__all__ = [
    "ReferenceLogProbs", "SIDES", "SequenceLogProbs", "model_digest", "preference_step_metrics",
    "preference_validation", "ref_key",
]
