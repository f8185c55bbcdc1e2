"""What each algorithm is, in one table: the only place that knows an algorithm by its name.

Config validation, preflight, role building, the loaders, throughput, the tokenizer check, the
reward-model worker, the CLI and the lifecycle ask `traits_of(name)` (or `Config.traits`) a
question ("does it generate?", "which role trains?") instead of comparing `algorithm.name` with
names; `tests/test_algorithm_traits.py` fails on such a comparison anywhere else. Adding an
algorithm means a row here and, when no recipe runs it yet, a recipe (`recipe`). The formulas
(advantage estimators, losses) live in `rlcore.algos`; an estimator says there what it reads
(`advantage_estimator_inputs`: the critic's values, ReMax's greedy baseline).

Imports nothing of rlcore: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AlgorithmName = Literal["grpo", "ppo", "dpo", "kto", "rm"]  # `algorithm.name` of a training config
Role = Literal["actor", "ref", "critic", "rollout", "reward", "reward_model"]
# Rows of the training data: RL prompts (verl's schema), preference pairs (prompt, chosen,
# rejected), unpaired preference rows (prompt, completion, label), supervised rows.
DataKind = Literal["prompts", "pairwise", "unpaired", "sft"]
# The loss a preference algorithm's update trains with (`rlcore.workers.preference.OBJECTIVES`):
# DPO's on pairs (its variants by `preference.loss_type`), KTO's on unpaired labelled rows.
PreferenceObjective = Literal["dpo", "kto"]


@dataclass(frozen=True)
class AlgorithmTraits:
    """One algorithm as the rest of rlcore needs to know it."""

    name: str
    recipe: str  # "module:Class", the control flow that runs it (`rlcore.trainer.run.make_trainer`)
    data: DataKind  # rows of data.train_files
    val_data: tuple[DataKind, ...]  # rows data.val_files may hold
    generates: bool  # samples from the policy every step (rollout, one-step overlap, agent loop)
    reward: bool  # those samples are scored by the reward: the rule scorer, and reward_model.path
    trains: tuple[Role, ...]  # roles its updates train, whose state its checkpoints hold
    reference: Literal["always", "with_kl", "never"]  # needs the reference model; with_kl: when a KL term is used
    task_validation: bool  # greedy task accuracy on preference.task_val_files (rollout + rule scorer)
    preference_keys: tuple[str, ...] = ()  # the `preference.*` settings it reads; others set are refused
    objective: PreferenceObjective | None = None  # a preference algorithm's loss, handed to `update_preference`

    @property
    def critic(self) -> bool:
        """A value model trains beside the policy (its estimator reads the values: GAE)."""
        return "critic" in self.trains

    @property
    def trains_policy(self) -> bool:
        """The actor (the policy) is what it trains; else a reward model."""
        return "actor" in self.trains


_ON_POLICY = "rlcore.trainer.on_policy:OnPolicyTrainer"
_PREFERENCE = "rlcore.trainer.preference:PreferenceTrainer"
_OFFLINE_KEYS = ("beta", "max_response_length", "ref_cache", "ref_cache_dir", "task_val_files")

ALGORITHMS: dict[str, AlgorithmTraits] = {t.name: t for t in (
    AlgorithmTraits("grpo", _ON_POLICY, data="prompts", val_data=("prompts",), generates=True, reward=True,
                    trains=("actor",), reference="with_kl", task_validation=False),
    AlgorithmTraits("ppo", _ON_POLICY, data="prompts", val_data=("prompts",), generates=True, reward=True,
                    trains=("actor", "critic"), reference="with_kl", task_validation=False),
    AlgorithmTraits("dpo", _PREFERENCE, data="pairwise", val_data=("pairwise", "unpaired"), generates=False,
                    reward=False, trains=("actor",), reference="always", task_validation=True,
                    preference_keys=(*_OFFLINE_KEYS, "loss_type", "label_smoothing"), objective="dpo"),
    AlgorithmTraits("kto", _PREFERENCE, data="unpaired", val_data=("pairwise", "unpaired"), generates=False,
                    reward=False, trains=("actor",), reference="always", task_validation=True,
                    preference_keys=(*_OFFLINE_KEYS, "desirable_weight", "undesirable_weight"), objective="kto"),
    AlgorithmTraits("rm", "rlcore.trainer.reward_model:RewardModelTrainer", data="pairwise", val_data=("pairwise",),
                    generates=False, reward=False, trains=("reward_model",), reference="never", task_validation=False),
    # `rlcore sft` (its own config type, no `algorithm.name`); "sft" is what its checkpoints record
    AlgorithmTraits("sft", "rlcore.trainer.sft:SFTTrainer", data="sft", val_data=("sft",), generates=False,
                    reward=False, trains=("actor",), reference="never", task_validation=False),
)}

if set(get_args(AlgorithmName)) != set(ALGORITHMS) - {"sft"}:  # the config's names are the table's
    raise AssertionError(f"AlgorithmName {get_args(AlgorithmName)} and ALGORITHMS {sorted(ALGORITHMS)} disagree")


def traits_of(name: str) -> AlgorithmTraits:
    """The traits of algorithm `name`; an unknown name is an error listing the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None


def names_where(**traits: object) -> list[str]:
    """The algorithms (of `algorithm.name`) whose traits have these values, in table order, e.g.
    `names_where(generates=True)` -> ["grpo", "ppo"]: for messages and CLI choices."""
    return [name for name, t in ALGORITHMS.items()
            if name in get_args(AlgorithmName) and all(getattr(t, k) == v for k, v in traits.items())]


__all__ = ["ALGORITHMS", "AlgorithmName", "AlgorithmTraits", "DataKind", "PreferenceObjective", "Role", "names_where", "traits_of"]
