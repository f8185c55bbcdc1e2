"""Colocated hybrid mode in the control flow: when the rollout engine sleeps and wakes, and the
per-phase peak-memory metrics. The order is checked on CPU with `rollout.free_memory_when_idle`
forced on (the HF engine's sleep is a no-op there, the calls are what matters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.trainer.metrics import Timer
from rlcore.trainer.rollout_parts import rollout_shares_gpu
from rlcore.trainer.run import make_trainer


def _bare_config(*overrides: str):
    return load_config(None, ["model.path=/nowhere", "data.train_files=[x.jsonl]", *overrides])


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["trainer.device=cpu"], False),
        (["trainer.device=cuda"], True),
        (["trainer.device=cuda", "rollout.free_memory_when_idle=false"], False),
        (["trainer.device=cpu", "rollout.free_memory_when_idle=true"], True),
        (["trainer.backend=ray", "ray.colocate=[[actor,rollout]]", "ray.pools.default.gpus_per_bundle=1"], True),
        (["trainer.backend=ray", "ray.colocate=[[actor,rollout]]"], False),  # colocated on CPU: nothing to free
        (["trainer.backend=ray", "ray.pools.default.gpus_per_bundle=1"], True),  # one GPU pool for all roles
        (["trainer.backend=ray"], False),  # CPU-only pool
        (["trainer.backend=ray", "ray.pools.default.gpus_per_bundle=1",
          "ray.pools.gen.gpus_per_bundle=1", "ray.roles.rollout=gen"], False),  # separate GPU pools
    ],
)
def test_rollout_shares_gpu(overrides, expected):
    assert rollout_shares_gpu(_bare_config(*overrides)) is expected


def test_timer_without_device_memory_records_only_seconds():
    timer = Timer(device_memory=False)
    with timer.phase("generate"):
        pass
    assert set(timer.seconds) == {"generate"} and timer.peak_gib == {}


class _Recorder:
    """Delegates to a worker group and logs the rollout calls the control flow makes."""

    def __init__(self, group, calls: list[str]) -> None:
        self._group, self._calls = group, calls

    def __getattr__(self, name):
        attr = getattr(self._group, name)
        if name in ("generate_sequences", "sleep", "wake", "update_weights"):
            def call(*args, **kwargs):
                self._calls.append(name)
                return attr(*args, **kwargs)
            return call
        return attr


@pytest.mark.slow
@pytest.mark.parametrize("sleeps", [True, False])
def test_engine_sleeps_after_generation_and_wakes_before_weight_sync(tiny_example, tmp_path: Path, sleeps):
    overrides = tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.val_batch_size=128",
        "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_before_train=false",
        "trainer.device=cpu", f"rollout.free_memory_when_idle={str(sleeps).lower()}",
    ]
    trainer = make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides))
    calls: list[str] = []
    trainer.groups.rollout = _Recorder(trainer.groups.rollout, calls)
    history = trainer.fit()

    train_calls = calls[: calls.index("update_weights", calls.index("update_weights") + 1) + 1]
    if sleeps:
        assert train_calls == ["generate_sequences", "sleep", "wake", "update_weights"] * 2
        assert all("time/rollout_sleep_s" in h and "time/rollout_wake_s" in h for h in history)
    else:
        assert train_calls == ["generate_sequences", "update_weights"] * 2
    assert "sleep" not in calls[len(train_calls):]  # validation generates right after a sync, awake
    assert not any(k.startswith("memory/") for h in history for k in h)  # CPU: nothing to measure
