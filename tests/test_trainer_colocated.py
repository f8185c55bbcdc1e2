"""Colocated hybrid mode in the control flow: when the rollout engine sleeps and wakes
(`rollout.sleep`), how `auto` decides from a step's numbers, and the per-phase peak-memory
metrics. The order is checked on CPU with `rollout.sleep` forced (the HF engine's sleep is a no-op
there, the calls are what matters)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.metrics import Timer
from rlcore.trainer.rollout_parts import RolloutSleep, rollout_shares_gpu, sleep_mode
from rlcore.trainer.run import make_trainer

GIB = 2**30


def _bare_config(*overrides: str):
    return load_config(None, ["model.path=/nowhere", "data.train_files=[x.jsonl]", *overrides])


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["trainer.device=cpu"], False),
        (["trainer.device=cuda"], True),
        (["trainer.device=cuda", "trainer.off_policy=one_step"], False),  # it generates while the actor trains
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


@pytest.mark.parametrize(
    "overrides,mode,says",
    [
        (["trainer.device=cpu"], "never", "stays awake: it runs on a CPU, where sleeping is a no-op"),
        (["trainer.device=cuda"], "auto", "step 1 sleeps the engine through the update and measures"),
        (["trainer.backend=ray", "ray.pools.default.gpus_per_bundle=1", "ray.pools.gen.gpus_per_bundle=1",
          "ray.roles.rollout=gen"], "never", "stays awake: it shares no GPU with the actor"),
        (["trainer.device=cuda", "rollout.sleep=never"], "never", "rollout.sleep=never"),
        (["trainer.device=cpu", "rollout.sleep=always"], "always", "rollout.sleep=always (a no-op on a CPU"),
        (["trainer.device=cuda", "rollout.free_memory_when_idle=false"], "never", "rollout.sleep=never"),  # the older spelling
        (["trainer.device=cpu", "rollout.free_memory_when_idle=true"], "always", "rollout.sleep=always"),
    ],
)
def test_sleep_mode_says_what_it_does_and_why(overrides, mode, says):
    got, why = sleep_mode(_bare_config(*overrides))
    assert got == mode and says in why


class _EngineOnAGpu:
    """A stand-in for a rollout group on a GPU (none here): `sleep` reports the bytes a real one
    measures (released by sleeping, the device's size), every call is recorded."""

    def __init__(self, released: int, total: int) -> None:
        self.calls: list[str] = []
        self.numbers = {"released_bytes": float(released), "device_total_bytes": float(total)}

    def sleep(self):
        self.calls.append("sleep")
        return [self.numbers, {"released_bytes": 0.0, "device_total_bytes": float(self.numbers["device_total_bytes"])}]

    def wake(self):
        self.calls.append("wake")


@pytest.mark.parametrize("peak_gib,stays_awake", [(60.0, True), (126.0, False)])
def test_auto_decides_once_after_step_one_from_the_measured_peak(caplog, peak_gib, stays_awake):
    engine = _EngineOnAGpu(released=2 * GIB, total=140 * GIB)
    sleep = RolloutSleep(WorkerGroups(rollout=engine), "auto")  # type: ignore[arg-type]
    timer = Timer(device_memory=False)
    with caplog.at_level(logging.INFO, logger="rlcore.trainer.rollout_parts"):
        for step in (1, 2, 3):
            sleep.after_generation(timer)
            sleep.wake(timer)
            sleep.after_update({"memory/actor_update_device_peak_gib": peak_gib if step == 1 else 139.0})
    # step 1 always sleeps; the choice made from its numbers holds for every later step (139 GiB later changes nothing)
    assert engine.calls == ["sleep", "wake"] * (1 if stays_awake else 3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout.sleep=auto")]
    assert len(lines) == 1, lines
    need = peak_gib + 2 + 14
    assert lines[0] == ("rollout.sleep=auto: the engine " + ("stays awake" if stays_awake else "sleeps") + " through the update: "
                        f"the update's peak {peak_gib:.1f} GiB (measured in step 1) + the engine's 2.0 GiB + a 10% margin 14.0 GiB "
                        f"= {need:.1f} GiB {'fits in' if stays_awake else 'exceeds'} the device's 140.0 GiB")


def test_auto_without_device_numbers_keeps_sleeping_and_says_so(caplog):
    engine = _EngineOnAGpu(released=0, total=0)  # what a CPU reports
    sleep = RolloutSleep(WorkerGroups(rollout=engine), "auto")  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="rlcore.trainer.rollout_parts"):
        for _ in range(2):
            sleep.after_generation(Timer(device_memory=False))
            sleep.wake(Timer(device_memory=False))
            sleep.after_update({})
    assert engine.calls == ["sleep", "wake"] * 2
    assert "keeps sleeping through the update (no device measurement" in caplog.text


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
def test_engine_sleeps_after_generation_and_wakes_before_weight_sync(tiny_example, tmp_path: Path, sleeps, caplog):
    """`always` sleeps and wakes around every update, `never` keeps the engine awake; both runs
    train with `actor.max_tokens_per_micro_batch: auto` (on the CPU: 8,192 tokens, said once)."""
    overrides = tiny_example_overrides(tiny_example, str(tmp_path / "run")) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.val_batch_size=128",
        "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_before_train=false",
        "trainer.device=cpu", f"rollout.sleep={'always' if sleeps else 'never'}", "actor.max_tokens_per_micro_batch=auto",
        SCORE_IN_PROCESS,
    ]
    trainer = make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides))
    calls: list[str] = []
    trainer.groups.rollout = _Recorder(trainer.groups.rollout, calls)
    with caplog.at_level(logging.INFO, logger="rlcore"):
        history = trainer.fit()

    sized = [r.getMessage() for r in caplog.records if r.getMessage().startswith("actor.max_tokens_per_micro_batch=auto")]
    assert sized == ["actor.max_tokens_per_micro_batch=auto: 8,192 tokens on the CPU (the fixed default: host memory is "
                     "shared with the rollout engine and other processes, and a CPU is no faster per token in larger "
                     "micro-batches)"]
    assert all(math.isfinite(h["actor/pg_loss"]) and h["actor/grad_norm"] > 0 for h in history)  # it trained
    train_calls = calls[: calls.index("update_weights", calls.index("update_weights") + 1) + 1]
    if sleeps:
        assert train_calls == ["generate_sequences", "sleep", "wake", "update_weights"] * 2
        assert all("time/rollout_sleep_s" in h and "time/rollout_wake_s" in h for h in history)
    else:
        assert train_calls == ["generate_sequences", "update_weights"] * 2
    assert "sleep" not in calls[len(train_calls):]  # validation generates right after a sync, awake
    assert not any(k.startswith("memory/") for h in history for k in h)  # CPU: nothing to measure


def test_auto_weighs_the_bound_a_later_step_may_reach_not_only_step_ones_peak(caplog):
    engine = _EngineOnAGpu(released=2 * GIB, total=140 * GIB)
    sleep = RolloutSleep(WorkerGroups(rollout=engine), "auto")  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="rlcore.trainer.rollout_parts"):
        sleep.after_generation(Timer(device_memory=False))
        sleep.wake(Timer(device_memory=False))
        sleep.after_update({"memory/actor_update_device_peak_gib": 60.0, "memory/actor_update_device_bound_gib": 130.0})
    assert sleep.enabled  # 60 GiB measured would fit beside the engine; 130 GiB at full micro-batches does not
    assert ("the update's peak 130.0 GiB (measured in step 1, grown to the largest micro-batch a step may pack) + the "
            "engine's 2.0 GiB") in caplog.text
