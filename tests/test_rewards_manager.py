"""RewardScorer: parallel scoring in worker processes that survives raising, hanging and crashing
reward functions, and keeps input order."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from rlcore.rewards import RewardScorer, ScoreItem

# A user reward function whose behaviour each item picks through extra_info["mode"].
USER_REWARD = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    mode = (extra_info or {}).get("mode", "ok")
    if mode == "raise":
        raise ValueError(f"cannot grade {solution_str!r}")
    if mode == "hang":
        time.sleep(60)
    if mode == "exit":
        os._exit(3)
    if mode == "segv":
        import ctypes
        ctypes.string_at(0)
    if mode == "nan":
        return float("nan")
    if mode == "text":
        return "1.0"
    if mode == "slow":
        time.sleep(0.3)
    if mode in ("dict", "slow"):
        return {"score": float(solution_str), "pid": os.getpid(), "length": len(solution_str), "note": "x"}
    return float(solution_str)
'''


@pytest.fixture(scope="module")
def reward_spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "user_reward.py"
    path.write_text(USER_REWARD)
    return f"{path}:compute_score"


def items(modes: list[str], values: list[int] | None = None) -> list[ScoreItem]:
    values = values if values is not None else list(range(len(modes)))
    return [ScoreItem("custom", str(v), "", {"mode": m}) for v, m in zip(values, modes)]


@pytest.fixture(scope="module")
def scorer(reward_spec):
    """Shared pool: later tests also check it still works after earlier tests broke workers."""
    with RewardScorer(reward_spec, num_workers=2, timeout_s=1.0, error_score=-1.0, chunk_size=4) as s:
        yield s


def test_order_preserved_across_chunks(scorer):
    values = list(np.random.default_rng(0).permutation(200))
    res = scorer.score(items(["ok"] * 200, values))
    assert res.scores.dtype == np.float32
    np.testing.assert_array_equal(res.scores, np.array(values, dtype=np.float32))
    assert (res.n_errors, res.n_timeouts, res.first_error) == (0, 0, None)
    assert not res.failed.any()


def test_scoring_runs_in_several_worker_processes(scorer):
    res = scorer.score(items(["slow"] * 6))
    pids = set(res.extra["pid"].astype(np.int64).tolist())
    assert os.getpid() not in pids
    assert len(pids) == 2
    np.testing.assert_array_equal(res.scores, np.arange(6, dtype=np.float32))


def test_raising_calls_score_error_score_and_keep_first_message(scorer):
    res = scorer.score(items(["ok", "raise", "ok", "raise", "ok"], [10, 11, 12, 13, 14]))
    np.testing.assert_array_equal(res.scores, [10, -1, 12, -1, 14])
    assert (res.n_errors, res.n_timeouts) == (2, 0)
    assert res.first_error.startswith("ValueError: cannot grade '11'")
    assert "item 1" in res.first_error and "data_source='custom'" in res.first_error
    np.testing.assert_array_equal(res.failed, [False, True, False, True, False])


def test_bad_return_values_are_errors(scorer):
    res = scorer.score(items(["nan", "text", "ok"], [1, 2, 3]))
    np.testing.assert_array_equal(res.scores, [-1, -1, 3])
    assert res.n_errors == 2
    assert "ValueError: reward score is nan" in res.first_error


def test_dict_results_keep_numeric_extras(scorer):
    res = scorer.score(items(["dict", "ok", "dict", "raise"], [7, 8, 9, 10]))
    np.testing.assert_array_equal(res.scores, [7, 8, 9, -1])
    assert set(res.extra) == {"pid", "length"}  # the string field is dropped
    np.testing.assert_array_equal(res.extra["length"], [1, np.nan, 1, np.nan])
    assert res.extra["length"].dtype == np.float32


@pytest.mark.parametrize("mode, code", [("exit", "code 3"), ("segv", "code -11")])
def test_worker_crash_is_counted_and_pool_recovers(scorer, mode, code):
    res = scorer.score(items(["ok", "ok", mode, "ok", "ok", "ok"]))
    np.testing.assert_array_equal(res.scores, [0, 1, -1, 3, 4, 5])  # its chunk-mates were re-run
    assert (res.n_errors, res.n_timeouts) == (1, 0)
    assert res.first_error.startswith("WorkerDied") and code in res.first_error and "item 2" in res.first_error
    again = scorer.score(items(["ok"] * 10))
    np.testing.assert_array_equal(again.scores, np.arange(10))


def test_hanging_call_times_out_and_pool_recovers(scorer):
    t0 = time.monotonic()
    res = scorer.score(items(["ok", "hang", "ok", "ok", "ok", "ok", "ok"]))
    elapsed = time.monotonic() - t0
    assert elapsed < 30  # the call sleeps 60 s: it was cut off, not waited for
    np.testing.assert_array_equal(res.scores, [0, -1, 2, 3, 4, 5, 6])
    assert (res.n_errors, res.n_timeouts) == (0, 1)
    assert res.first_error.startswith("TimeoutError") and "item 1" in res.first_error
    again = scorer.score(items(["ok"] * 10))
    np.testing.assert_array_equal(again.scores, np.arange(10))
    assert again.n_timeouts == 0


@pytest.mark.slow
def test_every_call_hanging_still_returns(reward_spec):
    with RewardScorer(reward_spec, num_workers=2, timeout_s=0.5, chunk_size=2) as s:
        res = s.score(items(["hang", "ok", "hang", "hang", "ok"]))
        np.testing.assert_array_equal(res.scores, [0, 1, 0, 0, 4])
        assert res.n_timeouts == 3


def test_serial_mode_matches_and_uses_no_workers(reward_spec):
    with RewardScorer(reward_spec, num_workers=0, error_score=-2.0) as s:
        res = s.score(items(["dict", "raise", "ok"], [5, 6, 7]))
    np.testing.assert_array_equal(res.scores, [5, -2, 7])
    assert res.extra["pid"][0] == os.getpid()  # in this process
    assert res.n_errors == 1 and res.first_error.startswith("ValueError: cannot grade '6'")


def test_builtin_scorers_in_workers_by_default():
    batch = [ScoreItem("openai/gsm8k", f"so #### {i}", str(i if i % 2 else i + 1)) for i in range(20)]
    batch.append(ScoreItem("lighteval/MATH", r"\boxed{\frac12}", r"\frac{1}{2}"))
    batch.append(ScoreItem("unknown/source", "#### 1", "1"))
    with RewardScorer(None, num_workers=1) as s:
        res = s.score(batch)
    np.testing.assert_array_equal(res.scores[:20], [i % 2 for i in range(20)])
    assert res.scores[20] == 1.0 and res.scores[21] == 0.0
    assert res.n_errors == 1 and "NotImplementedError" in res.first_error and "unknown/source" in res.first_error


def test_module_spec_is_loaded_in_workers(tmp_path, monkeypatch):
    (tmp_path / "rlcore_test_worker_mod.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # workers import with the driver's sys.path
    with RewardScorer("rlcore_test_worker_mod:compute_score", num_workers=1) as s:
        res = s.score(items(["ok", "dict"], [3, 4]))
    np.testing.assert_array_equal(res.scores, [3, 4])
    assert res.extra["pid"][1] != os.getpid()


def test_bad_spec_and_bad_arguments_raise_at_construction(tmp_path):
    with pytest.raises(ValueError, match="rlcore_no_such_module_xyz"):
        RewardScorer("rlcore_no_such_module_xyz:fn", num_workers=1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer(None, num_workers=1, timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardScorer(None, num_workers=-1)


def test_empty_input_and_use_after_close(reward_spec):
    s = RewardScorer(reward_spec, num_workers=1)
    res = s.score([])
    assert res.scores.shape == (0,) and res.n_errors == 0
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        s.score(items(["ok"]))
