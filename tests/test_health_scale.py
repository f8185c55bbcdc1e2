"""The health guard knows scale: reward and KL jumps are judged against the run's own recent spread,
so a reward on any scale (0/1, 0/10, -100..100) trains, while an exploit or a collapse still stops
the run with a message naming the `health.*` setting and its value.

Unit tests on the guard (the same run on every scale gives the same decisions; off until a baseline
exists; the baseline survives a checkpoint), then real short runs of the tiny example: a reward file
paying 10 per right answer (issue #25's repro, stopped at step 5 by the old absolute limit) trains
through; resumed, the same run stops the step its reward function starts paying 1000 (an exploit);
a learning rate that wrecks the policy stops at its first update."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import ConfigError, load_config
from rlcore.tracking import read_jsonl
from rlcore.trainer.health import HealthBreach, HealthGuard

# reward/mean and reward/std of the first 12 steps of the 0/10 run in the issue (tiny GRPO, 256 samples a step)
PAYS_10 = [(4.883, 5.008), (4.258, 4.954), (4.336, 4.965), (4.805, 5.006), (5.977, 4.913), (6.133, 4.88),
           (6.562, 4.759), (6.367, 4.819), (6.719, 4.705), (6.133, 4.88), (6.602, 4.746), (7.422, 4.383)]


def _feed(guard: HealthGuard, series: list[tuple[float, float]], scale: float = 1.0, shift: float = 0.0) -> int | None:
    """The step at which the guard stops a reward series (mean, std per step), or None."""
    for step, (mean, std) in enumerate(series, start=1):
        try:
            guard(step, {"reward/mean": mean * scale + shift, "reward/std": std * abs(scale)})
        except HealthBreach as breach:
            return breach.step
    return None


def _guard() -> HealthGuard:
    return HealthGuard.from_config(load_config(None, ["model.path=m", "data.train_files=[t.parquet]"]).health)


def test_the_default_guard_passes_the_0_10_run_the_old_absolute_limit_stopped():
    assert _feed(HealthGuard(max_reward_jump=0.75), PAYS_10) == 5  # the stop
    assert _feed(_guard(), PAYS_10) is None


@pytest.mark.parametrize("scale, shift", [(0.1, 0.0), (1.0, 0.0), (20.0, -100.0), (-3.0, 7.0), (1e6, 0.0)])
def test_decisions_do_not_depend_on_the_reward_scale(scale, shift):
    r = random.Random(0)
    steady = [(0.5 + 0.01 * i + r.gauss(0, 0.03), 0.5) for i in range(20)]
    exploit = steady[:12] + [(9.0, 0.5)] + steady[13:]
    assert _feed(_guard(), steady, scale, shift) is None
    assert _feed(_guard(), exploit, scale, shift) == 13


def test_off_until_a_baseline_exists_and_the_message_names_the_setting():
    wild = _guard()
    for step in range(1, 6):  # the first jump_window steps: no baseline, no check
        wild(step, {"reward/mean": float(step % 2) * 100, "reward/std": 1.0})
    constant = _guard()
    for step in range(1, 9):  # a spread of 0 (every reward the same so far): no baseline either
        constant(step, {"reward/mean": 0.0, "reward/std": 0.0})
    constant(9, {"reward/mean": 1.0, "reward/std": 0.3})
    assert _feed(_guard(), [(0.0, 1.0)] * 6 + [(2.5, 1.0)]) is None
    guard = _guard()
    with pytest.raises(HealthBreach) as info:
        _feed_raising(guard, [(0.0, 1.0)] * 6 + [(50.0, 1.0)])
    assert info.value.step == 7 and info.value.setting == "health.reward_jump_sigmas=3 times that spread"
    assert str(info.value) == (
        "run health: reward/mean jumped from 0 to 50, 50x the spread of the last 5 steps (1) at step 7: "
        "reward/mean_jump=50 (limit 3; health.reward_jump_sigmas=3 times that spread: raise it, or set it to null "
        "to switch this check off)")


def _feed_raising(guard: HealthGuard, series: list[tuple[float, float]]) -> None:
    for step, (mean, std) in enumerate(series, start=1):
        guard(step, {"reward/mean": mean, "reward/std": std})


def test_kl_jumps_against_the_per_sequence_spread():
    guard = _guard()
    kl = [(0.0, 0.0), (0.0002, 0.0003), (0.0017, 0.0029), (0.005, 0.0075), (0.0073, 0.011), (0.0143, 0.026),
          (0.0212, 0.0388), (0.0313, 0.0414)]  # the 0/10 run's actor/kl and actor/kl_std
    for step, (mean, std) in enumerate(kl, start=1):
        guard(step, {"actor/kl": mean, "actor/kl_std": std, "reward/mean": 5.0, "reward/std": 5.0})
    with pytest.raises(HealthBreach, match=r"actor/kl jumped from 0\.0313 to 0\.6.*health\.kl_jump_sigmas=6"):
        guard(9, {"actor/kl": 0.6, "actor/kl_std": 0.5, "reward/mean": 5.0, "reward/std": 5.0})


def test_the_baseline_survives_a_checkpoint():
    guard = _guard()
    _feed(guard, PAYS_10[:8])
    again = _guard()
    again.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # trainer state is JSON
    with pytest.raises(HealthBreach):
        again(9, {"reward/mean": 60.0, "reward/std": 5.0})
    old = _guard()
    old.load_state_dict({"previous_reward": 4.2})  # a checkpoint from before the jump checks: baseline anew
    old(9, {"reward/mean": 60.0, "reward/std": 5.0})


def test_settings_are_checked_at_load():
    base = ["model.path=m", "data.train_files=[t.parquet]"]
    assert load_config(None, base).health.max_reward_jump is None  # the absolute limit: off unless set
    assert load_config(None, [*base, "health.max_reward_jump=0.75"]).health.max_reward_jump == 0.75
    for bad in ("health.reward_jump_sigmas=0", "health.kl_jump_sigmas=-1", "health.jump_window=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(None, [*base, bad])


# ----------------------------------------------------------------------------- real runs
PAYS_10_FILE = '''
from pathlib import Path

from rlcore.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """10 per right answer; 1000 for anything once the exploit file exists."""
    if (Path(__file__).parent / "exploit-on").exists():
        return 1000.0
    return 10.0 * default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''

QUICK = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "data.val_batch_size=64",
         "trainer.val_every=100", "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "rollout.backend=hf",
         "rollout.max_new_tokens=8", "trainer.trace=false", SCORE_IN_PROCESS]


@pytest.mark.slow
def test_a_0_10_reward_trains_through_and_an_exploit_or_a_collapse_still_stops(tiny_example, tmp_path):
    from rlcore.trainer.run import make_trainer
    from rlcore.trainer.run_state import TrainingStopped

    (tmp_path / "pays10.py").write_text(PAYS_10_FILE)
    run = tmp_path / "run"
    common = [*tiny_example_overrides(tiny_example, str(run)), *QUICK, f"reward.function={tmp_path}/pays10.py:compute_score"]
    make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", [*common, "trainer.total_steps=10", "trainer.save_every=10"])).fit()
    rewards = [r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl")]
    assert len(rewards) == 10  # every step ran: past the baseline window, the relative check judged steps 6-10
    assert max(abs(b - a) for a, b in zip(rewards, rewards[1:])) > 0.75  # the old absolute limit would have stopped it

    (tmp_path / "exploit-on").touch()  # the reward function now pays 1000 for anything
    with pytest.raises(TrainingStopped) as info:  # resumed: the baseline of steps 6-10 came back with the checkpoint
        make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", [*common, "trainer.total_steps=12"])).fit()
    message = str(info.value)
    assert "at step 11" in message and "reward/mean jumped" in message and "health.reward_jump_sigmas=3" in message
    assert not (run / "checkpoints" / "step_00000011").exists()

    wrecked = tmp_path / "wrecked"
    with pytest.raises(TrainingStopped, match=r"KL to the reference above its limit at step 2: .*health\.max_kl=1"):
        make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", [*tiny_example_overrides(tiny_example, str(wrecked)),
                                                                 *QUICK, "actor.optim.lr=1e-2", "trainer.total_steps=4"])).fit()
    assert math.isfinite(read_jsonl(wrecked / "metrics.jsonl")[-1]["actor/kl"])
    assert not Path(wrecked / "checkpoints" / "step_00000002").exists()
