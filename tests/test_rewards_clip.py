"""A reward beyond `reward.clip` (1e300, a Python int beyond any float) is clipped to it and
counted, never overflows float32, and a run with such a reward function trains on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import ConfigError, load_config
from rlcore.rewards import RewardScorer, ScoreItem

HUGE_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores written in solution_str: '1e300', '-1e300', 'bigint' (10**400), or any number."""
    if solution_str == "bigint":
        return {"score": 10**400, "raw": 1e300}
    return float(solution_str)
'''

SOLUTIONS = ["1e300", "-1e300", "bigint", "5", "-20000", "10000"]


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "huge_reward.py"
    path.write_text(HUGE_REWARD)
    return f"{path}:compute_score"


def items() -> list[ScoreItem]:
    return [ScoreItem("custom", s, "") for s in SOLUTIONS]


@pytest.mark.parametrize("num_workers", [0, 1], ids=["in-process", "worker-pool"])
def test_scores_beyond_clip_are_clipped_and_counted(spec, num_workers):
    with RewardScorer(spec, num_workers=num_workers, clip=1e4) as scorer:
        result = scorer.score(items())
    assert result.scores.tolist() == [1e4, -1e4, 1e4, 5.0, -1e4, 1e4]  # exactly 1e4 is not beyond it
    assert result.n_clipped == 4 and result.n_errors == 0 and result.scores.dtype == np.float32
    assert np.isfinite(result.extra["raw"][2])  # an extra metric (NaN where absent) is kept finite too


def test_without_a_clip_scores_still_never_overflow_float32(spec):
    with RewardScorer(spec, num_workers=0, clip=None) as scorer:
        result = scorer.score(items())
    top = float(np.finfo(np.float32).max)
    assert np.isfinite(result.scores).all()
    assert result.scores.tolist()[:3] == [top, -top, top] and result.scores[4] == -20000.0
    assert result.n_clipped == 3


def test_clip_is_checked_at_load():
    base = ["model.path=m", "data.train_files=[t.parquet]"]
    assert load_config(None, base).reward.clip == 1e4
    assert load_config(None, [*base, "reward.clip=null"]).reward.clip is None
    with pytest.raises(ConfigError, match=r"reward\.clip"):
        load_config(None, [*base, "reward.clip=0"])
    with pytest.raises(ConfigError, match=r"reward.error_score=-50000 lies beyond reward.clip=10000"):
        load_config(None, [*base, "reward.error_score=-5e4"])
    with pytest.raises(ValueError, match="error_score"):
        RewardScorer(None, num_workers=0, error_score=-5.0, clip=1.0)


@pytest.mark.slow
def test_a_run_with_a_1e300_reward_trains_on(tiny_example, tmp_path):
    """The issue's reproduction: before, `ValueError: scores: contains NaN or inf` ended the run."""
    from rlcore.trainer.run import run_training

    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1e300 if len(solution_str) % 2 else 0.0\n")
    config = load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        f"reward.function={reward}:score", "reward.clip=100", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
        "rollout.n=4", "rollout.max_new_tokens=8", "data.val_files=[]", "trainer.total_steps=1",
        "trainer.loggers=[jsonl]", "trainer.trace=false", "rollout.backend=hf"])
    [step] = run_training(config)
    assert step["reward/clipped"] > 0
    assert 0 < step["reward/mean"] < 100 and math.isfinite(step["actor/pg_loss"])
