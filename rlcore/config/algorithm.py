"""The algorithm sections: the control flow and its estimators, KL control, and the preference
objectives (DPO, KTO)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlcore.algorithms import AlgorithmName
from rlcore.config.base import Section, check_registered


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)


class AlgorithmConfig(Section):
    name: AlgorithmName = Field(
        "grpo", description="the control flow: grpo (and its critic-free relatives), ppo, dpo, kto, or rm (train a "
        "reward model on pairwise preference rows)")
    adv_estimator: str = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    use_reference: bool | None = Field(None, description="default: on when any KL term is used")

    @field_validator("adv_estimator")
    @classmethod
    def _known_adv_estimator(cls, name: str) -> str:
        return check_registered("advantage estimator", name)

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl_penalty(cls, name: str) -> str:
        return check_registered("KL estimator", name)



class PreferenceConfig(Section):
    """Offline preference optimisation (algorithm.name dpo or kto). data.train_files / val_files then
    hold preference rows (rlcore.data.preference: pairwise for DPO, unpaired for KTO; validation
    files may be pairwise for both, which gives held-out preference accuracy)."""

    loss_type: Literal["sigmoid", "ipo", "robust"] = Field("sigmoid", description="DPO loss (sigmoid + label_smoothing = cDPO)")
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="DPO sigmoid/robust: assumed label-flip rate")
    desirable_weight: float = Field(1.0, gt=0, description="KTO")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO")
    max_response_length: int = Field(64, ge=1, description="completions longer than this (tokens, EOS included) are dropped")
    ref_cache: bool = Field(True, description="reference log-probs computed once per dataset, cached by fingerprint")
    ref_cache_dir: str | None = Field(None, description="default: <trainer.output_dir>/ref_cache")
    task_val_files: list[str] = Field([], description="RL-schema prompts whose greedy accuracy (val/acc) is measured at validation")

