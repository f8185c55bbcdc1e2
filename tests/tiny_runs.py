"""Overrides shared by the tests' tiny trainings.

`SCORE_IN_PROCESS`: score rewards in the training's own process (`reward.num_workers=0`, see
rlcore/rewards/manager.py) instead of a scorer pool, whose two fresh interpreters cost each
training their start-up CPU seconds. Trainings in this process that test something other than the
pool use it. The pool itself stays tested where it is the subject: tests/test_rewards_manager.py
(timeouts, hangs, raising functions, a lost worker), tests/test_trainer_e2e.py (a raising reward
function in a training), and in the trainings on Ray and the pipeline runs, which keep the
default pool as a user's run does.

`prompts_per_step`: which prompts each step of a run trained, from its trace.jsonl (the async
runs compare them between runs)."""

from __future__ import annotations

from pathlib import Path

from rlcore.tracking import read_jsonl

SCORE_IN_PROCESS = "reward.num_workers=0"


def prompts_per_step(run: Path) -> list[set[str]]:
    """The uids of the prompts each step of the run in `run` trained, in step order."""
    return [{s["uid"] for s in rec["samples"]} for rec in read_jsonl(run / "trace.jsonl")]
