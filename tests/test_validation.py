"""Sampled validation: mean@n, pass@n and maj@n overall and per data source; greedy validation
with n > 1 is refused (it would report pass@n = accuracy)."""

from __future__ import annotations

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import ConfigError, load_config
from rlcore.trainer.run import make_trainer
from rlcore.trainer.validation import sampled_validation_metrics


def test_mean_pass_and_majority_per_prompt_and_source():
    # prompt a (math): answers 7, 7, 8 with 8 right -> mean 1/3, pass 1, majority "7" wrong -> 0
    # prompt b (math): 5, 5, 4 with 5 right          -> mean 2/3, pass 1, majority right -> 1
    # prompt c (code): x, y, z all wrong              -> 0, 0, 0 (tie: first answer "x" is the vote)
    uids = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    sources = ["math"] * 6 + ["code"] * 3
    answers = ["7", " 7", "8", "5", "5\n", "4", "x", "y", "z"]
    acc = [0, 0, 1, 1, 1, 0, 0, 0, 0]
    m = sampled_validation_metrics(uids, sources, answers, [float(a) for a in acc], 3)
    assert m["val/math/mean@3"] == pytest.approx(0.5)
    assert m["val/math/pass@3"] == 1.0 and m["val/math/maj@3"] == 0.5
    assert m["val/code/mean@3"] == 0.0 and m["val/code/pass@3"] == 0.0 and m["val/code/maj@3"] == 0.0
    assert m["val/mean@3"] == pytest.approx(1 / 3) and m["val/pass@3"] == pytest.approx(2 / 3)
    assert m["val/maj@3"] == pytest.approx(1 / 3)


def _config(example, tmp_path, *extra):
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(example, str(tmp_path / "run")) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.val_batch_size=400",
        "trainer.total_steps=1", "trainer.loggers=[jsonl]", "rollout.backend=hf", SCORE_IN_PROCESS, *extra])


def test_greedy_validation_with_several_samples_is_refused(tiny_example, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.val_greedy=true with rollout\.val_n=4"):
        _config(tiny_example, tmp_path, "rollout.val_n=4", "rollout.val_greedy=true")


@pytest.mark.slow
def test_sampled_validation_reports_each_metric_per_source(tiny_example, tmp_path):
    history = make_trainer(_config(tiny_example, tmp_path, "rollout.val_n=4", "trainer.val_before_train=false")).fit()
    m = history[-1]
    sources = {k.split("/")[1] for k in m if k.count("/") == 2 and k.startswith("val/") and k.endswith("/mean@4")}
    assert sources, m.keys()
    for s in sources:
        assert 0.0 <= m[f"val/{s}/mean@4"] <= m[f"val/{s}/pass@4"] <= 1.0
        assert m[f"val/{s}/maj@4"] <= m[f"val/{s}/pass@4"]
    # sampled, not greedy: a model at ~1/3 greedy accuracy gets some prompts right only sometimes
    assert m["val/pass@4"] > m["val/mean@4"]
