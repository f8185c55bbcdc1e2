"""Every advantage estimator recipe and policy loss that ships, and the actor/KL options, through
two real training steps on the tiny example (in-process, hf rollout): each must train (finite
metrics, weights moved) and show its effect in what the run reports (metrics.jsonl, trace.jsonl).

One training per estimator recipe, not per estimator: the trainer hands every estimator the same
inputs in one `compute_advantage` call (rlcore/trainer/on_policy.py), and each estimator's math is
pinned by tests/test_algos_golden.py. The GRPO run stands for the group-centred family; its other
members (`SAME_INPUTS_AS`) are computed here on that run's real samples, with the trainer's input
types, and must centre each prompt (or whiten the batch) as their end-to-end runs asserted."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.algos import (
    AdaptiveKLController,
    advantage_estimator_names,
    compute_advantage,
    get_advantage_estimator,
    get_policy_loss,
    group_ids_from_uids,
    masked_mean,
    policy_loss_names,
)
from rlcore.checkpoint import CheckpointManager
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import Config, load_config
from rlcore.rewards import scores_to_token_rewards
from rlcore.tracking import read_jsonl
from rlcore.trainer.baselines import greedy_reward_baselines
from rlcore.trainer.metrics import Timer
from rlcore.trainer.rollout_parts import generate, train_sampling, val_sampling
from rlcore.trainer.run import make_trainer, run_training

pytestmark = pytest.mark.slow

# 8 prompts x 4 samples (enough for some prompt to get mixed rewards at both steps), one
# optimizer step per training step (so step 1's loss is taken at the
# weights its logged entropy and old log-probs were computed with), no validation, no reference
# model unless a KL term asks for one.
SMALL = (
    SCORE_IN_PROCESS,
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "rollout.n=4",
    "rollout.backend=hf",
    "data.val_files=[]",
    "trainer.total_steps=2",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "actor.optim.warmup_steps=0",
    "algorithm.use_reference=null",
)
# A training each: the group-centred family (grpo), REINFORCE++'s discounted, whitened returns,
# ReMax's greedy-baseline generation, PPO with a critic (gae).
ESTIMATORS = ["grpo", "reinforce_plus_plus", "remax", "gae"]
# Checked on the GRPO run's samples (`test_estimator_on_a_real_step`): the same inputs, no training of their own.
SAME_INPUTS_AS = {"drgrpo": "grpo", "rloo": "grpo", "reinforce_plus_plus_baseline": "grpo"}
POLICY_LOSSES = ["vanilla", "gspo"]
ZERO_MEAN_PER_GROUP = {"grpo", "drgrpo", "rloo"}  # estimators that centre each prompt's scores
WHITENED = {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}  # zero mean over the batch's tokens


class Run:
    """One finished training run: its config, per-step metrics and trace records."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.out = Path(config.trainer.output_dir)
        self.history = run_training(config)
        self.trace = read_jsonl(self.out / "trace.jsonl")

    def final_actor(self) -> dict[str, torch.Tensor]:
        return load_file(CheckpointManager(self.out / "checkpoints").latest() / "actor" / "model.safetensors")


@pytest.fixture(scope="module")
def train(tiny_example, tmp_path_factory):
    """`train(*overrides)` -> Run, each distinct configuration trained once per module."""
    runs: dict[tuple[str, ...], Run] = {}

    def run(*overrides: str) -> Run:
        if overrides not in runs:
            out = tmp_path_factory.mktemp("run")
            config = load_config(CONFIG_DIR / "tiny_grpo.yaml",
                                 tiny_example_overrides(tiny_example, str(out)) + list(SMALL) + list(overrides))
            runs[overrides] = Run(config)
        return runs[overrides]

    return run


# KL in the reward with the adaptive controller (`test_adaptive_kl_controller_moves_the_coefficient`),
# trained in the vanilla policy loss's run: the two read different metrics of the same two steps.
KL_INIT, KL_TARGET, KL_HORIZON = 0.1, 0.05, 32


def policy_loss_overrides(loss: str) -> tuple[str, ...]:
    """Two PPO epochs, so the second pass sees ratios != 1 and the (tiny) clip range bites; the
    vanilla loss's run also carries the adaptive KL controller."""
    kl = ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", f"algorithm.kl_ctrl.kl_coef={KL_INIT}",
          f"algorithm.kl_ctrl.target_kl={KL_TARGET}", f"algorithm.kl_ctrl.horizon={KL_HORIZON}")
    return (f"actor.policy_loss={loss}", "actor.ppo_epochs=2", "actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4",
            *(kl if loss == "vanilla" else ()))


def estimator_overrides(name: str) -> tuple[str, ...]:
    return ("algorithm.name=ppo", "algorithm.adv_estimator=gae") if name == "gae" else (f"algorithm.adv_estimator={name}",)


def assert_trained(run: Run, start_model: Path) -> None:
    """Two steps, every numeric metric finite, no skipped update, and the saved actor moved."""
    assert [m.get("actor/bad_updates") for m in run.history] == [0.0, 0.0]
    for step, metrics in enumerate(run.history, 1):
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite {bad}"
        assert metrics["actor/grad_norm"] > 0
    start = load_file(start_model / "model.safetensors")
    final = run.final_actor()
    assert any(not torch.equal(start[k], final[k]) for k in final), "the actor's weights did not change"


