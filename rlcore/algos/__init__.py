"""The RL algorithm core: advantages, policy/value/KL losses, loss aggregation, KL controllers.

Torch reference implementations with verl's ``core_algos`` semantics (deliberate differences
are documented where they occur; the main one is :func:`agg_loss`, which returns a
micro-batch's share of the mini-batch loss so gradients don't depend on the micro-batch split).
Advantage building blocks dispatch to the Rust extension ``rlcore._native`` for float32 CPU
inputs (see :mod:`rlcore.native`).
"""

from rlcore.algos.advantages import (
    GROUP_MODES,
    advantage_estimator_inputs,
    advantage_estimator_names,
    compute_advantage,
    discounted_returns,
    gae_raw,
    get_advantage_estimator,
    group_ids_from_uids,
    group_outcome_advantage,
    register_advantage_estimator,
)
from rlcore.algos.aggregation import AGG_MODES, agg_loss, loss_counts
from rlcore.algos.entropy import entropy_from_logits
from rlcore.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from rlcore.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlcore.algos.policy_loss import (
    get_policy_loss,
    gspo_policy_loss,
    policy_loss_names,
    register_policy_loss,
    vanilla_policy_loss,
)
from rlcore.algos.value_loss import compute_value_loss

__all__ = [
    "AGG_MODES",
    "GROUP_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "advantage_estimator_inputs",
    "advantage_estimator_names",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_value_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae_raw",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_ids_from_uids",
    "group_outcome_advantage",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "loss_counts",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_names",
    "register_advantage_estimator",
    "register_policy_loss",
    "vanilla_policy_loss",
]

# Offline preference optimisation (DPO family, KTO).
from rlcore.algos.preference import (  # noqa: E402
    DPO_LOSS_TYPES,
    PreferenceLossOutput,
    bradley_terry_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    kto_reference_point_from_sums,
)

__all__ += ["DPO_LOSS_TYPES", "PreferenceLossOutput", "bradley_terry_loss", "dpo_loss", "kto_loss",
            "kto_reference_point", "kto_reference_point_from_sums"]

# A reward model's scores in the RL reward (normalisation, clipping, weights).
from rlcore.algos.reward_model import RunningMoments, combine_reward_scores  # noqa: E402

__all__ += ["RunningMoments", "combine_reward_scores"]
