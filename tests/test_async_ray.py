"""`trainer.off_policy=async` on Ray: the controller's producer thread calls the rollout group, on a
pool of its own, while the trainer thread drives the actor; the weights reach it between generate
calls by the Ray weight-sync path. The same prompts train in the same steps as the in-process async
run at the same seed, and a resume after a checkpoint gives them again. One Ray session (this
process connected to the shared `ray_local`), the tiny example, 3 steps; the layouts it refuses
are in tests/test_async_rollout.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import Config, load_config
from rlcore.tracking import read_jsonl
from rlcore.trainer.run import make_trainer

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPTS, N, STEPS = 4, 4, 3

ON_RAY = ["trainer.backend=ray", "trainer.device=cpu", "rollout.backend=hf",
          "ray.pools={default: {cpus_per_bundle: 1}, gen: {cpus_per_bundle: 1}}", "ray.roles={rollout: gen, reward: gen}"]


def _config(example, out: Path, steps: int, *extra: str) -> Config:
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(example, str(out)) + [
        f"data.train_batch_size={PROMPTS}", "actor.ppo_mini_batch_size=4", f"rollout.n={N}",
        f"trainer.total_steps={steps}", "trainer.save_every=2", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.val_before_train=false", "trainer.off_policy=async", "trainer.max_staleness=1",
        "trainer.async_chunk_prompts=2", "actor.behaviour_correction=decoupled", "actor.tis_cap=5", SCORE_IN_PROCESS,
        *extra])


def _prompts_per_step(run: Path) -> list[set[str]]:
    return [{s["uid"] for s in rec["samples"]} for rec in read_jsonl(run / "trace.jsonl")]


@pytest.mark.timeout(900)  # four tiny trainings, three of them starting Ray workers
def test_async_grpo_on_ray_trains_within_the_bound_as_in_process_and_resumes_exactly(tiny_example, tmp_path, ray_driver):
    on_ray = (*ON_RAY, f"ray.address={ray_driver}")
    make_trainer(_config(tiny_example, tmp_path / "ray", STEPS, *on_ray)).fit()
    records = [r for r in read_jsonl(tmp_path / "ray" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["async/staleness_0"] + r["async/staleness_1"] == PROMPTS * N  # every sample within the bound
        assert 0 <= r["rollout/staleness_max"] <= 1
        assert 0 <= r["async/trainer_wait_frac"] <= 1 and 0 <= r["async/rollout_wait_frac"] <= 1
        assert r["async/buffer_depth"] >= 0 and r["async/dropped_groups"] == 0
        assert math.isfinite(r["actor/pg_loss"])
    # step 1 and step 3 (after the checkpoint at 2) generate on the weights they train from
    assert [records[0]["async/staleness_0"], records[2]["async/staleness_0"]] == [PROMPTS * N] * 2
    trace = read_jsonl(tmp_path / "ray" / "trace.jsonl")
    rollout_pids = {s["rollout_pid"] for rec in trace for s in rec["samples"]}
    assert rollout_pids and os.getpid() not in rollout_pids  # generated in the Ray rollout worker
    assert rollout_pids == {w["pid"] for w in trace[0]["workers"]["rollout"]}

    on_ray_prompts = _prompts_per_step(tmp_path / "ray")
    assert [len(u) for u in on_ray_prompts] == [PROMPTS] * STEPS  # whole groups: n samples of each prompt
    assert len(set().union(*on_ray_prompts)) == STEPS * PROMPTS  # no prompt trained twice

    # the in-process async run at the same seed trains the same prompts in the same steps
    make_trainer(_config(tiny_example, tmp_path / "inprocess", STEPS)).fit()
    assert _prompts_per_step(tmp_path / "inprocess") == on_ray_prompts

    # stopped after the checkpoint at step 2 and resumed on Ray: the same prompts again
    make_trainer(_config(tiny_example, tmp_path / "resumed", 2, *on_ray)).fit()
    make_trainer(_config(tiny_example, tmp_path / "resumed", STEPS, *on_ray)).fit()
    assert _prompts_per_step(tmp_path / "resumed") == on_ray_prompts
