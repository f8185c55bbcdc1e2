"""The GRPO trainer on Ray against an externally started head node (`ray start --head`: the
session's `ray_local`), with 2 FSDP2 actor ranks: a worker killed mid-run is a clear error, and
the next run resumes from the last checkpoint (the sharded one) and finishes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.checkpoint import CheckpointManager, step_of
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.tracking import read_jsonl
from rlcore.trainer.run import make_trainer

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.distributed]  # 2 FSDP2 actor ranks on gloo


_CHILD = r"""
import json, os, signal, sys
from rlcore.config import load_config
from rlcore.controller import WorkerError
from rlcore.trainer.run import make_trainer

args = json.loads(sys.argv[1])
cfg = load_config(args["config"], args["overrides"])

def kill_actor_rank1(step, metrics):
    if step == args["kill_at"]:
        os.kill(trainer.groups.actor.pids()[1], signal.SIGKILL)

trainer = make_trainer(cfg, step_hooks=[kill_actor_rank1])
try:
    out = {"ok": True, "history": trainer.fit()}
except WorkerError as e:
    out = {"ok": False, "type": type(e).__name__, "role": e.role, "rank": e.rank, "method": e.method, "message": str(e)}
print("RESULT " + json.dumps(out))
"""


def _train(overrides: list[str], kill_at: int = 0) -> dict:
    """One run in a fresh process, as a restarted job would be (and one Ray session per process:
    object and actor ids repeat across sessions of one process)."""
    args = json.dumps({"config": str(CONFIG_DIR / "tiny_grpo.yaml"), "overrides": overrides, "kill_at": kill_at})
    proc = subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True, text=True, timeout=scaled(300))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _overrides(example, out: Path, address: str) -> list[str]:
    return tiny_example_overrides(example, str(out)) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
        "trainer.val_before_train=false", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.total_steps=3", "trainer.save_every=1", "trainer.device=cpu",
        "trainer.backend=ray", f"ray.address={address}", "actor.world_size=2",
        f"ray.call_timeout_s={scaled(300):.0f}", f"ray.init_timeout_s={scaled(300):.0f}",
    ]


@pytest.mark.timeout(900)  # two trainings in fresh processes (up to 300 s each), then a resume here
def test_grpo_on_external_head_resumes_after_a_killed_worker(ray_local, tiny_example, tmp_path):
    run = tmp_path / "run"
    first = _train(_overrides(tiny_example, run, ray_local), kill_at=2)
    # saving step 2 needs the killed rank: the run stops with the death, not a hang
    assert not first["ok"] and first["type"] == "WorkerDiedError"
    assert (first["role"], first["rank"]) == ("actor", 1)
    assert "died" in first["message"]
    manager = CheckpointManager(run / "checkpoints")
    assert step_of(manager.latest()) == 1
    assert (manager.latest() / "actor_dcp").is_dir()  # the sharded training state

    second = _train(_overrides(tiny_example, run, ray_local))  # trainer.resume=auto
    assert second["ok"]
    history = second["history"]
    assert len(history) == 2  # steps 2 and 3
    for m in history:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        assert m["time/weight_sync_s"] >= 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    final = manager.latest()
    assert step_of(final) == 3
    saved = load_file(final / "actor" / "model.safetensors")  # the full model, HF format
    start = load_file(Path(tiny_example.model_dir) / "model.safetensors")
    assert set(saved) == set(start)
    assert all(saved[k].shape == start[k].shape for k in saved)
    assert any(not torch.equal(start[k], saved[k]) for k in saved)

    # the sharded checkpoint of 2 ranks resumes in one process (in-process backend)
    one_rank = [o for o in _overrides(tiny_example, run, ray_local)
                if not o.startswith(("trainer.backend", "ray.", "actor.world_size", "trainer.total_steps"))]
    more = make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", one_rank + ["trainer.total_steps=4"])).fit()
    assert len(more) == 1 and math.isfinite(more[0]["actor/pg_loss"])
    assert step_of(manager.latest()) == 4
