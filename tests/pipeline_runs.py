"""How the suite runs the pipeline: each scenario once, every property asserted on that one run.

A full `rlcore pipeline run` of the tiny example costs about 20 CPU seconds (Prefect, MLflow, a
training, an evaluation), so a scenario started the same way runs once, in a module-scoped
fixture of the file that asserts its properties, one test per property group. A second run of the
same scenario is kept only where the way it is started is what a test is about (its trigger).

Every full pipeline run in the suite (file::test or fixture -- trigger -- config -- what it asserts
-- wall s in one CI run of the whole suite on 2 workers, 2026-12-05):

- test_pipeline_run::`runs` (module fixture, 7 tests) -- `rlcore pipeline run --json` in a
  subprocess, the session's Prefect server, MLflow's default ./mlflow.db -- tiny GRPO, rule reward,
  2 steps, twice (margin -1, then 0.5: warm start from the champion) -- summaries, UI links, the
  registry's versions/aliases/tags/descriptions, the champion as transformers and MLflow model,
  one MLflow run per stage, metrics logged while training, datasets, Prefect <-> MLflow links,
  the data_prep cache, the promotion line in the log. -- 31 s (both runs).
- test_pipeline_reward_model::`rm_run` (module fixture, 4 tests) -- same start -- `--algorithm
  ppo --reward model`: reward model 30 steps (margin -1), PPO 2 steps against it; then a second
  reward model's stages in process (2 steps) -- the RM registered, loadable and scoring, the
  policy's lineage naming it, the stages' MLflow runs, the RM champion/challenger gate. -- 26 s.
- test_own_model_e2e::`pipeline` (module fixture, 3 tests) -- same start, a user's own model --
  `--sft-data/--sft-config`: SFT warm start 200 steps, GRPO (hf) 12 steps -- RL learns and is
  promoted; the SFT model as transformers runs it; the vLLM rollout and vLLM serving agree. -- 22 s.
- test_wheel::test_installed_wheel_runs_the_pipeline_outside_the_repository -- the installed
  wheel's `rlcore` from an empty folder, Prefect's ephemeral server -- tiny GRPO 2 steps, margin -1
  -- the package (flows, configs, native code) comes from the wheel, the run completes there. -- 27 s.
- test_flows_server::test_data_event_runs_pipeline_and_registers_version -- `pipeline serve
  --watch`: a file arriving -> event -> deployment run -- tiny GRPO 2 steps on the 64 rows that
  arrived -- the run trains on the arrived file, is tagged with it, the decision in serve's log. -- 30 s.
- test_schedule_server::test_cron_schedule_creates_runs_that_register_a_model_version -- `pipeline
  serve --cron '* * * * *'`: the server's scheduler -- tiny GRPO -- (owned elsewhere). -- 63 s.
- test_failure_notify (2 tests) -- `pipeline serve`, runs that crash, hang or are killed --
  (owned elsewhere). -- 91 s + 59 s.
- test_ray_cluster::test_pipeline_runs_its_stages_as_ray_jobs_and_retries_a_lost_node_from_the_checkpoint
  -- `pipeline run --ray-address`: stages as Ray jobs on a 3-node cluster, a node killed mid-step --
  tiny GRPO on the cluster's roles -- the retried job resumes to the uninterrupted run's weights.
  -- 137 s (+ 70 s setup: the cluster and the single-node reference run).

Pipeline commands that stop before training (refusals, a data_prep failure: test_cli_lifecycle,
test_ray_address_hostile, test_secrets, test_sft_recipe) are not full runs and not listed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from conftest import PrefectServer, prefect_env, reset_prefect  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128"]


def pipeline_env(prefect_api: tuple[str, dict[str, str]]) -> dict[str, str]:
    """A pipeline's environment: a client of the session's Prefect server (`prefect_api`, with its
    own Prefect home), MLflow's default store (./mlflow.db)."""
    _, env = prefect_api
    env = dict(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`rlcore ARGS` in a subprocess, as a user runs it; fails the test with its stderr."""
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@contextlib.contextmanager
def module_prefect(server: PrefectServer, home: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """`prefect_api` for a module-scoped fixture: the shared server emptied of what earlier tests
    made (and again when the module is done), a client environment with its Prefect home (result
    storage, task cache) under `home`."""
    reset_prefect(server.api, server.start_state)
    try:
        yield server.api, dict(server.env, **prefect_env(home), PREFECT_API_URL=server.api)
    finally:
        reset_prefect(server.api, server.start_state)
