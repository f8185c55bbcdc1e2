"""A real training step goes through the Rust kernels, not a silent torch fallback: every call
into rlcore._native is counted during one step of tiny GRPO and PPO via the public API."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore import _native
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.native import REQUIRED_FUNCTIONS
from rlcore.trainer.run import run_training

pytestmark = pytest.mark.slow

ONE_SMALL_STEP = [
    SCORE_IN_PROCESS,
    "trainer.total_steps=1",
    "trainer.save_every=1",
    "trainer.val_before_train=false",
    "trainer.val_every=100",
    "trainer.loggers=[jsonl]",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
]


def count_native_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wrap every function of the extension so that each call is counted, then run the real one."""
    calls: Counter[str] = Counter()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in REQUIRED_FUNCTIONS:
        monkeypatch.setattr(_native, name, counted(name, getattr(_native, name)))
    return calls


@pytest.mark.parametrize(("algorithm", "advantage_kernel"), [("grpo", "group_advantages"), ("ppo", "gae")])
def test_one_training_step_calls_the_rust_kernels(tiny_example, tmp_path, monkeypatch, algorithm, advantage_kernel):
    calls = count_native_calls(monkeypatch)
    overrides = tiny_example_overrides(tiny_example, str(tmp_path / "run")) + ONE_SMALL_STEP
    history = run_training(load_config(CONFIG_DIR / f"tiny_{algorithm}.yaml", overrides))
    assert len(history) == 1
    # One advantage computation per step, on the Rust kernel (torch would not touch _native).
    assert calls[advantage_kernel] == 1, dict(calls)
    # Micro-batches are packed by token budget (actor.dynamic_batch_size, on by default).
    assert calls["pack_token_budget"] >= 1, dict(calls)