def trace_samples(run: Run, step: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Step `step`'s samples as the trace records them: uids, scores [B], response mask [B, T]."""
    samples = next(r for r in run.trace if r["step"] == step)["samples"]
    lengths = torch.tensor([s["response_length"] for s in samples])
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
    return [s["uid"] for s in samples], torch.tensor([s["reward"] for s in samples], dtype=torch.float32), mask


def test_every_shipped_estimator_and_policy_loss_is_covered():
    """A new estimator or loss in rlcore.algos must get its end-to-end run here (or, when it takes
    the inputs of one that has, its check on that run's samples)."""
    shipped = {n for n in advantage_estimator_names() if get_advantage_estimator(n).__module__.startswith("rlcore.")}
    assert shipped == set(ESTIMATORS) | set(SAME_INPUTS_AS)
    assert set(SAME_INPUTS_AS.values()) <= set(ESTIMATORS)
    assert {n for n in policy_loss_names() if get_policy_loss(n).__module__.startswith("rlcore.")} == set(POLICY_LOSSES)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_trains_two_steps(name, train, tiny_example):
    run = train(*estimator_overrides(name))
    assert_trained(run, Path(tiny_example.model_dir))
    cfg = run.config.algorithm
    for step, metrics in enumerate(run.history, 1):
        if name == "gae":
            assert math.isfinite(metrics["critic/vf_loss"])
        if name == "remax":  # the greedy baseline is a reward: tiny_arith scores are 0 or 1
            assert 0.0 <= metrics["remax/greedy_reward_mean"] <= 1.0
            assert metrics["time/baseline_generate_s"] > 0
        if name in WHITENED:
            assert metrics["advantages/mean"] == pytest.approx(0.0, abs=1e-5)
        if name in {"remax", "gae"}:
            continue  # their advantages depend on the greedy baseline / the critic's values
        # Recompute the advantages from what the trace recorded (scores, lengths, prompt uids):
        # the trainer must group samples by prompt and use their scores exactly like this.
        uids, scores, mask = trace_samples(run, step)
        expected, _ = compute_advantage(name, token_level_rewards=scores_to_token_rewards(scores, mask),
                                        response_mask=mask, group_ids=np.array(uids), gamma=cfg.gamma, lam=cfg.lam,
                                        norm_adv_by_std=cfg.norm_adv_by_std)
        valid = expected[mask.bool()]
        assert metrics["advantages/mean"] == pytest.approx(float(masked_mean(expected, mask)), abs=1e-5)
        assert metrics["advantages/max"] == pytest.approx(float(valid.max()), abs=1e-5)
        assert metrics["advantages/min"] == pytest.approx(float(valid.min()), abs=1e-5)
        if name in ZERO_MEAN_PER_GROUP:
            per_sample = expected.sum(-1) / mask.sum(-1).clamp(min=1)
            by_prompt: dict[str, list[float]] = defaultdict(list)
            for uid, a in zip(uids, per_sample.tolist()):
                by_prompt[uid].append(a)
            assert all(abs(sum(a)) < 1e-4 for a in by_prompt.values())
            assert metrics["advantages/max"] > 0 > metrics["advantages/min"], "no prompt had mixed rewards: nothing learned"


@pytest.mark.parametrize("name", sorted(SAME_INPUTS_AS))
def test_estimator_on_a_real_step(name, train):
    """`name` on each step's samples of the run of the estimator whose inputs it takes, passed as
    the trainer passes them (token rewards, mask, torch long group ids from the prompt uids, the
    algorithm's gamma, lam and std setting): finite, and centred per prompt with both signs (or
    whitened over the batch's tokens) on real, mixed rewards."""
    run = train(*estimator_overrides(SAME_INPUTS_AS[name]))
    cfg = run.config.algorithm
    for step in (1, 2):
        uids, scores, mask = trace_samples(run, step)
        advantages, _ = compute_advantage(
            name, token_level_rewards=scores_to_token_rewards(scores, mask), response_mask=mask,
            group_ids=torch.as_tensor(group_ids_from_uids(np.array(uids)), dtype=torch.long),
            gamma=cfg.gamma, lam=cfg.lam, norm_adv_by_std=cfg.norm_adv_by_std)
        assert torch.isfinite(advantages).all() and not advantages[mask == 0].any()
        if name in WHITENED:
            assert float(masked_mean(advantages, mask)) == pytest.approx(0.0, abs=1e-5)
        if name in ZERO_MEAN_PER_GROUP:
            per_sample = advantages.sum(-1) / mask.sum(-1).clamp(min=1)
            by_prompt: dict[str, list[float]] = defaultdict(list)
            for uid, a in zip(uids, per_sample.tolist()):
                by_prompt[uid].append(a)
            assert all(abs(sum(a)) < 1e-4 for a in by_prompt.values())
        valid = advantages[mask.bool()]
        assert valid.max() > 0 > valid.min(), "no prompt had mixed rewards: nothing to learn from"


@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_policy_loss_trains_two_steps(loss, train, tiny_example):
    """Two PPO epochs, so the second pass sees ratios != 1 and the (tiny) clip range bites."""
    run = train(*policy_loss_overrides(loss))
    assert_trained(run, Path(tiny_example.model_dir))
    for metrics in run.history:
        assert 0.0 < metrics["actor/pg_clipfrac"] <= 1.0
        assert metrics["actor/ppo_kl"] != 0.0
        if loss == "gspo":
            assert metrics["actor/pg_clipfrac_lower"] == 0.0  # no dual clip in GSPO


def test_entropy_coeff_subtracts_the_entropy_bonus(train, tiny_example):
    """Same samples at step 1; the loss differs by exactly -coeff x the logged token-mean entropy."""
    coeff = 0.05
    base = train(*estimator_overrides("grpo"))
    run = train(*estimator_overrides("grpo"), f"actor.entropy_coeff={coeff}")
    assert_trained(run, Path(tiny_example.model_dir))
    first, ref = run.history[0], base.history[0]
    assert first["reward/mean"] == ref["reward/mean"] and first["actor/entropy"] == ref["actor/entropy"]
    assert first["actor/entropy"] > 0
    assert first["actor/pg_loss"] == pytest.approx(ref["actor/pg_loss"] - coeff * first["actor/entropy"], abs=1e-5)


def test_tis_cap_bounds_the_importance_weights(train, tiny_example):
    """float32 hf rollout: rollout and actor log-probs agree (weight ~1), so a cap of 0.5 makes
    every token's weight exactly 0.5: step 1's loss and gradient are half the uncapped run's."""
    cap = 0.5
    base = train(*estimator_overrides("grpo"))
    run = train(*estimator_overrides("grpo"), f"actor.tis_cap={cap}")
    assert_trained(run, Path(tiny_example.model_dir))
    first, ref = run.history[0], base.history[0]
    assert first["rollout/logprob_diff_max"] < 1e-3
    assert first["reward/mean"] == ref["reward/mean"]
    assert first["actor/grad_norm"] == pytest.approx(cap * ref["actor/grad_norm"], rel=1e-3)
    assert first["actor/pg_loss"] == pytest.approx(cap * ref["actor/pg_loss"], rel=1e-3, abs=1e-6)


def test_adaptive_kl_controller_moves_the_coefficient(train, tiny_example):
    """KL in the reward with the adaptive controller: step 1 uses the initial coefficient; the
    controller then sees step 1's KL (0: policy == reference) and lowers it for step 2 (GRPO, in
    the vanilla policy loss's two-epoch run)."""
    init, target, horizon = KL_INIT, KL_TARGET, KL_HORIZON
    run = train(*policy_loss_overrides("vanilla"))
    assert_trained(run, Path(tiny_example.model_dir))
    first, second = run.history
    assert first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/reward_kl_penalty_coeff"] == pytest.approx(init)
    expected = AdaptiveKLController(init, target, horizon)
    expected.update(first["actor/reward_kl_penalty"], n_steps=8 * 4)
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(expected.value)
    assert second["actor/reward_kl_penalty_coeff"] < init
    assert second["actor/reward_kl_penalty"] != 0.0  # the policy moved away from the reference


FINGERPRINT_REWARD = """
import zlib


def fingerprint(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 100_003)
"""


def test_greedy_baselines_are_the_scores_of_each_prompts_greedy_response(tiny_example, tmp_path):
    """With a reward that fingerprints the response text, each prompt's baseline equals the score
    of the response validation's greedy decoding gives it, and samples get their own prompt's."""
    reward = tmp_path / "fingerprint.py"
    reward.write_text(FINGERPRINT_REWARD)
    config = load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run"))
                         + list(SMALL) + ["algorithm.adv_estimator=remax", f"reward.function={reward}:fingerprint"])
    trainer = make_trainer(config)
    try:
        prompts = trainer.train_loader.next_batch()
        baselines = greedy_reward_baselines(trainer.groups, prompts, train_sampling(config, 1), Timer())

        greedy = generate(trainer.groups, prompts, val_sampling(config, 1), 0, Timer())
        greedy_scores = trainer.groups.reward.compute_reward(greedy)[0]["scores"].tolist()
        assert baselines.by_uid == dict(zip(greedy.meta["uid"].tolist(), greedy_scores))

        sampled = generate(trainer.groups, prompts, train_sampling(config, 1), 0, Timer())
        sampled_scores = trainer.groups.reward.compute_reward(sampled)[0]["scores"]
        assert not torch.equal(sampled_scores, baselines.for_samples(sampled.meta["uid"]))  # sampling != greedy

        order = np.random.default_rng(0).permutation(len(sampled))
        uids = sampled.meta["uid"][order]
        assert baselines.for_samples(uids).tolist() == [baselines.by_uid[u] for u in uids]
        with pytest.raises(KeyError, match="no greedy baseline"):
            baselines.for_samples(["not-a-prompt"])
    finally:
        trainer.groups.close()
